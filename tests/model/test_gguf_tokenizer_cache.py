"""The GGUF tokenizer cache of pagedllm.model.loader: a GGUF's tokenizer is built once, then
loaded from its save_pretrained files (split from test_loader.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm.model.loader import eos_token_ids, load_model, load_tokenizer
from pagedllm.model.loader.tokenizer import tokenizer_cache_dir
from tests.model.test_loader import write_tiny_gguf


def _tokenizer_facts(tok) -> tuple:
    texts = ["hello world", "<|im_start|>user\nhi<|im_end|>", "  tabs\t\tünïcödé 日本 🤖", ""]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True
    )
    ids = [tok(t)["input_ids"] for t in texts]
    return (
        ids,
        [tok.decode(i) for i in ids],
        chat,
        len(tok),
        tok.bos_token_id,
        tok.eos_token_id,
        tok.all_special_ids,
        tok.get_added_vocab(),
        eos_token_ids(tok),
    )


def _from_pretrained_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Record every AutoTokenizer.from_pretrained call made by the loader (which imports
    transformers' AutoTokenizer where it calls it, so the class itself is spied on)."""
    from transformers import AutoTokenizer

    calls: list[tuple[str, dict]] = []
    real = AutoTokenizer.from_pretrained

    def spy(path, **kw):
        calls.append((str(path), kw))
        return real(path, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    return calls


def test_gguf_tokenizer_cached_after_first_load(
    tiny_gguf_own_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf_own_cache
    calls = _from_pretrained_calls(monkeypatch)
    entry = tokenizer_cache_dir(path)
    assert entry.parent == tmp_path / "cache" / "tokenizers"
    first = load_tokenizer(path)
    assert calls == [(str(tmp_path), {"gguf_file": "tiny.gguf"})]  # built from the GGUF
    assert (entry / "tokenizer.json").is_file()
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary left over
    second = load_tokenizer(path)
    assert calls[1] == (str(entry), {})  # from the cache, not the GGUF
    assert len(calls) == 2
    assert _tokenizer_facts(second) == _tokenizer_facts(first)
    # The whole model loads the same through the cache.
    m = load_model(path)
    assert calls[2] == (str(entry), {})
    assert m.config.eos_token_ids == [0, m.tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_gguf_tokenizer_cache_key_follows_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        write_tiny_gguf(p, tokenizer=True)
    assert tokenizer_cache_dir(a) != tokenizer_cache_dir(b)  # another path
    before = tokenizer_cache_dir(a)
    st = a.stat()
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the file replaced in place
    assert tokenizer_cache_dir(a) != before


def test_gguf_tokenizer_damaged_cache_is_rebuilt(
    tiny_gguf_own_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_gguf_own_cache
    want = _tokenizer_facts(load_tokenizer(path))
    entry = tokenizer_cache_dir(path)
    (entry / "tokenizer.json").write_text("{not json")
    calls = _from_pretrained_calls(monkeypatch)
    assert _tokenizer_facts(load_tokenizer(path)) == want
    assert calls[-1] == (str(tmp_path), {"gguf_file": "tiny.gguf"})  # rebuilt from the GGUF
    assert _tokenizer_facts(load_tokenizer(path)) == want
    assert calls[-1] == (str(entry), {})  # and cached again
    # An entry without tokenizer.json (an interrupted copy by hand) does not block a new one.
    (entry / "tokenizer.json").unlink()
    assert _tokenizer_facts(load_tokenizer(path)) == want
    assert (entry / "tokenizer.json").is_file()


def test_gguf_tokenizer_unwritable_cache_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(not_a_dir))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tokenizer=True)
    tok = load_tokenizer(path)
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert not_a_dir.read_text() == "x"


def test_gguf_tokenizer_of_an_architecture_transformers_has_no_gguf_support_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' AutoTokenizer refuses a GGUF file whose architecture it has no GGUF
    support for (OLMo 2 here), although the tokenizer depends only on the file's tokenizer keys:
    pagedllm builds it from those, equal to the same keys' tokenizer in a Llama file."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "llama").mkdir()
    (tmp_path / "olmo2").mkdir()
    write_tiny_gguf(tmp_path / "llama" / "tiny.gguf", arch="llama")
    write_tiny_gguf(tmp_path / "olmo2" / "tiny.gguf", arch="olmo2")
    expected = _tokenizer_facts(load_tokenizer(tmp_path / "llama" / "tiny.gguf"))
    assert _tokenizer_facts(load_tokenizer(tmp_path / "olmo2" / "tiny.gguf")) == expected
    # ... and from the cache entry it wrote.
    assert _tokenizer_facts(load_tokenizer(tmp_path / "olmo2" / "tiny.gguf")) == expected
