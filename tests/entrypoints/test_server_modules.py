"""The server's modules: each imports, stays small, and reads the engine only through
``AsyncLLMEngine``'s public members (no private attributes, no ``LLMEngine`` internals)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import pagedllm.entrypoints.openai as openai_pkg

SERVER_DIR = Path(openai_pkg.__file__).parent
MODULES = sorted(p for p in SERVER_DIR.glob("*.py") if p.name != "__init__.py")
MAX_LINES = 600
#: ``AsyncLLMEngine.engine`` is the live ``LLMEngine``; the rest are its internals.
FORBIDDEN_ATTRS = {"engine", "scheduler", "block_manager", "call_in_engine_thread"}


def engine_accesses(source: str) -> list[str]:
    """``line: attribute`` of every forbidden attribute read in ``source``: one in
    ``FORBIDDEN_ATTRS``, or a private one (``_x``) of anything whose name mentions engine."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value)
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if node.attr in FORBIDDEN_ATTRS or (private and "engine" in owner.lower()):
            found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_checker_finds_what_it_forbids():
    src = (
        "import pagedllm.engine.async_engine\n"
        "x = app.state.async_engine.engine.scheduler.running\n"
        "loop = async_engine._loop\n"
        "ok = async_engine.counters.num_running + serving.async_engine.max_model_len\n"
    )
    assert sorted(engine_accesses(src)) == [
        "2: app.state.async_engine.engine",
        "2: app.state.async_engine.engine.scheduler",
        "3: async_engine._loop",
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_server_module_imports_small_and_uses_the_public_engine(path):
    importlib.import_module(f"pagedllm.entrypoints.openai.{path.stem}")
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_LINES
    assert engine_accesses(source) == []


def test_the_split_modules_are_there():
    names = {p.stem for p in MODULES}
    assert {
        "app",
        "routes",
        "serving_common",
        "serving_completion",
        "serving_chat",
        "middleware",
        "errors",
    } <= names
    from pagedllm.entrypoints.openai import api_server, app

    assert api_server.build_app is app.build_app  # the import path of cli_serve and benches


def test_sse_event_is_one_line_for_every_line_splitter():
    """U+0085, U+2028 and U+2029 stay raw in ensure_ascii=False JSON, and str.splitlines (httpx's
    iter_lines) splits on them: each event must stay one ``data:`` line that parses back."""
    import json

    from pagedllm.entrypoints.openai.serving_common import sse

    obj = {"text": "a\u2028b\u2029c\x85d\\\u2028e\n\u00e9\u4e2d"}
    event = sse(obj)
    assert event.endswith("\n\n") and event.startswith("data: ")
    assert len(event.rstrip("\n").splitlines()) == 1
    assert json.loads(event[len("data: "):]) == obj
    assert "\u00e9\u4e2d" in event  # other non-ASCII text stays as it is
