"""pagedllm: LLM serving with a paged KV cache (PagedAttention), copy-on-write sharing and
continuous batching."""

import os

# Before torch loads libgomp (which reads these once): how long an OpenMP thread spins at a
# barrier before it sleeps. libgomp's default (~3 ms of spinning) starves a descheduled thread when
# another busy process shares the cores (2 cores, batch-64 step: 3.6 s spinning vs 0.71 s
# sleeping); sleeping at once (OMP_WAIT_POLICY=PASSIVE) pays a futex wake-up at each of the
# hundreds of parallel regions of a step (server TPOT at 6 streams: 79-85 ms vs 55-63 ms). A
# bounded spin of 10,000 iterations (~0.1 ms) keeps most of the spinning speed on a quiet machine
# and bounds the loss under contention (batch 32 with a busy process on one core: 355 ms vs 283 ms
# passive vs ~1 s at 100,000). Figures: docs/benchmarks.md. A value set by the user wins.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "10000"
# Also before torch loads: PyTorch's CPU allocator backs allocations of 2 MiB or more (weights,
# oneDNN's packed copies, the KV cache) with transparent huge pages, so streaming 540 MB of weights
# and one KV page per block and head each decode step stops missing the TLB (batch-64 step about
# 10% faster; pagedllm.worker.huge_pages). A value set by the user wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# The step's temporaries of a few MiB (logits, prefill activations) stay mapped between steps
# instead of being faulted in and zeroed again each step: importing pagedllm.malloc_tuning
# sets glibc's thresholds.
from pagedllm import malloc_tuning  # noqa: F401
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers; import it lazily so `import pagedllm` stays light.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "CompletionOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
