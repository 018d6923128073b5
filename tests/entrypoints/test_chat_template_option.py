"""``chat_template`` (``--chat-template FILE``) replaces the model's chat template in ``LLM.chat``
and in the server, without touching the shared loaded model."""

from __future__ import annotations

import httpx
import pytest

from pagedllm.entrypoints.llm import apply_chat_template
from pagedllm.sampling_params import SamplingParams

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]
RENDERED = "[USER] hello world\n[ASSISTANT]"


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def test_llm_chat_uses_the_template_file(tiny_llm_factory, tiny_loaded, template_file):
    own = tiny_loaded.tokenizer.chat_template
    llm = tiny_llm_factory(chat_template=template_file)
    tok = llm.get_tokenizer()
    assert tok.chat_template == TEMPLATE
    assert tiny_loaded.tokenizer.chat_template == own  # the shared model is untouched
    expected = list(tok(RENDERED, add_special_tokens=False).input_ids)
    assert apply_chat_template(tok, MESSAGES) == expected
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt_token_ids == expected
    assert tiny_llm_factory().get_tokenizer().chat_template == own


def test_server_chat_uses_the_template_file(tiny_loaded, template_file):
    pytest.importorskip("fastapi")
    from pagedllm.entrypoints.openai.api_server import build_app
    from tests.entrypoints.server_utils import ServerThread

    app = build_app(
        {"chat_template": template_file, "max_model_len": 128, "kv_cache_memory": 1 << 22},
        loaded=tiny_loaded,
        served_model_name="tiny",
    )
    srv = ServerThread(app).start()
    try:
        r = httpx.post(srv.url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 200, r.text
        expected = list(tiny_loaded.tokenizer(RENDERED, add_special_tokens=False).input_ids)
        assert r.json()["tokens"] == expected
    finally:
        srv.stop()


def test_llm_chat_takes_text_parts_and_checks_messages(tiny_llm_factory, template_file):
    """LLM.chat reads messages as the server does: text parts joined with newlines; an unknown
    role or a non-text part is a ValueError naming the message (the list was a TypeError)."""
    llm = tiny_llm_factory(chat_template=template_file)
    tok = llm.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"},
                                          {"type": "text", "text": "world"}]}]
    out = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    rendered = "[USER] hello\nworld\n[ASSISTANT]"
    assert out.prompt_token_ids == list(tok(rendered, add_special_tokens=False).input_ids)
    bad = [
        ([{"role": "robot", "content": "hi"}], r"messages\[0\]\.role must be one of"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         r"messages\[0\]\.content: only text parts are supported, got 'image_url'"),
        ([{"role": "user", "content": [{"type": "text"}]}],
         r"messages\[0\]\.content: a text part needs a 'text' string"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
        (["hi"], r"messages\[0\] must be a dict"),
    ]
    for messages, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
