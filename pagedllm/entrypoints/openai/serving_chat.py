"""``POST /v1/chat/completions``: messages rendered with the model's chat template
(``chat_render.py``), text-only content, chat logprobs, ``echo`` and SSE streaming.

``response_format`` / ``structured_outputs`` / ``guided_*`` constrain the reply
(``structured.py``); tool calling (``tools``, ``tool_choice``, legacy ``functions``) is in
``tool_calls/``. Refused with 400 (no support in the engine): non-text content parts, and the
fields and messages ``validation.py`` refuses (unknown roles, null contents, ``stream_options``
without ``stream``, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.chat_render import message_text, render_request_messages
from pagedllm.entrypoints.openai.errors import APIError, value_error
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_common import (
    ChoiceState,
    OpenAIServing,
    RequestContext,
)
from pagedllm.entrypoints.openai.structured import structured_field
from pagedllm.entrypoints.openai.tool_calls.schema import resolve_tools
from pagedllm.entrypoints.openai.tool_calls.serving import ToolOutput
from pagedllm.entrypoints.openai.tool_calls.serving import setup as tool_setup
from pagedllm.entrypoints.openai.validation import (
    check_common,
    check_messages,
)
from pagedllm.outputs import CompletionOutput, RequestOutput


def _check_unsupported(req: ChatCompletionRequest) -> None:
    """Raises: APIError 400 naming a field this server cannot honour."""
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
    check_messages(req.messages, "chat")
    check_common(req, "chat")
    _check_unsupported(req)
    tool_config = resolve_tools(req)
    serving.check_request_template(req.chat_template)
    ids = await serving.off_loop(
        render_request_messages,
        serving.tokenizer,
        req,
        tool_config.tools if tool_config.active else None,
    )
    max_tokens: int | None
    if req.max_completion_tokens is not None:
        max_tokens, mt_name = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, mt_name = req.max_tokens, "max_tokens"
    rename = {
        "prompt": "messages",
        "logprobs": "top_logprobs",
        "max_tokens": mt_name,
        "structured_outputs": structured_field(req),
    }
    if tool_config.forced and rename["structured_outputs"] == "structured_outputs":
        # the grammar of a forced call comes from the tools' parameter schemas
        legacy = (req.model_extra or {}).get("functions") is not None
        rename["structured_outputs"] = "functions" if legacy else "tools"
    try:
        params = serving.sampling_params(
            req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None
        )
    except ValueError as e:
        raise value_error(e, rename) from None
    params, tool_parser = tool_setup(
        tool_config, params, serving.tool_call_parser, serving.tokenizer
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await serving.add_all(
        request_id,
        [ids],
        [params],
        arrival,
        rename,
        priority=req.priority,
        timeout=req.timeout,
        cache_salt=req.cache_salt,
    )
    ctx = ChatContext(serving, req, ids, request_id)
    if tool_parser is not None:
        ctx.tools = ToolOutput(tool_parser, tool_config.parallel)
    return await ctx.respond(streams, raw)


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
        #: ``echo``: the last message's content when it is the assistant's (as vLLM does).
        self.echo = ""
        #: The tool calls of the choices, when the model may call tools.
        self.tools: ToolOutput | None = None
        last = req.messages[-1]
        if req.echo and last.role == "assistant":
            self.echo = message_text(last, len(req.messages) - 1)

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for c in sorted(finals[0].outputs, key=lambda c: c.index):
            lp = None
            if self.k is not None:
                lp = {"content": self.tokens.chat_logprobs(c.token_ids, c.logprobs or [], self.k)}
            message: dict[str, Any] = {"role": "assistant", "content": self.echo + c.text}
            finish = c.finish_reason
            if self.tools is not None:
                message, finish = self.tools.message(c.text, self.echo, finish)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
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
                "delta": {"role": "assistant", "content": self.echo},
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
        delta: dict[str, Any] = {"content": new_text} if new_text else {}
        finish = c.finish_reason
        if self.tools is not None:
            delta, finish = self.tools.delta(c.index, c.text, finish)
        if not delta and not finished and not want_lp:
            return None
        lp = None
        if self.k is not None:
            lp = {"content": self.tokens.chat_logprobs(new_ids, new_entries, self.k)}
        st.commit(c)
        choice: dict[str, Any] = {
            "index": c.index,
            "delta": delta,
            "logprobs": lp,
            "finish_reason": finish if finished else None,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(new_ids)
        if finished:
            choice["stop_reason"] = c.stop_reason
            st.done = True
        return choice
