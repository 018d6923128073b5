"""Beam-search selection logic, pure: no model, no KV blocks.

The engine owns the sequences and their KV blocks (it forks the parent's block table for every
kept child -- the paper's block tree -- and frees the beams that are dropped).  This module only
decides, each step, which ``(parent beam, next token)`` pairs survive and which hypotheses are
finished.  It reproduces transformers 5.x ``generate(num_beams=W, do_sample=False,
length_penalty=LP, early_stopping=ES, max_new_tokens=M, num_return_sequences=n)`` for one prompt
bit for bit: the same float32 tensors go through the same ``torch.topk`` calls, so tie-breaks,
finished sequences, their order and ``sequences_scores`` all match.

The transformers behaviours reproduced here:

* Every step keeps the top ``K = max(2, 1 + n_eos) * W`` candidates of the ``[W * V]`` row of
  accumulated float32 log-probabilities (``logprob + running cum_logprob``); the flat index
  ``beam * V + token`` decides ties.  On the first step transformers has ``W`` copies of the
  prompt where copies ``1..W-1`` carry the score ``-1e9``; :meth:`BeamSearch.step` rebuilds that
  exact tensor from the single live beam.
* A candidate "hits a stopping criterion" when its token is an EOS id or when it is the
  ``max_tokens``-th generated token.  The next running beams are the top ``W`` of the ``K``
  candidates after ``-1e9`` is added to the ones that hit a criterion.
* Only candidates among the first ``W`` of the ``K`` that hit a criterion may become finished
  hypotheses (an EOS candidate ranked ``W..K-1`` is dropped).  Their score is
  ``cum_logprob / gen_len ** length_penalty`` where ``gen_len`` counts generated tokens only
  (including the final EOS; the prompt length never matters -- case C16).  They are merged with
  the ``W`` kept hypotheses (old ones first) and the top ``W`` are kept, via ``torch.topk``.
  When the ``max_tokens``-th token is generated, every candidate hits the length criterion, so the
  best ``W`` running continuations enter the finished set this way.
* Stopping (``done``): all ``K`` candidates hit a criterion (max length); or ``early_stopping is
  True`` and ``W`` hypotheses are finished; or the early-stop heuristic says no running beam can
  beat the worst of ``W`` finished hypotheses: the best running ``cum_logprob`` divided by
  ``L ** length_penalty`` with ``L = max_tokens`` for ``early_stopping == "never"`` and a positive
  penalty, else ``L`` = the current generated length.  The heuristic flag is sticky.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

_NEG = -1.0e9  # transformers' "impossible" score
# An empty finished slot, and a candidate that may not finish. transformers marks both with
# -1e9 too, which a real score passes below once |cum_logprob| * gen_len ** -length_penalty
# exceeds 1e9 (a negative length_penalty: -10 over 8 tokens); those hypotheses then lost to
# empty slots and a request came back with no output. Real scores are kept finite (_scores),
# so -inf is below every one of them.
_EMPTY = -math.inf
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class BeamHypothesis:
    """A finished beam.

    Attributes:
        token_ids: generated tokens only (includes the final EOS if it ended with one).
        cum_logprob: sum of the log-probabilities of ``token_ids`` (float32 accumulation).
        score: ``cum_logprob / len(token_ids) ** length_penalty`` as transformers computes it
            (float32); this is transformers' ``sequences_scores`` entry.
        finished_by_eos: whether the last token is one of the EOS ids.
        logprobs: per token of ``token_ids``, the request's logprob entries when it asks for
            them (set by the engine, ``beam_stepper``; this module never reads them).
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finished_by_eos: bool
    logprobs: list[Any] | None = None


class BeamSearch:
    """Beam-search bookkeeping for one request (see the module docstring for the exact rules).

    Usage::

        bs = BeamSearch(W, length_penalty, early_stopping, max_tokens, eos_ids, vocab_size)
        beams = [([], 0.0)]                              # the prompt: no generated tokens
        while True:
            logprobs = ...                               # [len(beams), V] log_softmax rows
            kept = bs.step(logprobs, beams)              # [(parent_row, token, cum_logprob)]
            if bs.done:
                break
            beams = [(beams[p][0] + [t], c) for p, t, c in kept]
        best = bs.finalize(beams, n)

    The engine must pass the beams of the next step in the order ``step`` returned them (row
    order is part of transformers' tie-breaking).
    """

    def __init__(
        self,
        beam_width: int,
        length_penalty: float,
        early_stopping: bool | str,
        max_tokens: int,
        eos_token_ids: list[int],
        vocab_size: int,
    ) -> None:
        if beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {beam_width}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        self.beam_width = beam_width
        self.length_penalty = float(length_penalty)
        self.early_stopping = early_stopping
        self.max_tokens = max_tokens
        self.eos_token_ids = list(dict.fromkeys(int(t) for t in eos_token_ids))
        self.vocab_size = vocab_size
        # candidates kept per step: enough that W of them are not EOS
        self.num_candidates = max(2, 1 + len(self.eos_token_ids)) * beam_width
        if self.num_candidates > beam_width * vocab_size:
            raise ValueError("vocab_size too small for this beam width / number of EOS ids")
        self._eos_set = set(self.eos_token_ids)
        self._top_w_mask = torch.zeros((1, self.num_candidates), dtype=torch.bool)
        self._top_w_mask[:, :beam_width] = True
        # the W finished slots, sorted best first; a slot holding a "hypothesis" that is not
        # finished (transformers fills empty slots with ~-1e9 scores) has ``None``
        self._slot_scores = torch.full((1, beam_width), _EMPTY, dtype=torch.float32)
        self._slot_finished = torch.zeros((1, beam_width), dtype=torch.bool)
        self._slot_hyps: list[BeamHypothesis | None] = [None] * beam_width
        self._heuristic_unsatisfied = torch.ones((1, 1), dtype=torch.bool)
        self._num_generated = 0  # tokens generated by every running beam so far
        self._done = False

    # ------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Whether beam search is over (transformers would leave its generation loop)."""
        return self._done

    @property
    def hypotheses(self) -> list[BeamHypothesis]:
        """The finished hypotheses kept so far, best first."""
        return [h for h in self._slot_hyps if h is not None]

    @property
    def num_generated(self) -> int:
        """Number of tokens every running beam has generated so far."""
        return self._num_generated

    def _scores(self, cum_logprobs: torch.Tensor, gen_len: int) -> torch.Tensor:
        """``cum_logprobs / gen_len ** length_penalty`` (float32), as transformers computes it
        (Python ``int ** float``), kept finite: a penalty past the float range (``gen_len **
        1000``) counts as infinite (transformers raises ``OverflowError`` there), and +-inf
        scores (a penalty that underflows to 0) become +-float32 max, so that no real score
        ties with an empty slot. Values inside the range are unchanged, bit for bit."""
        try:
            penalty = gen_len**self.length_penalty
        except OverflowError:
            penalty = math.inf
        return torch.nan_to_num(
            cum_logprobs / penalty, nan=0.0, posinf=_FLOAT32_MAX, neginf=-_FLOAT32_MAX
        )

    # ------------------------------------------------------------------------------------------
    def step(
        self, logprobs: torch.Tensor, beams: list[tuple[list[int], float]]
    ) -> list[tuple[int, int, float]]:
        """Run one beam-search step.

        Args:
            logprobs: ``[len(beams), V]`` float32 ``log_softmax`` of the raw logits of each live
                beam (row ``i`` belongs to ``beams[i]``).
            beams: ``(generated token ids so far, cumulative logprob)`` per live beam, in the
                order the previous ``step`` returned them.  On the first step: one beam, the
                prompt, with no tokens (``[([], 0.0)]``).

        Returns:
            The new live beams as ``(parent_row, token_id, new_cum_logprob)``, ``beam_width`` of
            them in the order transformers keeps them (best first), or ``[]`` once :attr:`done`.
            Finished hypotheses are recorded internally (see :meth:`finalize`).  In degenerate
            cases (fewer than ``W`` candidates that did not hit a stopping criterion, e.g. a tiny
            vocabulary made of EOS ids) a kept beam can carry a ``~-1e9`` score, exactly as in
            transformers.
        """
        if self._done:
            raise RuntimeError("beam search is already done")
        w, v = self.beam_width, self.vocab_size
        n = len(beams)
        if logprobs.dim() != 2 or logprobs.shape[0] != n or logprobs.shape[1] != v:
            raise ValueError(f"logprobs must be [{n}, {v}], got {list(logprobs.shape)}")
        if not 1 <= n <= w:
            raise ValueError(f"expected 1..{w} live beams, got {n}")
        for toks, _ in beams:
            if len(toks) != self._num_generated:
                raise ValueError(
                    f"every live beam must have {self._num_generated} generated tokens, "
                    f"got {len(toks)}"
                )
        lp = logprobs.detach().to(device="cpu", dtype=torch.float32)
        scores = [float(c) for _, c in beams]
        if n < w:
            # transformers keeps W rows; the missing ones (first step: copies of the prompt)
            # have identical log-probs and a -1e9 running score
            lp = torch.cat([lp, lp[:1].expand(w - n, v)], dim=0)
            scores += [_NEG] * (w - n)
        running_scores = torch.tensor([scores], dtype=torch.float32)  # [1, W]

        # top-K continuations over the flat [W * V] accumulated log-probs
        acc = lp.view(1, w, v) + running_scores[:, :, None]
        acc = acc.reshape(1, w * v)
        topk_log_probs, topk_indices = torch.topk(acc, k=self.num_candidates)
        parents = (topk_indices // v)[0].tolist()
        tokens = (topk_indices % v)[0].tolist()
        gen_len = self._num_generated + 1

        hits = torch.tensor(
            [[t in self._eos_set or gen_len >= self.max_tokens for t in tokens]], dtype=torch.bool
        )

        # next running beams: best W of the candidates that did not hit a stopping criterion
        topk_running = topk_log_probs + hits.to(torch.float32) * _NEG
        next_idx = torch.topk(topk_running, k=w)[1][0].tolist()
        running_vals = topk_running[0].tolist()
        new_running_scores = topk_running[:, next_idx]  # [1, W], sorted descending

        # finished hypotheses: merge the top-W candidates that hit a criterion into the W slots.
        # transformers adds -1e9 to the others (and to all once the slots are full under
        # early_stopping=True, or once the heuristic is satisfied), and its first-step copies of
        # the prompt (rows n..W-1) score ~-1e9 too; here they are masked to _EMPTY instead, so
        # that they never outrank an empty slot whatever the real scores are.
        did_finish = hits & self._top_w_mask
        full = torch.all(self._slot_finished, dim=-1, keepdim=True) & (self.early_stopping is True)
        real_parent = torch.tensor([[p < n for p in parents]], dtype=torch.bool)
        may_finish = did_finish & real_parent & ~full & self._heuristic_unsatisfied
        cand = torch.where(may_finish, self._scores(topk_log_probs, gen_len), _EMPTY)
        merged_scores = torch.cat((self._slot_scores, cand), dim=1)
        merged_finished = torch.cat((self._slot_finished, may_finish), dim=1)
        keep = torch.topk(merged_scores, k=w)[1]
        cand_cum = topk_log_probs[0].tolist()
        new_hyps: list[BeamHypothesis | None] = []
        for j in keep[0].tolist():
            if j < w:
                new_hyps.append(self._slot_hyps[j])
            elif bool(may_finish[0, j - w]):
                c = j - w
                toks = list(beams[parents[c]][0]) + [tokens[c]]
                new_hyps.append(
                    BeamHypothesis(
                        token_ids=toks,
                        cum_logprob=cand_cum[c],
                        score=float(merged_scores[0, j]),
                        finished_by_eos=tokens[c] in self._eos_set,
                    )
                )
            else:
                new_hyps.append(None)
        self._slot_scores = torch.gather(merged_scores, 1, keep)
        self._slot_finished = torch.gather(merged_finished, 1, keep)
        self._slot_hyps = new_hyps
        self._num_generated = gen_len

        # stopping condition for the whole search
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = gen_len
        best_possible = self._scores(new_running_scores[:, :1], best_len)
        worst_finished = torch.where(
            self._slot_finished,
            torch.min(self._slot_scores, dim=1, keepdim=True)[0],
            torch.tensor(_EMPTY, dtype=torch.float32),
        )
        self._heuristic_unsatisfied = self._heuristic_unsatisfied & torch.any(
            best_possible > worst_finished, dim=-1, keepdim=True
        )
        improvement_possible = bool(torch.any(self._heuristic_unsatisfied))
        exists_open_beam = not (
            bool(torch.all(self._slot_finished)) and self.early_stopping is True
        )
        valid_continuations = not bool(torch.all(hits))
        self._done = not (improvement_possible and exists_open_beam and valid_continuations)
        if self._done:
            return []
        return [(parents[i], tokens[i], running_vals[i]) for i in next_idx]

    # ------------------------------------------------------------------------------------------
    def finalize(self, beams: list[tuple[list[int], float]], n: int) -> list[BeamHypothesis]:
        """The best ``n`` finished hypotheses, best first, as transformers returns them.

        Args:
            beams: the current live beams (as passed to :meth:`step`).  Only used when the search
                is stopped before :attr:`done` (e.g. the request was cut short): the live beams
                then enter the finished set as if their last token had hit ``max_tokens``.
                Ignored once :attr:`done`.
            n: number of hypotheses to return (``num_return_sequences``), ``1..beam_width``.
        """
        if not 1 <= n <= self.beam_width:
            raise ValueError(f"n must be in 1..{self.beam_width}, got {n}")
        if not self._done and beams and self._num_generated > 0:
            self._add_running_as_finished(beams)
        return [h for h in self._slot_hyps[:n] if h is not None]

    def _add_running_as_finished(self, beams: list[tuple[list[int], float]]) -> None:
        w = self.beam_width
        gen_len = self._num_generated
        cum = torch.tensor([[float(c) for _, c in beams]], dtype=torch.float32)
        cand = self._scores(cum, gen_len)
        merged = torch.cat((self._slot_scores, cand), dim=1)
        keep = torch.topk(merged, k=w)[1][0].tolist()
        hyps: list[BeamHypothesis | None] = []
        for j in keep:
            if j < w:
                hyps.append(self._slot_hyps[j])
            else:
                toks, c = beams[j - w]
                hyps.append(
                    BeamHypothesis(
                        token_ids=list(toks),
                        cum_logprob=float(cum[0, j - w]),
                        score=float(merged[0, j]),
                        finished_by_eos=bool(toks) and toks[-1] in self._eos_set,
                    )
                )
        self._slot_scores = merged[:, keep]
        self._slot_finished = torch.ones((1, w), dtype=torch.bool)
        self._slot_hyps = hyps
        self._done = True
