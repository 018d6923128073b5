"""The linear layers alone: the floor a step, or a whole workload, could reach (issue 6).

A step's matrix multiplies are its QKV, O, gate/up and down projections in every layer on all
of the step's tokens, then the LM head on the rows that sample. ``linears_ms`` runs exactly those
through the model's own projection modules (so the packed weights and the GEMM the engine chose
count: pagedllm's own on AVX2, whose gate/up pass also applies SwiGLU in its epilogue, or oneDNN)
on random activations; everything else a step does (attention, norms, RoPE, sampling,
scheduling, Python) is left out. ``StepShapes`` records the (tokens, sampled rows) of
every step of a real run, and ``workload_floor_s`` replays the linears of all of them: a workload's
time if only its matmuls cost anything, which bounds the throughput any engine running the same
fp32 GEMMs can reach on this machine.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F


def linears_ms(model, num_tokens: int, num_logit_rows: int) -> float:
    """Milliseconds of one pass of the step's linear layers.

    Args:
        model: ``LlamaForCausalLM`` (the engine's worker model, weights packed or not).
        num_tokens: rows through every layer's projections (the step's prefill + decode tokens).
        num_logit_rows: rows through the LM head (sequences that sample this step).
    """
    d = model.config.hidden_size
    layers = list(model.layers)
    x = torch.randn(num_tokens, d, dtype=model.dtype)
    o_in = torch.randn(num_tokens, layers[0].self_attn.q_size, dtype=model.dtype)
    down_in = torch.randn(num_tokens, layers[0].mlp.inter, dtype=model.dtype)
    h = torch.randn(num_logit_rows, d, dtype=model.dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for layer in layers:
            layer.self_attn.qkv_proj(x)
            layer.self_attn.o_proj(o_in)
            layer.mlp.gate_up_proj(x)
            layer.mlp.down_proj(down_in)
        if num_logit_rows:
            if model.lm_head_packed is not None:
                model.lm_head_packed(h)
            else:
                F.linear(h, model.lm_head_weight)
        return (time.perf_counter() - t0) * 1e3


class StepShapes:
    """Records (num_tokens, num_sampled_rows) of every step an engine runs while attached.

    Wraps ``engine.executor.execute_model``; ``detach()`` restores it. Single-process executors
    only (the worker model must be reachable for the replay).
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.shapes: list[tuple[int, int]] = []
        self._orig = engine.executor.execute_model

        def recording(sched):
            out = self._orig(sched)
            tokens = sum(len(w.token_ids) for _, w in sched.scheduled)
            self.shapes.append((tokens, len(out.sample_seq_ids)))
            return out

        engine.executor.execute_model = recording

    def detach(self) -> None:
        self.engine.executor.execute_model = self._orig


def workload_floor_s(model, shapes: list[tuple[int, int]]) -> float:
    """Seconds of the linear layers of every recorded step, replayed once each (a warm-up pass
    over the distinct shapes first, so oneDNN's kernel generation is not counted)."""
    for shape in sorted(set(shapes)):
        linears_ms(model, *shape)
    return sum(linears_ms(model, *shape) for shape in shapes) / 1e3
