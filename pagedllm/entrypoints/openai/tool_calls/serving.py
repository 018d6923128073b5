"""Tool calling in ``/v1/chat/completions``: the parser and sampling parameters of a request
(``setup``), and its choices' messages and stream deltas (``ToolOutput``).

``auto``: the model writes calls in its own format, cut out by the ``--tool-call-parser``
parser. ``required`` / a named function: the grammar forces JSON (``schema.forced_schema``) through
``SamplingParams.structured_outputs``, parsed directly, so the arguments always parse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedllm.entrypoints.openai.chat_render import special_token_strings
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.tool_calls.parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStream,
    ToolParser,
    parser_for_template,
)
from pagedllm.entrypoints.openai.tool_calls.schema import ToolConfig, forced_schema
from pagedllm.entrypoints.openai.tool_calls.template import template_has_tools
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams


def default_parser_name(tokenizer: Any) -> str:
    """The parser for the model's template's format, ``hermes`` for the shipped tool template."""
    template = getattr(tokenizer, "chat_template", None)
    return parser_for_template(template if template_has_tools(template) else None)


def _constrained(params: SamplingParams, schema: dict[str, Any]) -> SamplingParams:
    """``params`` with the grammar forcing JSON that validates against ``schema``.

    Raises:
        APIError: 400 (``param="tool_choice"``) when the request already constrains its output
            (``response_format``, ``structured_outputs``, ``guided_*``) or its parameters take
            no grammar (``use_beam_search``).
    """
    if params.structured_outputs is not None:
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format / structured_outputs / guided_*",
            param="tool_choice",
        )
    try:
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
    except ValueError as e:  # e.g. use_beam_search, which takes no grammar
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from None


def setup(
    config: ToolConfig, params: SamplingParams, parser_name: str | None, tokenizer: Any
) -> tuple[SamplingParams, ToolParser | None]:
    """The sampling parameters and output parser of a request with tools (``None`` parser when
    the model may not call tools).

    Raises:
        APIError: 400 naming ``tool_choice`` when a forced choice cannot be enforced.
    """
    if not config.active:
        return params, None
    if config.forced:
        parser: ToolParser = (
            RequiredToolParser() if config.choice == "required" else NamedToolParser(config.choice)
        )
        return _constrained(params, forced_schema(config)), parser
    parser = TOOL_PARSERS[parser_name or default_parser_name(tokenizer)]()
    parser.declared = frozenset(t["function"]["name"] for t in config.tools)
    if set(parser.markers) & set(special_token_strings(tokenizer)):
        # The call markers are control tokens ([TOOL_CALLS], <|python_tag|>): keep them in the text.
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, parser


class ToolOutput:
    """The tool calls of one request's choices (one ``ToolCallStream`` per choice).

    Args:
        parser: the output format; parallel: ``parallel_tool_calls``.
    """

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self.streams: dict[int, ToolCallStream] = {}

    @staticmethod
    def _finish(reason: str | None, called: bool) -> str | None:
        # Output cut by max_tokens keeps "length" (OpenAI's and vLLM's answer), even after
        # complete calls: the client must not take a cut answer for a finished turn. A call
        # the cut left unfinished is never a call with arguments that do not parse: under
        # "auto" its text is content (what vLLM answers too, and no client runs a broken call);
        # a stream that already sent part of it keeps it (see ToolCallStream.delta).
        return "tool_calls" if called and reason == "stop" else reason

    def message(self, text: str, prefix: str, reason: str | None) -> tuple[dict[str, Any], Any]:
        """The non-streamed ``message`` of a finished choice (``prefix``: echoed text) and its
        finish reason (``tool_calls`` when it called tools, every call ended, and it stopped on
        its own). Under ``auto``, a call cut by max_tokens (finish ``length``) or a stop string
        (``stop``) is returned as content; a forced call stays a call whose arguments end where
        the output was cut, with that finish reason."""
        ts = ToolCallStream(self.parser, self.parallel)
        content, calls = ts.message(text)
        msg: dict[str, Any] = {"role": "assistant", "content": (prefix + (content or "")) or None}
        if calls:
            msg["tool_calls"] = calls
        elif msg["content"] is None:
            msg["content"] = ""
        return msg, self._finish(reason, bool(calls) and ts.calls_complete)

    def delta(self, index: int, text: str, reason: str | None) -> tuple[dict[str, Any], Any]:
        """The stream ``delta`` of choice ``index`` for its text so far, and its finish reason."""
        ts = self.streams.setdefault(index, ToolCallStream(self.parser, self.parallel))
        content, calls = ts.delta(text, final=reason is not None)
        d: dict[str, Any] = {}
        if content:
            d["content"] = content
        if calls:
            d["tool_calls"] = calls
        return d, self._finish(reason, ts.calls_ended)
