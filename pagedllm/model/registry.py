"""Architecture name -> model class, with lazy imports (a model file is imported only when used).

Keys: the ``architectures`` entry (or ``model_type``) of a Hugging Face ``config.json``, and the
``general.architecture`` of a GGUF file. Adding an architecture = one model file under
``pagedllm/model/`` + one :class:`ModelEntry` line in ``MODELS`` (see docs/models.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.model.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class ModelEntry:
    """One supported architecture.

    Attributes:
        architecture: the Hugging Face class name (``config.json`` ``architectures[0]``).
        module: the pagedllm module holding the model class (``pagedllm.model.<module>``).
        class_name: the model class in that module.
        model_types: Hugging Face ``model_type`` values it serves.
        gguf_architectures: GGUF ``general.architecture`` values it serves.
        family: human-readable model family, for docs/models.md.
    """

    architecture: str
    module: str
    class_name: str
    model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    family: str

    def load(self) -> type[DecoderForCausalLM]:
        """Import the module and return the class."""
        mod = importlib.import_module(f"pagedllm.model.{self.module}")
        cls: type[DecoderForCausalLM] = getattr(mod, self.class_name)
        return cls


MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("LlamaForCausalLM", "llama", "LlamaForCausalLM", ("llama",), ("llama",),
               "Llama 1-3, SmolLM, TinyLlama"),
    ModelEntry("MistralForCausalLM", "mistral", "MistralForCausalLM", ("mistral",), (),
               "Mistral (sliding window)"),
    ModelEntry("Qwen2ForCausalLM", "qwen2", "Qwen2ForCausalLM", ("qwen2",), ("qwen2",),
               "Qwen2, Qwen2.5"),
    ModelEntry("Qwen3ForCausalLM", "qwen3", "Qwen3ForCausalLM", ("qwen3",), ("qwen3",),
               "Qwen3 (dense)"),
    ModelEntry("Gemma2ForCausalLM", "gemma2", "Gemma2ForCausalLM", ("gemma2",), ("gemma2",),
               "Gemma 2 (soft-capping, local/global layers)"),
    ModelEntry("Phi3ForCausalLM", "phi3", "Phi3ForCausalLM", ("phi3",), ("phi3",),
               "Phi-3, Phi-3.5, Phi-4-mini (LongRoPE)"),
    ModelEntry("Gemma3ForCausalLM", "gemma3", "Gemma3ForCausalLM", ("gemma3_text",),
               ("gemma3",), "Gemma 3 (text)"),
    ModelEntry("OPTForCausalLM", "opt", "OPTForCausalLM", ("opt",), (), "OPT"),
    ModelEntry("GPT2LMHeadModel", "gpt2", "GPT2LMHeadModel", ("gpt2",), ("gpt2",), "GPT-2"),
    ModelEntry("GPTNeoXForCausalLM", "gpt_neox", "GPTNeoXForCausalLM", ("gpt_neox",),
               ("gptneox",),
               "GPT-NeoX, Pythia"),
    ModelEntry("PhiForCausalLM", "phi", "PhiForCausalLM", ("phi",), ("phi2",),
               "Phi-1, Phi-1.5, Phi-2"),
    ModelEntry("StableLmForCausalLM", "stablelm", "StableLmForCausalLM", ("stablelm",),
               ("stablelm",), "StableLM-3B-4E1T, StableLM 2"),
    ModelEntry("Starcoder2ForCausalLM", "starcoder2", "Starcoder2ForCausalLM", ("starcoder2",),
               ("starcoder2",), "StarCoder2 (sliding window)"),
    ModelEntry("MixtralForCausalLM", "mixtral", "MixtralForCausalLM", ("mixtral",), (),
               "Mixtral (sparse MoE, sliding window)"),
    ModelEntry("Qwen3MoeForCausalLM", "qwen3_moe", "Qwen3MoeForCausalLM", ("qwen3_moe",),
               ("qwen3moe",),
               "Qwen3-MoE (sparse MoE, q/k norm)"),
    ModelEntry("GemmaForCausalLM", "gemma", "GemmaForCausalLM", ("gemma",), ("gemma",),
               "Gemma (v1: 2B, 7B)"),
    ModelEntry("GraniteForCausalLM", "granite", "GraniteForCausalLM", ("granite",),
               ("granite",), "Granite 3.x dense (embedding / residual / attention / logit scales)"),
    ModelEntry("Qwen2MoeForCausalLM", "qwen2_moe", "Qwen2MoeForCausalLM", ("qwen2_moe",),
               ("qwen2moe",),
               "Qwen1.5-MoE, Qwen2-MoE (sparse MoE, shared expert)"),
    ModelEntry("Olmo2ForCausalLM", "olmo2", "Olmo2ForCausalLM", ("olmo2",), ("olmo2",),
               "OLMo 2 (post-norm layers, full-width q/k norm)"),
    ModelEntry("SmolLM3ForCausalLM", "smollm3", "SmolLM3ForCausalLM", ("smollm3",),
               ("smollm3",), "SmolLM3 (NoPE layers: no RoPE on every fourth)"),
    ModelEntry("CohereForCausalLM", "cohere", "CohereForCausalLM", ("cohere",), ("command-r",),
               "Command-R / R+, Aya 23 (parallel residual, interleaved RoPE, logit scale, "
               "q/k LayerNorms)"),
    ModelEntry("OlmoeForCausalLM", "olmoe", "OlmoeForCausalLM", ("olmoe",), ("olmoe",),
               "OLMoE (sparse MoE, full-width q/k norm)"),
    ModelEntry("GraniteMoeForCausalLM", "granite_moe", "GraniteMoeForCausalLM", ("granitemoe",),
               ("granitemoe",), "Granite 3.x MoE (Granite's scales, top-k then softmax routing)"),
    ModelEntry("GraniteMoeSharedForCausalLM", "granite_moe", "GraniteMoeForCausalLM",
               ("granitemoeshared",), (), "Granite MoE with an ungated shared expert"),
    ModelEntry("Ernie4_5ForCausalLM", "ernie4_5", "Ernie4_5ForCausalLM", ("ernie4_5",),
               ("ernie4_5",), "ERNIE 4.5 dense (0.3B; interleaved RoPE)"),
    ModelEntry("Exaone4ForCausalLM", "exaone4", "Exaone4ForCausalLM", ("exaone4",), ("exaone4",),
               "EXAONE 4.0 (post-norm layers, q/k norm, local RoPE / global NoPE layers)"),
    ModelEntry("GlmForCausalLM", "glm", "GlmForCausalLM", ("glm",), (),
               "GLM-4 (glm-4-9b-chat-hf: partial interleaved RoPE, q/k/v biases)"),
    ModelEntry("Glm4ForCausalLM", "glm", "Glm4ForCausalLM", ("glm4",), ("glm4",),
               "GLM-4-0414, GLM-Z1 (GLM with post-attention / post-MLP norms)"),
    ModelEntry("GptOssForCausalLM", "gpt_oss", "GptOssForCausalLM", ("gpt_oss",), (),
               "GPT-OSS (attention sinks, local / global layers, biased MoE, MXFP4 experts)"),
)  # fmt: skip


# GGUF architectures llama.cpp also uses for a MoE model -> that model's architecture.
GGUF_MOE_VARIANTS = {"llama": "MixtralForCausalLM"}
# GGUF architectures of supported models whose llama.cpp files are not read -> why.
GGUF_REFUSED = {
    "gpt-oss": "llama.cpp's GPT-OSS files (MXFP4 experts in ggml's block layout) are not read; "
    "load the Hugging Face folder (config.json + safetensors: its MXFP4 experts are "
    "dequantized at load)",
}


def supported_architectures() -> list[str]:
    """Every supported Hugging Face architecture name, in registry order."""
    return [e.architecture for e in MODELS]


def _unsupported(what: str) -> ValueError:
    names = ", ".join(supported_architectures())
    gguf = ", ".join(a for e in MODELS for a in e.gguf_architectures)
    return ValueError(f"unsupported {what}; supported architectures: {names} (GGUF: {gguf})")


def entry_for_hf_config(cfg: dict[str, Any], source: str = "<hf>") -> ModelEntry:
    """The entry for a Hugging Face ``config.json`` dict: by its ``architectures`` entries
    first, then by ``model_type``.

    Raises:
        ValueError: neither is supported; the message names both and lists what is.
    """
    for arch in cfg.get("architectures") or []:
        for e in MODELS:
            if e.architecture == arch:
                return e
    model_type = cfg.get("model_type")
    for e in MODELS:
        if model_type in e.model_types:
            return e
    archs = cfg.get("architectures")
    raise _unsupported(f"model in {source}: architectures={archs!r}, model_type={model_type!r}")


def entry_for_gguf(arch: str | None, source: str = "<gguf>", num_experts: int = 0) -> ModelEntry:
    """The entry for a GGUF file's ``general.architecture``; with ``num_experts`` (the file's
    ``<arch>.expert_count``) a dense architecture's MoE variant (llama.cpp writes Mixtral as
    ``llama`` with experts, ``GGUF_MOE_VARIANTS``).

    Raises:
        ValueError: it is not supported; the message names it and lists what is (or, for a
            supported model whose GGUF files are not read, ``GGUF_REFUSED``, says why).
    """
    if arch in GGUF_REFUSED:
        raise ValueError(f"general.architecture={arch!r} in {source}: {GGUF_REFUSED[arch]}")
    variant = GGUF_MOE_VARIANTS.get(arch or "") if num_experts else None
    for e in MODELS:
        if (arch in e.gguf_architectures and variant is None) or e.architecture == variant:
            return e
    raise _unsupported(f"model architecture in {source}: general.architecture={arch!r}")


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The model class for ``ModelArchConfig.architecture`` (a Hugging Face class name).

    Raises:
        ValueError: unknown name; the message lists the supported ones.
    """
    for e in MODELS:
        if e.architecture == architecture:
            return e.load()
    raise _unsupported(f"architecture {architecture!r}")
