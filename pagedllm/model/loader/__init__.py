"""Model loading: the bundled SmolLM2 GGUF, any Llama GGUF file, or a Hugging Face folder.

``load_model(None)`` returns a :class:`LoadedModel` (config, Hugging Face named state dict,
tokenizer) for the bundled SmolLM2-135M-Instruct; ``export_hf_folder`` writes one back out as a
folder transformers and vLLM can load.
"""

from pagedllm.model.loader.bundled import bundled_model_path
from pagedllm.model.loader.gguf_loader import (
    gguf_arch_config,
    gguf_to_hf_name,
    load_gguf_weights,
    open_gguf,
    unpermute_qk,
)
from pagedllm.model.loader.hf_loader import (
    export_hf_folder,
    hf_arch_config,
    hf_config_dict,
    load_hf_weights,
)
from pagedllm.model.loader.load import LoadedModel, load_model, resolve_model_path
from pagedllm.model.loader.tokenizer import (
    chat_template_end_of_turn_ids,
    eos_token_ids,
    load_tokenizer,
)

__all__ = [
    "LoadedModel",
    "bundled_model_path",
    "chat_template_end_of_turn_ids",
    "eos_token_ids",
    "export_hf_folder",
    "gguf_arch_config",
    "gguf_to_hf_name",
    "hf_arch_config",
    "hf_config_dict",
    "load_gguf_weights",
    "load_hf_weights",
    "load_model",
    "load_tokenizer",
    "open_gguf",
    "resolve_model_path",
    "unpermute_qk",
]
