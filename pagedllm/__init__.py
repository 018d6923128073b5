"""pagedllm: LLM serving with a paged KV cache (PagedAttention), copy-on-write sharing and
continuous batching."""

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
