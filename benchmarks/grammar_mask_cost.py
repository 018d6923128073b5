"""Per-token grammar mask cost of xgrammar vs llguidance on the bundled SmolLM2 vocabulary.

For each library: time to build the tokenizer info, time to compile a medium JSON schema, and
the per-token cost of "fill the next-token bitmask + accept the token" along a fixed valid JSON
document (tokenized with the model's tokenizer), plus one bitmask -> -inf application on a
[32, 49152] float32 logits tensor. Prints one line per library.

Run: ``PYTHONPATH=. python benchmarks/grammar_mask_cost.py``
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import torch

from pagedllm.model.loader.bundled import bundled_model_path
from pagedllm.model.loader.tokenizer import load_tokenizer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
# Compact separators: both libraries' no-whitespace JSON mode.
DOC = (
    '{"name":"Ada Lovelace","age":36,"email":"ada@math.com","tags":["math","poetry",'
    '"engines"],"address":{"street":"12 St James Square","city":"London","zip":"10001"},'
    '"role":"admin"}'
)


def bench_xgrammar(tok: Any, ids: list[int], vocab: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":")
    )
    t2 = time.perf_counter()
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    per_tok = []
    matcher = xgr.GrammarMatcher(compiled)
    for tid in ids:
        s = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        assert matcher.accept_token(tid), "the document must be accepted"
        per_tok.append(time.perf_counter() - s)
    return {"info_s": t1 - t0, "compile_s": t2 - t1, "tok_us": statistics.median(per_tok) * 1e6,
            "tok_p99_us": sorted(per_tok)[int(0.99 * len(per_tok))] * 1e6}


def bench_llguidance(tok: Any, ids: list[int], vocab: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    grm = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(lltok, grm)
    assert not matcher.is_error(), matcher.get_error()
    t2 = time.perf_counter()
    bitmask = lltorch.allocate_token_bitmask(1, vocab)
    per_tok = []
    for tid in ids:
        s = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, bitmask, 0)
        assert matcher.consume_token(tid), matcher.get_error()
        per_tok.append(time.perf_counter() - s)
    return {"info_s": t1 - t0, "compile_s": t2 - t1, "tok_us": statistics.median(per_tok) * 1e6,
            "tok_p99_us": sorted(per_tok)[int(0.99 * len(per_tok))] * 1e6}


def bench_apply(vocab: int, rows: int = 32) -> dict[str, float]:
    import xgrammar as xgr

    from pagedllm.structured.mask import apply_token_bitmask_torch_

    logits = torch.randn(rows, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    out = {}
    for name, fn in (
        ("xgrammar_apply_us", lambda: xgr.apply_token_bitmask_inplace(logits, bitmask)),
        ("torch_apply_us", lambda: apply_token_bitmask_torch_(logits, bitmask)),
    ):
        ts = []
        for _ in range(50):
            s = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - s)
        out[name] = statistics.median(ts) * 1e6
    return out


def main() -> None:
    tok = load_tokenizer(bundled_model_path())
    vocab = len(tok)
    ids = tok(DOC, add_special_tokens=False).input_ids
    print(f"vocab={vocab}, document={len(ids)} tokens, schema: 6 properties, nested object, "
          "array, enum, 2 patterns")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        r = fn(tok, ids, vocab)
        print(f"{name:11s} tokenizer-info {r['info_s'] * 1e3:7.1f} ms  compile "
              f"{r['compile_s'] * 1e3:7.1f} ms  mask+accept per token: median "
              f"{r['tok_us']:7.1f} us, p99 {r['tok_p99_us']:7.1f} us")
    a = bench_apply(vocab)
    print(f"bitmask -> -inf on [32, {vocab}] fp32: xgrammar kernel {a['xgrammar_apply_us']:.0f} "
          f"us, torch unpack+masked_fill {a['torch_apply_us']:.0f} us")


if __name__ == "__main__":
    main()
