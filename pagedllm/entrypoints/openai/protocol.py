"""Pydantic models of the OpenAI-compatible API: the request bodies, ``/v1/models``' answer and
the error envelope (the generation answers are built as plain dicts in the serving modules).

Request models accept (and ignore) unknown fields, as OpenAI clients add new ones over time (they
are logged once per name); known fields this server does not implement are refused in
``validation.py``. Value ranges are checked by ``SamplingParams`` and the engine, whose messages name the field, so that a
400 names the same ``param`` whichever layer caught it.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator

_SURROGATE = re.compile("[\ud800-\udfff]")


def _not_bool(value: Any) -> Any:
    # JSON true / false are not numbers; pydantic's lax mode would read them as 1 / 0, so that
    # `"prompt": [true]` would silently become token id 1.
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


# Integer and number request fields: lax (3.0 is 3, 1 is 1.0) but a boolean is a 400 naming
# the field (OpenAI refuses `"temperature": true` too).
Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]


def _find_lone_surrogate(value: Any) -> str | None:
    """The first string inside ``value`` (a str, or lists / dicts of them) holding a lone UTF-16
    surrogate (U+D800..U+DFFF, which JSON's ``\\ud83d`` escape can write but UTF-8 cannot
    encode), or None. Nested API models are skipped: their own validator checked them."""
    if isinstance(value, str):
        return None if value.isascii() or not _SURROGATE.search(value) else value
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, list | tuple):
        for item in value:
            if not isinstance(item, int) and (found := _find_lone_surrogate(item)) is not None:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    """Base of the API models: unknown fields are kept (and ignored), ``model_*`` names allowed.

    Every known field's strings must be valid Unicode: a lone surrogate is a validation error
    (a 400 naming the field), not a tokenizer ``TypeError`` (a 500) further on.
    """

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @field_validator("*")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        found = _find_lone_surrogate(value)
        if found is not None:
            at = _SURROGATE.search(found)
            assert at is not None
            raise ValueError(
                f"text holds a lone UTF-16 surrogate {at.group()!a} at character {at.start()}, "
                "which is not valid Unicode"
            )
        return value


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    """The body of the error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- shared pieces --------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage."""

    include_usage: StrictBool | None = False
    #: vLLM's per-chunk usage: refused (400) when true.
    continuous_usage_stats: StrictBool | None = False


class ResponseFormat(OpenAIBaseModel):
    """``response_format``: ``text`` (unconstrained), ``json_object`` or ``json_schema``
    (``json_schema`` = ``{"name", "schema", "strict"}``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingExtensions(OpenAIBaseModel):
    """vLLM's extensions to the OpenAI sampling fields (sent with ``extra_body`` by the client)."""

    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    min_tokens: Int = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    #: Add the generated token ids (``token_ids``) to every choice (and chunk).
    return_token_ids: StrictBool = False
    #: vLLM's scheduling priority: lower is served first under ``--scheduling-policy
    #: priority`` (ties by arrival); must be 0 under the default ``fcfs``.
    priority: Int = 0
    #: vLLM's prefix-cache salt: requests with different salts never share prefix-cache blocks
    #: (tenants cannot probe each other's prompts by timing); a non-empty string.
    cache_salt: str | None = None
    #: Deadline in seconds after the request arrived: the request is then aborted; the answer
    #: holds what was generated, with ``finish_reason: "timeout"`` (504 when nothing was).
    timeout: Float | None = None
    #: Most speculative tokens proposed per step for this request (needs the server's
    #: ``--speculative-config``): None = the server's default, 0 = off (``docs/spec_decode.md``).
    num_speculative_tokens: Int | None = None
    #: vLLM's beam search: ``best_of`` (default ``n``) is the beam width, the best ``n`` beams
    #: are returned; ranked by ``cumulative_logprob / len ** length_penalty``; ``early_stopping``
    #: is True, False or "never" (transformers' rules). Not with ``stream``.
    use_beam_search: StrictBool = False
    length_penalty: Float = 1.0
    early_stopping: StrictBool | Literal["never"] = False
    # Structured output (see ``structured.py``): OpenAI's response_format, vLLM's object and
    # its legacy guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


# ---- /v1/completions ------------------------------------------------------------------------
class CompletionRequest(SamplingExtensions):
    """The body of ``POST /v1/completions``."""

    model: str | None = None
    prompt: str | list[Int] | list[str] | list[list[Int]] | None = None
    suffix: str | None = None
    max_tokens: Int | None = 16
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    best_of: Int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: Int | None = None
    echo: StrictBool = False
    stop: str | list[str] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    seed: Int | None = None
    user: str | None = None


# ---- /v1/chat/completions -------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    """One part of a message's content list (only ``text`` parts are served)."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """One chat message: ``role``, ``content`` (text or parts), optional ``name``."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: An assistant message's tool calls (``{"id", "type": "function", "function": {"name",
    #: "arguments"}}``); checked in ``tool_calls/template.py``.
    tool_calls: list[Any] | None = None
    #: A ``tool`` message: the id of the call it answers.
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function: its name, description and ``parameters`` (a JSON schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIBaseModel):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingExtensions):
    """The body of ``POST /v1/chat/completions``."""

    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    n: Int = 1
    best_of: Int | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logprobs: StrictBool = False
    top_logprobs: Int | None = None
    stop: str | list[str] | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Float] | None = None
    seed: Int | None = None
    user: str | None = None
    tools: list[ChatTool] | None = None
    #: ``none``, ``auto``, ``required`` or ``{"type": "function", "function": {"name": ...}}``;
    #: the legacy ``functions`` / ``function_call`` (kept as extra fields) map onto these.
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM extensions for the template
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    #: vLLM's chat echo: the reply starts with the last message's content when that message is
    #: the assistant's (with ``continue_final_message``, the text being continued).
    echo: StrictBool = False
    #: Let special-token strings written in message contents (``<|im_end|>``) act as control
    #: tokens; by default they are tokenized as plain text, as OpenAI does.
    allow_special_tokens_in_content: StrictBool = False
    #: A Jinja chat template used for this request instead of the model's (rendered in
    #: transformers' sandboxed environment); a template that fails to render is a 400.
    chat_template: str | None = None
    #: Extra variables passed to the chat template (``{"enable_thinking": false}``).
    chat_template_kwargs: dict[str, Any] | None = None


# ---- models, tokenizer, version --------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    """One served name in ``GET /v1/models`` and ``GET /v1/models/{id}`` (vLLM's card): ``root``
    the model it serves (its path, or its first served name), ``parent`` always null (no
    adapters), ``max_model_len`` in tokens."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    """The answer of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template); both is a
    400."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: Tools offered to the chat template (as in a chat request).
    tools: list[ChatTool] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    allow_special_tokens_in_content: StrictBool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """The body of ``POST /detokenize``: token ids to decode."""

    model: str | None = None
    tokens: list[Int]


# ---- /v1/embeddings -------------------------------------------------------------------------
class EmbeddingRequest(OpenAIBaseModel):
    """The body of ``POST /v1/embeddings``: ``input`` is a string, a list of strings, a list of
    token ids or a list of token-id lists (checked in ``serving_embedding``, so that a bad shape
    is a 400 naming ``input``)."""

    model: str | None = None
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    #: Only the model's own hidden size is served (no Matryoshka truncation).
    dimensions: Int | None = None
    user: str | None = None
    #: Extensions: the pooling method (default: the server's ``--pooling``), L2 normalization
    #: (OpenAI's embeddings are unit vectors), special tokens added to text inputs.
    pooling: Literal["mean", "last"] | None = None
    normalize: StrictBool = True
    add_special_tokens: StrictBool = True


# ---- /v1/responses --------------------------------------------------------------------------
class ResponsesRequest(OpenAIBaseModel):
    """The body of ``POST /v1/responses`` (text in, text out). ``input`` is a string or a list
    of message items (``{"role", "content"}``, content a string or ``input_text`` /
    ``output_text`` parts), checked in ``serving_responses`` so a bad shape is a 400 naming
    ``input``."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stream: StrictBool = False
    #: Keep the response (and its conversation) in memory for ``previous_response_id`` and
    #: ``GET /v1/responses/{id}`` (a bounded LRU; OpenAI's default is true).
    store: StrictBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    background: StrictBool | None = None
    #: As in completions and chat: a non-empty string; only requests with the same salt share
    #: prefix-cache blocks.
    cache_salt: str | None = None
