"""Issue 23 item 3 on the tiny random Llama: beam search over HTTP (equal to ``LLM.generate``
with the same beam parameters) and a per-request ``chat_template`` / ``chat_template_kwargs``.

Every test ends with the engine idle and every KV block free (autouse fixture); error cases end
with ``healthy`` (a normal request succeeds, /health is 200).
"""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.llm import LLM
from pagedllm.entrypoints.openai.app import build_app
from pagedllm.sampling_params import SamplingParams
from tests.entrypoints.server_utils import ServerThread, assert_error, healthy

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
ENGINE_ARGS = {
    "max_model_len": 128,
    "kv_cache_memory": 1 << 22,
    "check_invariants": True,
    "num_threads": 1,
    "dtype": "float32",
}


@pytest.fixture(scope="module")
def server(tiny_loaded):
    app = build_app(dict(ENGINE_ARGS), loaded=tiny_loaded, served_model_name="tiny")
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref_llm(tiny_loaded):
    llm = LLM(loaded=tiny_loaded, **ENGINE_ARGS)
    yield llm
    llm.engine.shutdown()


def ok(client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


# ---- beam search ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "beam",
    [
        {"best_of": 3, "n": 2},
        {"best_of": 4, "n": 1, "length_penalty": 0.5, "early_stopping": True},
        {"n": 2, "early_stopping": "never"},  # width = n when best_of is not given
    ],
)
def test_completion_beam_search_equals_offline(client, ref_llm, beam):
    prompt = "paged attention stores keys"
    body = {"prompt": prompt, "max_tokens": 6, "use_beam_search": True, "temperature": 0}
    body.update(beam)
    got = ok(client, CMPL, {**body, "return_token_ids": True})
    params = SamplingParams(
        n=beam["n"],
        best_of=beam.get("best_of"),
        use_beam_search=True,
        temperature=0.0,
        max_tokens=6,
        length_penalty=beam.get("length_penalty", 1.0),
        early_stopping=beam.get("early_stopping", False),
    )
    (want,) = ref_llm.generate(prompt, params, use_tqdm=False)
    assert len(got["choices"]) == beam["n"] == len(want.outputs)
    for ch, c in zip(got["choices"], want.outputs, strict=True):
        assert ch["token_ids"] == c.token_ids
        assert ch["text"] == c.text
    # Beams differ (else beam search was ignored and greedy copies came back).
    if beam["n"] > 1:
        assert got["choices"][0]["token_ids"] != got["choices"][1]["token_ids"]


def test_chat_beam_search_equals_offline(client, ref_llm):
    messages = [{"role": "user", "content": "hello world"}]
    got = ok(
        client,
        CHAT,
        {"messages": messages, "max_tokens": 5, "use_beam_search": True, "best_of": 3, "n": 2},
    )
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=5)
    (want,) = ref_llm.chat(messages, params, use_tqdm=False)
    assert [c["message"]["content"] for c in got["choices"]] == [c.text for c in want.outputs]
    n_out = sum(len(c.token_ids) for c in want.outputs)
    assert got["usage"]["completion_tokens"] == n_out


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream": True}, "stream"),
        ({"stop": ["x"]}, "stop"),
        ({"temperature": 0.7}, "temperature"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": "long"}, "length_penalty"),
    ],
)
def test_beam_search_bad_values_are_400(client, server, extra, param):
    body = {"prompt": "hi", "max_tokens": 3, "use_beam_search": True, "best_of": 2, **extra}
    assert_error(client.post(CMPL, json=body), 400, param)
    healthy(server, client)


# ---- per-request chat template -------------------------------------------------------------------
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ reply_tag }}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]


def test_chat_template_per_request(client, server):
    tok = server.engine.tokenizer
    want = tok("[USER]hello world<s>assistant:", add_special_tokens=False).input_ids
    extra = {"chat_template": TEMPLATE, "chat_template_kwargs": {"reply_tag": "<s>assistant:"}}
    got = ok(client, "/tokenize", {"messages": MESSAGES, **extra})
    assert got["tokens"] == want
    body = {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True, **extra}
    assert ok(client, CHAT, body)["prompt_token_ids"] == want
    # Without it the model's own template is used again.
    own = ok(client, CHAT, {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    assert own["prompt_token_ids"] == tok.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # chat_template_kwargs alone reach the model's template (an unused variable is harmless).
    kw = ok(client, CHAT, {**body, "chat_template": None, "chat_template_kwargs": {"x": 1}})
    assert kw["prompt_token_ids"] == own["prompt_token_ids"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template": "{% for m in messages %}"}, "chat_template"),  # syntax error
        ({"chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
        ({"chat_template": "{{ messages[5]['content'] | upper }}"}, "chat_template"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["not", "a", "dict"]}, "chat_template_kwargs"),
        ({"chat_template": 5}, "chat_template"),
    ],
)
def test_chat_template_errors_are_400(client, server, extra, param):
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    assert_error(client.post(CHAT, json=body), 400, param)
    healthy(server, client)
