"""Mistral (Jiang et al. 2023, "Mistral 7B"): a Llama with sliding-window attention on every layer.

The window comes from ``config.json``'s ``sliding_window`` (read for every architecture by
``loader.hf_loader``); each layer passes it to the attention backend. GGUF files of Mistral
declare ``general.architecture = llama`` and load as Llama.
"""

from __future__ import annotations

from pagedllm.model.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama layers; the sliding window is a config field (``ModelArchConfig.sliding_window``)."""
