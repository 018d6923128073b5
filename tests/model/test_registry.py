"""The model registry: lookups, the error for unknown architectures, and docs/models.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedllm.model.decoder import DecoderForCausalLM
from pagedllm.model.registry import (
    GGUF_MOE_VARIANTS,
    MODELS,
    entry_for_gguf,
    entry_for_hf_config,
    model_class,
    supported_architectures,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_every_entry_imports_its_class():
    for e in MODELS:
        cls = model_class(e.architecture)
        assert issubclass(cls, DecoderForCausalLM) and cls.__name__ == e.class_name


def test_lookup_by_architecture_then_model_type():
    assert entry_for_hf_config({"architectures": ["Qwen2ForCausalLM"]}).module == "qwen2"
    assert entry_for_hf_config({"model_type": "gemma3_text"}).module == "gemma3"
    assert entry_for_gguf("qwen3").architecture == "Qwen3ForCausalLM"


@pytest.mark.parametrize(
    "lookup",
    [
        lambda: entry_for_hf_config({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}),
        lambda: entry_for_gguf("bloom"),
        lambda: model_class("BloomForCausalLM"),
    ],
)
def test_unknown_architecture_lists_supported(lookup):
    with pytest.raises(ValueError, match="bloom|Bloom") as info:
        lookup()
    for name in supported_architectures():
        assert name in str(info.value)


def test_docs_table_matches_registry():
    rows = []
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = re.match(
            r"^\| (\w+(?:ForCausalLM|LMHeadModel)) \| (.*?) \| (.*?) \| (.*?) \| `pagedllm/model/(\w+)\.py`",
            line,
        )
        if m:
            rows.append(m.groups())
    # A GGUF architecture llama.cpp reuses for a MoE variant (Mixtral = llama with experts).
    moe = {hf: f"{g} (with experts)" for g, hf in GGUF_MOE_VARIANTS.items()}
    want = [
        (
            e.architecture,
            ", ".join(e.model_types),
            ", ".join(e.gguf_architectures) or moe.get(e.architecture, "-"),
            e.family,
            e.module,
        )
        for e in MODELS
    ]
    assert rows == want
