"""The command-line flags of ``EngineConfig``: :func:`add_engine_args` derives one flag per field
(``pagedllm generate``, ``pagedllm serve``, ``pagedllm bench throughput``); read the result back
with ``EngineConfig.from_cli_args``."""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, fields
from typing import Any, cast

from pagedllm.config import EngineConfig, format_size, parse_size


class _ModelAction(argparse.Action):
    """Stores MODEL from the positional or from ``--model``; both at once must agree, unless
    ``several`` (``_SeveralModelsAction``)."""

    #: Whether a second, different model is appended to ``extra_model`` instead of refused.
    several = False

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values is None:  # the optional positional, absent
            return
        before = getattr(namespace, self.dest, None)
        if before is None or before == values:
            setattr(namespace, self.dest, values)
        elif not self.several:
            parser.error(f"the model is given twice: {before!r} and {values!r}")
        elif values not in (extra := list(getattr(namespace, "extra_model", None) or [])):
            namespace.extra_model = [*extra, values]


class _SeveralModelsAction(_ModelAction):
    """MODEL / ``--model`` for ``pagedllm serve``: the first is ``model``, each other (different)
    one is appended to ``extra_model``."""

    several = True


def _cli_size(text: str) -> int:
    """``parse_size`` for argparse: a bad value becomes an error naming the flag."""
    try:
        return parse_size(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _flag_help(f: Field[Any]) -> str:
    """The field's help sentence, the size units where they apply, and the default."""
    text = f.metadata["help"]
    if f.metadata.get("size"):
        text += (
            "; bytes, or a number with a unit: KiB/MiB/GiB (powers of 1024) or KB/MB/GB "
            "(powers of 1000), e.g. 2GiB"
        )
        default = f"{format_size(cast(int, f.default))} = {f.default} bytes"
    elif isinstance(f.default, bool):
        default = "on" if f.default else "off"
    elif f.default is None:  # the help says what None means
        return text.replace("%", "%%")
    else:
        default = str(f.default)
    return f"{text} (default: {default})".replace("%", "%%")


def add_engine_args(
    parser: argparse.ArgumentParser, several_models: bool = False
) -> argparse.ArgumentParser:
    """Add a flag for every ``EngineConfig`` field to ``parser``; returns the parser.

    Each field ``x_y`` becomes ``--x-y`` (plus the field's ``aliases``), typed from the
    annotation: booleans as ``--x-y / --no-x-y``, enumerations with their choices, sizes in bytes
    or with a unit (``2GiB``). ``model`` is also accepted as the positional ``MODEL``; giving two
    different models is an error, unless ``several_models`` (``pagedllm serve``): then the first
    is ``model`` and each other one is appended to ``args.extra_model``. The help of each flag is
    the field's sentence and its default. Read the result back with
    ``EngineConfig.from_cli_args(args)``.

    Raises:
        TypeError: naming a field whose annotation has no command-line type (a programming error).
    """
    group = parser.add_argument_group("engine options (EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        kw: dict[str, Any] = {"dest": f.name, "default": f.default, "help": _flag_help(f)}
        types = [t for t in typing.get_args(hints[f.name]) if t is not type(None)]
        kind = types[0] if types else hints[f.name]
        if meta.get("positional"):
            action = _SeveralModelsAction if several_models else _ModelAction
            parser.add_argument(
                f.name,
                nargs="?",
                default=f.default,
                action=action,
                metavar=f.name.upper(),
                help=f"same as {flag}",
            )
            kw.update(action=action, metavar=f.name.upper())
            if several_models:
                kw["help"] += "; repeat it to serve several models (the first is the default)"
        elif meta.get("size"):
            kw.update(type=_cli_size, metavar="SIZE")
        elif meta.get("choices"):
            kw["choices"] = list(meta["choices"])
        elif kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif kind in (int, float, str):
            kw["type"] = kind
        else:
            raise TypeError(f"EngineConfig.{f.name}: no command-line type for {hints[f.name]}")
        group.add_argument(flag, *meta.get("aliases", ()), **kw)
    return parser
