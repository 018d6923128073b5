"""The MXFP4 dequantizer (``pagedllm/model/quant/mxfp4.py``; GPT-OSS's experts) against a
hand-built block with known values and against transformers' converter, its refusals, and a
test-side MXFP4 encoder for checkpoints (``test_gpt_oss.py``)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.model.quant.mxfp4 import (
    FP4_E2M1_VALUES,
    dequantize_mxfp4,
    dequantize_mxfp4_experts,
)


def test_dequantize_a_hand_built_block():
    """Two blocks of one row: byte j of the first holds codes (low j, high 15 - j) under the
    scale byte 128 (x 2); the second is all code 0x7 / 0xF (6, -6) under 124 (x 1/8)."""
    first = torch.tensor([(15 - j) << 4 | j for j in range(16)], dtype=torch.uint8)
    second = torch.full((16,), 0xF7, dtype=torch.uint8)
    blocks = torch.stack([first, second]).view(1, 2, 16)
    scales = torch.tensor([[128, 124]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (1, 64)
    fp4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    want = []
    for j in range(16):
        want += [2 * fp4[j], 2 * fp4[15 - j]]
    want += [6 / 8, -6 / 8] * 16
    assert out[0].tolist() == want
    assert out[0, :4].tolist() == [0.0, -12.0, 1.0, -8.0]  # spelled out: codes 0, 15, 1, 14
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), out)


def test_dequantize_equals_transformers_converter():
    """Random experts' blocks and scales: ``dequantize_mxfp4_experts`` equals transformers'
    ``convert_moe_packed_tensors`` (layout [E, K, rows] included) exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 134, (3, 10, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    got = dequantize_mxfp4_experts(blocks, scales)
    assert got.shape == (3, 128, 10) and torch.equal(got, want)


def test_dequantizer_refuses_mismatched_inputs():
    blocks = torch.zeros(2, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(blocks.float(), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="stored as MXFP4"):
        from pagedllm.model.llama import LlamaForCausalLM

        LlamaForCausalLM.dequantize_mxfp4("x", blocks, torch.zeros(2, 3), torch.float32)


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A test-side MXFP4 encoder of ``w`` [..., K] (K a multiple of 32): per 32 values the
    power-of-two scale that fits the block's absmax into 6, each value rounded to the nearest
    FP4 value. Returns (blocks [..., K/32, 16], scales [..., K/32], the values they encode)."""
    fp4 = torch.tensor(FP4_E2M1_VALUES[:8])
    x = w.reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1).clamp_min(1e-30)
    exp = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    scaled = x / torch.exp2(exp.float()).unsqueeze(-1)
    mag = (scaled.abs().unsqueeze(-1) - fp4).abs().argmin(-1)  # nearest magnitude code
    codes = (mag | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = fp4[mag] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exp.float()).unsqueeze(-1)
    return blocks, (exp + 127).to(torch.uint8), values.reshape(w.shape)


def test_encoder_round_trips_through_the_dequantizer():
    w = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales, values = encode_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(blocks, scales), values)
    assert float((values - w).abs().max()) < 0.5 * float(w.abs().max())  # a lossy copy of w
