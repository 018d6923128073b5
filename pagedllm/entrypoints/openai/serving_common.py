"""What /v1/completions and /v1/chat/completions share: engine access, sampling parameters,
request fan-out, and the response builder (JSON body or SSE stream).

A request with several prompts (completions) becomes one engine request per prompt; ``n`` /
``best_of`` fan out inside the engine (one ``RequestOutput`` with ``n`` completions). Choice
``index`` is ``prompt_index * n + completion_index``. A streamed response is ``data: <chunk>``
events ending with ``data: [DONE]``; an error after the stream started is sent as a
``data: {"error": ...}`` event before ``[DONE]``. A client that disconnects aborts its requests
(the stream is cancelled, or ``collect`` notices within 0.5 s and answers 499).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import TIMEOUT_FINISH_REASON, AsyncLLMEngine, RequestStream
from pagedllm.entrypoints.openai.errors import APIError, engine_failure, value_error
from pagedllm.entrypoints.openai.logprobs import TokenFormatter
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.structured import structured_outputs_from_request
from pagedllm.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

_T = TypeVar("_T")

#: Highest temperature accepted (OpenAI's limit).
MAX_TEMPERATURE = 2.0
#: Seconds between two checks that a non-streaming client is still connected.
DISCONNECT_POLL_S = 0.5

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


#: Characters JSON leaves raw that Python's ``str.splitlines`` (and clients built on it, such as
#: httpx's ``iter_lines``) take for line ends, cutting an event's JSON in two.
_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON, on one line for every line
    splitter (U+0085, U+2028 and U+2029 escaped as ``\\uXXXX``; the parsed value is unchanged)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text.translate(_LINE_BREAKS_JSON_KEEPS)}\n\n"


def usage_body(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
    """The ``usage`` object (token counts; ``cached`` prompt tokens came from the prefix cache)."""
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def timed_out_empty(finals: list[RequestOutput]) -> bool:
    """Whether the request's deadline passed before any token was generated (with some tokens,
    the answer carries them with ``finish_reason: "timeout"``)."""
    outputs = [c for o in finals for c in o.outputs]
    return any(c.finish_reason == TIMEOUT_FINISH_REASON for c in outputs) and not any(
        c.token_ids for c in outputs
    )


def check_timed_out(finals: list[RequestOutput]) -> None:
    """Raises: APIError 504 ``request_timeout`` when ``timed_out_empty(finals)``."""
    if timed_out_empty(finals):
        raise APIError(
            504,
            "the request's timeout passed before any token was generated",
            "timeout_error",
            param="timeout",
            code="request_timeout",
        )


class ClientGone(Exception):
    """The client of a non-streaming request disconnected before the answer was ready."""


class OpenAIServing:
    """Per-app state and helpers of the generation endpoints, over the engine's public API.

    Args:
        async_engine: the engine (only its public members are used).
        served_model_name: the name (or names) accepted in ``model``; the first is reported.
    """

    def __init__(self, async_engine: AsyncLLMEngine, served_model_name: str | list[str]) -> None:
        self.async_engine = async_engine
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        self.model_names = list(names)
        self.model_name = self.model_names[0]
        #: The ``created`` time of the model cards (when the server started serving).
        self.created = int(time.time())
        self.tokenizer = async_engine.tokenizer
        self.tokens = TokenFormatter(self.tokenizer)
        self.metrics = ServerMetrics(async_engine, self.model_name)
        #: ``--tool-call-parser`` (None: chosen from the chat template).
        self.tool_call_parser: str | None = None
        #: ``--trust-request-chat-template``: a request may bring its own ``chat_template``.
        self.trust_request_chat_template = False
        # Chat rendering and prompt tokenization run here, one at a time, so that a long
        # render never stalls the event loop (/health, streams, other requests).
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-prompt")

    async def off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the prompt thread (chat rendering, tokenization), awaited; its
        exception is raised here."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._prompt_thread, functools.partial(fn, *args))

    def close(self) -> None:
        """Stop the prompt thread once its current job ends; queued jobs are cancelled."""
        self._prompt_thread.shutdown(wait=False, cancel_futures=True)

    def check_request_template(self, template: str | None) -> None:
        """Raises: APIError 400 naming ``chat_template`` when a request brings its own template
        and the server does not trust them (a Jinja template runs code on the server: string
        repetition alone can make it render for minutes), or brings an empty one."""
        if template is None:
            return
        if not self.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template: this server does not accept a chat template in the request "
                "(start it with --trust-request-chat-template to allow one)",
                param="chat_template",
            )
        if not template.strip():
            raise APIError(400, "chat_template must not be empty", param="chat_template")

    def check_model(self, model: str | None) -> None:
        """Raises: APIError 404 ``model_not_found`` when ``model`` is given and not served."""
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {self.model_names}.",
                param="model",
                code="model_not_found",
            )

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens unless told otherwise)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The ``SamplingParams`` of a request (unset fields get the engine's defaults).

        Raises:
            ValueError: naming the field (temperature over ``MAX_TEMPERATURE``, or any value
                ``SamplingParams`` rejects).
        """

        def d(v: Any, default: Any) -> Any:
            return default if v is None else v

        # The OpenAI API's range, narrower than the engine's (which accepts any finite value).
        if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE}], got {req.temperature}"
            )

        return SamplingParams(
            n=req.n,
            best_of=req.best_of,
            presence_penalty=d(req.presence_penalty, 0.0),
            frequency_penalty=d(req.frequency_penalty, 0.0),
            repetition_penalty=d(req.repetition_penalty, 1.0),
            temperature=d(req.temperature, 1.0),
            top_p=d(req.top_p, 1.0),
            top_k=d(req.top_k, 0),
            min_p=d(req.min_p, 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            logit_bias=req.logit_bias,  # type: ignore[arg-type]  # str keys are parsed
            use_beam_search=req.use_beam_search,
            length_penalty=req.length_penalty,
            early_stopping=req.early_stopping,
            structured_outputs=structured_outputs_from_request(req),
            num_speculative_tokens=req.num_speculative_tokens,
        )

    async def add_all(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        rename: dict[str, str],
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestStream]:
        """Validate every prompt, then queue one engine request per prompt
        (``{request_id}-{i}``) with the request's ``priority``, ``timeout`` and ``cache_salt``;
        all or nothing.

        Raises:
            APIError: 400 for an invalid request (``param`` renamed by ``rename``), 5xx when the
                engine cannot take it.
        """
        try:
            for sp in params:  # compile off the event loop (cached) before validating
                await self.async_engine.compile_structured(sp.structured_outputs)
            for ids, sp in zip(prompts, params, strict=True):
                self.async_engine.validate_request(ids, sp)
        except ValueError as e:
            raise value_error(e, rename) from None
        streams: list[RequestStream] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                streams.append(
                    await self.async_engine.add_request(
                        f"{request_id}-{i}",
                        ids,
                        sp,
                        arrival,
                        priority=priority,
                        timeout=timeout,
                        cache_salt=cache_salt,
                    )
                )
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, ValueError):
                raise value_error(e, rename) from None
            if isinstance(e, Exception):
                raise engine_failure(e) from None
            raise
        return streams


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's position; closes
    (aborts) every stream when the consumer stops early.

    Raises:
        whatever a stream raises (``EngineStepError``, ``EngineDeadError``, ...).
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out, None))
            q.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await q.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.close()


class ChoiceState:
    """How much of one choice a stream has sent: characters, tokens, and whether it is done."""

    __slots__ = ("text", "tokens", "done", "echoed", "offset")

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.done = False
        self.echoed = False  # completions: the echoed prompt was sent
        self.offset = 0  # completions logprobs: text offset of the next token

    def pending(self, c: CompletionOutput) -> tuple[str, list[int], list[PositionLogprobs]]:
        """The text, token ids and logprobs entries of ``c`` not sent yet."""
        return c.text[self.text :], c.token_ids[self.tokens :], (c.logprobs or [])[self.tokens :]

    def commit(self, c: CompletionOutput) -> None:
        """Mark everything of ``c`` so far as sent."""
        self.text, self.tokens = len(c.text), len(c.token_ids)


class RequestContext:
    """Builds one request's answer: the JSON body, or its SSE stream of chunks.

    Subclasses set ``object_name`` / ``chunk_object_name`` and implement ``full_response`` and
    ``stream_choice`` (plus ``first_chunks`` when the stream opens with chunks of its own).

    Args:
        serving: the app's ``OpenAIServing``.
        req: the request body.
        rid: the response ``id``.
        num_prompt_tokens: prompt tokens of all its prompts (for ``usage``).
    """

    object_name = ""
    chunk_object_name = ""
    #: Whether generated tokens count as ``completion_tokens`` (not for an echo of the prompt).
    counts_outputs = True

    def __init__(
        self,
        serving: OpenAIServing,
        req: CompletionRequest | ChatCompletionRequest | Any,
        rid: str,
        num_prompt_tokens: int,
    ) -> None:
        self.serving = serving
        self.tokens = serving.tokens
        self.req = req
        self.id = rid
        self.created = int(time.time())
        self.model = serving.model_name
        self.n = getattr(req, "n", 1)  # 1 for the embeddings / responses bodies
        self.num_prompt_tokens = num_prompt_tokens
        self._seen: set[int] = set()  # requests (prompt positions) with an output so far

    # ---- hooks ---------------------------------------------------------------------------
    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streaming body of the finished requests."""
        raise NotImplementedError

    def stream_choice(
        self, i: int, out: RequestOutput, c: CompletionOutput, st: ChoiceState
    ) -> dict[str, Any] | None:
        """The chunk choice of what ``c`` (of prompt ``i``) has new, or None when nothing."""
        raise NotImplementedError

    def first_chunks(self) -> list[dict[str, Any]]:
        """Chunk choices sent before any output (none by default)."""
        return []

    # ---- shared --------------------------------------------------------------------------
    def usage(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """The ``usage`` object of the finished requests (cached: prefix-cache hits, tokens)."""
        n_out = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return usage_body(
            self.num_prompt_tokens,
            n_out if self.counts_outputs else 0,
            sum(o.num_cached_tokens for o in finals),
        )

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``: a last chunk carries the usage."""
        so = self.req.stream_options
        return bool(so and so.include_usage)

    def body(self, choices: list[dict[str, Any]], finals: list[RequestOutput]) -> dict[str, Any]:
        """The non-streaming envelope around ``choices``."""
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(finals),
            "system_fingerprint": None,
        }

    def chunk(self, choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
        """One stream chunk; ``usage`` is null on every chunk but the last when asked for."""
        d: dict[str, Any] = {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not ...:
            d["usage"] = usage
        elif self.include_usage:
            d["usage"] = None
        return d

    def observe(self, i: int, out: RequestOutput, finals: list[RequestOutput | None]) -> None:
        """Metrics of an output of request ``i`` (prompt tokens at its first output, latencies
        when finished); keeps the final output in ``finals``."""
        if i not in self._seen:
            self._seen.add(i)
            self.serving.metrics.observe_prefilled(out)
        if out.finished:
            finals[i] = out
            self.serving.metrics.observe_finished(out)

    async def respond(self, streams: list[RequestStream], raw: Request) -> Response:
        """The HTTP answer: an SSE stream when ``stream`` was asked, else the JSON body (499
        when the client left first).

        Raises:
            APIError: 5xx when the engine failed before the body was ready.
        """
        if getattr(self.req, "stream", False):
            return StreamingResponse(
                self.stream(streams), media_type="text/event-stream", headers=SSE_HEADERS
            )
        try:
            finals = await self.collect(streams, raw)
        except ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise engine_failure(e) from None
        check_timed_out(finals)
        return JSONResponse(self.full_response(finals))

    async def collect(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream; aborts them all if the client disconnects.

        Raises:
            ClientGone: the client disconnected.
        """
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume() -> None:
            async for i, out in merge(streams):
                self.observe(i, out, finals)

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    break
                if await raw.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                s.close()
        assert all(f is not None for f in finals)
        return finals  # type: ignore[return-value]

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        """The SSE events: chunks as outputs come, the usage chunk if asked, ``[DONE]``; an
        error becomes an error event. Closing it (client gone) aborts the requests."""
        states: dict[int, ChoiceState] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            for choice in self.first_chunks():
                yield sse(self.chunk([choice]))
            async for i, out in merge(streams):
                if not any(st.tokens for st in states.values()) and timed_out_empty([out]):
                    self.observe(i, out, finals)  # counted as finished, like a non-stream 504
                    check_timed_out([out])  # no token streamed: an error event, not a chunk
                for c in out.outputs:
                    st = states.setdefault(i * self.n + c.index, ChoiceState())
                    if st.done:
                        continue
                    ch = self.stream_choice(i, out, c, st)
                    if ch is not None:
                        yield sse(self.chunk([ch]))
                self.observe(i, out, finals)
            if self.include_usage:
                yield sse(self.chunk([], self.usage([f for f in finals if f is not None])))
        except Exception as e:
            err = e if isinstance(e, APIError) else engine_failure(e)
            yield sse(err.body())
        finally:
            for s in streams:
                s.close()
        yield SSE_DONE
