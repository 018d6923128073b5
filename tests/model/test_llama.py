"""The Llama model equals transformers' LlamaForCausalLM on the same weights."""

import pytest
import torch

from pagedllm.attention import get_attention_backend
from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
from pagedllm.model.llama import LlamaForCausalLM, rope_inv_freq
from pagedllm.worker.cache_engine import CacheEngine, num_blocks_for_memory
from pagedllm.worker.model_runner import ModelRunner


def run_prefill(model, cfg, prompts, block_size=4):
    """Prefill several prompts in one flat batch; returns logits at every position."""
    num_blocks = 64
    cache = CacheEngine(cfg, num_blocks, block_size, torch.float32)
    runner = ModelRunner(model, cache.kv_caches, block_size)
    sched = SchedulerOutput()
    next_block = 0
    for i, p in enumerate(prompts):
        nb = -(-len(p) // block_size)
        table = list(range(next_block, next_block + nb))[::-1]  # non-contiguous order
        next_block += nb
        sched.scheduled.append(
            (str(i), ScheduledSequence(i, p, 0, table, True, prompt_logprobs=True))
        )
    out = runner.execute(sched)
    return [out.prompt_logits[i] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["reference", "torch_native"])
def test_prefill_logits_match_transformers(tiny_loaded, hf_tiny_model, backend):
    cfg = tiny_loaded.config
    model = LlamaForCausalLM(cfg, torch.float32, get_attention_backend(backend))
    model.load_weights(tiny_loaded.state_dict)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 1, 13)]
    ours = run_prefill(model, cfg, prompts)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf_tiny_model(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_rope_scaling_variants():
    plain = rope_inv_freq(16, 10000.0)
    assert torch.allclose(plain, 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    lin = rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert torch.allclose(lin, plain / 4)
    l3 = rope_inv_freq(
        16,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    assert l3[0] == plain[0]  # highest frequency untouched
    assert torch.isclose(l3[-1], plain[-1] / 8)  # lowest frequency divided by the factor
    with pytest.raises(ValueError, match="rope_scaling"):
        rope_inv_freq(16, 10000.0, {"rope_type": "no-such-scaling", "factor": 2.0})


def test_load_weights_reports_missing_and_misshapen(tiny_loaded):
    cfg = tiny_loaded.config
    model = LlamaForCausalLM(cfg, torch.float32, get_attention_backend("reference"))
    sd = dict(tiny_loaded.state_dict)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        model.load_weights(sd)
    sd = dict(tiny_loaded.state_dict)
    sd["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_weights(sd)


def test_kv_sizing(tiny_loaded):
    cfg = tiny_loaded.config  # 2 layers x 2 kv heads x 16 dims
    assert cfg.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4 == 512
    assert num_blocks_for_memory(cfg, 16, torch.float32, 512 * 16 * 10 + 5) == 10
    assert num_blocks_for_memory(cfg, 16, torch.bfloat16, 512 * 16 * 10) == 20
