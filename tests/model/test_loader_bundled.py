"""The real bundled model through pagedllm.model.loader: path, config, weights against
transformers, HF export, bf16 (slow; split from test_loader.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.model.loader import (
    LoadedModel,
    bundled_model_path,
    eos_token_ids,
    export_hf_folder,
    load_model,
)


@pytest.fixture(scope="module")
def bundled() -> LoadedModel:
    return load_model(None)


@pytest.mark.slow
def test_bundled_path_found() -> None:
    path = bundled_model_path()
    assert path.is_file() and path.suffix == ".gguf"


@pytest.mark.slow
def test_bundled_config_and_eos(bundled: LoadedModel) -> None:
    c = bundled.config
    assert c.num_hidden_layers == 30
    assert c.hidden_size == 576
    assert c.intermediate_size == 1536
    assert c.num_attention_heads == 9
    assert c.num_key_value_heads == 3
    assert c.head_dim == 64
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == 1e-5
    assert c.tie_word_embeddings is True
    assert "lm_head.weight" not in bundled.state_dict
    im_end = bundled.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in c.eos_token_ids
    assert bundled.tokenizer.eos_token_id in c.eos_token_ids
    assert c.bos_token_id == bundled.tokenizer.bos_token_id
    assert bundled.weight_bytes == sum(
        t.numel() * t.element_size() for t in bundled.state_dict.values()
    )
    assert eos_token_ids(bundled.tokenizer) == [bundled.tokenizer.eos_token_id] + [
        i for i in [im_end] if i != bundled.tokenizer.eos_token_id
    ]


@pytest.mark.slow
def test_bundled_weights_equal_transformers(bundled: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    path = bundled.source
    ref_model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ref = ref_model.state_dict()
    assert set(bundled.state_dict) == set(ref) - {"lm_head.weight"}
    for name, t in bundled.state_dict.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        assert t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name
    assert torch.equal(ref["lm_head.weight"], bundled.state_dict["model.embed_tokens.weight"])
    del ref_model, ref


@pytest.mark.slow
def test_bundled_hf_export_round_trip(bundled: LoadedModel, tmp_path: Path) -> None:
    out = tmp_path / "smollm2"
    export_hf_folder(bundled, out)
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in out.iterdir()
    }
    m2 = load_model(out)
    assert m2.config == bundled.config
    for name, t in bundled.state_dict.items():
        assert torch.equal(m2.state_dict[name], t), name
    assert m2.tokenizer.convert_tokens_to_ids("<|im_end|>") in m2.config.eos_token_ids


@pytest.mark.slow
def test_bundled_bfloat16(tmp_path: Path) -> None:
    # A folder holding exactly one .gguf (under another name) resolves to it.
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(bundled_model_path())
    m = load_model(folder, dtype=torch.bfloat16)
    assert m.source.name in ("model.gguf", bundled_model_path().name)
    assert all(t.dtype == torch.bfloat16 for t in m.state_dict.values())
    assert m.weight_bytes == sum(t.numel() * 2 for t in m.state_dict.values())
