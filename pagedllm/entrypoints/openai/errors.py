"""The OpenAI error envelope and the mapping of engine / validation errors onto it.

Every error answer is ``{"error": {"message", "type", "param", "code"}}``: invalid values are 400
with ``param`` naming the field (the engine and ``SamplingParams`` start their messages with the
field name), an unknown model 404, a prompt that does not fit 400 with code
``context_length_exceeded``, a missing / wrong API key 401, a body over the limit 413, a dead
engine 503 (``engine_dead``), a failed engine step 500 (``engine_error``), a full waiting queue
(``--max-waiting-requests``) or a draining server 503 with ``Retry-After``, a request whose
``timeout`` passed before anything was generated 504 (``request_timeout``).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestAbortedError,
)
from pagedllm.engine.llm_engine import ContextLengthExceededError
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)

logger = logging.getLogger(__name__)

#: OpenAPI ``responses=`` entry documenting the error envelope of a route.
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 500, 503, 504)
}
#: Seconds a client is told to wait (``Retry-After``) when the server is overloaded.
RETRY_AFTER_S = 1

#: Names a ValueError message may start with that are request fields (so ``param`` is set).
_REQUEST_FIELDS = (
    set(CompletionRequest.model_fields)
    | set(ChatCompletionRequest.model_fields)
    | {"prompt", "prompt_logprobs", "use_beam_search", "tokens"}
)


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The envelope ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    """An error answered with the OpenAI envelope and HTTP status ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON envelope (also sent as the ``data:`` of a stream's error event)."""
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        """The envelope as a JSON response with this error's status."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def overloaded(message: str, code: str) -> APIError:
    """A 503 that tells the client to retry (``Retry-After: RETRY_AFTER_S``)."""
    return APIError(
        503, message, "server_error", code=code, headers={"Retry-After": str(RETRY_AFTER_S)}
    )


def value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """Map an engine / ``SamplingParams`` ValueError to a 400 whose ``param`` is the field named
    first in the message (renamed, in ``param`` and in the message, to the request's own field
    name where they differ)."""
    rename = rename or {}
    msg = str(e)
    m = re.match(r"\s*([A-Za-z_]+)", msg)
    named = m.group(1) if m and m.group(1) in _REQUEST_FIELDS else None
    param = e.param if isinstance(e, ContextLengthExceededError) else named
    if param is not None and param in rename:
        new = rename[param]
        if new != param:
            # "structured_outputs.json" (a kind) -> "guided_json"; every mention of a field
            # name such as max_tokens, only the first of a word such as prompt ("a prompt of").
            mention = rf"(?<![\w.]){re.escape(param)}(\.\w+)?\b"
            msg = re.sub(mention, new, msg, count=0 if "_" in param else 1)
        param = new
    code = "context_length_exceeded" if isinstance(e, ContextLengthExceededError) else None
    return APIError(400, msg, param=param, code=code)


def engine_failure(e: BaseException) -> APIError:
    """Map a failure while serving (engine dead 503, aborted 503, failed step 500, anything else
    500 and logged) to its ``APIError``."""
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "server_error", code="engine_dead")
    if isinstance(e, QueueFullError):
        return overloaded(str(e), "queue_full")
    if isinstance(e, RequestAbortedError):
        return APIError(503, str(e), "server_error", code="request_aborted")
    if isinstance(e, EngineStepError):
        return APIError(500, str(e), "server_error", code="engine_error")
    logger.exception("unexpected error while serving a request", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
