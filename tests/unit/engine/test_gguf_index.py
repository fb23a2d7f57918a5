"""``read_gguf_index`` reads what ``gguf.GGUFReader`` reads (every scalar and string field,
every tensor's name, type, shape and bytes), skips long arrays, and names what is wrong with a
bad file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from cluster.engine.models.default_model import find_gguf
from cluster.engine.models.gguf_index import MAX_KEPT_ARRAY, read_gguf_index
from cluster.engine.models.tiny import write_tiny_gguf


def _same_as_reader(path: Path) -> int:
    reader = GGUFReader(str(path))
    index = read_gguf_index(path)
    skipped = 0
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own header pseudo-fields
            continue
        long_array = field.types[0] == GGUFValueType.ARRAY and len(field.data) > MAX_KEPT_ARRAY
        if long_array:
            assert key not in index.fields, key
            skipped += 1
        else:
            assert index.field(key) == pytest.approx(field.contents()), key
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type, ours.name
        assert ours.shape == tuple(int(x) for x in theirs.shape), ours.name
        assert ours.data.dtype == theirs.data.dtype, ours.name
        assert ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data.view(np.uint8), theirs.data.view(np.uint8)), ours.name
    return skipped


def test_the_index_equals_the_reader_on_a_file_of_every_supported_type(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    kinds = {"attn_q": "F16", "attn_k": "BF16", "attn_v": "Q4_0", "ffn_up": "Q4_1"}
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "t.gguf", types=kinds)
    _same_as_reader(path)
    index = read_gguf_index(path)
    assert index.field("general.architecture") == "llama"
    assert {t.tensor_type.name for t in index.tensors} >= {"F32", "F16", "BF16", "Q4_0", "Q8_0"}


@pytest.mark.integration
def test_the_index_equals_the_reader_on_the_default_model() -> None:
    path = find_gguf()
    assert path is not None
    # The vocabulary, merges and token types: the arrays that cost GGUFReader seconds.
    assert _same_as_reader(path) >= 3


def test_bad_files_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny_model_dir, tmp_path / "t.gguf")
    raw = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + raw[4:])
    with pytest.raises(ValueError, match="bad.gguf: not a GGUF file"):
        read_gguf_index(bad)
    bad.write_bytes(raw[:4] + (1).to_bytes(4, "little") + raw[8:])
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        read_gguf_index(bad)
    bad.write_bytes(raw[:200])
    with pytest.raises(ValueError, match="bad.gguf: GGUF file is truncated"):
        read_gguf_index(bad)
    bad.write_bytes(raw[: len(raw) - 64])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_gguf_index(bad)
