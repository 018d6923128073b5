"""The cached GGUF index (pagedllm.model.loader.gguf_index): a second open of an unchanged file
serves the reader's metadata and tensors without building ``gguf.GGUFReader``; a changed file,
a damaged entry or a value the index did not keep falls back to the reader."""

import os

import gguf
import numpy as np
import pytest
import torch

from pagedllm.model.loader import gguf_index, load_gguf_weights, open_gguf
from pagedllm.model.loader.gguf_index import GGUFIndex, index_path
from tests.model.test_loader import write_tiny_gguf


def _count_reader_builds(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    built: list[str] = []
    real = gguf.GGUFReader

    def counting(path, *a, **kw):
        built.append(str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    return built


def test_second_open_serves_the_readers_fields_and_tensors(tiny_gguf_own_cache, tmp_path, monkeypatch):
    tiny = tiny_gguf_own_cache
    monkeypatch.setattr(gguf_index, "MAX_CACHED_ARRAY", 8)  # the 264-token vocabulary: length only
    built = _count_reader_builds(monkeypatch)
    reader = open_gguf(tiny)
    assert built == [str(tiny)] and not isinstance(reader, GGUFIndex)
    assert index_path(tiny).parent == tmp_path / "cache" / "gguf_index"
    assert index_path(tiny).is_file()
    index = open_gguf(tiny)
    assert isinstance(index, GGUFIndex) and built == [str(tiny)]  # no second reader
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(index.fields) == sorted(keys)
    for key in keys:
        assert len(index.fields[key].data) == len(reader.fields[key].data), key
        if key != "tokenizer.ggml.tokens" and key != "tokenizer.ggml.token_type":
            assert index.fields[key].contents() == reader.fields[key].contents(), key
    assert built == [str(tiny)]
    # An array the index kept only the length of: the real reader, once, gives its contents.
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) > 8 and index.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert index.fields["tokenizer.ggml.token_type"].contents() == reader.fields[
        "tokenizer.ggml.token_type"].contents()  # fmt: skip
    assert built == [str(tiny), str(tiny)]
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for a, b in zip(index.tensors, reader.tensors):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)  # fmt: skip
        assert np.array_equal(a.shape, b.shape) and a.data.dtype == b.data.dtype
        assert a.data.shape == b.data.shape and np.array_equal(a.data, b.data), a.name
    assert {t.tensor_type.name for t in index.tensors} >= {"F32", "F16", "Q8_0"}


def test_weights_and_config_from_the_index_equal_the_readers(tiny_gguf_own_cache, monkeypatch):
    tiny = tiny_gguf_own_cache
    built = _count_reader_builds(monkeypatch)
    cfg1, sd1 = load_gguf_weights(tiny)
    cfg2, sd2 = load_gguf_weights(tiny)
    assert len(built) == 1 and cfg1 == cfg2 and sd1.keys() == sd2.keys()
    for name in sd1:
        assert torch.equal(sd1[name], sd2[name]), name


def test_a_changed_file_gets_a_fresh_index(tiny_gguf_own_cache, monkeypatch):
    tiny = tiny_gguf_own_cache
    built = _count_reader_builds(monkeypatch)
    open_gguf(tiny)
    old = index_path(tiny)
    write_tiny_gguf(tiny, tokenizer=True, theta=5000.0)
    st = tiny.stat()
    os.utime(tiny, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert index_path(tiny) != old
    reader = open_gguf(tiny)
    assert len(built) == 2 and not isinstance(reader, GGUFIndex)
    assert open_gguf(tiny).fields["llama.rope.freq_base"].contents() == 5000.0


def test_a_damaged_index_is_dropped_and_rebuilt(tiny_gguf_own_cache, monkeypatch, caplog):
    tiny = tiny_gguf_own_cache
    open_gguf(tiny)
    index_path(tiny).write_text('{"fields": {}, "tensors": [{"name": 1}]}')
    built = _count_reader_builds(monkeypatch)
    with caplog.at_level("WARNING"):
        reader = open_gguf(tiny)
    assert not isinstance(reader, GGUFIndex) and built == [str(tiny)]
    assert "ignoring the GGUF index" in caplog.text
    assert isinstance(open_gguf(tiny), GGUFIndex)  # written again from the reader


def test_an_unwritable_cache_only_costs_the_reader_again(tiny_gguf_own_cache, tmp_path, monkeypatch):
    tiny = tiny_gguf_own_cache
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker))
    built = _count_reader_builds(monkeypatch)
    open_gguf(tiny)
    open_gguf(tiny)
    assert len(built) == 2
