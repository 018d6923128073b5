"""Where speculative decoding stops paying on this CPU: the cost of verifying ``k`` drafts.

Loads the bundled model (SmolLM2-135M-Instruct, at the engine's dtype="auto": fp32, or bf16 on
CPUs with bf16 hardware), prefills ``max(--batches)`` ShareGPT
prompts of ``--prompt-len`` tokens, then, for each batch size B, times the model step
(``executor.execute_model``, the forward pass with its LM head rows) of the first B sequences
with 1 token per sequence (plain decode) and with ``k + 1`` tokens per sequence (a verification
of k drafts, ``num_spec_tokens = k``), plus the greedy sampling of the rows it returns. The
variants alternate within every repeat (noise hits them alike); figures are medians.

A speculative step emits ``1 + A`` tokens per sequence (A = accepted drafts) and costs
``r = T(k + 1) / T(1)`` plain steps, so it pays when ``1 + E[A] > r``. Printed per (B, k): the
ratio r, the break-even mean accepted length ``r - 1``, and the per-draft acceptance rate
``alpha`` needed when each draft is accepted independently with probability alpha
(``E[A] = alpha (1 - alpha^k) / (1 - alpha)``; Leviathan et al. 2023, section 3.1, eq. 1);
"never" when r > k + 1. The proposer's own cost (microseconds for n-gram / suffix) is left out.

    PAGEDLLM_DATA=../shared/data PYTHONPATH=. python benchmarks/spec_cutoff.py
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_lock, median, merge_json, sharegpt_prompts  # noqa: E402


def break_even_alpha(mean_accepted: float, k: int) -> float | None:
    """The per-draft acceptance rate alpha with ``alpha (1 - alpha^k) / (1 - alpha) =
    mean_accepted`` (bisection), 0.0 when ``mean_accepted <= 0``, None when it exceeds k."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a ** j for j in range(1, k + 1)) < mean_accepted:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, choices=["int8", "gguf"],
                    help="lossy weights (EngineConfig.quantization); default: dtype auto")
    ap.add_argument("--out", default=None, help="JSON file (default: benchmarks/results/spec_cutoff[_QUANT].json)")
    args = ap.parse_args()

    from pagedllm.config import EngineConfig
    from pagedllm.core.scheduler_output import ScheduledSequence, SchedulerOutput
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.model.loader import load_model
    from pagedllm.sampling.sampler import SamplingBatch
    from pagedllm.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    n_max, k_max = max(args.batches), max(args.ks)
    loaded = load_model(None, torch.float32)
    prompts = sharegpt_prompts(loaded.tokenizer, n_max, args.prompt_len)
    cfg = EngineConfig(
        max_model_len=args.prompt_len + k_max + 64,
        num_threads=args.threads,
        max_num_seqs=n_max,
        max_num_batched_tokens=max(2048, n_max * (k_max + 1)),
        quantization=args.quantization,
    )
    engine = LLMEngine(cfg, loaded=loaded)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    greedy = SamplingParams(temperature=0)
    filler = prompts[0][1 : k_max + 1]  # draft tokens: their values do not change the cost
    results: dict[str, dict[str, float | None]] = {}
    with bench_lock():
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp)
        while engine.scheduler.waiting or any(
            s.num_output_tokens == 0 for g in engine.scheduler.running for s in g.seqs
        ):
            engine.step()  # prefill; each sequence now holds one generated token
        seqs = [g.seqs[0] for g in engine.scheduler.running][:n_max]
        bm = engine.block_manager
        for seq in seqs:
            bm.allocate_slots(seq, k_max + 1)  # the slots every variant writes (rewritten alike)

        def step_ms(batch: int, k: int) -> tuple[float, float]:
            """(forward ms, forward + greedy sampling ms) of one step: ``batch`` sequences,
            ``1 + k`` tokens each. Nothing advances, so every repeat computes the same step."""
            out = SchedulerOutput()
            for seq in seqs[:batch]:
                start = seq.num_computed_tokens
                work = ScheduledSequence(
                    seq_id=seq.seq_id, token_ids=seq.token_ids[start:] + filler[:k],
                    start_pos=start, block_table=bm.get_block_table(seq), do_sample=True,
                    num_spec_tokens=k,
                )
                out.scheduled.append((str(seq.seq_id), work))
            out.num_batched_tokens = batch * (1 + k)
            t0 = time.perf_counter()
            logits = engine.executor.execute_model(out).logits
            t1 = time.perf_counter()
            rows = logits.shape[0]
            engine.sampler(logits, SamplingBatch(
                [greedy] * rows, [0] * rows, [[1]] * rows, [[1]] * rows, engine.eos_token_ids))
            t2 = time.perf_counter()
            return (t1 - t0) * 1e3, (t2 - t0) * 1e3

        weights = args.quantization or str(cfg.torch_dtype).replace("torch.", "")
        print(f"bundled SmolLM2-135M, weights {weights}, context {args.prompt_len}, {args.threads} threads, "
              f"medians of {args.repeats}; r = T(k+1 tokens) / T(1 token)")
        print(f"{'B':>3} {'k':>2} {'T1 ms':>8} {'Tk+1 ms':>8} {'r fwd':>6} {'r step':>6} "
              f"{'A needed':>8} {'alpha needed':>12}")
        for batch in args.batches:
            variants = [0, *args.ks]
            for k in variants:
                step_ms(batch, k)  # warm-up (shapes, allocator)
            times: dict[int, list[tuple[float, float]]] = {k: [] for k in variants}
            for _ in range(args.repeats):
                for k in variants:
                    times[k].append(step_ms(batch, k))
            t1_fwd = median([t[0] for t in times[0]])
            t1_step = median([t[1] for t in times[0]])
            for k in args.ks:
                fwd = median([t[0] for t in times[k]])
                step = median([t[1] for t in times[k]])
                r_fwd, r_step = fwd / t1_fwd, step / t1_step
                need = r_step - 1
                alpha = break_even_alpha(need, k)
                alpha_text = "never" if alpha is None else f"{alpha:.2f}"
                print(f"{batch:>3} {k:>2} {t1_step:>8.1f} {step:>8.1f} {r_fwd:>6.2f} "
                      f"{r_step:>6.2f} {need:>8.2f} {alpha_text:>12}", flush=True)
                results[f"B{batch}_k{k}"] = {
                    "t1_fwd_ms": round(t1_fwd, 2), "tk1_fwd_ms": round(fwd, 2),
                    "t1_step_ms": round(t1_step, 2), "tk1_step_ms": round(step, 2),
                    "ratio_fwd": round(r_fwd, 3), "ratio_step": round(r_step, 3),
                    "break_even_accepted": round(need, 3),
                    "break_even_alpha": None if alpha is None else round(alpha, 3),
                }
        for g in list(engine.scheduler.running):
            engine.abort_request(g.request_id)
    results["meta"] = {"context": args.prompt_len, "threads": args.threads,
                       "repeats": args.repeats, "weights": args.quantization or str(cfg.torch_dtype).replace("torch.", ""), "date": time.strftime("%Y-%m-%d %H:%M")}
    suffix = f"_{args.quantization}" if args.quantization else ""
    merge_json(args.out or f"benchmarks/results/spec_cutoff{suffix}.json", results)


if __name__ == "__main__":
    main()
