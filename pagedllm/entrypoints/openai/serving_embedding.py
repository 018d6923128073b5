"""``POST /v1/embeddings``: one pooling request per input, batched through the engine.

Each input (a string, or token ids) becomes a prefill-only engine request whose output is its
pooled final hidden state (``engine.pooling``: mean or last token, L2-normalized by default);
they run in the same continuous batches as generation requests. ``encoding_format="base64"``
sends each vector as the base64 of its little-endian float32 bytes (what the official client
decodes). ``dimensions`` is accepted only when it equals the model's hidden size.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import EmbeddingRequest
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIServing,
    RequestContext,
    usage_body,
)
from pagedllm.entrypoints.openai.validation import check_embedding_fields
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

#: Most inputs in one request (OpenAI's limit).
MAX_INPUTS = 2048


def _bad_input(why: str) -> APIError:
    return APIError(400, f"input {why}", param="input")


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_inputs(serving: OpenAIServing, req: EmbeddingRequest) -> list[list[int]]:
    """Token ids of every input of ``req.input``.

    Raises:
        APIError: 400 (``param="input"``) when it is missing, empty, of a wrong type, or holds
            an empty item.
    """
    value = req.input
    if value is None:
        raise _bad_input("is required")
    if isinstance(value, str) or (_is_ids(value) and value):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise _bad_input(
            "must be a non-empty string, list of strings, list of token ids or list of token-id "
            f"lists; got {type(value).__name__}" + (" (empty)" if value == [] else "")
        )
    if len(items) > MAX_INPUTS:
        raise _bad_input(f"has {len(items)} items; at most {MAX_INPUTS} are allowed")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids = serving.tokenize(item, req.add_special_tokens) if item else []
        elif _is_ids(item):
            ids = list(item)
        else:
            raise _bad_input(f"[{i}] must be a string or a list of token ids")
        if not ids:
            raise _bad_input(f"[{i}] must not be empty")
        out.append(ids)
    return out


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """The ``embedding`` field: the floats, or base64 of their little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


async def create_embedding(serving: OpenAIServing, req: EmbeddingRequest, raw: Request) -> Response:
    """Serve one ``/v1/embeddings`` request.

    Raises:
        APIError: 400 invalid request (``input``, ``dimensions``, unsupported fields such as
            ``truncate_prompt_tokens``), 404 unknown model, 5xx engine failure.
    """
    arrival = time.monotonic()
    serving.check_model(req.model)
    check_embedding_fields(req)
    hidden = serving.async_engine.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise APIError(
            400,
            f"dimensions must be {hidden} (this model's embedding size) or unset; reduced "
            f"dimensions are not supported, got {req.dimensions}",
            param="dimensions",
        )
    prompts = parse_inputs(serving, req)
    pooling = PoolingParams(
        req.pooling or serving.async_engine.default_pooling, req.normalize
    )
    params = SamplingParams(max_tokens=1, detokenize=False, pooling=pooling)
    request_id = f"embd-{uuid.uuid4().hex}"
    streams = await serving.add_all(
        request_id, prompts, [params] * len(prompts), arrival, {"prompt": "input"}
    )
    ctx = EmbeddingContext(serving, req, request_id, sum(len(p) for p in prompts))
    return await ctx.respond(streams, raw)


class EmbeddingContext(RequestContext):
    """The answer of one embeddings request (all its inputs)."""

    req: EmbeddingRequest

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}],
        "model", "usage"}`` (usage counts prompt tokens only)."""
        data = []
        for i, out in enumerate(finals):
            assert out.embedding is not None, "a pooling request finished without its embedding"
            data.append(
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encode(out.embedding, self.req.encoding_format),
                }
            )
        usage = usage_body(self.num_prompt_tokens, 0, None)
        del usage["completion_tokens"]
        return {"id": self.id, "object": "list", "data": data, "model": self.model, "usage": usage}
