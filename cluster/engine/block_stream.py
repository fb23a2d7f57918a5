"""Prefill role, long prompts: each finished chunk's full blocks, pinned and announced while the
later chunks compute (KV streaming, ``transfer.stream_min_tokens``).

After a step computed part of a streamed prompt (``Scheduler.commit`` -> the hand-off's
``computed``), the full blocks completed since the last announcement get one extra reference
each (a *pin*), so neither a preemption nor an abort of the request returns them to the free
queue while a decode replica may be reading them, and one ``RequestOutput`` announces the whole
list so far (``streamed_block_ids``, prompt order). The last chunk's blocks are never announced:
they are the tail that the held table adds when the first token is sampled. ``release`` (the
lease ended: pulled, expired, aborted) drops the pins.

A pin is a block table of its own in the block manager (the request id, NUL, ``pin`` and a
counter; the pinned blocks as its shared "hits"), so the manager's ref counts and
``check_integrity`` cover pins like any other holder. A preempted request recomputes after its
cached prefix; the announced list stays what was announced (those blocks are pinned and hold
the same KV), and only positions past it come from the new table.
"""

from __future__ import annotations

from cluster.engine.block_manager import BlockManager
from cluster.engine.outputs import RequestOutput
from cluster.engine.request import Request


class BlockStream:
    def __init__(self, block_manager: BlockManager, min_tokens: int) -> None:
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.min_tokens = min_tokens  # 0: nothing streams
        self._announced: dict[str, list[int]] = {}  # request id -> blocks announced so far
        self._pins: dict[str, list[str]] = {}  # request id -> its pin tables
        self._outputs: list[RequestOutput] = []

    def streams(self, req: Request) -> bool:
        return 0 < self.min_tokens <= req.num_prompt_tokens

    def computed(self, req: Request) -> None:
        """After a step: pin and announce the full prompt blocks completed since last time."""
        if not self.streams(req) or req.num_computed_tokens >= req.num_prompt_tokens:
            return  # not streamed, or the last chunk: its blocks are the tail
        rid = req.request_id
        num_full = req.num_computed_tokens // self.block_size
        announced = self._announced.setdefault(rid, [])
        if num_full <= len(announced):
            return
        new = self.block_manager.block_table(rid)[len(announced) : num_full]
        pins = self._pins.setdefault(rid, [])
        pin_id = f"{rid}\x00pin{len(pins)}"
        self.block_manager.allocate(pin_id, 0, new)
        pins.append(pin_id)
        announced.extend(new)
        self._outputs.append(
            RequestOutput(
                request_id=rid,
                new_token_ids=[],
                new_text="",
                finished=False,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                streamed_block_ids=list(announced),
                arrival_time=req.arrival_time,
                scheduled_time=req.scheduled_time,
            )
        )

    def table(self, req: Request) -> list[int]:
        """The table to hand over at the first token: what was announced, then the rest."""
        table = self.block_manager.block_table(req.request_id)
        announced = self._announced.get(req.request_id, [])
        return announced + table[len(announced) :]

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    def is_pinned(self, request_id: str) -> bool:
        return request_id in self._pins

    def release(self, request_id: str) -> bool:
        """Drop the request's pins (its lease ended); False when it has none."""
        self._announced.pop(request_id, None)
        pins = self._pins.pop(request_id, None)
        for pin_id in pins or ():
            self.block_manager.free(pin_id)
        return pins is not None

    @property
    def num_streaming(self) -> int:
        return len(self._pins)
