"""A shared stress driver for the speculative-decoding leak tests: random requests (n = 1-2,
greedy or sampled), random steps between arrivals, random aborts, then drain."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pagedllm.sampling_params import SamplingParams


def drive_with_aborts(
    engine, prompts: Sequence[Sequence[int]], num_requests: int, max_tokens_hi: int
) -> None:
    """Add ``num_requests`` seeded random requests to ``engine`` (prompt prefixes of 8-40 tokens,
    4..``max_tokens_hi`` tokens each), step 1-3 times after each, abort a live one with
    probability 0.3, then step until nothing is unfinished."""
    rng = random.Random(0)
    live: list[str] = []
    for i in range(num_requests):
        prompt = list(prompts[i % len(prompts)][: rng.randint(8, 40)])
        sp = SamplingParams(
            n=rng.choice([1, 1, 2]), temperature=rng.choice([0.0, 0.9]), seed=i,
            max_tokens=rng.randint(4, max_tokens_hi), ignore_eos=True,
        )  # fmt: skip
        engine.add_request(f"r{i}", prompt, sp)
        live.append(f"r{i}")
        for _ in range(rng.randint(1, 3)):
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
        if rng.random() < 0.3 and live:
            engine.abort_request(live.pop(rng.randrange(len(live))))
    while engine.has_unfinished_requests():
        engine.step()
