"""The offline API: ``LLM(...).generate(prompts, params)`` and ``LLM.chat(messages, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.common.sampling_params import SamplingParams
from cluster.config import ClusterConfig, flat_key_index, load_config
from cluster.engine.engine import EngineRequest, LLMEngine, RequestOutput

PromptInput = str | Sequence[int]
Messages = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class CompletionOutput:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0


class LLM:
    """An engine in one process. Keyword overrides take config leaf names or dotted paths:
    ``LLM(block_size=16, chunk_size=16)`` or ``LLM(**{"cache.num_blocks": 64})``.
    """

    def __init__(
        self, model: str | None = None, *, config: ClusterConfig | None = None, **overrides: Any
    ) -> None:
        index = flat_key_index()
        dotted: dict[str, Any] = {}
        for key, value in overrides.items():
            if "." in key:
                dotted[key] = value
            elif key in index:
                dotted[index[key]] = value
            else:
                raise ValueError(
                    f"{key}: unknown engine option; valid: {', '.join(sorted(index))} "
                    "(or a dotted config path)"
                )
        if model is not None:
            dotted["model.path"] = model
        base = config if config is not None else load_config()
        self.config = base.replace(dotted) if dotted else base
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what the engine runs outside this process (a tensor-parallel engine's other
        ranks; they also stop when the LLM is collected or the interpreter exits)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Run every prompt to completion, batched together; outputs in input order.

        A prompt is text or a list of token ids. Every prompt is validated before any runs, so
        a bad one raises ``ValueError`` without starting the others.
        """
        token_lists = self._tokenize_all(prompts)
        return self._run(token_lists, params)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        convs: list[Messages]
        if messages and isinstance(messages[0], Mapping):
            convs = [messages]  # type: ignore[list-item]
        else:
            convs = list(messages)  # type: ignore[arg-type]
        token_lists = [self.tokenizer.encode_chat(m) for m in convs]
        return self._run(token_lists, params)

    def stream(
        self, prompt: PromptInput, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """One request's deltas as they are produced."""
        (tokens,) = self._tokenize_all([prompt])
        rid = f"stream-{next(self._ids)}"
        self.engine.add(EngineRequest(rid, tokens, params or SamplingParams()))
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    # -- internals ----------------------------------------------------------------------------

    def _tokenize_all(self, prompts: PromptInput | Sequence[PromptInput]) -> list[list[int]]:
        if isinstance(prompts, str):
            items: list[PromptInput] = [prompts]
        elif prompts and all(isinstance(t, int) for t in prompts):
            items = [prompts]  # type: ignore[list-item]
        else:
            items = list(prompts)  # type: ignore[arg-type]
        if not items:
            raise ValueError("prompts: must not be empty")
        out = []
        for i, p in enumerate(items):
            if isinstance(p, str):
                out.append(self.tokenizer.encode(p))
            elif isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
                out.append(list(p))
            else:
                raise ValueError(f"prompts[{i}]: must be text or a list of token ids")
        return out

    def _run(
        self,
        token_lists: list[list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[CompletionOutput]:
        plist = _params_per_prompt(params, len(token_lists))
        base = next(self._ids)
        requests = [
            EngineRequest(f"offline-{base}-{i}", toks, p)
            for i, (toks, p) in enumerate(zip(token_lists, plist))
        ]
        self._add_all(requests)
        results = {
            r.request_id: CompletionOutput(list(r.prompt_token_ids), "", [], None) for r in requests
        }
        remaining = set(results)
        while remaining:
            for out in self.engine.step():
                res = results.get(out.request_id)
                if res is not None and _absorb(res, out):
                    remaining.discard(out.request_id)
        return [results[r.request_id] for r in requests]

    def _add_all(self, requests: list[EngineRequest]) -> None:
        """Add every request, or (one refused) none of them."""
        eng = self.engine
        added: list[str] = []
        try:
            for request in requests:
                eng.add(request)
                added.append(request.request_id)
        except ValueError:
            for rid in added:
                eng.abort_request(rid)
            eng.step()  # flush the abort outputs
            raise


def _params_per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    plist = list(params)
    if len(plist) != num_prompts:
        raise ValueError(f"params: {len(plist)} given for {num_prompts} prompts")
    return plist


def _absorb(res: CompletionOutput, out: RequestOutput) -> bool:
    """Add a step's output to a completion; True when it was the last."""
    res.token_ids.extend(out.new_token_ids)
    res.text += out.new_text
    if out.new_logprobs is not None:
        res.logprobs = (res.logprobs or []) + out.new_logprobs
        res.top_logprobs = (res.top_logprobs or []) + (out.new_top_logprobs or [])
    if out.finished:
        res.finish_reason = out.finish_reason
        res.num_cached_tokens = out.num_cached_tokens
    return out.finished
