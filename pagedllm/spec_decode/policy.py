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
taken in decreasing order of ``alpha ** j`` (so each sequence keeps a prefix of its proposal),
as many as maximise ``E[tokens] / T(R)`` (with the prior, past the knee: while
``alpha ** j >= row_cost * E[tokens] / T(R)``), and never below ``min_value``.

``alpha`` is an exponential moving average of each verification's estimate ``a / (a + 1)``
(``a`` accepted drafts before the first rejection; ``1.0`` when all ``k`` were accepted), so a
sequence that stops copying its input soon stops paying for rows.

A model-free proposal (n-gram lookup, suffix decoding) also says how long a suffix of the
sequence it matched, and that predicts acceptance far better than the sequence's history
(:class:`MatchAcceptance`): when the caller passes match lengths, draft ``j`` is valued by the
learned acceptance of depth ``j`` for proposals of that match length instead of ``alpha ** j``,
times the sequence's :meth:`DraftAllocator.reliability` (its accepted drafts against the
table's expectation), so a sequence still backs off on its own when it keeps missing.

The knee and the row cost differ by CPU, dtype and model (on an AVX2 CPU a 40-row step of the
bundled SmolLM2 in fp32 costs ~2.8 one-token batch-8 steps, a bf16 AMX tile GEMM moves the
knee far out), so the model above is only the prior: the engine reports every decode /
verification step's measured time (:meth:`DraftAllocator.observe_step`) and
:class:`StepCostTable` replaces the prior by the measured times, row count by row count.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StepCostTable:
    """Measured seconds of a decode / verification step by its row count, learned online.

    A row count is *measured* once it has ``min_samples`` samples. Its time is the lower
    quartile of its last ``window`` samples: on a shared machine interference only ever slows a
    step (measured here at batch 1: p10 24 ms, p50 27 ms, p90 34-57 ms for every row count), so a
    low quantile tracks what the rows themselves cost. The measured times are then made
    non-decreasing in the row count (isotonic regression by pooling adjacent violators, weighted
    by sample count): more rows never take less time. :meth:`cost` of R rows is, with measured
    counts ``R_1 < .. < R_n``:

    - nothing measured: the prior ``1 + row_cost * max(0, R - knee_rows)`` (one-token steps);
    - ``R_1 <= R <= R_n``: linear interpolation between the measured neighbours;
    - ``R < R_1``: ``T(R_1) * prior(R) / prior(R_1)``; ``R > R_n``: the last measured segment's
      slope carried on (the prior's shape when one count is measured).

    A count not yet measured is thus estimated from its neighbours (optimistically past the
    last one); the allocator picks it when the estimate pays, and its own samples then replace
    the estimate. A count with no sample in its last *age limit* steps reported (any row count)
    is forgotten: the allocator stops choosing a count it measured as too slow, so without
    expiry a few samples slowed by interference would turn those drafts off for good; once
    forgotten the count is estimated again and, where the estimate pays, re-measured. The age
    limit starts at ``min_age`` and doubles each time the count is forgotten, up to ``max_age``
    (binary exponential backoff), and starts over once the count fills its window (it is in
    regular use): a count slowed by a burst of interference comes back after ``min_age`` steps
    (with a fixed age of 2000, 9 rows measured at 23.7 ms in a burst, against 13.4-13.8 ms,
    left a batch-8 n-gram run on an AMX Xeon at 1.05x instead of 1.44-1.50x; docs/spec_decode.md),
    while one that is really slow costs ``min_samples`` re-measured steps at ages ``min_age``,
    ``2 min_age``, ... and then every ``max_age`` steps.

    Args:
        knee_rows / row_cost: the prior's shape (as :class:`DraftAllocator`'s).
        window: samples kept per row count (>= 1).
        min_samples: samples before a row count counts as measured (1 .. ``window``).
        min_age / max_age: the first and the largest age limit, in steps reported (of any row
            count) after a count's newest sample (``window <= min_age <= max_age``).

    Raises:
        ValueError: naming the argument out of range.
    """

    knee_rows: int = 6
    row_cost: float = 0.025
    window: int = 32
    min_samples: int = 3
    min_age: int = 64
    max_age: int = 2000
    _samples: dict[int, deque[float]] = field(default_factory=dict, repr=False)
    _quartiles: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)
    _measured: list[tuple[int, float]] = field(default_factory=list, repr=False)
    _steps: int = field(default=0, repr=False)  # steps reported so far
    _last_seen: dict[int, int] = field(default_factory=dict, repr=False)  # rows -> _steps
    _times_forgotten: dict[int, int] = field(default_factory=dict, repr=False)  # the backoff

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.min_samples <= self.window:
            raise ValueError(f"min_samples must be in [1, window], got {self.min_samples}")
        if not self.window <= self.min_age <= self.max_age:
            raise ValueError(
                f"min_age and max_age must satisfy window ({self.window}) <= min_age <= max_age, "
                f"got min_age={self.min_age}, max_age={self.max_age}"
            )

    def observe(self, rows: int, seconds: float) -> None:
        """Record one step of ``rows`` rows (tokens) that took ``seconds`` (ignored unless both
        are > 0)."""
        if rows <= 0 or not seconds > 0:
            return
        self._steps += 1
        self._last_seen[rows] = self._steps
        samples = self._samples.setdefault(rows, deque(maxlen=self.window))
        samples.append(seconds)
        if len(samples) == self.window:  # in regular use: the next age limit starts over
            self._times_forgotten.pop(rows, None)
        changed = self._expire() if self._steps % self.window == 0 else False
        if len(samples) >= self.min_samples:  # only this count's quartile changed
            self._quartiles[rows] = (sorted(samples)[len(samples) // 4], float(len(samples)))
            changed = True
        if changed:
            self._refit()

    def age_limit(self, rows: int) -> int:
        """Steps reported without a sample of ``rows`` rows after which the count is forgotten:
        ``min_age`` doubled for every earlier time it was forgotten, at most ``max_age``."""
        doublings = min(self._times_forgotten.get(rows, 0), self.max_age.bit_length())
        return min(self.max_age, self.min_age << doublings)

    def _expire(self) -> bool:
        """Forget the counts not seen within their age limit; True if one was measured. Checked
        every ``window`` steps, so a count lives at most its age limit + ``window`` steps."""
        stale = [
            r for r, seen in self._last_seen.items() if self._steps - seen >= self.age_limit(r)
        ]
        was_measured = False
        for rows in stale:
            del self._last_seen[rows], self._samples[rows]
            self._times_forgotten[rows] = self._times_forgotten.get(rows, 0) + 1
            was_measured |= self._quartiles.pop(rows, None) is not None
        return was_measured

    def _refit(self) -> None:
        # Pool adjacent violators over the counts' quartiles, weighted by their sample counts:
        # blocks of [sum of weight * time, sum of weight, row counts].
        blocks: list[list] = []
        for rows in sorted(self._quartiles):
            t, w = self._quartiles[rows]
            blocks.append([w * t, w, [rows]])
            while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
                tw, w, counts = blocks.pop()
                blocks[-1][0] += tw
                blocks[-1][1] += w
                blocks[-1][2] += counts
        self._measured = [(rows, tw / w) for tw, w, counts in blocks for rows in counts]

    @property
    def measured(self) -> list[tuple[int, float]]:
        """``(rows, seconds)`` of every measured row count, by rows: the lower quartiles after
        the isotonic fit."""
        return list(self._measured)

    def prior(self, rows: int) -> float:
        """The prior's cost of ``rows`` rows, in one-token steps."""
        return 1.0 + self.row_cost * max(0, rows - self.knee_rows)

    def cost(self, rows: int) -> float:
        """The estimated time of a step of ``rows`` rows (seconds once any count is measured,
        else one-token steps; only ratios between counts matter to the allocator)."""
        points = self._measured
        if not points:
            return self.prior(rows)
        i = bisect_left(points, (rows, float("-inf")))
        if i < len(points) and points[i][0] == rows:
            return points[i][1]
        if i == 0:
            r1, t1 = points[0]
            return t1 * self.prior(rows) / self.prior(r1)
        if i == len(points):
            rn, tn = points[-1]
            if len(points) == 1:
                return tn * self.prior(rows) / self.prior(rn)
            rp, tp = points[-2]
            return tn + max(0.0, (tn - tp) / (rn - rp)) * (rows - rn)
        (ra, ta), (rb, tb) = points[i - 1], points[i]
        return ta + (tb - ta) * (rows - ra) / (rb - ra)


@dataclass
class MatchAcceptance:
    """How often a model-free draft is accepted, by the length of the match it continues and by
    its depth in the proposal, learned online.

    An n-gram / suffix proposal continues an earlier occurrence of the sequence's last ``m``
    tokens; the longer that match, the likelier the model is copying a span, and once it copies,
    the later drafts are accepted about as often as the first. On the bundled SmolLM2's greedy
    bf16 answers to the repetitive workload (``benchmarks/spec_workload.py``, 32 requests,
    n-gram, k = 8, every draft verified): the first draft was accepted in 30 % of the proposals
    with a 1-token match (0.9 of 7.0 drafts accepted), 56 % with 2 (2.3 of 7.6), 85 % with 3
    (4.5 of 7.8) and 94 % with 4 (6.0 of 7.5). A per-sequence ``alpha ** j`` sees none of that.

    Per match class ``c = min(m, max_class)`` and depth ``j`` (1-based) it counts the
    verifications that reached draft ``j`` (all drafts before it accepted) and those that
    accepted it; the conditional rate is ``(accepted + 1) / (reached + 2)`` (Laplace's rule: 0.5
    before any sample), and draft ``j`` is worth the product of the rates up to ``j``. A cell
    that reaches ``window`` verifications has both counts halved, so the rates follow a change
    of workload.

    Args:
        max_class: match lengths from this on share one class (>= 1).
        window: verifications per cell before its counts are halved (>= 2).

    Raises:
        ValueError: naming the argument out of range.
    """

    max_class: int = 4
    window: int = 256
    # _counts[c][j - 1] = [reached, accepted] for match class c (0: no match) and depth j.
    _counts: list[list[list[float]]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.max_class < 1:
            raise ValueError(f"max_class must be >= 1, got {self.max_class}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2, got {self.window}")
        self._counts = [[] for _ in range(self.max_class + 1)]

    def _cells(self, match_len: int, depth: int) -> list[list[float]]:
        cells = self._counts[min(max(match_len, 0), self.max_class)]
        while len(cells) < depth:
            cells.append([0.0, 0.0])
        return cells

    def values(self, match_len: int, num_drafts: int) -> list[float]:
        """Acceptance probability of drafts ``1 .. num_drafts`` of a proposal continuing a
        ``match_len``-token match: the running products of the learned conditional rates."""
        out, value = [], 1.0
        for reached, accepted in self._cells(match_len, num_drafts)[:num_drafts]:
            value *= (accepted + 1.0) / (reached + 2.0)
            out.append(value)
        return out

    def record(self, match_len: int, num_drafts: int, num_accepted: int) -> None:
        """Fold in one verification: ``num_accepted`` of ``num_drafts`` drafts kept (the drafts
        past the first rejection were not reached and teach nothing)."""
        reached = min(num_accepted + 1, num_drafts)
        for j, cell in enumerate(self._cells(match_len, reached)[:reached]):
            cell[0] += 1.0
            cell[1] += 1.0 if j < num_accepted else 0.0
            if cell[0] >= self.window:
                cell[0] /= 2.0
                cell[1] /= 2.0


@dataclass
class DraftAllocator:
    """Per-sequence acceptance estimates and the per-step choice of draft lengths.

    Args:
        knee_rows: rows (tokens) of a step up to which the prior cost model is flat
            (weight-read-bound), >= 1.
        row_cost: the prior's cost of each row past ``knee_rows``, as a fraction of a one-token
            decode step, >= 0.
        prior: ``alpha`` of a sequence before its first verification, in [0, 1].
        smoothing: weight of the newest verification in the moving average, in (0, 1].
        min_value: a draft whose acceptance probability (``alpha ** j``, or the match-length
            estimate) is below this is never verified, even when its row is free (0: every
            draft below the knee is verified).
        learn_step_cost: replace the prior cost model by the step times reported to
            :meth:`observe_step` (:class:`StepCostTable`); False keeps the prior.

    Raises:
        ValueError: naming the argument out of range.
    """

    knee_rows: int = 6
    row_cost: float = 0.025
    prior: float = 0.6
    smoothing: float = 0.3
    min_value: float = 0.0
    learn_step_cost: bool = True
    _alpha: dict[int, float] = field(default_factory=dict, repr=False)
    step_cost: StepCostTable = field(init=False, repr=False)
    match_acceptance: MatchAcceptance = field(default_factory=MatchAcceptance, repr=False)
    # seq_id -> match length of the proposal it verifies this step, and the table's expected
    # accepted drafts of what was kept (allocate -> record).
    _match: dict[int, int] = field(default_factory=dict, repr=False)
    _expected: dict[int, float] = field(default_factory=dict, repr=False)
    # seq_id -> [accepted, expected] drafts of its match-valued verifications, decayed.
    _track: dict[int, list[float]] = field(default_factory=dict, repr=False)

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
        self.step_cost = StepCostTable(self.knee_rows, self.row_cost)

    def observe_step(self, rows: int, seconds: float) -> None:
        """Report a decode / verification step (no prefill in it) of ``rows`` rows that took
        ``seconds``; ignored when ``learn_step_cost`` is off."""
        if self.learn_step_cost:
            self.step_cost.observe(rows, seconds)

    def alpha(self, seq_id: int) -> float:
        """The sequence's per-draft acceptance estimate (``prior`` before any verification)."""
        return self._alpha.get(seq_id, self.prior)

    def reliability(self, seq_id: int) -> float:
        """How the sequence's accepted drafts compare with what :class:`MatchAcceptance`
        predicted for them, recent verifications weighing most: ``(accepted + 2) / (expected +
        2)``, at most 1 (1 before any). It scales the table's values for this sequence, so a
        sequence that keeps missing where other sequences with the same match lengths copy
        (a request that paraphrases its prompt) backs off on its own."""
        accepted, expected = self._track.get(seq_id, (0.0, 0.0))
        return min(1.0, (accepted + 2.0) / (expected + 2.0))

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """Fold one verification (``num_accepted`` of ``num_drafts`` drafts kept) into the
        sequence's ``alpha``, and into the match-length table and the sequence's reliability
        when the proposal came with a match length. A verification of no drafts changes
        nothing."""
        match_len = self._match.pop(seq_id, None)
        expected = self._expected.pop(seq_id, 0.0)
        if num_drafts <= 0:
            return
        if match_len is not None:
            self.match_acceptance.record(match_len, num_drafts, num_accepted)
            self._decay_track(seq_id, num_accepted, expected)
        estimate = 1.0 if num_accepted >= num_drafts else num_accepted / (num_accepted + 1)
        old = self.alpha(seq_id)
        self._alpha[seq_id] = old + self.smoothing * (estimate - old)

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's estimates."""
        self._alpha.pop(seq_id, None)
        self._match.pop(seq_id, None)
        self._expected.pop(seq_id, None)
        self._track.pop(seq_id, None)

    def _decay_track(self, seq_id: int, accepted: float, expected: float) -> None:
        """The reliability sums, the old ones weighted ``1 - smoothing``, plus one
        verification's accepted / expected drafts (0 / 0: a dropped proposal only decays them
        towards 1, so a sequence that stopped paying is tried again)."""
        track = self._track.setdefault(seq_id, [0.0, 0.0])
        keep = 1.0 - self.smoothing
        track[0] = keep * track[0] + accepted
        track[1] = keep * track[1] + expected

    def allocate(
        self, proposals: dict[int, int], num_rows: int, match_lengths: dict[int, int] | None = None
    ) -> dict[int, int]:
        """How many drafts each sequence verifies this step.

        Args:
            proposals: seq_id -> length of its proposal (the most it may verify).
            num_rows: rows the step has without drafts (one per decoding sequence, plus the
                tokens of any other scheduled work the caller wants counted), >= 0.
            match_lengths: seq_id -> length of the suffix match its proposal continues, for
                the sequences whose proposer reports one: their drafts are valued by
                :class:`MatchAcceptance` times the sequence's :meth:`reliability` (and the
                verification that follows teaches both), the others' by ``alpha ** j``.

        Returns:
            seq_id -> drafts kept (a prefix of the proposal; 0 drops it), for every key of
            ``proposals``. A sequence whose proposal is dropped has its ``alpha`` pulled back
            towards ``prior`` by ``smoothing``, and its reliability towards 1 (else a sequence
            that once stopped paying would never be tried again).
        """
        kept = dict.fromkeys(proposals, 0)
        matches = match_lengths or {}
        table_values: dict[int, list[float]] = {}  # match-valued seqs: the table's values
        # (value, position, seq_id): each draft's acceptance probability.
        candidates = []
        for seq_id, length in proposals.items():
            match_len = matches.get(seq_id)
            if match_len is None:
                self._match.pop(seq_id, None)
                a, value, values = self.alpha(seq_id), 1.0, []
                for _ in range(length):
                    value *= a
                    values.append(value)
            else:
                self._match[seq_id] = match_len
                table_values[seq_id] = self.match_acceptance.values(match_len, length)
                scale = self.reliability(seq_id)
                values = [v * scale for v in table_values[seq_id]]
            for j, value in enumerate(values, start=1):
                if value < self.min_value:
                    break
                candidates.append((value, j, seq_id))
        candidates.sort(key=lambda c: (-c[0], c[1]))
        # Goodput of keeping the first n candidates, for every n; the largest n of the best
        # wins. A scan rather than stopping at the first drop: a measured cost curve need not
        # be convex (a GEMM tile boundary, noise).
        rows = max(num_rows, 0)
        tokens = float(rows)  # each row without a draft emits one token
        best_n, best = 0, tokens / self._cost(rows) if rows > 0 else 0.0
        for n, (value, _, _) in enumerate(candidates, start=1):
            tokens += value
            goodput = tokens / self._cost(rows + n)
            if goodput >= best:
                best_n, best = n, goodput
        for _, _, seq_id in candidates[:best_n]:
            kept[seq_id] += 1
        for seq_id, n in kept.items():
            if seq_id in table_values:
                self._expected[seq_id] = sum(table_values[seq_id][:n])
            if n == 0 and proposals[seq_id] > 0:
                old = self.alpha(seq_id)
                self._alpha[seq_id] = old + self.smoothing * (self.prior - old)
                if seq_id in table_values:
                    self._decay_track(seq_id, 0.0, 0.0)
        return kept

    def _cost(self, rows: int) -> float:
        """Modelled step time of ``rows`` rows (``T(R)``, module docstring)."""
        return self.step_cost.cost(rows)
