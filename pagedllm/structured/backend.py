"""Grammar backends: compile a constraint into a grammar, and step a matcher over tokens.

The engine knows only :class:`GrammarBackend` / :class:`GrammarMatcher`; the backends sit in
``GRAMMAR_BACKENDS`` (name -> factory, imported lazily). xgrammar is the default: on this
project's CPU its next-token mask on the 49,152-token SmolLM2 vocabulary costs a few
microseconds per token against tens for llguidance (``benchmarks/grammar_mask_cost.py``,
figures in docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Protocol

import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured.regex_check import check_anchors
from pagedllm.structured.schema_check import check_schema

#: At most this many whitespace characters between two JSON tokens when whitespace is free, so
#: a constrained output can never run on in whitespace.
MAX_JSON_WHITESPACE = 2


class GrammarMatcher(Protocol):
    """The parse state of one sequence inside a compiled grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of an int32 [R, ceil(V/32)] bitmask
        (stop tokens allowed only where the grammar may end)."""
        ...

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted (nothing more may follow)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a stop token included): how speculative
        drafts are checked without committing to them."""
        ...


class GrammarBackend(Protocol):
    """Compiles constraints for one tokenizer / vocabulary."""

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A compiled grammar for ``spec`` (slow: called off the engine thread).

        Raises:
            ValueError: naming ``structured_outputs.<field>`` when the schema / regex / grammar
                is invalid.
        """
        ...

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A matcher at the start of ``compiled``."""
        ...


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly ``choices`` (each a literal; JSON escaping is EBNF's)."""
    # ensure_ascii=False: an escaped character outside the BMP is a UTF-16 surrogate pair, which
    # the grammar reads as two code points (an emoji choice came out as CESU-8 bytes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class _XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)  # xgrammar keeps an unlimited rollback history


class XGrammarBackend:
    """xgrammar (https://github.com/mlc-ai/xgrammar): pushdown automata with precomputed
    context-independent token sets.

    Args:
        tokenizer: a Hugging Face tokenizer of the model.
        vocab_size: V, the model's logits width (may exceed ``len(tokenizer)``).
        stop_token_ids: the ids that end a sequence (EOS); allowed only where the grammar may
            end.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # Caching is ours (keyed by the request's spec); one thread per compile.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        kind = spec.kind
        field = f"structured_outputs.{kind}"
        if spec.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported (use "
                "disable_any_whitespace)"
            )
        c = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema: Any = {"type": "object"} if kind == "json_object" else spec.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if schema is True:  # JSON text "true": the boolean schema matching any value
                    schema = {}
                if schema is False:
                    raise ValueError("the schema false matches no value")
                if not isinstance(schema, dict):
                    raise ValueError("a JSON schema must be an object")
                compiled = c.compile_json_schema(
                    json.dumps(check_schema(schema)),
                    any_whitespace=not spec.disable_any_whitespace,
                    max_whitespace_cnt=MAX_JSON_WHITESPACE,
                    separators=(",", ":") if spec.disable_any_whitespace else None,
                    strict_mode=True,
                )
            elif kind == "regex":
                check_anchors(spec.regex or "")
                compiled = c.compile_regex(spec.regex or "")
            elif kind == "choice":
                compiled = c.compile_grammar(choice_grammar(spec.choice or []))
            elif "::=" in (spec.grammar or ""):
                compiled = c.compile_grammar(spec.grammar or "")
            else:  # no "::=" rules: read it as a Lark grammar (``start: ...``)
                compiled = c.compile_grammar(self._xgr.Grammar.from_lark(spec.grammar or ""))
            self._check_not_empty(compiled)
            return compiled
        except ValueError as e:
            raise ValueError(f"{field} is invalid: {_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types
            raise ValueError(f"{field} is invalid: {_first_line(e)}") from None

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def _check_not_empty(self, compiled: Any) -> None:
        """Refuse a grammar that allows no first token (stop tokens included: their bits are
        set where the grammar may end), such as the regex ``[^\\x00-\\U0010FFFF]``: every
        token of its reply would be rejected.

        Raises:
            ValueError: "it matches no string".
        """
        matcher = self._xgr.GrammarMatcher(compiled)
        bitmask = self._xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise ValueError("it matches no string")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    # Drop xgrammar's "[hh:mm:ss] /path/file.cc:123: " location prefix.
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0])[:300]


#: Backend name -> factory ``(tokenizer, vocab_size, stop_token_ids) -> GrammarBackend``.
GRAMMAR_BACKENDS: dict[str, Callable[[Any, int, list[int]], GrammarBackend]] = {
    "xgrammar": XGrammarBackend,
}
