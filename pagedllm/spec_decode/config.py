"""The engine-wide speculative-decoding configuration (vLLM's ``--speculative-config`` shape)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from pagedllm.sampling_params import MAX_SPECULATIVE_TOKENS

#: Proposal methods; "suffix" needs ``pagedllm.spec_decode.suffix``; "draft_model" a ``model``.
SPEC_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """How the engine speculates (field names as in vLLM's speculative config).

    Attributes:
        method: "ngram" (prompt lookup: the last ``prompt_lookup_max..prompt_lookup_min`` tokens
            matched against the prompt and output so far), "suffix" (suffix decoding) or
            "draft_model". Left out (empty), it is inferred as vLLM does: "draft_model" when
            ``model`` names one, "ngram" otherwise (also for vLLM's ``model: "[ngram]"``).
        num_speculative_tokens: most tokens proposed per sequence and step (k, 1 ..
            ``MAX_SPECULATIVE_TOKENS`` = 32, a request's own bound); a request's
            ``SamplingParams.num_speculative_tokens`` may lower (or raise) it for itself.
        prompt_lookup_max / prompt_lookup_min: longest / shortest n-gram matched (tokens).
        disable_by_batch_size: no sequence speculates in a step once this many decoding
            sequences run (the step is then compute-bound, so verifying k tokens per sequence
            costs about k + 1 decodes). Default 16: from there on this CPU breaking even with k = 4
            needs a per-draft acceptance of ~0.5-0.7 (``benchmarks/spec_cutoff.py``, docs).
        step_rows_knee / step_row_cost: the step cost model of the n-gram / suffix policy: a
            forward step of up to ``step_rows_knee`` rows (tokens) costs about one one-token
            decode (weight-read-bound), each row past it adds ``step_row_cost`` of one. The
            proposals are trimmed per step so that a draft takes a row only while it raises the
            expected tokens per unit of step time (``spec_decode.policy.DraftAllocator``).
            This is the prior: with ``learn_step_cost`` the measured time of every decode /
            verification step replaces it (``policy.StepCostTable``). The defaults come from an
            AVX2 CPU before the fused layers (``benchmarks/spec_cutoff.py``, docs/spec_decode.md).
        learn_step_cost: learn the step cost from measured step times (default True); False
            keeps ``step_rows_knee`` / ``step_row_cost`` as they are.
        suffix_max_depth / suffix_max_cached_requests: the suffix proposer's tree depth and how
            many finished requests' outputs it keeps.
        model: the draft model of method "draft_model" (required there, refused elsewhere): a
            registry name or path as ``EngineConfig.model`` takes, or an already loaded
            ``pagedllm.model.loader.LoadedModel`` (tests share one). It must share the
            target's tokenizer (``spec_decode.draft_model``).

    Raises:
        ValueError: naming the field (``speculative_config.<field>``) when invalid.
    """

    method: str = ""
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = 16
    step_rows_knee: int = 6
    step_row_cost: float = 0.025
    learn_step_cost: bool = True
    suffix_max_depth: int = 24
    suffix_max_cached_requests: int = 1000
    model: Any = None

    def __post_init__(self) -> None:
        if not self.method:  # vLLM's rule: a draft model when one is named, else n-gram lookup
            if self.model in ("ngram", "[ngram]"):  # vLLM's older spelling of n-gram lookup
                self.model = None
            self.method = "ngram" if self.model is None or self.model == "" else "draft_model"
        if self.method not in SPEC_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}; "
                f"got {self.method!r}"
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("method", "model"):
                continue
            if f.name == "learn_step_cost":
                if not isinstance(value, bool):
                    raise ValueError(f"speculative_config.learn_step_cost must be true or false, got {value!r}")
                continue
            if f.name == "step_row_cost":
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"speculative_config.step_row_cost must be a number >= 0, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{f.name} must be an integer >= 1, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:  # a request's own bound too
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and (self.model is None or self.model == ""):
            raise ValueError(
                "speculative_config.model is required with method 'draft_model' (a registry "
                "name or path of a model sharing the target's tokenizer)"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(
                f"speculative_config.model is only used with method 'draft_model', not "
                f"{self.method!r}"
            )


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> (
    SpeculativeConfig | None
):
    """A ``SpeculativeConfig`` from a JSON object text (the CLI flag), a dict, or one already
    built; None stays None (no speculation).

    Raises:
        ValueError: naming ``speculative_config`` (not JSON, not an object, an unknown key) or
            the invalid field.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return SpeculativeConfig(**value)
