"""``/v1/embeddings`` on a tiny random Llama built with transformers: the vectors equal the same
pooling over transformers' final hidden states (cosine > 0.9999, norms checked), through httpx
and through the official ``openai`` client (which asks for base64 and decodes it); bad input is a
400 naming the field, and the server stays healthy with every KV block free.
"""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from pagedllm.entrypoints.openai.app import build_app
from tests.engine.test_pooling import PROMPTS, check, reference
from tests.entrypoints.server_utils import ServerThread, assert_error, healthy
from tests.model.arch_utils import build_tiny_hf_model

EMB = "/v1/embeddings"


@pytest.fixture(scope="module")
def hf_and_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_embed")
    return build_tiny_hf_model("llama", folder), folder


@pytest.fixture(scope="module")
def server(hf_and_folder):
    app = build_app(
        {
            "model": str(hf_and_folder[1]),
            "dtype": "float32",
            "max_model_len": 128,
            "kv_cache_memory": 1 << 22,
            "block_size": 4,
            "check_invariants": True,
            "num_threads": 1,
        },
        served_model_name="tiny-embed",
    )
    srv = ServerThread(app).start()
    yield srv
    srv.stop()


def embed(client, **body) -> dict:
    r = client.post(EMB, json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_transformers(client, server, hf_and_folder, pooling):
    model = hf_and_folder[0]
    tok = server.engine.tokenizer
    got = embed(client, input=PROMPTS, model="tiny-embed", pooling=pooling)
    assert got["object"] == "list" and got["model"] == "tiny-embed"
    ids = [tok(p).input_ids for p in PROMPTS]
    assert got["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids))}
    assert [d["index"] for d in got["data"]] == [0, 1, 2]
    for d, p_ids in zip(got["data"], ids, strict=True):
        assert d["object"] == "embedding"
        check(d["embedding"], reference(model, p_ids, pooling, True), True)
    # Not normalized: the raw pooled state, and base64 carries the same float32 values.
    raw = embed(client, input=ids[2], normalize=False, encoding_format="base64", pooling=pooling)
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    check(vec.tolist(), reference(model, ids[2], pooling, False), False)


def test_embeddings_token_id_inputs_and_prefix_cache(client, server, hf_and_folder):
    model = hf_and_folder[0]
    tok = server.engine.tokenizer
    base = tok(PROMPTS[2]).input_ids
    # Cache the prompt's blocks with a generation request, then embed prompts sharing them.
    r = client.post("/v1/completions", json={"prompt": base, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    inputs = [base + [5, 6, 7], base[:10]]
    got = embed(client, input=inputs, dimensions=64)
    for d, ids in zip(got["data"], inputs, strict=True):
        check(d["embedding"], reference(model, ids, "mean", True), True)


def test_official_client_embeddings(server, hf_and_folder):
    model = hf_and_folder[0]
    tok = server.engine.tokenizer
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    res = oai.embeddings.create(input=PROMPTS[:2], model="tiny-embed")  # base64 by default
    assert res.usage.prompt_tokens == sum(len(tok(p).input_ids) for p in PROMPTS[:2])
    for d, p in zip(res.data, PROMPTS[:2], strict=True):
        check(d.embedding, reference(model, tok(p).input_ids, "mean", True), True)
    floats = oai.embeddings.create(input="hello", model="tiny-embed", encoding_format="float")
    assert torch.allclose(
        torch.tensor(floats.data[0].embedding), torch.tensor(res.data[1].embedding), atol=1e-6
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"text": "x"}]}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [5] * 129}, "input"),  # longer than max_model_len
        ({"input": [999999]}, "input"),  # outside the vocabulary
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({"input": "hi", "pooling": "cls"}, "pooling"),
        ({"input": "hi", "normalize": "yes please"}, "normalize"),
        ({"input": "hi", "model": "other"}, "model"),
        # Known but not implemented: refused, never silently ignored (breaker pass).
        ({"input": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens"),
        ({"input": "hi", "cache_salt": "s"}, "cache_salt"),
    ],
)
def test_embeddings_bad_input_is_400(client, server, body, param):
    status = 404 if param == "model" else 400
    assert_error(client.post(EMB, json=body), status, param)
    healthy(server, client)
