"""Helpers shared by the tensor-parallel tests."""

from __future__ import annotations

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
    """Live (non-zombie) descendants of this process, except multiprocessing's resource tracker
    and fork server (one each per interpreter, started with the first ranks; they exit with us).
    The ranks are the fork server's children and carry its command line, so the server is told
    apart by being our own child."""
    import psutil

    me = psutil.Process()
    out = set()
    for c in me.children(recursive=True):
        try:
            if c.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(c.cmdline())
            if "resource_tracker" in cmdline or ("forkserver" in cmdline and c.ppid() == me.pid):
                continue
        except psutil.NoSuchProcess:
            continue
        out.add(c.pid)
    return out
