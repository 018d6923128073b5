"""Batched, vectorised token sampler with counter-based (batch-independent) seeded randomness.

Processing order for one decoding step (like vLLM):

1. raw log-probabilities of the returned tokens come from ``log_softmax`` of the UNPROCESSED
   logits (so they do not depend on temperature, penalties, truncation ...);
2. ``logit_bias`` is added;
3. ``min_tokens``: EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` are set to ``-inf``
   while fewer than ``min_tokens`` tokens have been generated;
4. penalties: repetition (tokens seen in prompt OR output), frequency and presence (output only);
   then the structured-output grammar mask (``SamplingBatch.token_bitmask``): disallowed tokens
   of the constrained rows get ``-inf``, the whole batch in one op;
5. greedy rows take the argmax of the processed logits;
6. random rows are divided by their temperature, truncated by top-k, top-p then min-p, and
   sampled with the exponential race ``argmax(probs / E)``, ``E = -log(u)``, where the uniforms
   ``u`` come from a counter-based hash of ``(seed, step, token id)`` (see :func:`counter_uniform`).

Every per-row quantity is turned into a tensor once per step and processed with batched torch
ops; Python only walks the rows to gather their parameters and to build the output lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams, SamplingType
from pagedllm.structured.mask import TokenBitmask, apply_token_bitmask_

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

_U64 = (1 << 64) - 1
_GAMMA_U = 0x9E3779B97F4A7C15  # splitmix64 increment (golden ratio)
_M1_U = 0xBF58476D1CE4E5B9
_M2_U = 0x94D049BB133111EB
#: rows x vocab elements hashed at once in the random path (bounds temporary memory).
_RACE_CHUNK_ELEMENTS = 1 << 22


def _to_i64(x: int) -> int:
    """Reinterpret the low 64 bits of a Python int as a signed int64 value."""
    x &= _U64
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _to_i64(_GAMMA_U)
_M1 = _to_i64(_M1_U)
_M2 = _to_i64(_M2_U)


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser applied IN PLACE to an int64 tensor (multiplies wrap mod 2**64).

    In-place ops avoid allocating a fresh [R, V] int64 tensor per step of the mix.
    """
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        t = z >> shift
        t &= (1 << (64 - shift)) - 1  # logical shift
        z ^= t
        if mult is not None:
            z *= mult
    return z


def _mix64_py(z: int) -> int:
    """Pure-Python splitmix64 finaliser on unsigned 64-bit values (reference for tests)."""
    z &= _U64
    z = ((z ^ (z >> 30)) * _M1_U) & _U64
    z = ((z ^ (z >> 27)) * _M2_U) & _U64
    return z ^ (z >> 31)


def counter_uniform_py(seed: int, step: int, token_id: int) -> float:
    """Pure-Python reference of :func:`counter_uniform` for one ``(seed, step, token_id)``."""
    key = _mix64_py((_mix64_py(seed & _U64) + step * _GAMMA_U) & _U64)
    bits = _mix64_py((key + (token_id + 1) * _GAMMA_U) & _U64)
    return float((2 * (bits >> 41) + 1) * 2.0**-24)


def counter_uniform(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor | int
) -> torch.Tensor:
    """Counter-based uniforms: ``u[r, j] = hash(seeds[r], steps[r], token_ids[r, j])`` in (0, 1).

    The hash is splitmix64 run on int64 tensors (wrapping multiplies, logical shifts emulated by
    masking): ``key = mix(mix(seed) + step * G)``, ``bits = mix(key + (v + 1) * G)`` with ``G``
    the golden-ratio increment; the top 23 bits ``m`` give ``u = (2m + 1) / 2**24``, exactly
    representable in float32, in ``[2**-24, 1 - 2**-24]`` (so ``-log(u)`` is finite and > 0).
    No generator state is involved: every value depends only on its own counters.

    Args:
        seeds: [R] int64, one seed per row (Python seeds reduced with ``_to_i64``).
        steps: [R] int64, the step index of each row (tokens generated so far).
        token_ids: either V (int: all ids ``0..V-1`` for every row) or an int64 tensor of ids,
            [K] (same ids for every row) or [R, K].

    Returns:
        [R, V] or [R, K] float32 on the device of ``seeds``.
    """
    key = _mix64_(seeds.to(torch.int64).clone())
    key += steps.to(torch.int64) * _GAMMA
    _mix64_(key)
    if isinstance(token_ids, int):
        ids = torch.arange(token_ids, dtype=torch.int64, device=seeds.device)
    else:
        ids = token_ids.to(device=seeds.device, dtype=torch.int64)
    ctr = (ids + 1) * _GAMMA
    if ctr.dim() == 1:
        ctr = ctr[None, :].expand(key.shape[0], -1)
    z = ctr + key[:, None]  # fresh [R, K] tensor, mixed in place below
    _mix64_(z)
    z >>= 41
    z &= (1 << 23) - 1
    u = z.to(torch.float32)
    u.mul_(2.0).add_(1.0).mul_(2.0**-24)
    return u


def derive_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th parallel sample (``n`` / ``best_of``) of a request with ``seed``.

    ``derive_seed(seed, 0) == seed`` so that sample 0 of a request behaves like an ``n=1``
    request with the same seed; other indices give a hashed value in ``[0, 2**63)``.

    Args:
        seed: the request's seed (any Python int).
        index: 0-based index of the parallel sample (>= 0).

    Raises:
        ValueError: when ``index`` is negative.
    """
    if index < 0:
        raise ValueError(f"index must be >= 0, got {index}")
    if index == 0:
        return seed
    z = _mix64_py((_mix64_py(seed & _U64) ^ 0x5851F42D4C957F2D) + index * _GAMMA_U)
    return z >> 1


@dataclass
class SamplingBatch:
    """Per-row inputs for one step, rows in the same order as logits rows.

    Attributes:
        params: [B] sampling parameters of each row.
        seeds: [B] effective seed per row, always set (the engine draws one when the user gave
            none); any Python int, reduced modulo 2**64.
        output_token_ids: [B] tokens generated so far per row; ``len`` is the step index used by
            the random hash and the ``min_tokens`` counter.
        prompt_token_ids: [B] prompt tokens per row (used by the repetition penalty).
        eos_token_ids: model-wide EOS ids, masked while ``len(output) < min_tokens`` unless the
            row has ``ignore_eos``.
        token_bitmask: the allowed next tokens of the rows under a grammar (structured
            outputs), or None.
    """

    params: list[SamplingParams]
    seeds: list[int]
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]]
    eos_token_ids: list[int]
    token_bitmask: TokenBitmask | None = None

    def select(self, rows: list[int]) -> SamplingBatch:
        """The sub-batch of ``rows`` (in that order), the grammar mask of its constrained rows
        included (None when none of them is constrained)."""
        mask = None
        if self.token_bitmask is not None:
            constrained = set(self.token_bitmask.rows)
            kept = [j for j, r in enumerate(rows) if r in constrained]
            if kept:
                bits = self.token_bitmask.bitmask
                mask = TokenBitmask(bits[torch.tensor(rows, device=bits.device)], kept)
        return SamplingBatch(
            [self.params[i] for i in rows],
            [self.seeds[i] for i in rows],
            [self.output_token_ids[i] for i in rows],
            [self.prompt_token_ids[i] for i in rows],
            self.eos_token_ids,
            mask,
        )


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        sampled_token_ids: [B] chosen token ids.
        sampled_logprobs: [B] log-probability (natural log) of the chosen token under the RAW
            model distribution (``log_softmax`` of the unprocessed logits).
        sampled_ranks: [B] 1-based rank of the chosen token in the raw distribution
            (1 + number of tokens with a strictly larger raw logit); 0 for every row when no row
            asked for logprobs (the count is a full pass over the logits, skipped then).
        top_logprobs: [B] per row the top-k ``(token_id, raw logprob)`` pairs sorted by
            decreasing logprob, ``k = params.logprobs`` (``[]`` for 0); None when the row asked
            for no logprobs.
    """

    sampled_token_ids: list[int]
    sampled_logprobs: list[float]
    sampled_ranks: list[int]
    top_logprobs: list[list[tuple[int, float]] | None]


def _counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, V] float32 occurrence counts of each token id per row (scatter_add over padded ids)."""
    rows = len(token_lists)
    max_len = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=device)
    if max_len == 0:
        return counts[:, :vocab_size]
    padded = torch.tensor(
        [t + [vocab_size] * (max_len - len(t)) for t in token_lists],
        dtype=torch.int64,
        device=device,
    )
    if int(padded.min()) < 0 or int(padded.max()) > vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}) for the penalties")
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler:
    """Chooses the next token of every row of a batch (see the module docstring for the order).

    Randomness is seeded and batch-independent without per-row ``torch.Generator`` objects: row
    ``i`` with seed ``s`` at step ``t = len(output_token_ids[i])`` draws ``u[v] = hash(s, t, v)``
    for every vocabulary id ``v`` (:func:`counter_uniform`, a vectorised splitmix64) and picks
    ``argmax_v probs[v] / -log(u[v])`` (the exponential race, equivalent to Gumbel-max: it samples
    exactly from ``probs``). The choice therefore depends only on ``(seed, step, the row's
    logits)``: never on the batch composition, the row's position, or the other rows, and a
    sequence recomputed after preemption draws the same token again at the same step.

    Args:
        vocab_size: V, number of real token ids. Logits with more columns (padded vocabulary) are
            cut to the first V columns.
        cpu_ops: the C++ CPU kernels (``pagedllm.ops.load_cpu_ops()``) or None; with it,
            float32 CPU logits get their argmax and logsumexp in one fused pass per row
            instead of three ATen passes over [B, V].
    """

    def __init__(self, vocab_size: int, cpu_ops: CpuOps | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.cpu_ops = cpu_ops

    # ------------------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [B, vocab] float32 (bf16/fp16 are upcast to float32 first), vocab >= V.
                Not modified.
            batch: per-row parameters, seeds and token histories, B rows.

        Returns:
            :class:`SamplerOutput` with B entries in each list.

        Raises:
            ValueError: wrong logits shape, row-count mismatch, or a ``logit_bias`` /
                ``stop_token_ids`` / EOS / history token id outside ``[0, V)``.
        """
        V = self.vocab_size
        if logits.dim() != 2 or logits.shape[1] < V:
            raise ValueError(f"logits must be [B, >= {V}], got {tuple(logits.shape)}")
        B = logits.shape[0]
        params = batch.params
        for name in ("params", "seeds", "output_token_ids", "prompt_token_ids"):
            if len(getattr(batch, name)) != B:
                raise ValueError(
                    f"batch.{name} has {len(getattr(batch, name))} rows, logits have {B}"
                )
        if B == 0:
            return SamplerOutput([], [], [], [])
        raw = logits[:, :V].float()  # a view when already float32: never modified in place
        device = raw.device
        processed = self._process(raw, batch)

        # Greedy rows keep ``sampled``; ``lse`` (logsumexp of the raw rows) serves the logprobs.
        sampled, lse = self._argmax_and_lse(raw, processed)
        rand_rows = [i for i, p in enumerate(params) if p.sampling_type != SamplingType.GREEDY]
        if rand_rows:
            sampled[torch.tensor(rand_rows, device=device)] = self._sample_random(
                processed, batch, rand_rows
            )

        return self._build_output(raw, sampled, params, lse)

    def probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row's sampled token is drawn from (logit bias, ``min_tokens``,
        penalties, grammar, then temperature / top-k / top-p / min-p, softmax): what
        ``__call__`` samples with its exponential race. Speculative decoding's rejection
        sampling (``spec_decode.rejection``) needs it for the target and the draft model.

        Args:
            logits: [B, vocab] float logits (vocab >= V); batch: B rows, none greedy.

        Returns:
            [B, V] float32 probabilities (rows sum to 1).

        Raises:
            ValueError: a greedy row (its distribution is the argmax, not a softmax).
        """
        if any(p.sampling_type == SamplingType.GREEDY for p in batch.params):
            raise ValueError("Sampler.probs: greedy rows have no sampling distribution")
        processed = self._process(logits[:, : self.vocab_size].float(), batch)
        return self._filtered_probs(processed, batch, list(range(processed.shape[0])))

    def output_for(
        self, logits: torch.Tensor, token_ids: list[int], params: list[SamplingParams]
    ) -> SamplerOutput:
        """A ``SamplerOutput`` for tokens chosen elsewhere (rejection sampling): their raw
        logprobs, ranks and the rows' top logprobs, as ``__call__`` reports its own samples.

        Args:
            logits: [B, vocab] float logits; token_ids: [B] chosen ids; params: [B].
        """
        raw = logits[:, : self.vocab_size].float()
        chosen = torch.tensor(token_ids, dtype=torch.int64, device=raw.device)
        return self._build_output(raw, chosen, params)

    def _process(self, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """``raw`` [B, V] after logit bias, ``min_tokens``, penalties and the grammar mask (a
        copy when any applies; ``raw`` itself otherwise)."""
        params = batch.params
        outs = batch.output_token_ids
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        min_tok_rows = [i for i, p in enumerate(params) if len(outs[i]) < p.min_tokens]
        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        grammar = batch.token_bitmask
        modified = bias_rows or min_tok_rows or pen_rows or grammar is not None
        processed = raw.clone() if modified else raw

        if bias_rows:
            self._apply_logit_bias(processed, params, bias_rows)
        if min_tok_rows:
            self._apply_min_tokens(processed, batch, min_tok_rows)
        if pen_rows:
            self._apply_penalties(processed, batch, pen_rows)
        if grammar is not None:
            apply_token_bitmask_(processed, grammar.bitmask, grammar.rows)
            if min_tok_rows:
                self._unblock_grammar_rows(processed, raw, grammar)
        return processed

    # ------------------------------------------------------------------------------------------
    def _apply_logit_bias(
        self, logits: torch.Tensor, params: list[SamplingParams], rows: list[int]
    ) -> None:
        V = self.vocab_size
        r_idx: list[int] = []
        t_idx: list[int] = []
        vals: list[float] = []
        for i in rows:
            bias = params[i].logit_bias or {}
            r_idx.extend([i] * len(bias))
            t_idx.extend(bias.keys())
            vals.extend(bias.values())
        if t_idx and (min(t_idx) < 0 or max(t_idx) >= V):
            raise ValueError(f"logit_bias token ids must be in [0, {V})")
        dev = logits.device
        logits.index_put_(
            (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)),
            torch.tensor(vals, dtype=logits.dtype, device=dev),
            accumulate=True,
        )

    def _apply_min_tokens(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> None:
        V = self.vocab_size
        r_idx: list[int] = []
        t_idx: list[int] = []
        for i in rows:
            p = batch.params[i]
            ids = set(p.stop_token_ids or [])
            if not p.ignore_eos:
                ids.update(batch.eos_token_ids)
            r_idx.extend([i] * len(ids))
            t_idx.extend(ids)
        if not t_idx:
            return
        if min(t_idx) < 0 or max(t_idx) >= V:
            raise ValueError(f"stop_token_ids / eos_token_ids must be in [0, {V})")
        dev = logits.device
        logits[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")

    def _unblock_grammar_rows(
        self, processed: torch.Tensor, raw: torch.Tensor, grammar: TokenBitmask
    ) -> None:
        """A grammar row left with no token (its grammar allows only EOS, which ``min_tokens``
        masks) takes the grammar's mask alone: the grammar wins over ``min_tokens``."""
        rows = torch.tensor(grammar.rows, device=processed.device)
        dead = torch.isneginf(processed.index_select(0, rows)).all(dim=-1)
        if bool(dead.any()):
            for r in rows[dead].tolist():
                processed[r] = raw[r]
                apply_token_bitmask_(processed, grammar.bitmask, [r])

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> None:
        V = self.vocab_size
        dev = logits.device
        params = [batch.params[i] for i in rows]
        all_rows = len(rows) == logits.shape[0]
        row_t = None if all_rows else torch.tensor(rows, device=dev)
        sub = logits if row_t is None else logits.index_select(0, row_t)

        out_counts = _counts([batch.output_token_ids[i] for i in rows], V, dev)
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=sub.dtype, device=dev)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)

        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_counts = _counts([batch.prompt_token_ids[i] for i in rows], V, dev)
            seen = (out_counts > 0) | (prompt_counts > 0)
            # Penalties past float32's range (1e-40 is a float32 denormal, 1e39 is inf) would make
            # inf or nan logits: kept within it, the limit holds (seen tokens win or vanish). The
            # bound leaves room for the division by any sampling temperature (>= 1e-5).
            fi = torch.finfo(sub.dtype)
            r = rep[:, None].clamp(min=fi.tiny, max=fi.max)
            bound = fi.max * GREEDY_TEMPERATURE_EPS
            penalised = torch.where(sub > 0, sub / r, sub * r).clamp_(min=-bound, max=bound)
            sub = torch.where(seen, penalised, sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            sub = sub - freq[:, None] * out_counts - pres[:, None] * (out_counts > 0).to(sub.dtype)

        if row_t is None:
            logits.copy_(sub)
        else:
            logits.index_copy_(0, row_t, sub)

    def _sample_random(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the seeded exponential race for ``rows``.

        Truncation keeps ties: top-k keeps every token whose value is >= the k-th largest value,
        top-p keeps every token whose value is >= the smallest value of the nucleus (the
        shortest prefix of the descending order whose mass reaches ``top_p``).

        Returns [len(rows)] int64 token ids.
        """
        V = self.vocab_size
        dev = logits.device
        R = len(rows)
        probs = self._filtered_probs(logits, batch, rows)
        seeds = torch.tensor([_to_i64(batch.seeds[i]) for i in rows], dtype=torch.int64, device=dev)
        steps = torch.tensor(
            [len(batch.output_token_ids[i]) for i in rows], dtype=torch.int64, device=dev
        )
        n_cand = int(torch.count_nonzero(probs > 0, dim=-1).max())
        chosen = torch.empty(R, dtype=torch.int64, device=dev)
        if n_cand * 4 <= V:
            # Few candidates (top-k / small nucleus): hash only their ids. The uniform of a token
            # depends on its id, not its position, so the result equals the full-vocab race.
            cand_p, cand_ids = probs.topk(max(n_cand, 1), dim=-1)
            width = cand_ids.shape[1]
        else:
            cand_p, cand_ids, width = probs, None, V
        chunk = max(1, _RACE_CHUNK_ELEMENTS // width)
        for s in range(0, R, chunk):
            e = min(s + chunk, R)
            ids = V if cand_ids is None else cand_ids[s:e]
            expo = counter_uniform(seeds[s:e], steps[s:e], ids).log_().neg_()  # Exp(1), > 0
            pick = (cand_p[s:e] / expo).argmax(dim=-1)
            chosen[s:e] = pick if cand_ids is None else cand_ids[s:e].gather(1, pick[:, None])[:, 0]
        return chosen

    def _filtered_probs(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> torch.Tensor:
        """[len(rows), V] float32: softmax of ``rows`` of ``logits`` after temperature, top-k,
        top-p and min-p (truncation keeps ties, see ``_sample_random``)."""
        V = self.vocab_size
        dev = logits.device
        neg_inf = float("-inf")
        params = [batch.params[i] for i in rows]
        x = logits.index_select(0, torch.tensor(rows, device=dev))
        temps = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev)
        x /= temps[:, None]

        # ---- top-k: threshold at the k-th largest value (topk is much cheaper than a sort) ---
        ks = [min(p.top_k, V) for p in params]
        if any(k > 0 for k in ks):
            k_t = torch.tensor(ks, device=dev)
            kth = x.topk(max(ks), dim=-1).values.gather(1, (k_t - 1).clamp(min=0)[:, None])
            kth = kth.masked_fill((k_t == 0)[:, None], neg_inf)
            x.masked_fill_(x < kth, neg_inf)

        # ---- top-p on the remaining tokens --------------------------------------------------
        tp_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if tp_rows:
            tp_idx = torch.tensor(tp_rows, device=dev)
            xs = x.index_select(0, tp_idx)
            if all(ks[j] > 0 for j in tp_rows):
                kept = int(torch.count_nonzero(xs > neg_inf, dim=-1).max())
                vals = xs.topk(max(kept, 1), dim=-1).values
            else:
                vals = xs.sort(dim=-1, descending=True).values
            probs_sorted = vals.softmax(dim=-1)
            exclusive = probs_sorted.cumsum(dim=-1) - probs_sorted
            top_p = torch.tensor([params[j].top_p for j in tp_rows], dtype=x.dtype, device=dev)
            n_keep = torch.count_nonzero(exclusive < top_p[:, None], dim=-1).clamp(min=1)
            cutoff = vals.gather(1, (n_keep - 1)[:, None])
            xs.masked_fill_(xs < cutoff, neg_inf)
            x.index_copy_(0, tp_idx, xs)

        # ---- min-p --------------------------------------------------------------------------
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
            probs = x.softmax(dim=-1)
            thresh = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
            x.masked_fill_(probs < thresh, neg_inf)

        return x.softmax(dim=-1)

    def raw_logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """[B] float32 logsumexp of [B, V] raw logits, computed as the sampled tokens' logprobs
        compute it (the fused C++ pass on float32 CPU rows), so that a prompt token's logprob
        (``compute_prompt_logprobs``) is the same float as that token's when sampled."""
        raw = logits.float()
        _, lse = self._argmax_and_lse(raw, raw)
        return torch.logsumexp(raw, dim=-1) if lse is None else lse

    def _argmax_and_lse(
        self, raw: torch.Tensor, processed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B] int64 argmax of ``processed`` and [B] float32 logsumexp of ``raw`` (None: let
        ``_build_output`` compute it), in one fused C++ pass per row when ``cpu_ops`` is set."""
        ops = self.cpu_ops
        if ops is None or raw.device.type != "cpu" or raw.dtype != torch.float32:
            return processed.argmax(dim=-1), None
        arg, lse = ops.argmax_logsumexp(raw)
        if not all(map(math.isfinite, lse.tolist())):
            # NaN / inf logits (a broken model) take the ATen path, which propagates them.
            return processed.argmax(dim=-1), None
        return (arg if processed is raw else processed.argmax(dim=-1)), lse

    def _build_output(
        self,
        raw: torch.Tensor,
        sampled: torch.Tensor,
        params: list[SamplingParams],
        lse: torch.Tensor | None = None,
    ) -> SamplerOutput:
        if lse is None:
            lse = torch.logsumexp(raw, dim=-1)
        chosen_logit = raw.gather(1, sampled[:, None]).squeeze(1)
        sampled_lp = chosen_logit - lse
        ks = [p.logprobs for p in params]
        if any(k is not None for k in ks):
            ranks = (torch.count_nonzero(raw > chosen_logit[:, None], dim=-1) + 1).tolist()
        else:
            ranks = [0] * len(ks)

        k_max = max((k for k in ks if k is not None), default=0)
        top: list[list[tuple[int, float]] | None] = [None if k is None else [] for k in ks]
        if k_max > 0:
            top_vals, top_idx = raw.topk(min(k_max, self.vocab_size), dim=-1)
            vals = (top_vals - lse[:, None]).tolist()
            idx = top_idx.tolist()
            for i, k in enumerate(ks):
                if k:
                    top[i] = list(zip(idx[i][:k], vals[i][:k], strict=True))
        return SamplerOutput(
            sampled_token_ids=sampled.tolist(),
            sampled_logprobs=sampled_lp.tolist(),
            sampled_ranks=ranks,
            top_logprobs=top,
        )
