"""The rows linear kernel: equal to ``F.linear``, batch-invariant bit for bit, and the engine
with drafts verified through it equals the engine without."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels.rows import MAX_ROWS, RowsLinear, rows_linear


def _kernel(tmp_path_factory: pytest.TempPathFactory, threads: int) -> RowsLinear:
    k = rows_linear(tmp_path_factory.mktemp("cache"), threads, F.linear)
    if k is None:
        pytest.skip("no C compiler: the engine uses the fallback linear")
    assert isinstance(k, RowsLinear)
    return k


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> dict[int, RowsLinear]:
    return {t: _kernel(tmp_path_factory, t) for t in (1, 2, 3)}


@pytest.mark.parametrize(("n", "k"), [(96, 64), (1030, 72), (7, 13), (512, 600)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear(kernels: dict[int, RowsLinear], n: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for rows in (1, 2, 3, 5, 8, 9, 17, MAX_ROWS):
        x = torch.randn(rows, k, generator=g)
        want = F.linear(x, w, b)
        for kernel in kernels.values():
            got = kernel(x, w, b)
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (rows, n, k)


def test_each_row_is_the_same_alone_or_in_a_batch_and_on_any_thread_split(
    kernels: dict[int, RowsLinear],
) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 576, generator=g)  # above the parallel threshold: split over threads
    b = torch.randn(2048, generator=g)
    x = torch.randn(MAX_ROWS, 576, generator=g)
    alone = [kernels[1](x[i : i + 1], w, b)[0] for i in range(MAX_ROWS)]
    for threads, kernel in kernels.items():
        for rows in (1, 2, 3, 4, 7, 9, 16, MAX_ROWS):
            out = kernel(x[:rows], w, b)
            for i in range(rows):
                assert torch.equal(out[i], alone[i]), (threads, rows, i)


def test_other_shapes_and_dtypes_go_to_the_fallback(kernels: dict[int, RowsLinear]) -> None:
    calls = []

    def fallback(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(x.shape)
        return F.linear(x, w, b)

    kernel = kernels[2]
    kernel.fallback, saved = fallback, kernel.fallback
    try:
        w = torch.randn(16, 8)
        kernel(torch.randn(MAX_ROWS + 1, 8), w, None)  # a prefill chunk
        kernel(torch.randn(2, 8, dtype=torch.float64), w.double(), None)
        out = kernel(torch.randn(2, 3, 8), w, None)  # leading dims are rows: 6 <= MAX_ROWS
        assert out.shape == (2, 3, 16)
        assert calls == [(MAX_ROWS + 1, 8), (2, 8)]
    finally:
        kernel.fallback = saved


def test_greedy_drafts_equal_no_drafts_bit_for_bit_with_the_kernel(tiny_model_dir: Path) -> None:
    """Every verified row's logits are bitwise those of the same position decoded without
    drafts (while the steps stay under MAX_ROWS rows: 5 requests x (1 + 4 drafts))."""
    from cluster.engine.engine import LLMEngine
    from tests.helpers import greedy, make_config, run_until_done
    from tests.spec_helpers import ScriptedProposer, use_proposer

    def engine(spec: bool) -> LLMEngine:
        extra = {"decode.speculative.method": "ngram"} if spec else {}
        return LLMEngine(
            make_config(
                **{
                    "model.path": str(tiny_model_dir),
                    "model.num_threads": 2,
                    "decode.speculative.num_speculative_tokens": 4,
                    **extra,
                }
            )
        )

    off, on = engine(False), engine(True)
    if not isinstance(getattr(off.runner.model.ops, "linear", None), RowsLinear):
        pytest.skip("the rows kernel is not in use here (no compiler or not CPU fp32)")
    prompts = {f"r{i}": [5 + (i * 7 + j * 3) % 400 for j in range(9 + 6 * i)] for i in range(5)}
    logits: dict[tuple[str, int], torch.Tensor] = {}
    compared = 0

    def recorder(eng: LLMEngine, check: bool):  # type: ignore[no-untyped-def]
        forward = eng.runner.forward  # type: ignore[attr-defined]

        def record(inputs):  # type: ignore[no-untyped-def]
            nonlocal compared
            out = forward(inputs)
            row = 0
            for item in inputs.sampled:
                r = item.request
                n = r.num_output_tokens
                for j in range(item.num_sampled_rows):
                    key = (r.request_id, n + j)
                    if not check:
                        logits[key] = out[row + j].clone()
                    elif item.draft_token_ids[:j] == expected[r.request_id][n : n + j]:
                        assert torch.equal(logits[key], out[row + j]), key
                        compared += 1
                row += item.num_sampled_rows
            return out

        eng.runner.forward = record  # type: ignore[attr-defined,method-assign]

    recorder(off, check=False)
    for rid, p in prompts.items():
        off.add(rid, p, greedy(30))
    expected = run_until_done(off)
    recorder(on, check=True)
    use_proposer(on, ScriptedProposer(expected, on.vocab_size, wrong_share=0.3))
    for rid, p in prompts.items():
        on.add(rid, p, greedy(30))
    assert run_until_done(on) == expected
    assert on.stats()["spec"]["num_accepted_tokens"] > 0
    assert compared >= 5 * 30
