"""RoPE scaling variants equal transformers: the frequencies of YaRN, dynamic NTK and Phi-3
LongRoPE against transformers' own rope init functions, and tiny Llamas with YaRN and dynamic NTK
generating the same greedy tokens (logprobs within 1e-4) through the whole engine, with
sequences longer than the trained context."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.model.layers.rope_scaling import (
    dynamic_ntk_inv_freq,
    longrope_inv_freqs,
    static_inv_freq,
)
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import (
    build_tiny_hf_model,
    compare_to_reference,
    greedy_reference,
    greedy_reference_cached,
)

HEAD = 16


def _hf_inv_freq(config_cls, rope: dict, seq_len=None, **kw):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = config_cls(
        hidden_size=64, num_attention_heads=4, head_dim=HEAD, rope_parameters=rope, **kw
    )
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, torch.device("cpu"), seq_len=seq_len)


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 4.0, "original_max_position_embeddings": 64},
        {"factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
        {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 2, "mscale_all_dim": 1},
        {"factor": 3.0, "original_max_position_embeddings": 64, "truncate": False},
    ],
)
def test_yarn_frequencies_equal_transformers(rope):
    from transformers import LlamaConfig

    rope = {"rope_type": "yarn", "rope_theta": 5000.0, **rope}
    want_inv, want_attn = _hf_inv_freq(LlamaConfig, rope, max_position_embeddings=256)
    inv, attn = static_inv_freq(HEAD, 5000.0, rope, trained_len=256)
    torch.testing.assert_close(inv, want_inv, rtol=1e-6, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-9) and attn != 1.0


@pytest.mark.parametrize("seq_len", [10, 32, 33, 100])
def test_dynamic_ntk_frequencies_equal_transformers(seq_len):
    from transformers import LlamaConfig

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    want, _ = _hf_inv_freq(LlamaConfig, rope, seq_len=seq_len, max_position_embeddings=32)
    got = dynamic_ntk_inv_freq(HEAD, 10000.0, 2.0, 32, torch.tensor([seq_len, 5]))
    torch.testing.assert_close(got[0], want, rtol=1e-6, atol=0)
    # A sequence within the trained context keeps the unscaled frequencies.
    torch.testing.assert_close(got[1], static_inv_freq(HEAD, 10000.0, None)[0], rtol=0, atol=0)


def test_longrope_frequencies_equal_transformers():
    from transformers import Phi3Config

    g = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(HEAD // 2, generator=g)).tolist()
    long = (2 + 4 * torch.rand(HEAD // 2, generator=g)).tolist()
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
            "long_factor": long, "original_max_position_embeddings": 32}
    kw = dict(max_position_embeddings=128, original_max_position_embeddings=32)
    want_short, want_attn = _hf_inv_freq(Phi3Config, rope, seq_len=None, **kw)
    want_long, _ = _hf_inv_freq(Phi3Config, rope, seq_len=33, **kw)
    s, lg, attn, switch = longrope_inv_freqs(HEAD, 10000.0, rope, 128)
    torch.testing.assert_close(s, want_short, rtol=1e-6, atol=0)
    torch.testing.assert_close(lg, want_long, rtol=1e-6, atol=0)
    assert attn == pytest.approx(want_attn) and attn > 1.0 and switch == 32
    with pytest.raises(ValueError, match="short_factor"):
        longrope_inv_freqs(HEAD, 10000.0, {**rope, "short_factor": short[:3]}, 128)


def _meta(seq_lens: list[int], query_lens: list[int]) -> AttentionMetadata:
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    t = starts[-1]
    return AttentionMetadata(
        slot_mapping=torch.zeros(t, dtype=torch.int64),
        block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens),
        query_start_loc=torch.tensor(starts),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
        query_start_loc_list=starts,
        num_decodes=sum(q == 1 for q in query_lens),
        block_size=16,
    )


def test_longrope_picks_the_factor_set_per_sequence_on_the_fused_kernel():
    """A decode of a long sequence and a short prefill in one step: each sequence's tokens use
    its own factor set (the C++ kernel and the ATen path agree)."""
    from pagedllm.attention.cpu import load_cpu_ops

    short, long = [1.0] * (HEAD // 2), [4.0] * (HEAD // 2)
    rope = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": 32}
    emb = RotaryEmbedding(HEAD, 10000.0, rope, 64, trained_len=128)
    meta = _meta([40, 3], [1, 3])
    positions = torch.tensor([39, 0, 1, 2])
    x = torch.randn(4, 2, HEAD)
    got = emb.for_step(positions, torch.float32, meta)(x.clone())
    plain_long = RotaryEmbedding(HEAD, 10000.0, {**rope, "short_factor": long}, 64, 128)
    plain_short = RotaryEmbedding(HEAD, 10000.0, {**rope, "long_factor": short}, 64, 128)
    want_long = plain_long.for_step(positions[:1], torch.float32)(x[:1].clone())
    want_short = plain_short.for_step(positions[1:], torch.float32)(x[1:].clone())
    torch.testing.assert_close(got, torch.cat((want_long, want_short)))
    ops = load_cpu_ops()
    if ops is not None:
        emb.cpu_ops = ops
        torch.testing.assert_close(emb.for_step(positions, torch.float32, meta)(x.clone()), got)


@pytest.fixture(scope="module", params=["llama-yarn", "llama-dynamic"])
def rope_case(request, tmp_path_factory):
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    hf = build_tiny_hf_model(arch, folder)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 20, 37)]
    ref_fn = greedy_reference_cached if arch == "llama-dynamic" else greedy_reference
    return folder, prompts, [ref_fn(hf, p, 12) for p in prompts]


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_scaled_rope_llama_equals_transformers(rope_case, backend):
    from pagedllm.attention.cpu import load_cpu_ops
    from pagedllm.entrypoints.llm import LLM

    if backend == "cpu" and load_cpu_ops() is None:
        pytest.skip("C++ CPU kernels unavailable")
    folder, prompts, refs = rope_case
    llm = LLM(str(folder), dtype="float32", block_size=16, max_model_len=128,
              kv_cache_memory=1 << 22, attention_backend=backend)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    counted = 0
    for o, ref in zip(llm.generate(prompts, params, use_tqdm=False), refs, strict=True):
        c = o.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, ref)
    assert counted >= 0.75 * 12 * len(prompts)
