"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API, text in and
text out, over the chat template.

The conversation is ``instructions`` (a system message, not carried to later turns, as OpenAI
does), then the messages of the ``previous_response_id`` chain, then ``input``; it is rendered
with the chat template (``chat_render``) into one engine request. A stored response (``store``,
default true) keeps its conversation plus its reply in a bounded in-memory LRU
(``ResponseStore``, ``MAX_STORED_RESPONSES`` entries; the least recently used is dropped); an
unknown or dropped id is a 404 (code ``previous_response_not_found`` for
``previous_response_id``), as OpenAI answers.

Streaming sends the Responses events (``event: <type>`` + ``data: <json>``, each with a
``sequence_number``): ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``
(one per new text), ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut the text; an ``error`` event when the engine failed). Tools, non-text
formats and ``background`` are refused with a 400 naming the field.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.engine.async_engine import RequestStream
from pagedllm.entrypoints.openai.chat_render import render_messages
from pagedllm.entrypoints.openai.errors import APIError, engine_failure, value_error
from pagedllm.entrypoints.openai.protocol import ChatMessage, ResponsesRequest
from pagedllm.entrypoints.openai.serving_common import (
    MAX_TEMPERATURE,
    OpenAIServing,
    RequestContext,
    merge,
)
from pagedllm.entrypoints.openai.validation import log_unknown_fields
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

#: Most responses kept for ``previous_response_id`` / GET (least recently used dropped first).
MAX_STORED_RESPONSES = 1000
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponseStore:
    """Stored responses by id: the response body and the conversation that led to it plus its
    reply (``[{"role", "content"}]``), in an LRU bounded to ``capacity`` entries.

    Args:
        capacity: most responses kept (>= 1).
    """

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, str]]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict[str, Any], conversation: list[dict[str, str]]) -> None:
        """Keep ``body`` (its ``id``) and its conversation; drops the least recently used."""
        self._items[body["id"]] = (body, conversation)
        self._items.move_to_end(body["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
        """(body, conversation) of a stored response (now the most recently used), or None."""
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item


def _item_text(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not content:
            raise APIError(400, f"input[{i}].content is an empty array", param="input")
        texts = []
        for part in content:
            if not (
                isinstance(part, dict)
                and part.get("type") in _TEXT_PARTS
                and isinstance(part.get("text"), str)
            ):
                raise APIError(
                    400, f"input[{i}].content: only text parts are supported", param="input"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(400, f"input[{i}].content must be a string or a list of parts", param="input")


# Roles of a Responses input message (tool results come as function_call_output items there,
# which this server does not take, so chat's "tool" / "function" roles are not among them).
RESPONSES_ROLES = ("system", "developer", "user", "assistant")


def input_messages(value: str | list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """``input`` as ``[{"role", "content"}]`` messages.

    Raises:
        APIError: 400 (``param="input"``): missing, empty, an item that is not a text message.
    """
    if value is None or value == "" or value == []:
        raise APIError(400, "input is required (a string or a list of messages)", param="input")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    out = []
    for i, item in enumerate(value):
        if item.get("type", "message") != "message":
            raise APIError(
                400,
                f"input[{i}].type {item.get('type')!r} is not supported (only messages)",
                param="input",
            )
        role = item.get("role")
        if role not in RESPONSES_ROLES:
            raise APIError(
                400, f"input[{i}].role must be one of {', '.join(RESPONSES_ROLES)}", param="input"
            )
        out.append({"role": str(role), "content": _item_text(item, i)})
    return out


def _check_unsupported(req: ResponsesRequest) -> None:
    """Raises: APIError 400 naming a field this server cannot honour."""
    if req.tools:
        raise APIError(400, "tools are not supported on /v1/responses", param="tools")
    fmt = (req.text or {}).get("format") or {}
    if fmt and fmt.get("type") != "text":
        raise APIError(400, "text.format: only 'text' is supported", param="text")
    if req.background:
        raise APIError(400, "background responses are not supported", param="background")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise APIError(
            400,
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {req.temperature}",
            param="temperature",
        )


async def create_response(
    serving: OpenAIServing, store: ResponseStore, req: ResponsesRequest, raw: Request
) -> Response:
    """Serve one ``POST /v1/responses`` (JSON body or the Responses event stream).

    Raises:
        APIError: 400 invalid request, 404 unknown model or ``previous_response_id``, 5xx engine
            failure.
    """
    arrival = time.monotonic()
    serving.check_model(req.model)
    log_unknown_fields(req, "responses")
    _check_unsupported(req)
    history: list[dict[str, str]] = []
    if req.previous_response_id is not None:
        found = store.get(req.previous_response_id)
        if found is None:
            raise APIError(
                404,
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = list(found[1])
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    try:
        ids = await serving.off_loop(
            render_messages,
            serving.tokenizer,
            [ChatMessage.model_validate(m) for m in system + conversation],
            True,
            False,
        )
    except APIError as e:
        if e.param == "messages":  # the conversation is this API's ``input``
            e.param = "input"
            e.message = e.message.replace("messages", "input", 1)
        raise
    rename = {"prompt": "input", "max_tokens": "max_output_tokens"}
    try:
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=req.max_output_tokens,
        )
    except ValueError as e:
        raise value_error(e, rename) from None
    rid = f"resp_{uuid.uuid4().hex}"
    streams = await serving.add_all(
        rid, [ids], [params], arrival, rename, cache_salt=req.cache_salt
    )
    return await ResponsesContext(serving, store, req, rid, ids, conversation).respond(streams, raw)


class ResponsesContext(RequestContext):
    """The answer of one Responses request: the response object, or its event stream."""

    req: ResponsesRequest

    def __init__(
        self,
        serving: OpenAIServing,
        store: ResponseStore,
        req: ResponsesRequest,
        rid: str,
        prompt_ids: list[int],
        conversation: list[dict[str, str]],
    ) -> None:
        super().__init__(serving, req, rid, len(prompt_ids))
        self.store = store
        self.conversation = conversation
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.seq = 0

    def response_object(self, final: RequestOutput | None, text: str) -> dict[str, Any]:
        """The response object: in progress (``final`` None) or finished with ``text``."""
        c = final.outputs[0] if final is not None else None
        done = c is not None and c.finish_reason is not None
        cut = done and c is not None and c.finish_reason == "length"
        status = "in_progress" if not done else ("incomplete" if cut else "completed")
        output = []
        if done:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            output.append(
                {
                    "type": "message",
                    "id": self.item_id,
                    "status": status,
                    "role": "assistant",
                    "content": [part],
                }
            )
        req = self.req
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "metadata": req.metadata or {},
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "user": req.user,
            "usage": None,
        }
        if final is not None and done:
            n_out = len(final.outputs[0].token_ids)
            body["usage"] = {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + n_out,
            }
        return body

    def finish(self, final: RequestOutput) -> dict[str, Any]:
        """The finished response object, stored when ``store``."""
        text = final.outputs[0].text
        body = self.response_object(final, text)
        if self.req.store:
            reply = {"role": "assistant", "content": text}
            self.store.put(body, [*self.conversation, reply])
        return body

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return self.finish(finals[0])

    def event(self, type_: str, **fields: Any) -> str:
        """One Responses SSE event (``event:`` line and JSON ``data:`` with its number)."""
        data = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The Responses events (see the module docstring); closing it aborts the request."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        item = {
            "type": "message",
            "id": self.item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        sent = 0
        try:
            yield self.event("response.created", response=self.response_object(None, ""))
            yield self.event("response.in_progress", response=self.response_object(None, ""))
            yield self.event("response.output_item.added", output_index=0, item=item)
            yield self.event("response.content_part.added", **where, part=empty_part)
            final: RequestOutput | None = None
            async for _, out in merge(streams):
                self.observe(0, out, [None])
                text = out.outputs[0].text
                if len(text) > sent:
                    yield self.event(
                        "response.output_text.delta", **where, delta=text[sent:], logprobs=[]
                    )
                    sent = len(text)
                if out.finished:
                    final = out
            assert final is not None
            body = self.finish(final)
            text = final.outputs[0].text
            yield self.event("response.output_text.done", **where, text=text, logprobs=[])
            part = body["output"][0]["content"][0]
            yield self.event("response.content_part.done", **where, part=part)
            yield self.event("response.output_item.done", output_index=0, item=body["output"][0])
            kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
            yield self.event(kind, response=body)
        except Exception as e:
            err = e if isinstance(e, APIError) else engine_failure(e)
            yield self.event("error", code=err.code, message=err.message, param=err.param)
        finally:
            for s in streams:
                s.close()


def get_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """A stored response's object.

    Raises:
        APIError: 404 when it was not stored or was dropped from the LRU.
    """
    found = store.get(response_id)
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return found[0]
