"""Cost of the speculative-decoding building blocks, and the suffix proposer's oracle acceptance.

1. ``rejection_sample`` wall time per call at ``--batch`` rows, ``k`` drafts, the SmolLM2
   vocabulary (49152), with deterministic (one-hot) drafts and with draft probabilities.
2. ``SuffixProposer`` on a replayed answer: the prompt is a workload prompt (tokenized chat
   prompt), the "model" emits the reference answer token by token; each step proposes ``k``
   tokens, keeps the prefix that matches the reference, plus one token (what greedy verification
   does when the model's output is the reference). Printed: tokens per step (an upper bound of
   the speed-up that proposals alone allow), acceptance rate, and microseconds per ``propose``
   call (incremental indexing included). Workloads: the repetitive one of
   ``benchmarks/spec_workload.py`` and ShareGPT (first human turn -> first reply), the answers
   played in order so later requests can reuse earlier outputs.
3. ``--model-replay N``: the same replay on the bundled SmolLM2-135M-Instruct's own greedy
   answers to N workload prompts (fp32, ``max_tokens`` = reference length + 16, at most 128):
   exactly the tokens per step that greedy verification with this proposer would reach.

Run: ``PYTHONPATH=. python benchmarks/spec_building_blocks.py [--n 32] [--k 4]`` (data from
``$PAGEDLLM_DATA`` or ``../shared/data``).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks.spec_workload import _bundled_tokenizer, build_repetitive_tasks
from pagedllm.bench.datasets import dataset_file
from pagedllm.spec_decode.rejection import rejection_sample
from pagedllm.spec_decode.suffix import SuffixProposer

VOCAB = 49152


def time_rejection(batch: int, k: int, with_probs: bool, top_k: int = 0, repeats: int = 7) -> float:
    """Median seconds per ``rejection_sample`` call; ``top_k`` > 0 truncates the target."""
    gen = torch.Generator().manual_seed(0)
    p = torch.rand(batch, k + 1, VOCAB, generator=gen).softmax(dim=-1)
    if top_k:
        p = p.masked_fill(p < p.topk(top_k, dim=-1).values[..., -1:], 0.0)
        p /= p.sum(dim=-1, keepdim=True)
    q = torch.rand(batch, k, VOCAB, generator=gen).softmax(dim=-1) if with_probs else None
    drafts = torch.randint(0, VOCAB, (batch, k), generator=gen)
    nd = torch.full((batch,), k)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        rejection_sample(p, drafts, nd, q, list(range(batch)), [r] * batch)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def replay(pairs: list[tuple[list[int], list[int]]], k: int) -> dict[str, float]:
    """Replay ``(prompt_ids, answer_ids)`` pairs through one SuffixProposer (see module doc)."""
    sp = SuffixProposer()
    steps = proposed = accepted = calls = 0
    elapsed = 0.0
    for i, (prompt, answer) in enumerate(pairs):
        seq = list(prompt)
        g = 0
        while g < len(answer):
            t0 = time.perf_counter()
            prop = sp.propose(seq, len(prompt), k, str(i))
            elapsed += time.perf_counter() - t0
            calls += 1
            a = 0
            while a < len(prop) and g + a < len(answer) and prop[a] == answer[g + a]:
                a += 1
            take = answer[g : g + a + 1]
            seq += take
            g += len(take)
            steps += 1
            proposed += len(prop)
            accepted += a
        sp.on_request_finished(seq, len(prompt), str(i))
    out_tokens = sum(len(a) for _, a in pairs)
    return {
        "tokens_per_step": out_tokens / max(steps, 1),
        "acceptance_rate": accepted / max(proposed, 1),
        "us_per_propose": 1e6 * elapsed / max(calls, 1),
        "output_tokens": out_tokens,
    }


def _chat_ids(tok: Any, message: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
    )
    return list(tok.encode(text, add_special_tokens=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=32, help="requests per workload")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--model-replay", type=int, default=0, help="prompts run through SmolLM2")
    args = ap.parse_args()
    # One thread for the timings: on a shared, loaded machine a 2-thread pool's waits dominate.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print("torch threads = 1 for the rejection_sample timings")
    for with_probs, top_k in ((False, 0), (True, 0), (False, 50)):
        s = time_rejection(args.batch, args.k, with_probs, top_k)
        kind = "draft probs" if with_probs else "one-hot drafts"
        target = f"top-k {top_k} target" if top_k else "full-vocab target"
        print(
            f"rejection_sample batch={args.batch} k={args.k} V={VOCAB} {kind}, {target}: "
            f"{1e3 * s:.1f} ms/call"
        )

    torch.set_num_threads(threads)
    tok = _bundled_tokenizer()
    enc = tok.encode
    tasks = build_repetitive_tasks(args.n, 0)
    rep = [(_chat_ids(tok, t.message), enc(t.reference, add_special_tokens=False)) for t in tasks]
    records = json.loads(dataset_file("sharegpt").read_text())[: args.n]
    share = [
        (
            _chat_ids(tok, r["conversations"][0]["value"])[-1024:],
            enc(r["conversations"][1]["value"], add_special_tokens=False)[:512],
        )
        for r in records
    ]
    for name, pairs in (("repetitive", rep), ("sharegpt", share)):
        res = replay(pairs, args.k)
        print(
            f"suffix oracle replay {name} (n={args.n}, k={args.k}): "
            f"{res['tokens_per_step']:.2f} tokens/step, acceptance {res['acceptance_rate']:.2f}, "
            f"{res['us_per_propose']:.0f} us/propose over {res['output_tokens']} output tokens"
        )
    if args.model_replay:
        model_replay(tok, tasks[: args.model_replay], args.k)


def model_replay(tok: Any, tasks: list[Any], k: int) -> None:
    """Replay the proposer on SmolLM2's own greedy answers (module docstring, item 3)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(dtype="float32")
    prompts = [{"prompt_token_ids": _chat_ids(tok, t.message)} for t in tasks]
    params = [
        SamplingParams(temperature=0.0, max_tokens=min(128, len(tok.encode(t.reference)) + 16))
        for t in tasks
    ]
    outs = llm.generate(prompts, params)
    pairs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    for kk in (k, 2 * k):
        res = replay(pairs, kk)
        print(
            f"suffix replay on SmolLM2 greedy answers (n={len(pairs)}, k={kk}): "
            f"{res['tokens_per_step']:.2f} tokens/step, acceptance {res['acceptance_rate']:.2f} "
            f"over {res['output_tokens']} output tokens"
        )


if __name__ == "__main__":
    main()
