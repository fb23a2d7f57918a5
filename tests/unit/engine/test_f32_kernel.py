"""The native linear on dense fp32 weights (the F32 format): equal to ``F.linear`` on every
instruction-set variant, batch-invariant bit for bit, the rule between it and BLAS, and the
engine with drafts verified through it equal to the engine without."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels.native import ISA_NAMES, NativeKernels, load_native
from cluster.engine.kernels.quant import F32
from cluster.engine.models import packed as packed_module
from cluster.engine.models.packed import KERNEL_MAX_ROWS, PackedLinear
from cluster.engine.request import EngineRequest
from tests.helpers import greedy, make_config, run_until_done

MAX_ROWS = KERNEL_MAX_ROWS["avx2"]["dense"]


@pytest.fixture(scope="module")
def kernels(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, NativeKernels]]:
    cache = tmp_path_factory.mktemp("cache")
    ks = {t: load_native(cache, t) for t in (1, 2, 3)}
    if any(k is None for k in ks.values()):
        pytest.skip("no native library here (no C compiler): the engine uses F.linear")
    yield {t: k for t, k in ks.items() if k is not None}
    ks[1].set_isa(None)  # type: ignore[union-attr]


def _isas(k: NativeKernels) -> list[str]:
    """Every variant this CPU runs (the rest are skipped: the CPU lacks their instructions)."""
    k.set_isa(None)
    return list(ISA_NAMES[: ISA_NAMES.index(k.isa) + 1])


@pytest.mark.parametrize(("n", "k"), [(96, 64), (1030, 72), (7, 13), (512, 600)])
@pytest.mark.parametrize("bias", [False, True])
def test_equals_f_linear_on_every_isa(
    kernels: dict[int, NativeKernels], n: int, k: int, bias: bool
) -> None:
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    for isa in _isas(kernels[1]):
        kernels[1].set_isa(isa)
        for rows in (1, 2, 3, 5, 8, 9, 17, MAX_ROWS):
            x = torch.randn(rows, k, generator=g)
            want = F.linear(x, w, b)
            for kernel in kernels.values():
                got = kernel.linear(F32, w, None, k, x, torch.empty(rows, n), b)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"{isa} {rows}")


def test_each_row_is_the_same_alone_or_in_a_batch_and_on_any_thread_split(
    kernels: dict[int, NativeKernels],
) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(2048, 576, generator=g)  # above the parallel threshold: split over threads
    b = torch.randn(2048, generator=g)
    x = torch.randn(MAX_ROWS, 576, generator=g)
    for isa in _isas(kernels[1]):
        kernels[1].set_isa(isa)
        alone = [kernels[1].linear(F32, w, None, 576, x[i : i + 1], torch.empty(1, 2048), b)[0]
                 for i in range(MAX_ROWS)]  # fmt: skip
        for threads, kernel in kernels.items():
            for rows in (1, 2, 3, 4, 7, 9, 16, MAX_ROWS):
                out = kernel.linear(F32, w, None, 576, x[:rows], torch.empty(rows, 2048), b)
                for i in range(rows):
                    assert torch.equal(out[i], alone[i]), (isa, threads, rows, i)


def test_accumulate_adds_into_the_output(kernels: dict[int, NativeKernels]) -> None:
    g = torch.Generator().manual_seed(2)
    w, x, h = torch.randn(40, 24, generator=g), torch.randn(3, 24, generator=g), torch.randn(3, 40)
    got = kernels[2].linear(F32, w, None, 24, x, h.clone(), accumulate=True)
    torch.testing.assert_close(got, h + F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_the_rule_sends_larger_chunks_to_blas(
    kernels: dict[int, NativeKernels], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to the rule's rows (dense weights, this CPU's variant): the kernel; more: the tiles'
    BLAS on the weight itself (no copy); no library, another dtype or device: the torch
    reference (F.linear)."""
    linear = PackedLinear(kernels[2])
    blas: list[tuple[int, ...]] = []
    ref: list[tuple[int, ...]] = []
    f_linear, blas_linear = F.linear, packed_module.blas_linear

    def spy_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        ref.append(tuple(x.shape))
        return f_linear(x, w, b)

    def spy_blas(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        blas.append(tuple(x.shape))
        return blas_linear(x, w, b)

    monkeypatch.setattr(F, "linear", spy_ref)
    monkeypatch.setattr(packed_module, "blas_linear", spy_blas)
    w = torch.randn(16, 8)
    rows = linear.max_rows(packed=False)
    assert rows == KERNEL_MAX_ROWS[kernels[2].isa]["dense"]
    out = linear(torch.randn(2, 3, 8), w, None)  # leading dims are rows: 6 <= max
    assert out.shape == (2, 3, 16) and blas == [] and ref == []
    x = torch.randn(rows + 1, 8)  # a prefill chunk
    torch.testing.assert_close(linear(x, w, None), f_linear(x, w), atol=1e-5, rtol=1e-5)
    assert blas == [(rows + 1, 8)]
    ref.clear()
    linear(torch.randn(2, 8, dtype=torch.float64), w.double(), None)
    assert ref == [(2, 8)] and blas == [(rows + 1, 8)]
    assert PackedLinear(None).kernel_max_rows == 0
    for isa in ISA_NAMES:  # the rule covers every variant, dense and packed
        assert KERNEL_MAX_ROWS[isa]["dense"] >= 1 and KERNEL_MAX_ROWS[isa]["packed"] >= 1


def test_greedy_drafts_equal_no_drafts_bit_for_bit_with_the_kernel(tiny_model_dir: Path) -> None:
    """Every verified row's logits are bitwise those of the same position decoded without
    drafts (while the steps stay under the kernel's rows: 5 requests x (1 + 4 drafts))."""
    from tests.spec_helpers import ScriptedProposer, use_proposer

    off, on = _engine(tiny_model_dir, spec=False), _engine(tiny_model_dir, spec=True)
    linear = off.runner.model.ops.linear
    if not isinstance(linear, PackedLinear) or linear.kernels is None:
        pytest.skip("the native kernel is not in use here (no compiler or not CPU fp32)")
    prompts = {f"r{i}": [5 + (i * 7 + j * 3) % 400 for j in range(9 + 6 * i)] for i in range(5)}
    recorded: dict[tuple[str, int], torch.Tensor] = {}
    _record_logits(off, recorded, None)
    for rid, p in prompts.items():
        off.add(EngineRequest(rid, p, greedy(30)))
    expected = run_until_done(off)
    compared: list[int] = []
    _record_logits(on, recorded, (expected, compared))
    use_proposer(on, ScriptedProposer(expected, on.vocab_size, wrong_share=0.3))
    for rid, p in prompts.items():
        on.add(EngineRequest(rid, p, greedy(30)))
    assert run_until_done(on) == expected
    assert on.stats()["spec"]["num_accepted_tokens"] > 0
    assert len(compared) >= 5 * 30


def _engine(model_dir: Path, spec: bool) -> Any:
    from cluster.engine.engine import LLMEngine

    cfg: dict[str, Any] = {
        "model.path": str(model_dir),
        "model.num_threads": 2,
        "decode.speculative.num_speculative_tokens": 4,
    }
    if spec:
        cfg["decode.speculative.method"] = "ngram"
    return LLMEngine(make_config(**cfg))


def _record_logits(
    eng: Any,
    logits: dict[tuple[str, int], torch.Tensor],
    check: tuple[dict[str, list[int]], list[int]] | None,
) -> None:
    """Wrap ``eng``'s forward: record each sampled row's logits by (request, output index), or
    (``check``: the expected tokens, a list counting comparisons) compare a verified row whose
    drafts before it were right with the recorded row, bit for bit."""
    forward = eng.runner.forward

    def record(inputs: Any) -> torch.Tensor:
        out = forward(inputs)
        row = 0
        for item in inputs.sampled:
            r = item.request
            n = r.num_output_tokens
            for j in range(item.num_sampled_rows):
                key = (r.request_id, n + j)
                if check is None:
                    logits[key] = out[row + j].clone()
                elif item.draft_token_ids[:j] == check[0][r.request_id][n : n + j]:
                    assert torch.equal(logits[key], out[row + j]), key
                    check[1].append(1)
            row += item.num_sampled_rows
        return out

    eng.runner.forward = record
