"""The 30 committed JSON schemas (tests/data/json_schemas/, growing complexity) through a real
server with the bundled SmolLM2-135M and the official ``openai`` client: every reply validates
against its schema with ``jsonschema``, streamed and not (``finish_reason`` "length" is a
failure); and ``client.chat.completions.parse`` with pydantic models on 50 varied prompts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.app import build_app
from tests.entrypoints.server_utils import ServerThread, wait_idle

pytestmark = pytest.mark.slow

SCHEMA_DIR = Path(__file__).parent.parent / "data" / "json_schemas"
FIXTURES = [json.loads(p.read_text()) for p in sorted(SCHEMA_DIR.glob("*.json"))]
MAX_TOKENS = 400  # generous: every schema bounds its strings, arrays and recursion


@pytest.fixture(scope="module")
def server(smollm):  # type: ignore[no-untyped-def]
    app = build_app(
        {"max_model_len": 1024, "kv_cache_memory": 96 << 20, "check_invariants": True},
        loaded=smollm,
        served_model_name="smol",
    )
    srv = ServerThread(app).start()
    yield srv
    wait_idle(srv.engine)  # every KV block free again
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


def _ask(oai: openai.OpenAI, fx: dict[str, Any], stream: bool) -> tuple[str, str | None]:
    kw: dict[str, Any] = dict(
        model="smol",
        messages=[{"role": "system", "content": "Answer in JSON."},
                  {"role": "user", "content": fx["prompt"]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": fx["schema"], "strict": True}},
    )
    if not stream:
        r = oai.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_30_schemas_validate(oai, stream: bool) -> None:  # type: ignore[no-untyped-def]
    assert len(FIXTURES) == 30
    with ThreadPoolExecutor(len(FIXTURES)) as pool:  # batched in the engine
        results = list(pool.map(lambda fx: _ask(oai, fx, stream), FIXTURES))
    failures = []
    for fx, (text, reason) in zip(FIXTURES, results, strict=True):
        try:
            assert reason == "stop", f"finish_reason {reason}"
            jsonschema.validate(json.loads(text), fx["schema"])
        except (AssertionError, ValueError, jsonschema.ValidationError) as e:
            failures.append(f"{fx['description']}: {str(e)[:200]} :: {text[:200]!r}")
    assert not failures, "\n".join(failures)


# ---- client.chat.completions.parse with pydantic models -------------------------------------
class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=50_000_000)


class Person(BaseModel):
    first_name: str = Field(max_length=30)
    last_name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)


# Every string and list is bounded (as real apps bound what they ask for): a 135M model may
# otherwise write one string, or the digits of one float, until max_tokens.
class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]
    confidence_percent: int = Field(ge=0, le=100)


class TodoList(BaseModel):
    title: str = Field(max_length=40)
    items: list[Annotated[str, Field(max_length=40)]] = Field(max_length=4)


class Animal(BaseModel):
    species: str = Field(max_length=30)
    legs: int = Field(ge=0, le=100)
    can_fly: bool


MODELS: list[tuple[type[BaseModel], list[str]]] = [
    (City, ["Tell me about Paris.", "Describe Tokyo.", "What is the capital of Italy?",
            "Tell me about a big city in Brazil.", "Describe London.", "Describe Cairo.",
            "Tell me about Sydney.", "Describe New York.", "Describe Berlin.",
            "Describe a city you like."]),
    (Person, ["Invent a person.", "Describe Albert Einstein.", "Describe a young student.",
              "Describe a famous painter.", "Invent a character for a novel.",
              "Describe your neighbour.", "Describe a doctor.", "Describe a chef.",
              "Describe an astronaut.", "Describe a child."]),
    (Sentiment, ["I love this product!", "This was the worst day ever.", "It is fine, I guess.",
                 "Absolutely fantastic service.", "I will never buy this again.",
                 "The weather is cloudy.", "Best purchase of the year!", "Meh.",
                 "I am so disappointed.", "Okay but nothing special."]),
    (TodoList, ["Make a shopping list.", "Plan my weekend.", "Tasks for moving house.",
                "Things to pack for a trip.", "Chores for today.", "Steps to bake bread.",
                "Plan a birthday party.", "Study plan for an exam.", "Garden work for spring.",
                "Morning routine."]),
    (Animal, ["Describe a dog.", "Describe an eagle.", "Describe a spider.", "Describe a fish.",
              "Describe a penguin.", "Describe a horse.", "Describe a bat.", "Describe a snake.",
              "Describe an ant.", "Describe a parrot."]),
]


def test_parse_pydantic_50_prompts(oai) -> None:  # type: ignore[no-untyped-def]
    jobs = [(model, prompt) for model, prompts in MODELS for prompt in prompts]
    assert len(jobs) == 50

    def parse(job: tuple[type[BaseModel], str]) -> Any:
        model, prompt = job
        r = oai.chat.completions.parse(
            model="smol", messages=[{"role": "user", "content": prompt}],
            response_format=model, max_tokens=MAX_TOKENS, temperature=0.7, seed=len(prompt),
        )
        return r.choices[0].message.parsed

    with ThreadPoolExecutor(25) as pool:
        parsed = list(pool.map(parse, jobs))
    for (model, prompt), obj in zip(jobs, parsed, strict=True):
        assert isinstance(obj, model), (prompt, obj)
