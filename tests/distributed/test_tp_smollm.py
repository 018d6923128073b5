"""The bundled SmolLM2-135M (9 query / 3 KV heads) at tensor-parallel size 3: greedy tokens equal
tp = 1 (fp32), and each rank's weights read straight from the GGUF file equal the slices of the
full load. Slow: loads the real model and starts worker processes."""

import json
from pathlib import Path

import pytest
import torch

from pagedllm.entrypoints.llm import LLM, apply_chat_template
from pagedllm.model.loader.sharded import load_weight_shard
from pagedllm.model.sharding import TensorParallelShard, shard_state_dict
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 20
PROMPTS = json.loads((Path(__file__).parents[1] / "data" / "real_prompts.json").read_text())[:4]


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    ids = [apply_chat_template(smollm.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in ids}) > 1  # prompts of different lengths
    return ids


def test_gguf_rank_slices_equal_sliced_full_load(smollm):
    for rank in range(3):
        shard = TensorParallelShard.for_rank(smollm.config, rank, 3)
        mine = load_weight_shard(smollm.source, "gguf", smollm.config, shard)
        ref = shard_state_dict(smollm.state_dict, shard, smollm.config.head_dim)
        assert mine.keys() == ref.keys()
        for name, t in ref.items():
            assert torch.equal(mine[name], t), name


def test_tp3_greedy_equals_tp1(smollm, prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    reqs = [{"prompt_token_ids": p} for p in prompt_ids]
    ref_llm = LLM(loaded=smollm, max_model_len=512)
    ref = ref_llm.generate(reqs, params, use_tqdm=False)
    del ref_llm
    # No near-tie at any compared step: a reduction-order difference cannot flip a token.
    for o in ref:
        for pos in o.outputs[0].logprobs:
            top = sorted((lp.logprob for lp in pos.values()), reverse=True)
            assert top[0] - top[1] > 1e-3
    llm = LLM(loaded=smollm, max_model_len=512, tensor_parallel_size=3, check_invariants=True)
    try:
        assert llm.engine.executor.world_size == 3
        outs = llm.generate(reqs, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for o, r in zip(outs, ref):
        assert list(o.outputs[0].token_ids) == list(r.outputs[0].token_ids)
        assert len(o.outputs[0].token_ids) == NUM_TOKENS
