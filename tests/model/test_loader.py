"""Tests of pagedllm.model.loader: GGUF / Hugging Face loading, Q/K un-permutation, export."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from pagedllm.model.loader import (
    LoadedModel,
    export_hf_folder,
    gguf_to_hf_name,
    load_gguf_weights,
    load_hf_weights,
    load_model,
    unpermute_qk,
)

# A tiny Llama: 2 layers, hidden 64, 4 query heads, 2 kv heads (head_dim 16), ffn 128.
TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, ctx=256, theta=10000.0, eps=1e-6)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation, written from its definition:
    reshape to (n_head, 2, head_dim // 2, in) -> swap axes 1, 2 -> reshape back."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _byte_tokens() -> list[str]:
    """GPT-2 byte-level alphabet (bytes -> printable unicode), 256 tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def tiny_hf_weights(vocab: int, seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face layout and names."""
    rng = np.random.default_rng(seed)
    h, f, hd = TINY["hidden"], TINY["ffn"], TINY["hidden"] // TINY["heads"]
    kv = TINY["kv_heads"] * hd

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {"model.embed_tokens.weight": r(vocab, h), "model.norm.weight": r(h)}
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = r(h)
        w[p + "post_attention_layernorm.weight"] = r(h)
        w[p + "self_attn.q_proj.weight"] = r(h, h)
        w[p + "self_attn.k_proj.weight"] = r(kv, h)
        w[p + "self_attn.v_proj.weight"] = r(kv, h)
        w[p + "self_attn.o_proj.weight"] = r(h, h)
        w[p + "mlp.gate_proj.weight"] = r(f, h)
        w[p + "mlp.up_proj.weight"] = r(f, h)
        w[p + "mlp.down_proj.weight"] = r(h, f)
    if not tied:
        w["lm_head.weight"] = r(vocab, h)
    return w


HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    path: Path,
    *,
    tied: bool = True,
    arch: str = "llama",
    tokenizer: bool = True,
    theta: float = TINY["theta"],
    rope_freqs: np.ndarray | None = None,
    linear_rope: float | None = None,
) -> dict[str, np.ndarray]:
    """Write a tiny llama GGUF the way llama.cpp's converter would; return the expected HF weights
    (float32, after the storage types' rounding)."""
    tokens = SPECIALS + _byte_tokens() + ["he", "ll", "hell", "hello"]
    merges = ["h e", "l l", "he ll", "hell o"]
    vocab = len(tokens)
    hf = tiny_hf_weights(vocab, tied=tied)
    heads, kv_heads = TINY["heads"], TINY["kv_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(TINY["layers"])
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    if linear_rope is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(linear_rope)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
    w.add_layer_norm_rms_eps(TINY["eps"])
    w.add_rope_dimension_count(TINY["hidden"] // heads)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(0)
        w.add_chat_template(CHAT_TEMPLATE)
    expected: dict[str, np.ndarray] = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            g = f"blk.{layer}.{HF_TO_GGUF[rest.rsplit('.', 1)[0]]}.weight"
        stored = t
        if ".self_attn.q_proj." in name:
            stored = llama_cpp_permute(t, heads)
        elif ".self_attn.k_proj." in name:
            stored = llama_cpp_permute(t, kv_heads)
        if "mlp.up_proj" in name or name == "lm_head.weight":
            w.add_tensor(g, stored.astype(np.float16))  # F16
            expected[name] = t.astype(np.float16).astype(np.float32)
        elif "mlp.down_proj" in name or "self_attn.k_proj" in name:
            # Q8_0 quantizes each row in blocks of 32, so it commutes with the row permutation.
            q = quantize(stored, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            qt = gguf.GGMLQuantizationType.Q8_0
            expected[name] = dequantize(quantize(t, qt), qt).reshape(t.shape)
        else:
            w.add_tensor(g, stored)  # F32
            expected[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# --------------------------------------------------------------------------------------------
# Q/K permutation and names
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n_head", "head_dim", "n_in"), [(9, 64, 576), (3, 64, 576), (4, 16, 64)])
def test_unpermute_qk_inverts_llama_cpp_permutation(n_head: int, head_dim: int, n_in: int) -> None:
    rng = np.random.default_rng(n_head)
    hf = rng.standard_normal((n_head * head_dim, n_in)).astype(np.float32)
    permuted = llama_cpp_permute(hf, n_head)
    assert not np.array_equal(permuted, hf)
    restored = unpermute_qk(torch.from_numpy(permuted), n_head)
    assert restored.is_contiguous()
    assert torch.equal(restored, torch.from_numpy(hf))
    # biases (1-D) too
    b = rng.standard_normal(n_head * head_dim).astype(np.float32)
    assert torch.equal(
        unpermute_qk(torch.from_numpy(llama_cpp_permute(b, n_head)), n_head), torch.from_numpy(b)
    )


def test_unpermute_qk_for_k_with_kv_heads() -> None:
    n_head, n_kv, head_dim, n_in = 8, 2, 32, 256
    k = torch.randn(n_kv * head_dim, n_in)
    permuted = torch.from_numpy(llama_cpp_permute(k.numpy(), n_kv))
    assert torch.equal(unpermute_qk(permuted, n_kv), k)
    # Using the query head count would be wrong: the k rows belong to kv heads.
    assert not torch.equal(unpermute_qk(permuted, n_head), k)
    with pytest.raises(ValueError):
        unpermute_qk(torch.zeros(10, 4), 3)


def test_gguf_to_hf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.12.attn_norm.weight") == "model.layers.12.input_layernorm.weight"
    assert gguf_to_hf_name("blk.0.attn_q.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert (
        gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert gguf_to_hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


# --------------------------------------------------------------------------------------------
# Tiny synthetic GGUF
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_weights_round_trip(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, tied=tied, tokenizer=False)
    config, state = load_gguf_weights(path)
    assert config.num_hidden_layers == 2
    assert config.hidden_size == 64
    assert config.intermediate_size == 128
    assert config.num_attention_heads == 4
    assert config.num_key_value_heads == 2
    assert config.head_dim == 16
    assert config.vocab_size == expected["model.embed_tokens.weight"].shape[0]
    assert config.rope_theta == 10000.0
    assert config.rms_norm_eps == 1e-6
    assert config.max_position_embeddings == 256
    assert config.rope_scaling is None
    assert config.tie_word_embeddings is tied
    assert set(state) == set(expected)
    for name, want in expected.items():
        got = state[name]
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert tuple(got.shape) == want.shape, name
        assert torch.equal(got, torch.from_numpy(want)), name

    _, half = load_gguf_weights(path, dtype=torch.bfloat16)
    for name, want in expected.items():
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], torch.from_numpy(want).to(torch.bfloat16)), name


def test_tiny_gguf_load_model_and_hf_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, tied=True)
    m = load_model(path)
    assert isinstance(m, LoadedModel)
    assert m.source == path.resolve()
    assert m.config.bos_token_id == 1
    im_end = m.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert m.config.eos_token_ids[0] == 0  # tokenizer / GGUF EOS first
    assert im_end in m.config.eos_token_ids  # chat-template end of turn
    assert m.weight_bytes == sum(v.nbytes for v in expected.values())
    for name, want in expected.items():
        assert torch.equal(m.state_dict[name], torch.from_numpy(want)), name
    # A folder holding exactly one .gguf resolves to it.
    assert load_model(tmp_path).source == path.resolve()

    out = tmp_path / "hf"
    export_hf_folder(m, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "float32" and cfg["tie_word_embeddings"] is True
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # loadable by transformers 4.x
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    config2, state2 = load_hf_weights(out)
    assert "lm_head.weight" not in state2
    m2 = load_model(out)
    assert m2.config == m.config
    assert set(m2.state_dict) == set(m.state_dict)
    for name, t in m.state_dict.items():
        assert torch.equal(m2.state_dict[name], t), name
    assert m2.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello"}], tokenize=False
    ) == m.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)


def test_exported_tiny_folder_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tied=False)
    m = load_model(path)
    out = tmp_path / "hf"
    export_hf_folder(m, out)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for name, t in m.state_dict.items():
        assert torch.equal(ref[name], t), name
    assert ref["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "bloom.gguf"
    write_tiny_gguf(path, arch="bloom", tokenizer=False)
    with pytest.raises(ValueError, match="general.architecture"):
        load_gguf_weights(path)


def test_hf_folder_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bloom"}))
    with pytest.raises(ValueError, match="bloom"):
        load_hf_weights(tmp_path)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(missing)


def test_random_bytes_is_not_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "random.gguf"
    bad.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_model(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf_weights(empty)


@pytest.mark.parametrize("fraction", [0.02, 0.5, 0.999])
def test_truncated_gguf(tmp_path: Path, fraction: float) -> None:
    good = tmp_path / "tiny.gguf"
    write_tiny_gguf(good, tokenizer=True)
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_model(cut)


def test_corrupt_header_bytes(tmp_path: Path) -> None:
    good = tmp_path / "tiny.gguf"
    write_tiny_gguf(good, tokenizer=False)
    data = bytearray(good.read_bytes())
    data[:4] = b"GGUX"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is not a valid GGUF file"):
        load_gguf_weights(bad)


# --------------------------------------------------------------------------------------------
# Less common inputs
# --------------------------------------------------------------------------------------------


def test_sharded_hf_folder(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    vocab = 300
    weights = {k: torch.from_numpy(v) for k, v in tiny_hf_weights(vocab, tied=False).items()}
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for fname, keys in shards.items():
        save_file({k: weights[k].to(torch.bfloat16) for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": [0, 2],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config, state = load_hf_weights(tmp_path, dtype=torch.float32)
    assert config.head_dim == 16 and config.rope_theta == 500000.0 and config.rope_scaling is None
    assert config.eos_token_ids == [0, 2] and config.tie_word_embeddings is False
    assert set(state) == set(weights)
    for k, v in weights.items():
        assert state[k].dtype == torch.float32
        assert torch.equal(state[k], v.to(torch.bfloat16).float()), k


def test_unsupported_tensor_type_names_tensor(tmp_path: Path) -> None:
    path = tmp_path / "int.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(0)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.int8))  # I8: no dequantizer
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"output_norm\.weight.*I8"):
        load_gguf_weights(path)


def test_llama3_rope_freqs_recovered(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1 rope scaling as a rope_freqs tensor; it must come back as the
    Hugging Face llama3 rope_scaling dict (converter formula written from its definition)."""
    import math

    theta, head_dim = 500000.0, 16
    factor, low, high, old_ctx = 8.0, 1.0, 4.0, 8192
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(
        path, tokenizer=False, rope_freqs=np.array(factors, dtype=np.float32), theta=theta
    )
    config, state = load_gguf_weights(path)
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert not any("rope" in k for k in state)


def test_linear_rope_scaling_keys(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, tokenizer=False, linear_rope=4.0)
    config, _ = load_gguf_weights(path)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_gguf_expert_tensors_are_checked() -> None:
    """Stacked expert tensors are cut per expert only when the model has that many experts."""
    from pagedllm.model.loader.gguf_expand import gguf_tensor_to_hf_parts
    from tests.conftest import make_tiny_config

    mixtral = make_tiny_config(
        16, 0, architecture="MixtralForCausalLM", num_experts=3, num_experts_per_tok=2
    )
    stacked = torch.arange(3 * 4 * 8, dtype=torch.float32).reshape(3, 4, 8)
    parts = gguf_tensor_to_hf_parts("blk.0.ffn_up_exps.weight", stacked, mixtral)
    assert list(parts) == [
        f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight" for e in range(3)
    ]
    for e in range(3):
        assert torch.equal(
            parts[f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight"], stacked[e]
        )
    with pytest.raises(ValueError, match=r"expert_count"):
        gguf_tensor_to_hf_parts("blk.0.ffn_up_exps.weight", stacked[:2], mixtral)
    llama = make_tiny_config(16, 0)
    with pytest.raises(ValueError, match="has none"):
        gguf_tensor_to_hf_parts("blk.0.ffn_gate_inp.weight", stacked[0], llama)
