"""The OpenAI-compatible HTTP server: FastAPI app over an ``AsyncLLMEngine``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``,
``GET /version`` and FastAPI's ``/openapi.json`` / ``/docs``.

Every error is the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``: invalid
values are 400 with ``param`` naming the field (the engine and ``SamplingParams`` start their
messages with the field name), an unknown model 404, a prompt that does not fit 400 with code
``context_length_exceeded``, a missing / wrong API key 401, a body over the limit 413. An error
after a stream started is sent as a ``data: {"error": ...}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStepError,
    RequestAbortedError,
    RequestStream,
)
from pagedllm.engine.llm_engine import ContextLengthExceededError, LLMEngine
from pagedllm.entrypoints.llm import apply_chat_template
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagedllm.outputs import PositionLogprobs, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Highest temperature accepted (OpenAI's limit).
MAX_TEMPERATURE = 2.0
#: Logprobs of -inf (or NaN) are not JSON; they are reported as this value, as vLLM does.
MIN_LOGPROB = -9999.0
#: Paths that stay open when an API key is set (everything else needs it).
OPEN_PATHS = ("/health", "/version", "/metrics", "/openapi.json", "/docs", "/redoc")

_ERRORS = {400: ErrorResponse, 401: ErrorResponse, 404: ErrorResponse, 413: ErrorResponse}
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {k: {"model": v} for k, v in _ERRORS.items()}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pagedllm")
    except Exception:
        return "0.1.0"


# ---- errors ---------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_REQUEST_FIELDS = (
    set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | {"prompt", "prompt_logprobs", "use_beam_search", "tokens"}
)


def value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """Map an engine / ``SamplingParams`` ValueError to a 400 whose ``param`` is the field named
    first in the message (renamed to the request's own field name where they differ)."""
    rename = rename or {}
    msg = str(e)
    if isinstance(e, ContextLengthExceededError):
        return APIError(
            400, msg, param=rename.get(e.param, e.param), code="context_length_exceeded"
        )
    m = re.match(r"\s*([A-Za-z_]+)", msg)
    param = m.group(1) if m and m.group(1) in _REQUEST_FIELDS else None
    if param is not None:
        param = rename.get(param, param)
    return APIError(400, msg, param=param)


def _engine_failure(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, RequestAbortedError):
        return APIError(503, str(e), "server_error", code="request_aborted")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", code="engine_error")
    logger.exception("unexpected error while serving a request", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_SSE_DONE = "data: [DONE]\n\n"


def _lp(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB  # also maps NaN (all comparisons false)


# ---- byte-level tokens -> bytes --------------------------------------------------------------
def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable character map of byte-level BPE tokenizers: bytes that
    are printable stay themselves, the other 68 are shifted to code points 256 and up."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: b for b in keep}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()


# ---- the server ------------------------------------------------------------------------------
class _ClientGone(Exception):
    pass


class OpenAIServer:
    """Request handling shared by the routes (one per app)."""

    def __init__(
        self,
        async_engine: AsyncLLMEngine,
        served_model_name: str | list[str],
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.async_engine = async_engine
        self.engine: LLMEngine = async_engine.engine
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        self.model_names = list(names)
        self.model_name = self.model_names[0]
        self.max_body_bytes = max_body_bytes
        # The engine thread decodes with its tokenizer; the event loop gets its own copy.
        try:
            self.tokenizer = copy.deepcopy(self.engine.tokenizer)
        except Exception:
            self.tokenizer = self.engine.tokenizer
        self.metrics = ServerMetrics(self.engine, self.model_name)
        self._token_bytes: dict[int, list[int]] = {}
        self._token_str: dict[int, str] = {}

    # ---- helpers -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {self.model_names}.",
                param="model",
                code="model_not_found",
            )

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def token_str(self, tid: int, entry: PositionLogprobs | None = None) -> str:
        if entry is not None and tid in entry:
            decoded = entry[tid].decoded_token
            if decoded is not None:
                return decoded
        text = self._token_str.get(tid)
        if text is None:
            text = self._token_str[tid] = str(self.tokenizer.decode([tid]))
        return text

    def token_bytes(self, tid: int, text: str) -> list[int]:
        """Raw bytes of a token (byte-level BPE), else the UTF-8 of its text."""
        b = self._token_bytes.get(tid)
        if b is None:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
            b = list(text.encode("utf-8"))
            # A token holding part of a multi-byte character decodes to U+FFFD: give its raw bytes.
            if (
                "\ufffd" in text
                and isinstance(piece, str)
                and piece
                and all(c in _BYTE_OF_CHAR for c in piece)
            ):
                b = [_BYTE_OF_CHAR[c] for c in piece]
            self._token_bytes[tid] = b
        return b

    def sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
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
        )

    async def add_all(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        rename: dict[str, str],
    ) -> list[RequestStream]:
        """Validate every prompt, then queue one engine request per prompt."""
        try:
            for ids, sp in zip(prompts, params, strict=True):
                self.engine.validate_request(ids, sp)  # read-only: no engine lock needed
        except ValueError as e:
            raise value_error(e, rename) from None
        streams: list[RequestStream] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                streams.append(
                    await self.async_engine.add_request(f"{request_id}-{i}", ids, sp, arrival)
                )
        except BaseException as e:
            for s in streams:
                s.close()
            if isinstance(e, ValueError):
                raise value_error(e, rename) from None
            if isinstance(e, Exception):
                raise _engine_failure(e) from None
            raise
        return streams

    async def merge(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several requests as they come, tagged with the request's position."""
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

    async def collect(self, streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream; aborts them all if the client disconnects."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume() -> None:
            async for i, out in self.merge(streams):
                if out.finished:
                    finals[i] = out
                    self.metrics.observe_finished(out)

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    task.result()
                    break
                if await raw.is_disconnected():
                    raise _ClientGone()
        finally:
            if not task.done():
                task.cancel()
            for s in streams:
                s.close()
        assert all(f is not None for f in finals)
        return finals  # type: ignore[return-value]

    # ---- logprobs ------------------------------------------------------------------------
    def legacy_logprobs(
        self,
        token_ids: list[int],
        entries: list[PositionLogprobs | None],
        k: int,
        offset: int,
        acc: dict[str, list] | None = None,
    ) -> tuple[dict[str, list], int]:
        """Completions logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``,
        ``text_offset``), appended to ``acc``; returns it and the next text offset."""
        acc = acc or {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, entry in zip(token_ids, entries, strict=False):
            tok = self.token_str(tid, entry)
            acc["tokens"].append(tok)
            acc["text_offset"].append(offset)
            offset += len(tok)
            if entry is None or tid not in entry:
                acc["token_logprobs"].append(None)
                acc["top_logprobs"].append(None)
                continue
            acc["token_logprobs"].append(_lp(entry[tid].logprob))
            top: dict[str, float] = {}
            for alt, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
                if alt == tid or (lp.rank is not None and lp.rank <= k):
                    top.setdefault(self.token_str(alt, entry), _lp(lp.logprob))
            acc["top_logprobs"].append(top)
        return acc, offset

    def chat_logprobs(
        self, token_ids: list[int], entries: list[PositionLogprobs], k: int
    ) -> list[dict[str, Any]]:
        """Chat logprobs: ``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``."""
        content = []
        for tid, entry in zip(token_ids, entries, strict=False):
            tok = self.token_str(tid, entry)
            tops = sorted(
                (lp.rank, alt, lp)
                for alt, lp in entry.items()
                if lp.rank is not None and lp.rank <= k
            )
            top_list = []
            for _, alt, lp in tops[:k]:
                t = self.token_str(alt, entry)
                top_list.append(
                    {"token": t, "logprob": _lp(lp.logprob), "bytes": self.token_bytes(alt, t)}
                )
            content.append(
                {
                    "token": tok,
                    "logprob": _lp(entry[tid].logprob) if tid in entry else MIN_LOGPROB,
                    "bytes": self.token_bytes(tid, tok),
                    "top_logprobs": top_list,
                }
            )
        return content

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached: int | None) -> dict[str, Any]:
        u: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if cached is not None:
            u["prompt_tokens_details"] = {"cached_tokens": cached}
        return u

    # ---- /v1/completions -----------------------------------------------------------------
    def parse_prompts(self, prompt: Any) -> list[tuple[str | None, list[int]]]:
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
                out.append((p, self.tokenize(p) if p else []))
            else:
                out.append((None, list(p)))
            if not out[-1][1]:
                raise APIError(400, "prompt must not be empty", param="prompt")
        return out

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = self.parse_prompts(req.prompt)
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
        rename = {"prompt_logprobs": "logprobs"}
        try:
            params = self.sampling_params(
                req, max_tokens, req.logprobs, req.logprobs if want_plp else None
            )
        except ValueError as e:
            raise value_error(e, rename) from None
        per_prompt = []
        for _, ids in prompts:
            sp = params.clone()
            if "max_tokens" not in req.model_fields_set:
                # OpenAI's default of 16, cut to the room the prompt leaves (at least 1, so that a
                # prompt that fills the context still gets the context-length error).
                room = self.engine.max_model_len - len(ids)
                sp.max_tokens = max(1, min(sp.max_tokens or 16, room))
            per_prompt.append(sp)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_all(
            request_id, [ids for _, ids in prompts], per_prompt, arrival, rename
        )
        ctx = _CompletionContext(self, req, prompts, echo_only, request_id)
        if req.stream:
            return _sse_response(ctx.stream(streams))
        try:
            finals = await self.collect(streams, raw)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise _engine_failure(e) from None
        return JSONResponse(ctx.full_response(finals))

    # ---- /v1/chat/completions ------------------------------------------------------------
    def message_dicts(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
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

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(req.model)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
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
        messages = self.message_dicts(req.messages)
        try:
            ids = apply_chat_template(
                self.tokenizer, messages, req.add_generation_prompt, req.continue_final_message
            )
        except ValueError as e:
            raise value_error(e) from None
        max_tokens: int | None
        if req.max_completion_tokens is not None:
            max_tokens, mt_name = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, mt_name = req.max_tokens, "max_tokens"
        rename = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": mt_name}
        try:
            params = self.sampling_params(
                req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None
            )
        except ValueError as e:
            raise value_error(e, rename) from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.add_all(request_id, [ids], [params], arrival, rename)
        ctx = _ChatContext(self, req, ids, request_id)
        if req.stream:
            return _sse_response(ctx.stream(streams[0]))
        try:
            finals = await self.collect(streams, raw)
        except _ClientGone:
            return Response(status_code=499)
        except Exception as e:
            raise _engine_failure(e) from None
        return JSONResponse(ctx.full_response(finals[0]))


def _sse_response(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(
        gen,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


class _ChoiceState:
    __slots__ = ("text", "tokens", "done", "echoed", "offset")

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.done = False
        self.echoed = False
        self.offset = 0


class _CompletionContext:
    def __init__(
        self,
        server: OpenAIServer,
        req: CompletionRequest,
        prompts: list[tuple[str | None, list[int]]],
        echo_only: bool,
        request_id: str,
    ) -> None:
        self.s = server
        self.req = req
        self.prompts = prompts
        self.echo_only = echo_only
        self.id = request_id
        self.created = int(time.time())
        self.model = server.model_name
        self.n = req.n
        self.k = req.logprobs

    def prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else str(self.s.tokenizer.decode(ids))

    def _choice(
        self, i: int, out: RequestOutput, c: Any, st: _ChoiceState, final: bool
    ) -> dict[str, Any] | None:
        """The text / logprobs of choice ``c`` not yet sent (all of it when ``final``)."""
        want_lp = self.k is not None
        text = ""
        acc: dict[str, list] | None = None
        if self.req.echo and not st.echoed:
            if want_lp and out.prompt_logprobs is None:
                return None  # prompt logprobs not complete yet (chunked prefill)
            text += self.prompt_text(i)
            if want_lp:
                acc, st.offset = self.s.legacy_logprobs(
                    out.prompt_token_ids,
                    list(out.prompt_logprobs or []),
                    self.k or 0,
                    st.offset,
                )
            st.echoed = True
        finished = c.finish_reason is not None
        new_ids: list[int] = []
        if self.echo_only:
            finish_reason: str | None = "length"
            stop_reason = None
        else:
            new_text = c.text[st.text :]
            new_ids = c.token_ids[st.tokens :]
            if not text and not new_text and not finished and not (want_lp and new_ids):
                return None
            text += new_text
            if want_lp and new_ids:
                acc, st.offset = self.s.legacy_logprobs(
                    new_ids, (c.logprobs or [])[st.tokens :], self.k or 0, st.offset, acc
                )
            st.text, st.tokens = len(c.text), len(c.token_ids)
            finish_reason, stop_reason = (
                (c.finish_reason, c.stop_reason) if finished else (None, None)
            )
        if finish_reason is not None:
            st.done = True
        lp = None
        if want_lp:
            lp = acc or {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        choice = {
            "index": i * self.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(new_ids)
            if final:
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def _usage(self, finals: list[RequestOutput]) -> dict[str, Any]:
        n_prompt = sum(len(ids) for _, ids in self.prompts)
        n_out = 0 if self.echo_only else sum(len(c.token_ids) for o in finals for c in o.outputs)
        return self.s.usage(n_prompt, n_out, sum(o.num_cached_tokens for o in finals))

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                ch = self._choice(i, out, c, _ChoiceState(), final=True)
                assert ch is not None
                choices.append(ch)
        choices.sort(key=lambda ch: ch["index"])
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(finals),
            "system_fingerprint": None,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not ...:
            d["usage"] = usage
        elif self._include_usage:
            d["usage"] = None
        return d

    @property
    def _include_usage(self) -> bool:
        so = self.req.stream_options
        return bool(so and so.include_usage)

    async def stream(self, streams: list[RequestStream]) -> AsyncIterator[str]:
        states: dict[int, _ChoiceState] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in self.s.merge(streams):
                for c in out.outputs:
                    st = states.setdefault(i * self.n + c.index, _ChoiceState())
                    if st.done:
                        continue
                    ch = self._choice(i, out, c, st, final=False)
                    if ch is not None:
                        yield _sse(self._chunk([ch]))
                if out.finished:
                    finals[i] = out
                    self.s.metrics.observe_finished(out)
            if self._include_usage:
                yield _sse(self._chunk([], self._usage([f for f in finals if f is not None])))
        except Exception as e:
            err = e if isinstance(e, APIError) else _engine_failure(e)
            yield _sse(err.body())
        finally:
            for s in streams:
                s.close()
        yield _SSE_DONE


class _ChatContext:
    def __init__(
        self, server: OpenAIServer, req: ChatCompletionRequest, prompt_ids: list[int], rid: str
    ) -> None:
        self.s = server
        self.req = req
        self.prompt_ids = prompt_ids
        self.id = rid
        self.created = int(time.time())
        self.model = server.model_name
        self.k = (req.top_logprobs or 0) if req.logprobs else None

    def _usage(self, final: RequestOutput) -> dict[str, Any]:
        return self.s.usage(
            len(self.prompt_ids),
            sum(len(c.token_ids) for c in final.outputs),
            final.num_cached_tokens,
        )

    def full_response(self, final: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            lp = None
            if self.k is not None:
                lp = {"content": self.s.chat_logprobs(c.token_ids, c.logprobs or [], self.k)}
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
        resp = {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(final),
            "system_fingerprint": None,
        }
        if self.req.return_token_ids:
            resp["prompt_token_ids"] = list(self.prompt_ids)
        return resp

    @property
    def _include_usage(self) -> bool:
        so = self.req.stream_options
        return bool(so and so.include_usage)

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not ...:
            d["usage"] = usage
        elif self._include_usage:
            d["usage"] = None
        return d

    async def stream(self, stream: RequestStream) -> AsyncIterator[str]:
        n = self.req.n
        states = [_ChoiceState() for _ in range(n)]
        final: RequestOutput | None = None
        try:
            for j in range(n):
                yield _sse(
                    self._chunk(
                        [
                            {
                                "index": j,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            async for out in stream:
                for c in out.outputs:
                    if c.index >= len(states):
                        states.extend(_ChoiceState() for _ in range(c.index + 1 - len(states)))
                    st = states[c.index]
                    if st.done:
                        continue
                    new_text = c.text[st.text :]
                    new_ids = c.token_ids[st.tokens :]
                    finished = c.finish_reason is not None
                    want_lp = self.k is not None and bool(new_ids)
                    if not new_text and not finished and not want_lp:
                        continue
                    lp = None
                    if self.k is not None:
                        lp = {
                            "content": self.s.chat_logprobs(
                                new_ids, (c.logprobs or [])[st.tokens :], self.k
                            )
                        }
                    st.text, st.tokens = len(c.text), len(c.token_ids)
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
                    yield _sse(self._chunk([choice]))
                if out.finished:
                    final = out
                    self.s.metrics.observe_finished(out)
            if self._include_usage and final is not None:
                yield _sse(self._chunk([], self._usage(final)))
        except Exception as e:
            err = e if isinstance(e, APIError) else _engine_failure(e)
            yield _sse(err.body())
        finally:
            stream.close()
        yield _SSE_DONE


# ---- middleware --------------------------------------------------------------------------------
class _BodyTooLarge(BaseException):
    """Raised from ``receive`` (a BaseException so that no ``except Exception`` swallows it)."""


async def _send_json(send: Callable, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """API key check (``Authorization: Bearer <key>``) and the request body size limit."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        if self.api_key and not (path in OPEN_PATHS or scope.get("method") == "OPTIONS"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                await _send_json(
                    send,
                    401,
                    error_body(
                        "invalid or missing API key (send 'Authorization: Bearer <key>')",
                        "authentication_error",
                        None,
                        "invalid_api_key",
                    ),
                )
                return
        cl = headers.get(b"content-length")
        if cl is not None:
            try:
                length = int(cl)
            except ValueError:
                await _send_json(
                    send, 400, error_body("invalid Content-Length", "invalid_request_error")
                )
                return
            if length > self.max_body_bytes:
                await _send_json(send, 413, self._too_large())
                return
        received = 0
        started = False

        async def limited_receive() -> dict:
            nonlocal received
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg: dict) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await _send_json(send, 413, self._too_large())

    def _too_large(self) -> dict[str, Any]:
        return error_body(
            f"request body is larger than the limit of {self.max_body_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )


# ---- the app ------------------------------------------------------------------------------------
def create_app(
    async_engine: AsyncLLMEngine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    enable_dashboard: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``async_engine``; its lifespan starts and stops the engine thread.

    Args:
        async_engine: the engine (not started yet, or started on the loop that runs the app).
        served_model_name: the name (or names) accepted in ``model``; the first is reported.
        api_key: when set, every path except /health, /version, /metrics and the docs needs
            ``Authorization: Bearer <api_key>``.
        max_body_bytes: larger request bodies get 413.
    """
    server = OpenAIServer(async_engine, served_model_name, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.state.server = server
    app.state.async_engine = async_engine
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ())]
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx", {}) or {}
            return APIError(
                400, f"the body is not valid JSON: {ctx.get('error', first.get('msg'))}"
            ).response()
        param = loc[1] if len(loc) > 1 and loc[0] == "body" else None
        if param is None and loc[:1] == ["body"]:
            msg = f"the body must be a JSON object: {first.get('msg', 'invalid')}"
        else:
            where = ".".join(loc[1:]) if loc[:1] == ["body"] else ".".join(loc)
            msg = f"{where}: {first.get('msg', 'invalid value')}"
            if len(errors) > 1:
                msg += f" (and {len(errors) - 1} more errors)"
        return APIError(400, msg, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), kind).response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.post(
        "/v1/completions",
        responses={200: {"description": "a completion or an SSE stream"}, **_ERROR_RESPONSES},
    )
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post(
        "/v1/chat/completions",
        responses={200: {"description": "a chat completion or an SSE stream"}, **_ERROR_RESPONSES},
    )
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(req, raw)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        eng = server.engine
        return ModelList(
            data=[
                ModelCard(
                    id=name, root=str(eng.config.model or name), max_model_len=eng.max_model_len
                )
                for name in server.model_names
            ]
        )

    @app.get("/health")
    async def health() -> Response:
        if async_engine.is_dead or not async_engine.is_running:
            reason = async_engine.dead_reason or "the engine is not running"
            return APIError(500, reason, "server_error", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, ctype = server.metrics.render()
        return Response(content=data, media_type=ctype)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        server.check_model(req.model)
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            try:
                ids = apply_chat_template(
                    server.tokenizer,
                    server.message_dicts(req.messages),
                    req.add_generation_prompt,
                    req.continue_final_message,
                )
            except ValueError as e:
                raise value_error(e) from None
        elif req.prompt is not None:
            ids = list(
                server.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens).input_ids
            )
        else:
            raise APIError(400, "prompt or messages is required", param="prompt")
        return {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        server.check_model(req.model)
        vocab = server.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return {"prompt": server.tokenizer.decode(req.tokens)}

    # ---- KV-cache dashboard (/debug/kv*, /dashboard): see debug_routes.py ----
    if enable_dashboard:
        from pagedllm.entrypoints.openai.debug_routes import mount_debug_routes

        mount_debug_routes(app, async_engine)
    return app


def build_app(
    engine_args: dict[str, Any] | None = None,
    *,
    loaded: Any = None,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_stats_interval: float = 5.0,
    enable_dashboard: bool = False,
) -> FastAPI:
    """Build the engine from ``EngineConfig`` keyword arguments and return its app.

    Args:
        engine_args: ``EngineConfig`` fields (``model``, ``max_model_len``, ...).
        loaded: a ``LoadedModel`` to reuse instead of loading ``engine_args["model"]``.
        served_model_name: default: the model path, or "SmolLM2-135M-Instruct" for the bundled one.
    """
    from pagedllm.config import EngineConfig

    config = EngineConfig(**(engine_args or {}))
    if config.tensor_parallel_size == 1:
        # Built on the thread that will step it (AsyncLLMEngine.from_factory: one OpenMP team).
        async_engine = AsyncLLMEngine.from_factory(
            lambda: LLMEngine(config, loaded=loaded), log_stats_interval=log_stats_interval
        )
    else:  # worker processes / Ray are started from the main thread
        async_engine = AsyncLLMEngine(
            LLMEngine(config, loaded=loaded), log_stats_interval=log_stats_interval
        )
    name = served_model_name or config.model or "SmolLM2-135M-Instruct"
    return create_app(
        async_engine,
        name,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        enable_dashboard=enable_dashboard,
    )


def _dashboard_enabled(args: Any) -> bool:
    """KV dashboard: on for loopback hosts, elsewhere only with ``--enable-dashboard``."""
    from pagedllm.entrypoints.openai.debug_routes import dashboard_enabled

    return dashboard_enabled(args.host, getattr(args, "enable_dashboard", False))


def run_server(args: Any) -> int:
    """``pagedllm serve``: load the model, serve until SIGINT / SIGTERM, then exit 0.

    On the signal the server stops accepting connections and aborts every in-flight request
    (streams get an error event and ``[DONE]``), so shutdown does not wait for generations.
    """
    import uvicorn

    from pagedllm.entrypoints.cli import engine_kwargs

    kw = engine_kwargs(args)
    kw["max_logprobs"] = args.max_logprobs
    try:
        app = build_app(
            kw,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_body_bytes=args.max_body_bytes,
            log_stats_interval=args.log_stats_interval,
            enable_dashboard=_dashboard_enabled(args),
        )
    except (ValueError, FileNotFoundError) as e:
        logger.error("could not start the engine: %s", e)
        return 2
    async_engine: AsyncLLMEngine = app.state.async_engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # no re-raise of the signal: exit 0
            loop = async_engine._loop
            if loop is not None and not loop.is_closed():
                err = RequestAbortedError("the server is shutting down")
                loop.call_soon_threadsafe(async_engine.abort_all, err)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            else:
                self.should_exit = True

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _Server(config)
    logger.info(
        "serving %s on http://%s:%d (OpenAI API under /v1)",
        app.state.server.model_name,
        args.host,
        args.port,
    )
    server.run()
    return 0
