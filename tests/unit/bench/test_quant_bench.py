"""P11's repetitions: a cell in which other work took an arm's cores runs again, on fresh
prompts (our engine would otherwise find the first attempt's prompt in its prefix cache and
report a prefill that never ran), and only the accepted attempt is kept."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import quant
from benchmarks.harness import BenchContext
from tests.helpers import make_config


def test_a_disturbed_cell_runs_again_on_fresh_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = BenchContext("quant", "quick", make_config(**{"model.num_threads": 1}))
    engine = SimpleNamespace(
        vocab_size=1000, tokenizer=SimpleNamespace(encode=lambda _: [5, 6]), check_integrity=list
    )
    seen: dict[str, list[list[list[int]]]] = {cell: [] for cell in quant.CELLS}

    def arm(cell: str) -> quant.Arm:
        def run(prompts: list[list[int]], _tokens: int) -> float:
            seen[cell].append(prompts)
            return float(len(seen[cell]))

        return run

    cells = {cell: {"ours": arm(cell), "llamacpp": arm(cell)} for cell in quant.CELLS}
    arms = quant._Arms({"gguf": engine}, ["gguf"], None, cells)  # type: ignore[dict-item]
    # b1's two arms got their cores; then one prefill arm did not; every later arm did.
    utils = iter([1.0, 1.0, 0.5, 1.0, *[1.0] * 100])
    meter = SimpleNamespace(utilisation=lambda: next(utils))
    monkeypatch.setattr(quant, "CpuMeter", lambda _threads: meter)
    sizes = quant._Sizes(1, 4, 3, 8, {"b8": 2, "b32": 3})

    run = quant._measure(ctx, arms, sizes)

    assert [d["cell"] for d in run.disturbed] == ["prefill"]
    assert all(len(v) == 1 for cell in run.results.values() for v in cell.values())
    _warm, _warm_other, first, first_other, again, again_other = seen["prefill"]
    assert first == first_other and again == again_other  # every arm of a cell: the same ids
    assert again != first  # fresh prompts for the second attempt
    assert sorted(run.results["prefill"]["ours"] + run.results["prefill"]["llamacpp"]) == [5, 6]
