"""How many proposed tokens each sequence verifies in a step: a goodput rule over the batch.

A verification row is nearly free while the step is bound by reading the weights (few rows),
and costs a share of the compute once the step is compute-bound (many rows: a batch of 8
sequences with k = 4 scores 40 rows). So a proposed token is worth its row only when it is
likely to be accepted. Each sequence keeps an estimate ``alpha`` of its per-draft acceptance
(the probability that a draft is accepted given that the drafts before it were); draft ``j`` of
the sequence is then accepted with probability ``alpha ** j``. With the step cost modelled as
``T(R) = 1 + row_cost * max(0, R - knee_rows)`` in units of a one-token decode step (R = rows
of the step: one per sequence plus its drafts; flat while weight-read-bound, then each row adds
``row_cost``), the step keeps the drafts that maximise the
expected tokens per unit of step time (goodput), as SmartSpec does (Liu et al. 2024, "Optimizing
Speculative Decoding for Serving Large Language Models Using Goodput", section 4): drafts are
taken in decreasing order of ``alpha ** j`` (so each sequence keeps a prefix of its proposal)
while taking one more does not lower ``E[tokens] / T(R)`` (past the knee: while
``alpha ** j >= row_cost * E[tokens] / T(R)``), and never below ``min_value``.

``alpha`` is an exponential moving average of each verification's estimate ``a / (a + 1)``
(``a`` accepted drafts before the first rejection; ``1.0`` when all ``k`` were accepted), so a
sequence that stops copying its input soon stops paying for rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftAllocator:
    """Per-sequence acceptance estimates and the per-step choice of draft lengths.

    Args:
        knee_rows: rows (tokens) of a step up to which its cost is flat (weight-read-bound),
            >= 1.
        row_cost: the cost of each row past ``knee_rows``, as a fraction of a one-token decode
            step, >= 0.
        prior: ``alpha`` of a sequence before its first verification, in [0, 1].
        smoothing: weight of the newest verification in the moving average, in (0, 1].
        min_value: a draft whose acceptance probability ``alpha ** j`` is below this is never
            verified, even when its row is free (0: every draft below the knee is verified).

    Raises:
        ValueError: naming the argument out of range.
    """

    knee_rows: int = 6
    row_cost: float = 0.025
    prior: float = 0.6
    smoothing: float = 0.3
    min_value: float = 0.0
    _alpha: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.knee_rows < 1:
            raise ValueError(f"knee_rows must be >= 1, got {self.knee_rows}")
        if self.row_cost < 0:
            raise ValueError(f"row_cost must be >= 0, got {self.row_cost}")
        for name in ("prior", "min_value"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def alpha(self, seq_id: int) -> float:
        """The sequence's per-draft acceptance estimate (``prior`` before any verification)."""
        return self._alpha.get(seq_id, self.prior)

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Fold one verification (``num_accepted`` of ``num_drafts`` drafts kept) into the
        sequence's ``alpha``. A verification of no drafts changes nothing."""
        if num_drafts <= 0:
            return
        estimate = 1.0 if num_accepted >= num_drafts else num_accepted / (num_accepted + 1)
        old = self.alpha(seq_id)
        self._alpha[seq_id] = old + self.smoothing * (estimate - old)

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's estimate."""
        self._alpha.pop(seq_id, None)

    def allocate(self, proposals: dict[int, int], num_rows: int) -> dict[int, int]:
        """How many drafts each sequence verifies this step.

        Args:
            proposals: seq_id -> length of its proposal (the most it may verify).
            num_rows: rows the step has without drafts (one per decoding sequence, plus the
                tokens of any other scheduled work the caller wants counted), >= 0.

        Returns:
            seq_id -> drafts kept (a prefix of the proposal; 0 drops it), for every key of
            ``proposals``. A sequence whose proposal is dropped has its ``alpha`` pulled back
            towards ``prior`` by ``smoothing`` (else a sequence that once stopped paying would
            never be tried again).
        """
        kept = dict.fromkeys(proposals, 0)
        # (value, position, seq_id): each draft's acceptance probability alpha ** j.
        candidates = []
        for seq_id, length in proposals.items():
            a = self.alpha(seq_id)
            value = 1.0
            for j in range(1, length + 1):
                value *= a
                if value < self.min_value:
                    break
                candidates.append((value, j, seq_id))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        rows = max(num_rows, 0)
        tokens = float(rows)  # each row without a draft emits one token
        for value, _, seq_id in candidates:
            if rows > 0 and (tokens + value) * self._cost(rows) < tokens * self._cost(rows + 1):
                break  # goodput would drop; the rest are worth no more
            rows += 1
            tokens += value
            kept[seq_id] += 1
        for seq_id, n in kept.items():
            if n == 0 and proposals[seq_id] > 0:
                old = self.alpha(seq_id)
                self._alpha[seq_id] = old + self.smoothing * (self.prior - old)
        return kept

    def _cost(self, rows: int) -> float:
        """Modelled step time in units of a weight-read-bound step (``T(R)``, module docstring)."""
        return 1.0 + self.row_cost * max(0, rows - self.knee_rows)
