"""pagedllm: LLM serving with a paged KV cache (PagedAttention), copy-on-write sharing and
continuous batching."""

import os

# Before torch loads libgomp (which reads this once): OpenMP threads that sleep at barriers instead
# of spinning. When the cores are shared with another busy process, spinning threads starve the
# descheduled one at every parallel region; measured on 2 cores with a second job running, a
# batch-64 decode step took 3.6 s spinning vs 0.71 s sleeping. A value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import pagedllm` stays light.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
