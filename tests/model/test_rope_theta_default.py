"""A ``config.json`` that names no RoPE base gets transformers' default for its architecture."""

from __future__ import annotations

import pytest
import transformers

from pagedllm.model.config import hf_rope_parameters
from pagedllm.model.loader.hf_loader import hf_arch_config
from pagedllm.model.registry import MODELS

# Gemma 3 reads one base per layer type itself (gemma3.py: 1M global, 10k local).
_OWN_RULE = {"gemma3_text"}


def _transformers_theta(model_type: str) -> float | None:
    """transformers' default RoPE base of ``model_type``'s config class; None without RoPE
    (learned positions: OPT, GPT-2)."""
    cfg = transformers.AutoConfig.for_model(model_type).to_dict()
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    return None if theta is None else float(theta)


ROTARY = [e for e in MODELS
          if e.model_types[0] not in _OWN_RULE and _transformers_theta(e.model_types[0]) is not None]


@pytest.mark.parametrize("entry", ROTARY, ids=lambda e: e.architecture)
def test_default_rope_theta_matches_transformers(entry):
    assert entry.load().default_rope_theta == _transformers_theta(entry.model_types[0])


def test_every_architecture_but_learned_positions_is_checked():
    assert {e.model_types[0] for e in MODELS} - {e.model_types[0] for e in ROTARY} == {
        "opt", "gpt2", *_OWN_RULE}


@pytest.mark.parametrize(("model_type", "arch", "theta"), [
    ("mixtral", "MixtralForCausalLM", 1e6),
    ("cohere", "CohereForCausalLM", 500000.0),
    ("llama", "LlamaForCausalLM", 10000.0),
])
def test_config_without_rope_theta_reads_the_architecture_default(model_type, arch, theta):
    cfg = {"architectures": [arch], "model_type": model_type, "hidden_size": 64,
           "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
           "intermediate_size": 128, "vocab_size": 256}
    assert hf_arch_config(cfg).rope_theta == theta
    assert hf_arch_config({**cfg, "rope_theta": 1234.0}).rope_theta == 1234.0
    assert hf_arch_config({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 99.0}}
                          ).rope_theta == 99.0


def test_hf_rope_parameters_default_theta_only_when_unnamed():
    assert hf_rope_parameters({}, default_theta=5.0) == (5.0, None)
    assert hf_rope_parameters({"rope_theta": 7.0}, default_theta=5.0) == (7.0, None)
