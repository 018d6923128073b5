"""Pydantic models of the OpenAI-compatible API: requests, responses and the error envelope.

Request models accept (and ignore) unknown fields, as OpenAI clients add new ones over time; value
ranges are checked by ``SamplingParams`` and the engine, whose messages name the field, so that a
400 names the same ``param`` whichever layer caught it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# ---- errors ---------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error envelope: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# ---- shared pieces --------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class SamplingExtensions(OpenAIBaseModel):
    """vLLM's extensions to the OpenAI sampling fields (sent with ``extra_body`` by the client)."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    #: Add the generated token ids (``token_ids``) to every choice (and chunk).
    return_token_ids: bool = False


# ---- /v1/completions ------------------------------------------------------------------------
class CompletionRequest(SamplingExtensions):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    suffix: str | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool = False
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy logprobs shape: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


# ---- /v1/chat/completions -------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingExtensions):
    model: str | None = None
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions for the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatLogprobTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


# ---- models, tokenizer, version --------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
