"""Chat messages that carry tool calls and tool results, for the chat template; and the choice
of template: the model's own when it knows tools, else the shipped ``hermes_tools.jinja``.

The template receives an assistant message's ``tool_calls`` with ``arguments`` parsed to an
object (what Hugging Face tool templates expect; OpenAI sends them as a JSON string), and a
``tool`` message with its ``tool_call_id``. The legacy forms are mapped: an assistant
``function_call`` becomes one tool call, a ``function`` message a ``tool`` message.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.errors import APIError

_TEMPLATE_FILE = Path(__file__).with_name("hermes_tools.jinja")


@cache
def tool_template() -> str:
    """The Jinja text of the shipped Hermes-style tool template (ChatML turns)."""
    return _TEMPLATE_FILE.read_text()


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` (it mentions them)."""
    return bool(template) and "tools" in str(template)


def _bad(i: int, what: str) -> APIError:
    return APIError(400, f"messages[{i}].{what}", param="messages")


def _template_call(call: Any, i: int, j: int) -> dict[str, Any]:
    """One assistant tool call as the template takes it (arguments parsed)."""
    if not isinstance(call, dict):
        raise _bad(i, f"tool_calls[{j}] must be an object")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict):
        raise _bad(i, f"tool_calls[{j}] must be {{'type': 'function', 'function': {{...}}}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(i, f"tool_calls[{j}].function.name must be a non-empty string")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError as e:
            raise _bad(i, f"tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tool_message_fields(m: Any, i: int) -> dict[str, Any]:
    """The tool fields of message ``i`` (a ``ChatMessage``) for the template: ``role``
    (``function`` becomes ``tool``), ``tool_calls``, ``tool_call_id``.

    Raises:
        APIError: 400 (``param="messages"``) for a malformed tool call or tool message.
    """
    extra = m.model_extra or {}
    calls = getattr(m, "tool_calls", None)
    legacy = extra.get("function_call")
    if m.role == "assistant":
        if legacy is not None and calls is None:
            calls = [{"id": f"call_{i}", "type": "function", "function": legacy}]
        if calls is None:
            return {}
        if not isinstance(calls, list):
            raise _bad(i, "tool_calls must be a list")
        return {"tool_calls": [_template_call(c, i, j) for j, c in enumerate(calls)]}
    if calls is not None or legacy is not None:
        raise _bad(i, f"tool_calls: only assistant messages hold tool calls, not {m.role!r}")
    if m.role == "function":
        return {"role": "tool"}
    if m.role == "tool":
        if not isinstance(getattr(m, "tool_call_id", None), str):
            raise _bad(i, "tool_call_id is required on a tool message")
        return {"tool_call_id": m.tool_call_id}
    return {}


def needs_tool_template(tools: list[dict[str, Any]] | None, messages: list[Any]) -> bool:
    """Whether rendering involves tools: tools offered, or tool calls / results in the messages."""
    if tools:
        return True
    for m in messages:
        extra = m.model_extra or {}
        if m.role in ("tool", "function") or getattr(m, "tool_calls", None) is not None:
            return True
        if extra.get("function_call") is not None:
            return True
    return False


def template_override(
    tokenizer: Any, tools: list[dict[str, Any]] | None, messages: list[Any]
) -> str | None:
    """The chat template to render with instead of the tokenizer's: the shipped tool template
    when tools are involved and the model's template does not know them; else None."""
    if needs_tool_template(tools, messages) and not template_has_tools(
        getattr(tokenizer, "chat_template", None)
    ):
        return tool_template()
    return None
