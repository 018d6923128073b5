"""GLM specifics beyond tests/model/test_architectures.py (which runs tiny GLM and GLM-4-0414
models against transformers): the load-time row order reproduces transformers' partial
interleaved RoPE, and the refused configs name their field."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.glm import GlmForCausalLM
from pagedllm.model.layers.interleaved_rope import interleaved_to_half_order
from pagedllm.model.layers.rotary import apply_rotary, rope_inv_freq


def test_permuted_rows_turn_as_transformers_partial_interleaved_rope():
    """Rotate-half over the first R dimensions of the permuted head equals transformers' GLM
    rotation (interleaved pairs on the first R dimensions, the rest untouched), permuted."""
    from transformers.models.glm.modeling_glm import apply_rotary_pos_emb

    head_dim, rot, n = 16, 8, 5
    x = torch.randn(1, 1, n, head_dim)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(rot, 10000.0))
    emb = torch.cat((freqs, freqs), -1)
    ref, _ = apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    order = interleaved_to_half_order(head_dim, rot)
    xp = x[0, 0][:, order].clone()
    xp[:, :rot] = apply_rotary(xp[:, :rot], freqs.cos(), freqs.sin())
    torch.testing.assert_close(xp, ref[0, 0][:, order], atol=1e-6, rtol=0)


@pytest.mark.parametrize("factor", [0.0, 0.3125])  # widths 0 and 5 of a 16-wide head
def test_odd_or_zero_rotary_width_is_refused(factor):
    cfg = {"num_attention_heads": 4, "hidden_size": 64, "head_dim": 16}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        GlmForCausalLM.hf_config_fields({**cfg, "partial_rotary_factor": factor})


def test_partial_rotary_factor_defaults_to_half_and_reads_rope_parameters():
    cfg = {"num_attention_heads": 4, "hidden_size": 64}
    assert GlmForCausalLM.hf_config_fields(cfg)["partial_rotary_factor"] == 0.5
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    got = GlmForCausalLM.hf_config_fields({**cfg, "rope_parameters": params})
    assert got["partial_rotary_factor"] == 0.25 and "rope_scaling" not in got
    assert got["attention_bias"] and not got["o_proj_bias"]
