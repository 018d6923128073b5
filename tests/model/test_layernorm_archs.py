"""OPT, GPT-2, GPT-NeoX, Phi, StableLM and StarCoder2 beyond the shared architecture tests: their
layer variants (OPT's post-norm layers, GPT-NeoX and StableLM without parallel residual, Phi with
grouped-query attention and a tied head, StarCoder2 without biases) against transformers, the
context limit of learned positions, StableLM's stacking of its per-head q/k norm weights, and
the configurations refused with a clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model, compare_to_reference, greedy_reference

STEPS = 12
KW: dict[str, Any] = dict(dtype="float32", kv_cache_memory=1 << 22, block_size=16)


def _greedy_matches_transformers(arch: str, folder: Any, overrides: dict[str, Any]) -> None:
    from pagedllm.entrypoints.llm import LLM

    hf = build_tiny_hf_model(arch, folder, overrides=overrides)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 23)]
    refs = [greedy_reference(hf, p, STEPS) for p in prompts]
    llm = LLM(str(folder), max_model_len=128, **KW)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
    counted = 0
    for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), refs, strict=True):
        c = out.outputs[0]
        lps = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
        counted += compare_to_reference(c.token_ids, lps, ref)
    assert counted >= 0.75 * STEPS * len(prompts), f"only {counted} steps had a clear top-2 gap"


def test_opt_post_norm_layers_equal_transformers(tmp_path):
    """``do_layer_norm_before`` false (OPT-350m's layout): norms after each residual add and no
    final norm."""
    _greedy_matches_transformers("opt", tmp_path, {"do_layer_norm_before": False})


def test_gpt_neox_sequential_residual_equals_transformers(tmp_path):
    """``use_parallel_residual`` false, and half of each head rotated (``rotary_pct`` 0.5)."""
    _greedy_matches_transformers(
        "gpt_neox", tmp_path, {"use_parallel_residual": False, "rotary_pct": 0.5}
    )


def test_phi_grouped_query_tied_head_equals_transformers(tmp_path):
    """Phi with 2 KV heads for 4 query heads, three quarters of each head rotated, and the head
    tied to the embedding (its bias still its own)."""
    _greedy_matches_transformers(
        "phi",
        tmp_path,
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 500.0,
                "partial_rotary_factor": 0.75,
            },
        },
    )


def test_stablelm_sequential_residual_equals_transformers(tmp_path):
    """``use_parallel_residual`` false (StableLM-3B-4E1T, StableLM 2 1.6B): the MLP reads
    ``post_attention_layernorm`` of the attention's output added in; no q/k/v biases; half of
    each head rotated."""
    _greedy_matches_transformers(
        "stablelm",
        tmp_path,
        {
            "use_parallel_residual": False,
            "use_qkv_bias": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
    )


def test_starcoder2_without_biases_untied_equals_transformers(tmp_path):
    """``use_bias`` false (no projection biases; the LayerNorms keep theirs), an untied head."""
    _greedy_matches_transformers(
        "starcoder2", tmp_path, {"use_bias": False, "tie_word_embeddings": False}
    )


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-gpt2")
    build_tiny_hf_model("gpt2", folder)  # 256 learned positions
    return folder


def test_max_model_len_beyond_learned_positions_is_refused(gpt2_folder):
    from pagedllm.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"max_model_len \(300\).*max_position_embeddings \(256\)"):
        LLM(str(gpt2_folder), max_model_len=300, **KW)


def test_request_past_the_position_table_is_refused(gpt2_folder):
    """max_model_len defaults to the table (256 positions): a request that would run past it is
    a ValueError naming max_tokens, and the engine holds no KV block afterwards."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(str(gpt2_folder), **KW)
    assert llm.engine.max_model_len == 256
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[5] * 250], params, use_tqdm=False)
    out = llm.generate([[5] * 246], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 10  # positions 246..255: the last row of the table


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        (
            {"model_type": "opt", "hidden_size": 1024, "word_embed_proj_dim": 512},
            "word_embed_proj_dim",
        ),
        ({"model_type": "opt", "layer_norm_elementwise_affine": False}, "elementwise_affine"),
        ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, "inverse_layer_idx"),
        ({"model_type": "gpt2", "scale_attn_weights": False}, "scale_attn_weights"),
        ({"model_type": "phi", "qk_layernorm": True}, "qk_layernorm"),
    ],
)
def test_unsupported_variants_are_refused(cfg, field):
    from pagedllm.model.loader.hf_loader import hf_arch_config

    with pytest.raises(ValueError, match=field):
        hf_arch_config(cfg)


def test_stablelm_per_head_norms_stack_in_head_order():
    """``qk_layernorm``'s per-head weights become one [heads, head_dim] tensor in head order
    (whatever order the file lists them in); a head missing from the numbering is refused."""
    from pagedllm.model.stablelm import StableLmForCausalLM

    prefix = "model.layers.0.self_attn."
    rows = {h: torch.full((4,), float(h)) for h in (2, 0, 1)}
    state = {f"{prefix}q_layernorm.norms.{h}.weight": t for h, t in rows.items()}
    state[f"{prefix}q_proj.weight"] = torch.zeros(12, 8)
    stacked = StableLmForCausalLM.stack_hf_weights(state)
    assert sorted(stacked) == [f"{prefix}q_norm.weight", f"{prefix}q_proj.weight"]
    assert torch.equal(stacked[f"{prefix}q_norm.weight"][:, 0], torch.tensor([0.0, 1.0, 2.0]))
    del state[f"{prefix}q_layernorm.norms.1.weight"]
    with pytest.raises(ValueError, match=r"q_norm\.weight.*\[0, 2\]"):
        StableLmForCausalLM.stack_hf_weights(state)
