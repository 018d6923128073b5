"""The request fields that ask for structured output, mapped onto ``StructuredOutputsParams``.

Accepted (at most one of them per request):

- OpenAI's ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}`` (``text`` = unconstrained);
- vLLM's ``structured_outputs`` object (``json``, ``json_object``, ``regex``, ``choice``,
  ``grammar``, ``disable_any_whitespace``, ``whitespace_pattern``);
- vLLM's legacy ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (with
  ``guided_whitespace_pattern``).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.sampling_params import StructuredOutputsParams

#: Legacy vLLM field -> the ``StructuredOutputsParams`` field it sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_field(req: CompletionRequest | ChatCompletionRequest) -> str:
    """The request field that asked for structured output (for a 400's ``param``), or
    ``"structured_outputs"`` when none did."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    for name in GUIDED_FIELDS:
        if getattr(req, name) is not None:
            return name
    return "structured_outputs"


def structured_outputs_from_request(
    req: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None.

    Raises:
        ValueError: starting with the request field's name (``response_format``,
            ``structured_outputs``, ``guided_json`` ...): several of them given, a malformed
            ``response_format``, or a constraint ``StructuredOutputsParams`` rejects.
    """
    sources: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        sources.append(("response_format", _from_response_format(rf.type, rf.json_schema)))
    if req.structured_outputs is not None:
        sources.append(("structured_outputs", dict(req.structured_outputs)))
    for name, field in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            kw: dict[str, Any] = {field: value}
            if req.guided_whitespace_pattern is not None:
                kw["whitespace_pattern"] = req.guided_whitespace_pattern
            sources.append((name, kw))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(n for n, _ in sources)
        raise ValueError(f"{sources[0][0]}: give only one of {names}")
    name, kw = sources[0]
    unknown = set(kw) - set(StructuredOutputsParams.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{name} has unknown fields {sorted(unknown)}")
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        if name == "structured_outputs" or str(e).startswith("structured_outputs."):
            raise  # the 400's value_error renames "structured_outputs.json" to the field
        raise ValueError(f"{name}: {e}") from None


def _from_response_format(kind: str, json_schema: dict[str, Any] | None) -> dict[str, Any]:
    if kind == "json_object":
        return {"json_object": True}
    # json_schema
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), (dict, bool)):
        raise ValueError(
            "response_format: type 'json_schema' needs json_schema.schema (a JSON schema object)"
        )
    return {"json": json_schema["schema"]}
