"""``POST /v1/chat/completions``: messages rendered with the model's chat template, text-only
content, chat logprobs and SSE streaming.

Refused with 400 (no support in the engine): non-text content parts, ``response_format`` other
than ``text``, ``tools`` unless ``tool_choice="none"``, ``tool_choice`` ``required`` or a
function.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.llm import apply_chat_template
from pagedllm.entrypoints.openai.errors import APIError, value_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_common import (
    ChoiceState,
    OpenAIServing,
    RequestContext,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The ``{"role", "content"[, "name"]}`` dicts the chat template takes (text parts of a
    content list joined with newlines).

    Raises:
        APIError: 400 (``param="messages"``) for a content part that is not text.
    """
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise APIError(
                        400,
                        f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                        param="messages",
                    )
                texts.append(part.text)
            content = "\n".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def render_messages(
    serving: OpenAIServing,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template.

    Raises:
        APIError: 400 for an empty list, a non-text part, or what the template refuses.
    """
    if not messages:
        raise APIError(400, "messages must not be empty", param="messages")
    try:
        return apply_chat_template(
            serving.tokenizer,
            message_dicts(messages),
            add_generation_prompt,
            continue_final_message,
        )
    except ValueError as e:
        raise value_error(e) from None


def _check_unsupported(req: ChatCompletionRequest) -> None:
    """Raises: APIError 400 naming a field this server cannot honour."""
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(
            400,
            f"response_format {req.response_format.type!r} is not supported (no guided "
            "decoding); use 'text'",
            param="response_format",
        )
    if req.tools and req.tool_choice != "none":
        raise APIError(
            400,
            "tools are not supported by this server (use tool_choice='none')",
            param="tools",
        )
    if isinstance(req.tool_choice, dict) or req.tool_choice == "required":
        raise APIError(400, "tool_choice requires tool support", param="tool_choice")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")


async def create_chat_completion(
    serving: OpenAIServing, req: ChatCompletionRequest, raw: Request
) -> Response:
    """Serve one ``/v1/chat/completions`` request (JSON body or SSE stream).

    Raises:
        APIError: 400 invalid or unsupported request, 404 unknown model, 5xx engine failure.
    """
    arrival = time.monotonic()
    serving.check_model(req.model)
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    _check_unsupported(req)
    ids = render_messages(
        serving, req.messages, req.add_generation_prompt, req.continue_final_message
    )
    max_tokens: int | None
    if req.max_completion_tokens is not None:
        max_tokens, mt_name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, mt_name = req.max_tokens, "max_tokens"
    rename = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": mt_name}
    try:
        params = serving.sampling_params(
            req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None
        )
    except ValueError as e:
        raise value_error(e, rename) from None
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.add_all(request_id, [ids], [params], arrival, rename)
    return await ChatContext(serving, req, ids, request_id).respond(streams, raw)


class ChatContext(RequestContext):
    """The answer of one chat request (one engine request with ``n`` samples)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    req: ChatCompletionRequest

    def __init__(
        self, serving: OpenAIServing, req: ChatCompletionRequest, prompt_ids: list[int], rid: str
    ) -> None:
        super().__init__(serving, req, rid, len(prompt_ids))
        self.prompt_ids = prompt_ids
        self.k = (req.top_logprobs or 0) if req.logprobs else None

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for c in sorted(finals[0].outputs, key=lambda c: c.index):
            lp = None
            if self.k is not None:
                lp = {"content": self.tokens.chat_logprobs(c.token_ids, c.logprobs or [], self.k)}
            choices.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            if self.req.return_token_ids:
                choices[-1]["token_ids"] = list(c.token_ids)
        resp = self.body(choices, finals)
        if self.req.return_token_ids:
            resp["prompt_token_ids"] = list(self.prompt_ids)
        return resp

    def first_chunks(self) -> list[dict[str, Any]]:
        return [
            {
                "index": j,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for j in range(self.n)
        ]

    def stream_choice(
        self, i: int, out: RequestOutput, c: CompletionOutput, st: ChoiceState
    ) -> dict[str, Any] | None:
        new_text, new_ids, new_entries = st.pending(c)
        finished = c.finish_reason is not None
        want_lp = self.k is not None and bool(new_ids)
        if not new_text and not finished and not want_lp:
            return None
        lp = None
        if self.k is not None:
            lp = {"content": self.tokens.chat_logprobs(new_ids, new_entries, self.k)}
        st.commit(c)
        choice: dict[str, Any] = {
            "index": c.index,
            "delta": {"content": new_text} if new_text else {},
            "logprobs": lp,
            "finish_reason": c.finish_reason if finished else None,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(new_ids)
        if finished:
            choice["stop_reason"] = c.stop_reason
            st.done = True
        return choice
