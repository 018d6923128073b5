"""An MoE model's logprobs do not depend on the batch: a token decoded alone and among others
gets the same floats (README, "A token's logprobs do not depend on how it was computed").

Found: the routers (and Qwen2-MoE's shared-expert gate) ran on MKL's sgemm through
``F.linear``, whose order of summation depends on the number of rows, so routing weights and
then logprobs moved by ~1e-6 between a batch of 1 and of 8; they now run on the own GEMM
(``MoeRouter.pack``) whose rows are independent of each other.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.sampling_params import SamplingParams
from tests.model.arch_utils import build_tiny_hf_model

MOE_ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "granitemoe_shared", "gpt_oss"]
PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(6 + 5 * i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def own_gemm():
    from pagedllm.model.packed_linear import cpu_gemm_ops
    from pagedllm.ops import load_cpu_ops

    if cpu_gemm_ops(load_cpu_ops(), torch.float32) is None:
        pytest.skip("rows independent of the batch need pagedllm's own GEMM (C++ kernels)")


def _logprobs(outputs):
    return [[(t, {k: v.logprob for k, v in step.items()})
             for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
            for o in outputs]  # fmt: skip


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logprobs_alone_equal_batched(arch, own_gemm, tmp_path):
    from pagedllm.entrypoints.llm import LLM

    build_tiny_hf_model(arch, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128, kv_cache_memory=1 << 22,
              enable_prefix_caching=False)  # fmt: skip
    alone = [_logprobs(llm.generate([p], PARAMS, use_tqdm=False))[0] for p in PROMPTS]
    assert _logprobs(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == alone
