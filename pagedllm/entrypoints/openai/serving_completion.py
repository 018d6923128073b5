"""``POST /v1/completions``: text (or token-id) prompts, several per request, with ``echo``,
legacy logprobs and SSE streaming.

``max_tokens`` defaults to OpenAI's 16, cut to the room the prompt leaves; ``max_tokens=0`` is
allowed with ``echo`` (the prompt alone, with its logprobs when asked). ``suffix`` is refused.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import APIError, value_error
from pagedllm.entrypoints.openai.logprobs import empty_legacy_logprobs
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_common import (
    ChoiceState,
    OpenAIServing,
    RequestContext,
)
from pagedllm.entrypoints.openai.structured import structured_field
from pagedllm.entrypoints.openai.validation import check_common
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

#: OpenAI's default ``max_tokens`` of a completion.
DEFAULT_MAX_TOKENS = 16


async def _pool_room(serving: OpenAIServing, ids: list[int], params: SamplingParams) -> int:
    """The most output tokens the engine would give ``ids`` with ``params`` and no
    ``max_tokens`` (the KV pool may hold less than ``max_model_len``; under data parallel a
    replica tells), a large number when no engine can tell (no replica answers), 1 when it
    refuses the request (the request itself then fails with the engine's reason, e.g. ``n``
    samples that do not fit, not with a ``max_tokens`` the client never sent)."""
    probe = params.clone()
    probe.max_tokens = None
    try:
        room = await serving.async_engine.validate_request_async(ids, probe)
    except ValueError:
        return 1
    return room or sys.maxsize


def parse_prompts(serving: OpenAIServing, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """``(text or None, token ids)`` of each prompt of ``prompt`` (a string, a list of ids, or a
    list of either).

    Raises:
        APIError: 400 (``param="prompt"``) when it is missing or a prompt is empty.
    """
    if prompt is None:
        raise APIError(400, "prompt is required", param="prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    elif all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    out: list[tuple[str | None, list[int]]] = []
    for p in items:
        if isinstance(p, str):
            out.append((p, serving.tokenize(p) if p else []))
        else:
            out.append((None, list(p)))
        if not out[-1][1]:
            raise APIError(400, "prompt must not be empty", param="prompt")
    return out


async def create_completion(
    serving: OpenAIServing, req: CompletionRequest, raw: Request
) -> Response:
    """Serve one ``/v1/completions`` request (JSON body or SSE stream).

    Raises:
        APIError: 400 invalid request, 404 unknown model, 5xx engine failure.
    """
    arrival = time.monotonic()
    serving.check_model(req.model)
    check_common(req, "completions")
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = await serving.off_loop(parse_prompts, serving, req.prompt)
    echo_only = False
    max_tokens = req.max_tokens
    if max_tokens == 0:
        if not req.echo:
            raise APIError(
                400,
                "max_tokens must be >= 1 (0 is allowed only with echo=true)",
                "invalid_request_error",
                "max_tokens",
            )
        if req.min_tokens:
            raise APIError(400, "min_tokens must be <= max_tokens (0)", param="min_tokens")
        # Echo of the prompt alone: run one step for the prompt logprobs, drop the token.
        echo_only, max_tokens = True, 1
    want_plp = req.echo and req.logprobs is not None
    rename = {"prompt_logprobs": "logprobs", "structured_outputs": structured_field(req)}
    try:
        params = serving.sampling_params(
            req, max_tokens, req.logprobs, req.logprobs if want_plp else None
        )
    except ValueError as e:
        raise value_error(e, rename) from None
    per_prompt = []
    max_model_len = serving.async_engine.max_model_len
    for _, ids in prompts:
        sp = params.clone()
        if "max_tokens" not in req.model_fields_set:
            # The default, cut to the room the prompt leaves in the context and in the KV pool
            # (at least 1, so that a prompt that fills either still gets its error).
            room = min(max_model_len - len(ids), await _pool_room(serving, ids, sp))
            sp.max_tokens = max(1, min(sp.max_tokens or DEFAULT_MAX_TOKENS, room))
        per_prompt.append(sp)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await serving.add_all(
        request_id,
        [ids for _, ids in prompts],
        per_prompt,
        arrival,
        rename,
        priority=req.priority,
        timeout=req.timeout,
        cache_salt=req.cache_salt,
    )
    ctx = CompletionContext(serving, req, prompts, echo_only, request_id)
    return await ctx.respond(streams, raw)


class CompletionContext(RequestContext):
    """The answer of one completions request (all its prompts)."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    req: CompletionRequest

    def __init__(
        self,
        serving: OpenAIServing,
        req: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        echo_only: bool,
        request_id: str,
    ) -> None:
        super().__init__(serving, req, request_id, sum(len(ids) for _, ids in prompts))
        self.prompts = prompts
        self.echo_only = echo_only
        self.counts_outputs = not echo_only
        self.k = req.logprobs

    def prompt_text(self, i: int) -> str:
        """The text of prompt ``i`` (decoded when it was given as token ids)."""
        text, ids = self.prompts[i]
        return text if text is not None else str(self.serving.tokenizer.decode(ids))

    def _choice(
        self, i: int, out: RequestOutput, c: CompletionOutput, st: ChoiceState, final: bool
    ) -> dict[str, Any] | None:
        """The text / logprobs of choice ``c`` not yet sent (all of it when ``final``)."""
        want_lp = self.k is not None
        text = ""
        acc: dict[str, list] | None = None
        if self.req.echo and not st.echoed:
            if want_lp and out.prompt_logprobs is None and not final:
                return None  # prompt logprobs not complete yet (chunked prefill)
            text += self.prompt_text(i)
            if want_lp:
                # A request that ended before its prefill did (aborted, failed) has none: its
                # prompt tokens are echoed with null logprobs.
                entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                acc, st.offset = self.tokens.legacy_logprobs(
                    out.prompt_token_ids, list(entries), self.k or 0, st.offset
                )
            st.echoed = True
        finished = c.finish_reason is not None
        new_ids: list[int] = []
        if self.echo_only:
            finish_reason: str | None = "length"
            stop_reason = None
        else:
            new_text, new_ids, new_entries = st.pending(c)
            if not text and not new_text and not finished and not (want_lp and new_ids):
                return None
            text += new_text
            if want_lp and new_ids:
                acc, st.offset = self.tokens.legacy_logprobs(
                    new_ids, new_entries, self.k or 0, st.offset, acc
                )
            st.commit(c)
            finish_reason, stop_reason = (
                (c.finish_reason, c.stop_reason) if finished else (None, None)
            )
        if finish_reason is not None:
            st.done = True
        choice: dict[str, Any] = {
            "index": i * self.n + c.index,
            "text": text,
            "logprobs": (acc or empty_legacy_logprobs()) if want_lp else None,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(new_ids)
            if final:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def stream_choice(
        self, i: int, out: RequestOutput, c: CompletionOutput, st: ChoiceState
    ) -> dict[str, Any] | None:
        return self._choice(i, out, c, st, final=False)

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ch = self._choice(i, out, c, ChoiceState(), final=True)
                assert ch is not None
                choices.append(ch)
        choices.sort(key=lambda ch: ch["index"])
        return self.body(choices, finals)
