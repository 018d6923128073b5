"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import copy
import enum
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Literal

from pagedllm.pooling_params import PoolingParams

#: Temperatures below this are treated as greedy decoding (argmax).
GREEDY_TEMPERATURE_EPS = 1e-5
#: ``logit_bias`` values must lie in [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT] (OpenAI's range).
LOGIT_BIAS_LIMIT = 100.0
#: A ``logit_bias`` string key: a decimal integer in ASCII digits (no sign, space, ``_`` or
#: other scripts' digits, which ``int()`` would take; at most 64 digits, far past any
#: vocabulary); a leading ``-`` gets the ">= 0" message.
_DECIMAL = re.compile(r"-?[0-9]{1,64}")


class SamplingType(enum.IntEnum):
    """How the next token of a request is chosen.

    GREEDY: argmax of the processed logits (temperature < 1e-5 or top_k == 1).
    RANDOM: random sampling; the engine draws a seed for the request.
    RANDOM_SEED: random sampling with a user-given seed (reproducible).
    """

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


#: Most speculative tokens a request may ask for per step.
MAX_SPECULATIVE_TOKENS = 32


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _as_float(name: str, value: Any) -> float:
    # A real number only: True is no temperature, and "0.5" is a caller's bug, not a value.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


#: Fields of :class:`StructuredOutputsParams` that name a constraint (exactly one is set).
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (constrained decoding), shaped like vLLM's object.

    Exactly one of the constraint fields is set:

    Attributes:
        json: a JSON schema (``dict``, or its JSON text; the boolean schema ``True`` means
            ``{}``, ``False`` is refused) the output must validate against.
        json_object: True = any syntactically valid JSON object (OpenAI ``json_object`` mode).
        regex: a regular expression the whole output must match.
        choice: a non-empty list of strings; the output is exactly one of them.
        grammar: a context-free grammar (EBNF / GBNF text) the output must derive from.
        disable_any_whitespace: JSON modes only: no whitespace at all between JSON tokens
            (the default allows a short bounded run, never an unbounded one).
        whitespace_pattern: JSON modes only: a regex for the whitespace allowed between JSON
            tokens (overrides the bounded default); None = the default.

    Raises:
        ValueError: from ``__post_init__``: message starting with ``structured_outputs`` and
            naming the field when none or several constraints are set or one has the wrong type.
            Whether a schema / regex / grammar compiles is checked later, when it is compiled
            (also a ValueError).
    """

    json: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json is True:  # JSON Schema's boolean schemas: true matches any value
            self.json = {}
        elif self.json is False:
            raise ValueError("structured_outputs.json is false: the schema matches no value")
        set_fields = [k for k in STRUCTURED_OUTPUT_KINDS if self._is_set(k)]
        if len(set_fields) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got "
                f"{', '.join(set_fields) if set_fields else 'none'}"
            )
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (object or JSON text), "
                f"got {type(self.json).__name__}"
            )
        if not isinstance(self.json_object, bool):
            raise ValueError(
                f"structured_outputs.json_object must be a boolean, got {self.json_object!r}"
            )
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            choice = list(self.choice) if isinstance(self.choice, (list, tuple)) else None
            if not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of strings, "
                    f"got {self.choice!r}"
                )
            self.choice = choice
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a boolean, "
                f"got {self.disable_any_whitespace!r}"
            )

    def _is_set(self, name: str) -> bool:
        v = getattr(self, name)
        return v is not False and v is not None

    @property
    def kind(self) -> str:
        """The one constraint field that is set: ``"json"``, ``"json_object"``, ``"regex"``,
        ``"choice"`` or ``"grammar"``."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if self._is_set(k))


@dataclass
class SamplingParams:
    """Sampling parameters of one request (defaults and meaning as in vLLM / the OpenAI API).

    Attributes:
        n: number of output sequences returned for the prompt (>= 1).
        best_of: number of sequences generated, the best ``n`` returned (>= n); None means n.
        presence_penalty: subtracted once from the logit of every token already present in the
            OUTPUT so far, in [-2, 2].
        frequency_penalty: subtracted ``count`` times from the logit of every token, where count is
            its number of occurrences in the OUTPUT so far, in [-2, 2].
        repetition_penalty: > 0; logits of tokens seen in the prompt OR the output are divided by
            it when positive and multiplied by it when negative (1 = off).
        temperature: >= 0, finite; logits are divided by it. Below 1e-5 means greedy.
        top_p: nucleus sampling mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off (-1 is stored as 0).
        min_p: in [0, 1]; drop tokens whose probability is below ``min_p`` times the top one.
        seed: random seed making the request's samples reproducible, an int64 (the OpenAI
            API's range); None = engine-drawn.
        stop: strings that end generation; a plain ``str`` is normalised to a one-item list,
            None to ``[]``. Each must be non-empty.
        stop_token_ids: token ids (>= 0) that end generation; None is normalised to ``[]``.
        ignore_eos: keep generating after the model's EOS token(s).
        max_tokens: maximum number of generated tokens (>= 1); None = up to max_model_len.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated
            (0 <= min_tokens <= max_tokens).
        logprobs: number of top log-probabilities returned per output token (>= 0) or None.
        prompt_logprobs: number of top log-probabilities returned per prompt token (>= 0) or None.
        include_stop_str_in_output: keep the matched stop string in the output text.
        skip_special_tokens: drop special tokens when detokenizing.
        spaces_between_special_tokens: put spaces between special tokens when detokenizing
            (slow tokenizers only).
        logit_bias: ``{token_id: bias}`` added to the raw logits. String keys must be decimal
            token ids such as ``"123"`` (ASCII digits only) and are converted to int; values
            must be numbers in [-100, 100] (OpenAI's range; never clamped).
        use_beam_search: beam search instead of sampling.
        length_penalty: beam-search length penalty exponent (finite).
        early_stopping: beam-search stopping rule: True, False or ``"never"``.
        detokenize: produce output text (False = token ids only).
        pooling: set for an embedding request (``LLM.embed``, ``/v1/embeddings``): the prompt
            is prefilled and its pooled final hidden state returned
            (``RequestOutput.embedding``); nothing is sampled and the other fields are unused.
        structured_outputs: constrain the output to a JSON schema / regex / choice / grammar
            (:class:`StructuredOutputsParams`); None = unconstrained. Not allowed with beam search.
        num_speculative_tokens: most speculative tokens proposed per step for this request
            (``spec_decode``; needs an engine ``speculative_config``): None = the engine's
            default, 0 = off. Not allowed with beam search.

    Raises:
        ValueError: from ``__post_init__`` when a field is invalid; the message starts with the
            field's name, e.g. ``"temperature must be non-negative and finite, got -1"``.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    detokenize: bool = True
    pooling: PoolingParams | None = None
    structured_outputs: StructuredOutputsParams | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        # ---- counts -------------------------------------------------------------------------
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(
                f"best_of must be an integer >= n ({self.n}) when given, got {self.best_of!r}"
            )

        # ---- penalties ----------------------------------------------------------------------
        for name in ("presence_penalty", "frequency_penalty"):
            v = _as_float(name, getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
            setattr(self, name, v)
        rp = _as_float("repetition_penalty", self.repetition_penalty)
        if not (rp > 0.0 and math.isfinite(rp)):
            raise ValueError(
                f"repetition_penalty must be positive and finite, got {self.repetition_penalty!r}"
            )
        self.repetition_penalty = rp

        # ---- temperature / truncation --------------------------------------------------------
        t = _as_float("temperature", self.temperature)
        if not (t >= 0.0 and math.isfinite(t)):
            raise ValueError(
                f"temperature must be non-negative and finite, got {self.temperature!r}"
            )
        self.temperature = t
        p = _as_float("top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_p = p
        if not _is_int(self.top_k) or (self.top_k < 0 and self.top_k != -1):
            raise ValueError(
                f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}"
            )
        if self.top_k == -1:
            self.top_k = 0
        mp = _as_float("min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self.min_p = mp

        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            # The OpenAI API's and vLLM's range; wider seeds would wrap onto smaller ones.
            raise ValueError(f"seed must be in [-2**63, 2**63 - 1] (int64), got {self.seed!r}")

        # ---- lengths ------------------------------------------------------------------------
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise ValueError(f"{name} must be an integer >= 0 or None, got {v!r}")

        # ---- stops --------------------------------------------------------------------------
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)) or hasattr(
            self.stop_token_ids, "tolist"
        ):  # (numpy / torch arrays as well)
            ids = self.stop_token_ids
            self.stop_token_ids = list(ids.tolist() if hasattr(ids, "tolist") else ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}"
            )
        for tid in self.stop_token_ids:
            if not _is_int(tid) or tid < 0:
                raise ValueError(f"stop_token_ids must be integers >= 0, got {tid!r}")

        # ---- logit bias ---------------------------------------------------------------------
        if self.logit_bias is not None:
            bias: dict[int, float] = {}
            for key, val in dict(self.logit_bias).items():
                if _is_int(key):
                    tid = key
                elif isinstance(key, str) and _DECIMAL.fullmatch(key):
                    tid = int(key)
                else:
                    raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
                if tid < 0:
                    raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
                try:
                    b = float(val)
                except (TypeError, ValueError):
                    raise ValueError(
                        f"logit_bias values must be finite numbers, got {val!r} for {key!r}"
                    ) from None
                if isinstance(val, bool) or not math.isfinite(b):
                    raise ValueError(
                        f"logit_bias values must be finite numbers, got {val!r} for {key!r}"
                    )
                if not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
                    raise ValueError(
                        f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, "
                        f"{LOGIT_BIAS_LIMIT:g}], got {val!r} for {key!r}"
                    )
                bias[tid] = b
            self.logit_bias = bias

        # ---- beam search --------------------------------------------------------------------
        lp = _as_float("length_penalty", self.length_penalty)
        if not math.isfinite(lp):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")
        self.length_penalty = lp
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )

        # ---- structured outputs -------------------------------------------------------------
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = set(so) - set(StructuredOutputsParams.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}")
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}"
            )
        if so is not None and self.use_beam_search:
            raise ValueError("structured_outputs is not supported with use_beam_search")

        # ---- speculative decoding -----------------------------------------------------------
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] "
                f"or None, got {k!r}"
            )
        if k and self.use_beam_search:
            raise ValueError("num_speculative_tokens is not supported with use_beam_search")

    # ------------------------------------------------------------------------------------------
    def verify_token_ids(self, vocab_size: int) -> None:
        """Check that every token id named by the request lies in ``[0, vocab_size)``.

        Args:
            vocab_size: number of token ids of the model (int).

        Raises:
            ValueError: message starting with ``stop_token_ids`` or ``logit_bias`` for an id
                outside the vocabulary.
        """
        for tid in self.stop_token_ids or []:
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"stop_token_ids must be in [0, {vocab_size}) for this model, got {tid}"
                )
        for tid in self.logit_bias or {}:
            if not 0 <= tid < vocab_size:
                raise ValueError(
                    f"logit_bias token ids must be in [0, {vocab_size}) for this model, got {tid}"
                )

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY when temperature < 1e-5 or top_k == 1, else RANDOM_SEED / RANDOM by ``seed``."""
        if self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def all_stop_token_ids(self, eos_ids: list[int] | set[int] | tuple[int, ...]) -> set[int]:
        """Token ids that finish the request: ``stop_token_ids`` plus the model's ``eos_ids``
        (the latter left out when ``ignore_eos``)."""
        ids = set(self.stop_token_ids or [])
        if not self.ignore_eos:
            ids.update(eos_ids)
        return ids

    @property
    def max_stop_str_len(self) -> int:
        """Length in characters of the longest stop string (0 when there is none)."""
        return max((len(s) for s in self.stop or []), default=0)

    @property
    def needs_penalties(self) -> bool:
        """True when any of the repetition / frequency / presence penalties is active."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        """Deep copy (lists and the bias dict are not shared with the original)."""
        return copy.deepcopy(self)
