"""Engine configuration: cache, scheduler and model options, validated once at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# 1 GiB of KV cache by default: for SmolLM2-135M in fp32 (46,080 bytes per token) that is about
# 23,000 tokens, far more than the batch limits below can fill on a 2-core CPU.
DEFAULT_KV_CACHE_MEMORY = 1 << 30


# Host swap space: 256 MiB holds about 5,800 tokens of SmolLM2-135M KV in fp32.
DEFAULT_SWAP_SPACE = 256 << 20

# KV memory managers: the paged one and the contiguous (Orca) baselines of paper section 6.1.
KV_MANAGERS = ("paged", "orca-max", "orca-pow2", "orca-oracle")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" (or a torch dtype) to a torch dtype.

    Raises:
        ValueError: naming ``dtype`` when it is not one of the supported types.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key == "auto":
        return torch.float32
    if key not in _DTYPES:
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[key]


@dataclass
class EngineConfig:
    """Every option of the engine, in the units the user gives them.

    Attributes:
        model: path to a GGUF file or Hugging Face folder; None = the bundled SmolLM2-135M-Instruct.
        dtype: weight, activation and KV-cache dtype. Default float32: on this CPU (AVX-512 without
            AMX) fp32 matmuls run at ~320 GFLOP/s against ~190 for bf16, and decode batches are
            matmul-bound, so fp32 is the faster choice here despite the 2x memory.
        block_size: tokens per KV block (the paper's block size, section 4.2).
        kv_cache_memory: bytes given to the KV block pool; the number of blocks follows from it.
        num_gpu_blocks_override: force the number of KV blocks (tests use tiny pools).
        max_num_seqs: most sequences in one step's batch.
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
            None = max(max_model_len, 2048) without chunked prefill, 512 with it.
        max_model_len: longest sequence (prompt + output tokens); None = the model's context length.
        enable_chunked_prefill: split prompts longer than the step's token budget over several steps.
        enable_prefix_caching: reuse the KV blocks of earlier requests with the same prefix.
        swap_space: bytes of host swap space for preemption by swapping.
        preemption_mode: "auto", "swap" or "recompute" (see ``core.scheduler``).
        seed: seeds the random seeds given to requests that do not set their own.
        num_threads: torch intra-op threads; None = all cores.
        max_logprobs: most top logprobs a request may ask for.
        check_invariants: run the block-manager invariant check after every step (tests).
        kv_manager: the KV memory manager: "paged" (block tables, this engine's design) or one
            of the contiguous-reservation baselines of the paper's section 6.1, "orca-max",
            "orca-pow2", "orca-oracle" (see ``core.contiguous_kv_manager``; prefix caching,
            sharing and swapping are off for them).
        tensor_parallel_size: ranks the model is split over (paper section 4.6; Megatron-LM
            sharding). ``kv_cache_memory`` is then per rank: each rank caches only its KV heads.
        distributed_executor_backend: "uni" (in-process, tp = 1), "mp" (worker processes on this
            machine; the default when tp > 1) or "ray" (Ray actors); None = pick.
    """

    model: str | None = None
    dtype: str | torch.dtype = "float32"
    block_size: int = 16
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = True
    swap_space: int = DEFAULT_SWAP_SPACE
    preemption_mode: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    max_logprobs: int = 20
    check_invariants: bool = False
    device: str = "cpu"
    kv_manager: str = "paged"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        self.torch_dtype = parse_dtype(self.dtype)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.tensor_parallel_size == 1 else "mp"
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be 'uni', 'mp' or 'ray', got "
                f"{self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one process: it needs "
                f"tensor_parallel_size 1, got {self.tensor_parallel_size}"
            )
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(
                f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}"
            )
        if self.kv_manager not in KV_MANAGERS:
            raise ValueError(f"kv_manager must be one of {KV_MANAGERS}, got {self.kv_manager!r}")
        if self.num_threads is None:
            self.num_threads = os.cpu_count() or 1
        from pagedllm.device import canonical_device  # ValueError naming ``device``

        self.device = canonical_device(self.device, self.tensor_parallel_size)

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the loaded model (called once by the engine).

        Raises:
            ValueError: naming ``max_model_len`` / ``max_num_batched_tokens`` when inconsistent.
        """
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                512 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) unless enable_chunked_prefill is set: a whole prompt must "
                "fit in one step"
            )
