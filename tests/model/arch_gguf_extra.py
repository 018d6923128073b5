"""Tiny-model settings and llama.cpp-style GGUF writers of the architectures added after
``tests/model/arch_utils.py`` reached its size limit: SmolLM3 (NoPE layers).

``arch_utils._arch_kwargs`` and ``write_gguf_like_llama_cpp`` dispatch here for the names in
``EXTRA_ARCHS`` / ``EXTRA_GGUF_WRITERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# 4 layers so that transformers' default NoPE interval (4) leaves layer 3 without RoPE, as
# llama.cpp's fixed interval does for the GGUF file; RoPE base 10000 (not SmolLM3's 2e6) so that
# rotating the NoPE layer would change the tiny model's tokens.
SMOLLM3_LAYERS = 4
EXTRA_ARCHS = ("smollm3",)


def extra_arch_kwargs(arch: str) -> tuple[Any, dict[str, Any]]:
    """(transformers model class, config kwargs) for ``arch`` in ``EXTRA_ARCHS``, in the form
    of ``arch_utils._arch_kwargs``."""
    import transformers as tf

    from tests.model.arch_utils import TINY

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "smollm3":  # tied head, as released
        return tf.SmolLM3ForCausalLM, {
            "config": tf.SmolLM3Config,
            "tiny": {**TINY, "num_hidden_layers": SMOLLM3_LAYERS},
            "tie_word_embeddings": True,
            "rope_parameters": rope,
        }
    raise ValueError(arch)


EXTRA_GGUF_WRITERS: dict[str, Callable[[Any, Path, Any], None]] = {}
