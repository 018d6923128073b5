"""Request checks shared by the generation endpoints: fields we know but do not serve, the
streaming rules, chat roles and message contents, and the one-time log of unknown fields.

The rule: an unknown field is accepted and ignored (OpenAI clients add new ones over time), and
logged once per field name; a field this server knows (from OpenAI's or vLLM's API) but does not
implement is a 400 naming it whenever its value asks for the feature, never silently dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.llm import CHAT_ROLES
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)
from pagedllm.entrypoints.openai.tool_calls.template import tool_message_fields

logger = logging.getLogger(__name__)


def _set(v: Any) -> bool:
    """Whether a value asks for its feature (anything but null, false, empty or zero)."""
    return v is not None and v is not False and v != [] and v != {} and v != 0


def _not_text(v: Any) -> bool:
    return v is not None and v != ["text"]


#: Known fields this server does not implement: name -> (whether a value asks for the feature,
#: why it is refused). Checked on both generation endpoints.
UNSUPPORTED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "prompt_logprobs": (_set, "prompt_logprobs is not supported (use echo with logprobs)"),
    "allowed_token_ids": (_set, "allowed_token_ids is not supported"),
    "bad_words": (_set, "bad_words is not supported"),
    "truncate_prompt_tokens": (_set, "prompt truncation is not supported"),
    "logits_processors": (_set, "logits_processors is not supported"),
    "return_tokens_as_token_ids": (_set, "return_tokens_as_token_ids is not supported"),
    "vllm_xargs": (_set, "vllm_xargs is not supported"),
    "kv_transfer_params": (_set, "KV transfer is not supported"),
}
#: Known chat-only fields this server does not implement (same shape).
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_set, "audio output is not supported"),
    "modalities": (_not_text, "only the text modality is supported"),
    "prediction": (_set, "predicted outputs are not supported"),
    "web_search_options": (_set, "web search is not supported"),
    "reasoning_effort": (_set, "reasoning_effort is not supported by this model"),
    "documents": (_set, "documents are not supported"),
    "mm_processor_kwargs": (_set, "multi-modal inputs are not supported"),
    "add_special_tokens": (_set, "add_special_tokens is not supported for chat"),
}

#: Known fields of vLLM's embeddings request this server does not implement (same shape).
UNSUPPORTED_EMBEDDING_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "truncate_prompt_tokens": UNSUPPORTED_FIELDS["truncate_prompt_tokens"],
    "cache_salt": (_set, "cache_salt is not supported for embeddings"),
}

#: Most distinct unknown field names remembered (and logged); later ones are not logged.
MAX_LOGGED_UNKNOWN = 1000
_logged_unknown: set[str] = set()


def log_unknown_fields(model: BaseModel, where: str) -> None:
    """Log (once per field name and place, as a warning) the unknown fields of ``model``, which
    are accepted and ignored; at most ``MAX_LOGGED_UNKNOWN`` names, so that clients sending
    ever new names cannot grow the set without bound."""
    for name in model.model_extra or {}:
        key = f"{where}.{name}"
        if key in _logged_unknown or len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
            continue
        _logged_unknown.add(key)
        if len(_logged_unknown) > MAX_LOGGED_UNKNOWN:
            logger.warning("too many unknown request fields: no longer logging new ones")
        else:
            shown = name if len(name) <= 64 else name[:64] + "..."
            logger.warning("ignoring the unknown request field %r (in %s)", shown, where)


def _check_table(
    extra: dict[str, Any], table: dict[str, tuple[Callable[[Any], bool], str]]
) -> None:
    for name, (asks, why) in table.items():
        if name in extra and asks(extra[name]):
            raise APIError(400, f"{name}: {why}", param=name)


def check_embedding_fields(req: BaseModel) -> None:
    """Refuse the known embeddings fields this server does not implement; log unknown ones.

    Raises:
        APIError: 400 naming the field (e.g. ``truncate_prompt_tokens``, never silently dropped).
    """
    _check_table(req.model_extra or {}, UNSUPPORTED_EMBEDDING_FIELDS)
    log_unknown_fields(req, "embeddings")


def check_common(req: CompletionRequest | ChatCompletionRequest, where: str) -> None:
    """The checks both generation endpoints share: unsupported known fields, ``stream_options``
    only with ``stream``, no ``best_of > n`` when streaming; logs unknown fields.

    Raises:
        APIError: 400 naming the offending field.
    """
    extra = req.model_extra or {}
    _check_table(extra, UNSUPPORTED_FIELDS)
    if isinstance(req, ChatCompletionRequest):
        _check_table(extra, UNSUPPORTED_CHAT_FIELDS)
    if req.stream_options is not None:
        if not req.stream:
            raise APIError(
                400,
                "stream_options is only allowed when stream is true",
                param="stream_options",
            )
        if req.stream_options.continuous_usage_stats:
            raise APIError(
                400,
                "stream_options.continuous_usage_stats is not supported",
                param="stream_options",
            )
    if req.stream and req.use_beam_search:
        raise APIError(
            400,
            "stream is not supported with use_beam_search: the best beams are known only at "
            "the end; drop stream",
            param="stream",
        )
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError(
            400,
            f"best_of ({req.best_of}) > n ({req.n}) cannot be streamed: the best candidates "
            "are known only at the end; drop stream or set best_of = n",
            param="best_of",
        )
    log_unknown_fields(req, where)
    if req.stream_options is not None:
        log_unknown_fields(req.stream_options, f"{where}.stream_options")


def check_messages(messages: list[ChatMessage], where: str) -> None:
    """Roles and contents of chat messages: a known role, a content on every message (null is
    OpenAI's form only for an assistant message with tool calls), well-formed tool calls and
    tool messages (``tool_calls/template.py``); logs unknown message fields.

    Raises:
        APIError: 400 (``param="messages"``) naming the message and the problem.
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise APIError(
                400,
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {m.role!r}",
                param="messages",
            )
        calls = tool_message_fields(m, i).get("tool_calls")
        if m.content is None and not calls:
            raise APIError(
                400,
                f"messages[{i}].content must be a string or a list of text parts (null is "
                "only valid on an assistant message with tool calls)",
                param="messages",
            )
        log_unknown_fields(m, f"{where}.messages")


def check_generation_prompt(
    add_generation_prompt: bool, continue_final_message: bool, fields_set: set[str]
) -> bool:
    """The ``add_generation_prompt`` to render with: ``continue_final_message`` continues the
    last message, so no generation prompt is added unless explicitly asked, which is an error.

    Raises:
        APIError: 400 (``param="continue_final_message"``) when both are explicitly true.
    """
    if not continue_final_message:
        return add_generation_prompt
    if add_generation_prompt and "add_generation_prompt" in fields_set:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true (set "
            "add_generation_prompt to false to continue the last message)",
            param="continue_final_message",
        )
    return False
