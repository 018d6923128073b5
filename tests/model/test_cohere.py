"""Cohere Command-R beyond the token-exact comparison of ``test_architectures.py`` (``cohere``):
the load-time q/k row permutation turns rotate-half RoPE into transformers' interleaved RoPE
with the same attention scores, the bias-free LayerNorm is mean-subtracting, and the per-head
q/k LayerNorms of ``use_qk_norm`` equal transformers'.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch


def test_permuted_rows_rotate_half_equals_interleaved() -> None:
    """transformers' Cohere rotary on q / k equals pagedllm's rotate-half rotary on the rows
    permuted by ``permute_head_rows`` (up to the same per-head reordering of dimensions), so
    q . k is unchanged."""
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

    from pagedllm.model.layers.interleaved_rope import interleaved_to_half_order, permute_head_rows
    from pagedllm.model.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    tokens, heads, hidden, d = 5, 2, 24, 16
    wq, wk = (
        torch.randn(heads * d, hidden, generator=g),
        torch.randn(heads * d, hidden, generator=g),
    )
    x = torch.randn(tokens, hidden, generator=g)
    positions = torch.arange(3, 3 + tokens)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.repeat_interleave(positions[:, None].float() * inv, 2, dim=-1)  # Cohere's layout
    q_hf, k_hf = (w.matmul(x.T).T.view(tokens, heads, d).transpose(0, 1)[None] for w in (wq, wk))
    q_ref, k_ref = apply_rotary_pos_emb(q_hf, k_hf, freqs.cos()[None], freqs.sin()[None])
    rotate = RotaryEmbedding(d, 10000.0, None, 64).for_step(positions, torch.float32)
    for w in (wq, wk):
        permute_head_rows(w, d)
    q, k = (rotate(w.matmul(x.T).T.view(tokens, heads, d)) for w in (wq, wk))
    order = interleaved_to_half_order(d)
    torch.testing.assert_close(q, q_ref[0].transpose(0, 1)[..., order], atol=1e-5, rtol=1e-5)
    scores = torch.einsum("thd,shd->hts", q, k)
    ref_scores = torch.einsum("htd,hsd->hts", q_ref[0], k_ref[0])
    torch.testing.assert_close(scores, ref_scores, atol=1e-4, rtol=1e-5)


def test_bias_free_layer_norm_equals_cohere_layer_norm() -> None:
    """``LayerNorm(bias=False)`` subtracts the mean (unlike RMSNorm) and adds nothing."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from pagedllm.model.layers.layer_norm import LayerNorm

    g = torch.Generator().manual_seed(1)
    ref = CohereLayerNorm(32, eps=1e-5)
    ours = LayerNorm(32, 1e-5, torch.float32, bias=False)
    assert ours.bias is None
    with torch.no_grad():
        ref.weight.copy_(torch.randn(32, generator=g))
        ours.weight.copy_(ref.weight)
    x = 3.0 + torch.randn(4, 32, generator=g)  # far from zero mean
    torch.testing.assert_close(ours(x), ref(x))


@pytest.mark.parametrize(
    ("cfg", "expect"),
    [({}, 0.0625), ({"logit_scale": 0.5}, 0.5), ({"logit_scale": 1.0}, None)],
)
def test_logit_scale_default_and_identity(cfg: dict[str, Any], expect: float | None) -> None:
    from pagedllm.model.cohere import CohereForCausalLM

    fields = CohereForCausalLM.hf_config_fields(cfg)
    assert fields["logit_scale"] == expect
    assert fields["layer_norm_bias"] is False and fields["shared_input_norm"] is True


def test_use_qk_norm_reads_per_head_layer_norms() -> None:
    """``use_qk_norm`` switches on the per-head q/k LayerNorms, which equal transformers'
    ``CohereLayerNorm`` of shape (heads, head_dim): mean-subtracting, one weight row per head."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from pagedllm.model.cohere import CohereForCausalLM
    from pagedllm.model.layers.layer_norm import HeadLayerNorm

    assert CohereForCausalLM.hf_config_fields({"use_qk_norm": True})["qk_layer_norm"] is True
    assert CohereForCausalLM.hf_config_fields({})["qk_layer_norm"] is False
    g = torch.Generator().manual_seed(2)
    ref = CohereLayerNorm((3, 16), eps=1e-5)
    ours = HeadLayerNorm(3, 16, 1e-5, torch.float32)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(3, 16, generator=g))
        ours.weight.copy_(ref.weight)
    x = 2.0 + torch.randn(5, 3, 16, generator=g)  # [tokens, heads, head_dim], far from zero mean
    torch.testing.assert_close(ours(x), ref(x))
