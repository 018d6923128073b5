"""Shared fixtures: a tiny random Llama (fast tests) and the bundled SmolLM2 (slow tests)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import string

# isort: off
import pagedllm  # noqa: F401  (first: it sets the OpenMP wait policy before torch loads)

# Next, before any test module can import triton: on a machine without CUDA it sets
# TRITON_INTERPRET=1 first, which the interpreted Triton tests need (a pytest-xdist worker may
# otherwise import triton through another module first, and those tests then skip).
import pagedllm.attention.triton_paged  # noqa: F401

# isort: on
import pytest
import torch

from pagedllm.model.config import LlamaArchConfig


def _glibc() -> ctypes.CDLL | None:
    """The C library when it has glibc's ``malloc_trim`` (see _release_memory_after_module)."""
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


_LIBC = _glibc()


def pytest_collection_modifyitems(config, items):
    """Files holding slow (real-model) tests run first, the others after, each file's own order
    kept: ``make test`` runs two pytest-xdist workers that take a file at a time, and a long file
    collected last would keep one worker busy at the end while the other idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: False (slow) first


def pytest_configure(config):
    """dtype="auto" is bf16 on AMX CPUs; the exactness checks compare against fp32 references, so
    the suite (and the servers it starts) resolves "auto" to float32 on every CPU kind
    (tests/test_dtype_auto.py checks the rule itself)."""
    os.environ.setdefault("PAGEDLLM_AUTO_DTYPE", "float32")


TINY_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention stores keys and values in blocks",
    "a block table maps logical blocks to physical blocks",
    "continuous batching lets new requests join between steps",
    "hello world, hello engine; 123 456 789!",
    string.ascii_letters + string.digits + string.punctuation,
]


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer trained in-process on a few sentences (vocab ~400), with
    ``</s>`` as EOS, wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        TINY_CORPUS * 4, vocab_size=400, min_frequency=1, special_tokens=["</s>", "<s>"]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token="</s>", bos_token="<s>"
    )
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    return tok


def make_tiny_config(vocab_size: int, eos_id: int, **over) -> LlamaArchConfig:
    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=[eos_id],
    )
    kw.update(over)
    return LlamaArchConfig(**kw)


def make_random_state_dict(cfg: LlamaArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Hugging Face-named random weights, scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (shape[-1] ** -0.5)

    d, h, kv, hd, inter = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, d, generator=g)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        sd[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
        sd[p + "self_attn.q_proj.weight"] = w(h * hd, d)
        sd[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
        sd[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
        sd[p + "self_attn.o_proj.weight"] = w(d, h * hd)
        sd[p + "mlp.gate_proj.weight"] = w(inter, d)
        sd[p + "mlp.up_proj.weight"] = w(inter, d)
        sd[p + "mlp.down_proj.weight"] = w(d, inter)
    sd["model.norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = w(cfg.vocab_size, d)
    return sd


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory):
    """Keep the tokenizer cache (``PAGEDLLM_CACHE_DIR``) of the test run out of ~/.cache; the
    C++ kernel builds stay in the usual cache (``PAGEDLLM_KERNEL_CACHE_DIR``), so a test run does
    not recompile them (minutes)."""
    from pagedllm.ops.loader import cache_root

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_KERNEL_CACHE_DIR", str(cache_root()))
        mp.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path_factory.mktemp("pagedllm_cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def gguf_readers():
    """One ``gguf.GGUFReader`` per bundled model file for the whole run (tests/gguf_readers.py):
    transformers' loads of the same file (reference models, tokenizer builds) otherwise parse its
    vocabulary metadata again (5-10 s each; pagedllm's own later opens use the GGUF index)."""
    from tests.gguf_readers import shared_gguf_readers

    with shared_gguf_readers() as shared:
        yield shared


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_module():
    """After each test file: collect its garbage and hand the freed heap back to the OS. A
    worker runs many files, and glibc keeps freed blocks of a model load (weights, tokenizer
    tables) in its arenas. Workers once grew past 13 GiB each and ran the 24 GiB machine out
    of memory (mostly the engine leak tests/entrypoints/test_app_releases_engine.py pins); with
    the leak fixed and this trim they stay near 2 GiB."""
    yield
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def cpu_ops():
    """The C++ CPU kernels (``pagedllm.ops.CpuOps``); the test skips, with the build error, where
    they cannot be built."""
    from pagedllm.ops import cpu_ops_error, load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        pytest.skip(f"C++ CPU kernels unavailable: {cpu_ops_error()}")
    return ops


@contextlib.contextmanager
def _kernel_switch(switch, on: bool, cannot: str):
    """Runs the block with the process-wide kernel setting ``switch`` (a ``CpuOps`` method:
    ``switch(None)`` asks, ``switch(flag)`` sets and returns the new state) at ``on``, then
    restores it; skips the test with reason ``cannot`` where ``on`` cannot be had."""
    before = switch()
    if switch(on) != on:
        switch(before)
        pytest.skip(cannot)
    try:
        yield
    finally:
        switch(before)


def attention_bf16_dot(ops, on: bool):
    """The attention kernels' bf16 dot products (``CpuOps.attention_bf16_dot``) on or off for
    the block (they need the avx512 kernel variant and the ``avx512_bf16`` CPU flag)."""
    return _kernel_switch(
        ops.attention_bf16_dot, on,
        f"bf16 attention dot products need the avx512_bf16 CPU flag (missing here) and the "
        f"avx512 kernel variant (this one: {ops.variant})",
    )  # fmt: skip


def attention_amx(ops, on: bool):
    """The bf16 attention dot products on AMX tiles (``CpuOps.attention_amx``: scores and p . V)
    on or off for the block (they need the avx512 kernel variant and the ``amx_bf16`` /
    ``amx_tile`` CPU flags)."""
    return _kernel_switch(
        ops.attention_amx, on,
        f"AMX attention tiles need the amx_bf16 and amx_tile CPU flags (missing here) and the "
        f"avx512 kernel variant (this one: {ops.variant})",
    )  # fmt: skip


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_loaded(tiny_tokenizer):
    """A ``LoadedModel`` with a tiny random Llama (2 layers, 4 heads / 2 KV heads, GQA)."""
    return make_tiny_loaded(tiny_tokenizer)


@pytest.fixture(scope="session")
def tiny_loaded_hd64(tiny_tokenizer):
    """The tiny random Llama with head_dim 64 (a multiple of 32: bf16 KV caches then take the bf16
    dot-product attention, on AMX tiles on AMX CPUs)."""
    return make_tiny_loaded(tiny_tokenizer, hidden_size=128, head_dim=64)


def make_tiny_loaded(tokenizer, **over):
    """A ``LoadedModel`` of :func:`make_tiny_config` (``over`` replaces its fields) with
    :func:`make_random_state_dict` weights."""
    from pathlib import Path

    from pagedllm.model.loader import LoadedModel

    cfg = make_tiny_config(len(tokenizer), tokenizer.eos_token_id, **over)
    sd = make_random_state_dict(cfg)
    return LoadedModel(
        config=cfg,
        state_dict=sd,
        tokenizer=tokenizer,
        source=Path("<tiny-random-llama>"),
        weight_bytes=sum(t.numel() * t.element_size() for t in sd.values()),
    )


@pytest.fixture(scope="session")
def hf_tiny_model(tiny_loaded):
    """The same tiny weights in transformers' LlamaForCausalLM (the reference implementation)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = tiny_loaded.config
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=c.eos_token_ids[0],
        pad_token_id=c.eos_token_ids[0],
    )
    model = LlamaForCausalLM(hf_cfg).eval()
    model.load_state_dict(tiny_loaded.state_dict, strict=True)
    return model


@pytest.fixture(scope="session")
def smollm():
    """The bundled SmolLM2-135M-Instruct, loaded once per test run (fp32)."""
    from pagedllm.model.loader import load_model

    return load_model(None, torch.float32)


@pytest.fixture
def tiny_llm_factory(tiny_loaded):
    """Build an ``LLM`` on the tiny model (or the ``loaded=`` one) with invariant checks after
    every step."""
    from pagedllm.entrypoints.llm import LLM

    made = []

    def make(**kw):
        kw.setdefault("check_invariants", True)
        kw.setdefault("max_model_len", 256)
        kw.setdefault("kv_cache_memory", 1 << 22)
        kw.setdefault("loaded", tiny_loaded)
        llm = LLM(**kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:  # every test leaves an empty pool behind
        bm = llm.engine.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
