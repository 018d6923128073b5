"""Data parallelism: 2 replicas behind the cache-aware router vs round robin, same run, then a
replica killed mid-run (issue 26).

Workload: WMT16 en->de translation prompts behind ``--sets`` different few-shot prefixes (each set
has its own ``--shots`` example pairs), interleaved in a fixed random order, greedy, exactly
``--output`` tokens (ignore_eos), ``--concurrency`` requests in flight. Each policy gets fresh
replicas (cold prefix caches). Printed per policy: the prefix-cache hit rate (prompt tokens found in
the cache / looked up, summed over replicas), output tokens/s and requests/s. The kill run sends the
same workload with the cache-aware router, kills replica 0 (Ray restarts it) after
``--kill-after`` completed requests, and prints how many completed, failed cleanly, or hung
(none may: every request is awaited with ``--request-timeout``).

On the 2-core development machine each replica gets 1 thread (Ray ``num_cpus=1``).

    .venv/bin/python benchmarks/data_parallel.py                 # ~5-8 min on 2 cores
    .venv/bin/python benchmarks/data_parallel.py --requests 16 --output 8
"""

from __future__ import annotations

import pagedllm  # noqa: F401 (first: it sets OpenMP's barrier spin before torch loads libgomp)

# isort: split
import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR, bench_lock  # noqa: E402

from pagedllm.sampling_params import SamplingParams  # noqa: E402


def workload(tok, sets: int, shots: int, n: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts: set ``i % sets``'s few-shot prefix + one sentence, shuffled."""
    records = json.loads((DATA_DIR / "wmt16_en_de.json").read_text())
    moderate = [r for r in records if 8 <= len(r["en"].split()) <= 30]
    examples = [moderate[k * shots : (k + 1) * shots] for k in range(sets)]
    used = {r["id"] for ex in examples for r in ex}
    sentences = [
        r["en"] for r in records if r["id"] not in used and 4 <= len(r["en"].split()) <= 40
    ]
    prompts = []
    for i in range(n):
        prefix = "Translate English to German.\n\n" + "".join(
            f"English: {r['en']}\nGerman: {r['de']}\n\n" for r in examples[i % sets]
        )
        prompts.append(
            tok(prefix, add_special_tokens=False).input_ids
            + tok(f"English: {sentences[i]}\nGerman:", add_special_tokens=False).input_ids
        )
    random.Random(seed).shuffle(prompts)
    return prompts


async def run(dp, prompts, output: int, concurrency: int, timeout: float, kill_after=None):
    """Send every prompt (at most ``concurrency`` at once); returns outcome counts and timing."""
    import ray

    sem = asyncio.Semaphore(concurrency)
    done = {"ok": 0, "failed": 0, "hung": 0, "tokens": 0}
    errors: dict[str, int] = {}
    killed = False

    async def one(i: int, ids: list[int]) -> None:
        nonlocal killed
        async with sem:
            params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)

            async def consume() -> int:
                stream = await dp.add_request(f"r{i}", ids, params)
                last = None
                async for out in stream:
                    last = out
                return len(last.outputs[0].token_ids) if last else 0

            try:
                n_tokens = await asyncio.wait_for(consume(), timeout)
                done["tokens"] += n_tokens  # after the await: no lost update
                done["ok"] += 1
            except asyncio.TimeoutError:
                done["hung"] += 1
            except Exception as e:  # noqa: BLE001 - counted: a clean failure
                done["failed"] += 1
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            if kill_after is not None and not killed and done["ok"] >= kill_after:
                killed = True
                ray.kill(dp.replicas[0].actor, no_restart=False)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    done["seconds"] = time.perf_counter() - t0
    done["errors"] = errors
    await asyncio.sleep(1.2)  # one more counters poll
    c = dp.counters
    q, h = c.prefix_cache_query_tokens or 0, c.prefix_cache_hit_tokens or 0
    done["hit_rate"] = h / q if q else 0.0
    done["decisions"] = dict(dp.router.decisions)
    return done


async def policy_run(engine_args: dict, policy: str, args, kill_after=None) -> dict:
    """Fresh replicas (cold caches), the whole workload, then shut them down."""
    from pagedllm.serving.dp_engine import DataParallelEngine

    dp = DataParallelEngine(engine_args, 2, policy, threads_per_replica=1)
    dp.start()
    try:
        prompts = workload(dp.tokenizer, args.sets, args.shots, args.requests)
        res = await run(
            dp, prompts, args.output, args.concurrency, args.request_timeout, kill_after
        )
        res["mean_prompt_tokens"] = sum(map(len, prompts)) / len(prompts)
        if kill_after is not None:  # how long until Ray restarted replica 0 (in rotation again)
            t0 = time.perf_counter()
            while not dp.replicas[0].in_rotation and time.perf_counter() - t0 < 180:
                await asyncio.sleep(0.5)
            res["restart_s"] = time.perf_counter() - t0 if dp.replicas[0].in_rotation else None
        return res
    finally:
        dp.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--sets", type=int, default=4)
    ap.add_argument("--shots", type=int, default=3)
    ap.add_argument("--output", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--kill-after", type=int, default=8)
    args = ap.parse_args()
    engine_args = {
        "model": args.model,
        "enable_prefix_caching": True,
        "max_model_len": 2048,
        "num_threads": 1,
    }
    print(
        f"DP=2, 1 thread per replica, {args.requests} WMT16 prompts behind {args.sets} "
        f"{args.shots}-shot prefixes, {args.output} output tokens, concurrency {args.concurrency}; "
        "CPU: AMD EPYC Zen 3 (AVX2), 2 cores, shared/noisy"
    )
    results = {}
    with bench_lock():
        for policy in ("cache_aware", "round_robin"):
            r = asyncio.run(policy_run(engine_args, policy, args))
            results[policy] = r
            print(
                f"  {policy:<12} hit rate {r['hit_rate']:.3f}  {r['tokens'] / r['seconds']:.2f} "
                f"output tok/s  {r['ok'] / r['seconds']:.3f} req/s  ({r['ok']} ok, "
                f"{r['failed']} failed, {r['seconds']:.1f} s; mean prompt "
                f"{r['mean_prompt_tokens']:.0f} tok; decisions {r['decisions']})",
                flush=True,
            )
        r = asyncio.run(policy_run(engine_args, "cache_aware", args, kill_after=args.kill_after))
        results["kill_one_replica"] = r
        print(
            f"  kill replica 0 after {args.kill_after} completions: {r['ok']} ok, {r['failed']} "
            f"failed cleanly {r['errors']}, {r['hung']} hung (timeout {args.request_timeout:.0f} "
            f"s), {r['seconds']:.1f} s; replica 0 back in rotation after "
            f"{r['restart_s'] if r['restart_s'] is None else round(r['restart_s'], 1)} s"
        )
    import ray

    ray.shutdown()
    out = Path(__file__).resolve().parent / "results" / "data_parallel.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
