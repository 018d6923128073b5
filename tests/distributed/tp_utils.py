"""Helpers shared by the tensor-parallel tests."""

from __future__ import annotations

import os
from pathlib import Path

from pagedllm.entrypoints.llm import LLM
from pagedllm.model.loader import LoadedModel
from pagedllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def tiny_variant(base: LoadedModel, **over) -> LoadedModel:
    """The tiny tokenizer with a random Llama of another shape (heads, KV heads, widths)."""
    from tests.conftest import make_random_state_dict, make_tiny_config

    cfg = make_tiny_config(base.config.vocab_size, base.config.eos_token_ids[0], **over)
    sd = make_random_state_dict(cfg, seed=3)
    return LoadedModel(
        config=cfg,
        state_dict=sd,
        tokenizer=base.tokenizer,
        source=Path("<tiny-random-llama-variant>"),
        weight_bytes=sum(t.numel() * t.element_size() for t in sd.values()),
    )


def small_llm(loaded: LoadedModel, **kw) -> LLM:
    """An engine with a small KV pool (64 blocks, 128 tokens) that checks its invariants."""
    kw.setdefault("num_gpu_blocks_override", 64)
    kw.setdefault("max_model_len", 128)
    return LLM(loaded=loaded, check_invariants=True, **kw)


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process, except multiprocessing's
    resource tracker (one per interpreter, started by the first ``spawn``; it exits with us)."""
    try:
        import psutil

        out = set()
        for c in psutil.Process().children(recursive=True):
            try:
                if c.status() == psutil.STATUS_ZOMBIE:
                    continue
                if any("resource_tracker" in a for a in c.cmdline()):
                    continue
            except psutil.NoSuchProcess:
                continue
            out.add(c.pid)
        return out
    except ImportError:  # pragma: no cover
        me = os.getpid()
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[1]) == me and stat[0] != "Z":
                    out.add(int(d.name))
        return out
