"""The tool fields of a chat request resolved into one ``ToolConfig``: ``tools`` /
``tool_choice`` / ``parallel_tool_calls``, with the legacy ``functions`` / ``function_call``
mapped onto them, validated (400 naming the field); and the JSON schemas that the grammar
enforces for ``tool_choice="required"`` (an array of calls) and a named function (its arguments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.structured.schema_check import check_schema, rebase_local_refs

#: OpenAI's rule for function names.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: The parameters of a function declared without any.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolConfig:
    """A request's resolved tool settings.

    ``tools``: OpenAI-shaped ``{"type": "function", "function": {...}}`` dicts (what the chat
    template receives); ``choice``: ``"none"``, ``"auto"``, ``"required"`` or a function's name;
    ``parallel``: ``parallel_tool_calls`` (default true).
    """

    tools: list[dict[str, Any]] = field(default_factory=list)
    choice: str = "none"
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model may call tools (tools given and the choice is not ``none``)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether a call is forced by the grammar (``required`` or a named function)."""
        return self.active and self.choice != "auto"

    def parameters(self, name: str) -> dict[str, Any]:
        """The parameters schema of function ``name``."""
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)


def _function_dicts(req: Any) -> tuple[list[dict[str, Any]], str]:
    """The declared functions (as dicts) and the field they came from."""
    extra = req.model_extra or {}
    legacy = extra.get("functions")
    if legacy is not None:
        if req.tools:
            raise APIError(400, "functions: give either tools or functions", param="functions")
        if not isinstance(legacy, list) or not all(isinstance(f, dict) for f in legacy):
            raise APIError(400, "functions must be a list of function objects", param="functions")
        return list(legacy), "functions"
    return [t.function.model_dump(exclude_none=True) for t in req.tools or []], "tools"


def _check_function(fn: dict[str, Any], where: str, param: str) -> dict[str, Any]:
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise APIError(
            400,
            f"{where}.name must be 1-64 letters, digits, '_' or '-'; got {name!r}",
            param=param,
        )
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise APIError(400, f"{where}.parameters must be a JSON schema object", param=param)
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            raise APIError(
                400, f"{where}.parameters is not a valid JSON schema: {e.message}", param=param
            ) from None
    out: dict[str, Any] = {"name": name}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    out["parameters"] = params or EMPTY_PARAMETERS
    return out


def _choice(req: Any, names: list[str]) -> tuple[str, str]:
    """The tool choice (``none`` / ``auto`` / ``required`` / a name) and its field."""
    extra = req.model_extra or {}
    legacy = extra.get("function_call")
    if legacy is not None:
        if getattr(req, "tool_choice", None) is not None:
            raise APIError(
                400,
                "function_call: give either tool_choice or function_call",
                param="function_call",
            )
        if legacy in ("none", "auto"):
            return legacy, "function_call"
        if isinstance(legacy, dict) and isinstance(legacy.get("name"), str):
            return legacy["name"], "function_call"
        raise APIError(
            400, 'function_call must be "none", "auto" or {"name": ...}', param="function_call"
        )
    tc = getattr(req, "tool_choice", None)
    if tc is None:
        return ("auto" if names else "none"), "tool_choice"
    if isinstance(tc, str):
        return tc, "tool_choice"
    fn = tc.get("function")
    if (
        tc.get("type") != "function"
        or not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
    ):
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return fn["name"], "tool_choice"


def resolve_tools(req: Any) -> ToolConfig:
    """The ``ToolConfig`` of a ``ChatCompletionRequest`` (or a ``TokenizeRequest``, whose
    choice is then ``auto`` when it has tools).

    Raises:
        APIError: 400 naming the field: both a field and its legacy twin, an invalid function
            name or parameters schema, duplicate names, ``required`` or a named choice without
            tools, a named choice that is not a declared function, parameters the grammar of a
            forced choice cannot enforce (``check_schema``, its pointers relative to them).
    """
    fns, fparam = _function_dicts(req)
    wheres = [
        f"{fparam}[{i}].function" if fparam == "tools" else f"{fparam}[{i}]"
        for i in range(len(fns))
    ]
    checked = [_check_function(f, where, fparam) for f, where in zip(fns, wheres, strict=True)]
    names = [f["name"] for f in checked]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise APIError(400, f"{fparam}: duplicate function names {sorted(dup)}", param=fparam)
    choice, cparam = _choice(req, names)
    if choice not in ("none", "auto") and not names:
        raise APIError(400, f"{cparam} {choice!r} needs tools", param=cparam)
    if choice not in ("none", "auto", "required") and choice not in names:
        raise APIError(
            400, f"{cparam}: no function named {choice!r} in {fparam} ({names})", param=cparam
        )
    for f, where in zip(checked, wheres, strict=True):
        # The grammar enforces these parameters (a tool named "auto" is not chosen by "auto").
        if choice == "required" or (choice not in ("auto", "none") and choice == f["name"]):
            try:
                check_schema(f["parameters"])
            except ValueError as e:  # its pointers are the parameters', not the wrapper's
                raise APIError(400, f"{where}.parameters: {e}", param=fparam) from None
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    return ToolConfig([{"type": "function", "function": f} for f in checked], choice, parallel)


def required_schema(config: ToolConfig) -> dict[str, Any]:
    """The JSON schema forced for ``tool_choice="required"``: an array of at least one
    ``{"name": <a declared function>, "arguments": <its parameters>}`` (at most one when
    ``parallel_tool_calls`` is false). ``name`` comes first, so it streams before the arguments.
    A parameters schema's local ``$ref``s (pydantic's ``#/$defs/...``) are rebased to where it
    sits in this one.
    """
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": rebase_local_refs(
                    t["function"]["parameters"], f"/items/anyOf/{i}/properties/arguments"
                ),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, t in enumerate(config.tools)
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not config.parallel:
        schema["maxItems"] = 1
    return schema


def forced_schema(config: ToolConfig) -> dict[str, Any]:
    """The schema the grammar enforces for a forced choice: ``required_schema`` or the named
    function's parameters (the output is then the arguments object alone)."""
    if config.choice == "required":
        return required_schema(config)
    return config.parameters(config.choice)
