"""The synchronous engine: add requests, then ``step()`` = schedule -> execute -> process outputs.

One step (paper section 4.5, iteration-level scheduling):
1. the scheduler picks the sequences and token counts of this step and their block tables;
2. the executor runs the model on them (writing their K/V into the paged cache);
3. the engine samples one token for every sequence that reached its end, detokenizes it, checks
   the stop conditions, and frees the blocks of finished requests.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
import weakref
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockManager, cdiv
from pagedllm.core.contiguous_kv_manager import ContiguousKVManager
from pagedllm.core.kv_waste import KVWaste, contiguous_waste, paged_waste
from pagedllm.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedllm.engine.beam_search import BeamSearch
from pagedllm.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedllm.executor.factory import create_executor
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.model.sharding import TensorParallelShard
from pagedllm.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pagedllm.sampling.sampler import Sampler, SamplingBatch, compute_prompt_logprobs, derive_seed
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.worker.cache_engine import kv_block_bytes, num_blocks_for_memory

logger = logging.getLogger(__name__)


class ContextLengthExceededError(ValueError):
    """The prompt (plus ``max_tokens``) does not fit in ``max_model_len`` or in the KV pool.

    Attributes:
        param: the request field to blame ("prompt" or "max_tokens").
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class EngineStats:
    """Counters over the engine's life.

    Attributes:
        num_steps: steps that ran the model.
        prompt_tokens / generation_tokens: tokens computed for prompts / sampled.
        peak_blocks_used: most KV blocks in use after any step.
        slot_utilization_sum: sum over steps of (tokens held in the cache / slots of the blocks
            in use); divide by ``num_steps`` for the mean share of allocated KV slots that hold
            real token states (the paper's figure 2 metric for a paged cache).
        blocks_used_sum / blocks_unshared_sum: sums over steps of the blocks in use, and of the
            blocks the same sequences would use if nothing were shared (the sum of their block
            table lengths): the paper's figure 15 memory saving is 1 - used / unshared.
        batched_requests_sum: sum over steps of the requests scheduled in the step; divide by
            ``num_steps`` for the paper's figure 13 (average number of batched requests).
        kv_token_states_share_sum / kv_reserved_share_sum / kv_internal_fragmentation_share_sum
            / kv_external_fragmentation_share_sum: sums over steps of each part's share of the
            accounted KV memory (paper figure 2; definitions in ``core.kv_waste``);
            ``kv_waste_steps`` counts the steps with allocated memory. The mean is weighted by
            step (every step counts once, however long it took).
    """

    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    peak_blocks_used: int = 0
    slot_utilization_sum: float = 0.0
    num_preemptions: int = 0
    blocks_used_sum: int = 0
    blocks_unshared_sum: int = 0
    batched_requests_sum: int = 0
    kv_token_states_share_sum: float = 0.0
    kv_reserved_share_sum: float = 0.0
    kv_internal_fragmentation_share_sum: float = 0.0
    kv_external_fragmentation_share_sum: float = 0.0
    kv_waste_steps: int = 0

    @property
    def mean_batched_requests(self) -> float:
        """Requests per step, averaged over steps (paper figure 13)."""
        return self.batched_requests_sum / self.num_steps if self.num_steps else 0.0

    def memory_waste(self) -> dict[str, float]:
        """Mean share (0..1, step-weighted) of the accounted KV memory holding token states,
        reserved for future tokens, lost to internal and to external fragmentation."""
        n = self.kv_waste_steps or 1
        return {
            "token_states": self.kv_token_states_share_sum / n,
            "reserved": self.kv_reserved_share_sum / n,
            "internal_fragmentation": self.kv_internal_fragmentation_share_sum / n,
            "external_fragmentation": self.kv_external_fragmentation_share_sum / n,
        }

    def summary(self) -> dict[str, Any]:
        """Every counter plus the derived figures (batched requests, memory waste, slot
        utilization, sharing saving), JSON-ready."""
        return {
            **asdict(self),
            "mean_batched_requests": self.mean_batched_requests,
            "mean_slot_utilization": self.mean_slot_utilization,
            "sharing_saving": self.sharing_saving,
            "memory_waste": self.memory_waste(),
        }

    @classmethod
    def delta(cls, before: dict[str, Any], after: dict[str, Any]) -> EngineStats:
        """The counters of the steps between two ``summary()`` dicts (``peak_blocks_used`` is
        the later value: a peak cannot be differenced)."""
        kw = {f.name: after[f.name] - before[f.name] for f in fields(cls)}
        kw["peak_blocks_used"] = after["peak_blocks_used"]
        return cls(**kw)

    def add_waste(self, w: KVWaste) -> None:
        """Add one step's breakdown (steps with no accounted memory are skipped)."""
        if w.total <= 0:
            return
        self.kv_waste_steps += 1
        self.kv_token_states_share_sum += w.token_states / w.total
        self.kv_reserved_share_sum += w.reserved / w.total
        self.kv_internal_fragmentation_share_sum += w.internal_fragmentation / w.total
        self.kv_external_fragmentation_share_sum += w.external_fragmentation / w.total

    @property
    def mean_slot_utilization(self) -> float:
        return self.slot_utilization_sum / self.num_steps if self.num_steps else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of KV blocks saved by sharing, averaged over steps (0 when nothing shared)."""
        if not self.blocks_unshared_sum:
            return 0.0
        return 1.0 - self.blocks_used_sum / self.blocks_unshared_sum


class LLMEngine:
    """Owns the tokenizer, the scheduler (with the block manager) and the executor.

    Args:
        config: engine options.
        loaded: an already loaded model (tests share one); None = load ``config.model``.
        attention_backend: "auto", "torch_native" or "reference".

    Raises:
        FileNotFoundError / ValueError: from loading or an inconsistent config.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        attention_backend: str = "auto",
    ) -> None:
        self.config = config
        loaded = loaded or load_model(config.model, config.torch_dtype)
        if config.chat_template_text is not None:
            loaded = loaded.with_chat_template(config.chat_template_text)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        mc = loaded.config
        config.finalize(mc.max_position_embeddings)
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        self.max_model_len: int = config.max_model_len
        self.eos_token_ids: list[int] = list(mc.eos_token_ids)

        dtype = config.torch_dtype
        # Under tensor parallelism the driver counts the blocks for every rank: each rank's
        # block holds only its KV heads (the same number on every rank), and kv_cache_memory
        # is per rank.
        tp = config.tensor_parallel_size
        rank_kv_heads = TensorParallelShard.for_rank(mc, 0, tp).num_kv_heads if tp > 1 else None
        num_blocks = config.num_gpu_blocks_override or num_blocks_for_memory(
            mc, config.block_size, dtype, config.kv_cache_memory, rank_kv_heads
        )
        dtype_bytes = torch.empty((), dtype=dtype).element_size()
        self.num_blocks = num_blocks
        self.block_bytes = kv_block_bytes(mc, config.block_size, dtype, rank_kv_heads)
        num_swap_blocks = config.swap_space // self.block_bytes
        logger.info(
            "model: %s | weights %.1f MiB | KV %d bytes/token (2 x %d layers x %d kv heads x %d dims x "
            "%d bytes) | %d blocks x %d tokens = %d tokens in cache (%.1f MiB)",
            loaded.source,
            loaded.weight_bytes / 2**20,
            mc.kv_bytes_per_token(dtype_bytes),
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            dtype_bytes,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * self.block_bytes / 2**20,
        )
        if tp > 1:
            logger.info(
                "tensor parallel: %d ranks (%s executor), %s KV heads per rank; block counts are "
                "per rank",
                tp,
                config.distributed_executor_backend,
                rank_kv_heads,
            )

        self.block_manager: BlockManager
        if config.kv_manager == "paged":
            self.block_manager = BlockManager(
                num_blocks,
                config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                num_swap_blocks=num_swap_blocks,
            )
        else:
            # Contiguous reservation baselines (paper section 6.1): no sharing, no swapping.
            num_swap_blocks = 0
            self.block_manager = ContiguousKVManager(
                num_blocks, config.block_size, config.kv_manager, self.max_model_len
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
            ),
            self.block_manager,
        )
        self.executor = create_executor(
            config, loaded, num_blocks, num_swap_blocks, attention_backend=attention_backend
        )
        # Worker processes never outlive the engine: shutdown() on garbage collection and at
        # interpreter exit.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        sampler_ops = None
        if config.device == "cpu" and attention_backend in ("auto", "cpu"):
            from pagedllm.attention.cpu import load_cpu_ops

            sampler_ops = load_cpu_ops()  # already built by the worker: a cached import
        self.sampler = Sampler(mc.vocab_size, cpu_ops=sampler_ops)
        self._seed_rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.requests: dict[str, SequenceGroup] = {}
        self._seqs: dict[int, tuple[Sequence, SequenceGroup]] = {}
        self.stats = EngineStats()

    def shutdown(self) -> None:
        """Stop the executor's workers (no process is left behind); idempotent."""
        self._finalizer()

    # ---- requests --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it enters the engine; returns its effective max_tokens.

        Raises:
            ValueError: naming the field: ``prompt`` (empty, ids outside the vocabulary, too
                long), ``max_tokens`` (prompt + max_tokens over ``max_model_len``, or more blocks
                than the whole pool), ``use_beam_search`` (not supported yet),
                ``logprobs`` (over ``max_logprobs``), ``stop_token_ids`` / ``logit_bias`` (ids
                outside the vocabulary).
        """
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt contains token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        params.verify_token_ids(self.vocab_size)
        if params.use_beam_search:
            if params.stop:
                raise ValueError("stop strings are not supported with use_beam_search")
            if params.temperature not in (0.0, 1.0) or params.top_p < 1.0 or params.top_k > 1:
                raise ValueError(
                    "temperature / top_p / top_k must keep their defaults with use_beam_search"
                )
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.config.max_logprobs:
                raise ValueError(f"{name} must be <= {self.config.max_logprobs}, got {k}")
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ContextLengthExceededError(
                f"prompt is {n_prompt} tokens; max_model_len is {self.max_model_len}, which leaves "
                "no room for an output token",
                "prompt",
            )
        room = self.max_model_len - n_prompt
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ContextLengthExceededError(
                f"max_tokens: prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})",
                "max_tokens",
            )
        num_samples = max(params.n, params.best_of or 1)
        bm = self.block_manager
        if isinstance(bm, ContiguousKVManager):
            if num_samples > 1 or params.use_beam_search:
                raise ValueError(
                    f"n: kv_manager={self.config.kv_manager!r} reserves one contiguous run per "
                    "request and cannot share it; parallel sampling and beam search need 'paged'"
                )
            probe = Sequence(-1, prompt_token_ids, 0)
            probe.max_num_tokens = n_prompt + max_tokens
            if not bm.fits_pool(probe):
                raise ContextLengthExceededError(
                    f"max_tokens: the {self.config.kv_manager} reservation of "
                    f"{bm.reservation_tokens(probe)} tokens needs a chunk of "
                    f"{bm.chunk_blocks_for(probe)} blocks, more than the pool's largest "
                    f"({bm.buddy.max_chunk_blocks} blocks of {self.config.block_size} tokens)",
                    "max_tokens",
                )
        per_seq = cdiv(n_prompt + max_tokens, self.config.block_size)
        if (
            per_seq + (num_samples - 1) * (per_seq - n_prompt // self.config.block_size)
            > self.num_blocks
        ):
            raise ContextLengthExceededError(
                f"max_tokens: the request's {num_samples} sample(s) of up to {n_prompt + max_tokens} "
                f"tokens need more KV blocks than the whole pool ({self.num_blocks} blocks of "
                f"{self.config.block_size} tokens)",
                "max_tokens",
            )
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Validate and queue a request.

        Args:
            request_id: unique among live requests.
            prompt: text (tokenized with the model's tokenizer) or token ids.
            params: sampling parameters (default ``SamplingParams()``).
            arrival_time: ``time.monotonic()`` seconds; default now.
            cache_salt: requests with different salts never share prefix-cache blocks.

        Raises:
            ValueError: see ``validate_request``; also a duplicate ``request_id``.
        """
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text: str | None = prompt
            token_ids = self.tokenize(prompt) if prompt else []
        else:
            prompt_text = None
            token_ids = list(prompt)
        max_tokens = self.validate_request(token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        salt = cache_salt.encode() if cache_salt else None
        seq = Sequence(next(self._seq_ids), token_ids, seed, salt)
        seq.max_num_tokens = len(token_ids) + max_tokens
        if params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=params,
            prompt=prompt_text,
            arrival_index=next(self._arrivals),
            metrics=RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()),
            max_tokens=max_tokens,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.use_beam_search:
            group.beam = BeamSearch(
                beam_width=max(params.n, params.best_of or 1),
                length_penalty=params.length_penalty,
                early_stopping=params.early_stopping,
                max_tokens=max_tokens,
                eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                vocab_size=self.vocab_size,
            )
        self.requests[request_id] = group
        self._seqs[seq.seq_id] = (seq, group)
        self.scheduler.add_seq_group(group)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it was not live."""
        group = self.scheduler.abort(request_id)
        if group is None:
            return False
        self._forget(group)
        group.metrics.finished_time = time.monotonic()
        return True

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes of finished requests (``BlockManager.reset_prefix_cache``);
        returns how many blocks were dropped from the cache."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that made progress."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.monotonic()
        result = self.executor.execute_model(sched)
        touched: dict[str, SequenceGroup] = {}
        self.scheduler.on_step_done(sched)
        for request_id, work in sched.scheduled:
            seq, group = self._seqs[work.seq_id]
            touched[request_id] = group
            if group.metrics.first_scheduled_time is None:
                group.metrics.first_scheduled_time = now
            n_prompt_part = max(0, min(seq.num_prompt_tokens - work.start_pos, len(work.token_ids)))
            self.stats.prompt_tokens += n_prompt_part
        for seq_id, logits in result.prompt_logits.items():
            self._add_prompt_logprobs(*self._seqs[seq_id], logits)
        if result.sample_seq_ids:
            self._process_samples(result.sample_seq_ids, result.logits)

        outputs = [self._make_output(g) for g in touched.values()]
        self._account(sched)
        for group in self.scheduler.free_finished():
            group.metrics.finished_time = time.monotonic()
            self._forget(group)
        if self.config.check_invariants:
            self.block_manager.check_invariants()
        return outputs

    def _process_samples(self, seq_ids: list[int], logits: torch.Tensor) -> None:
        pairs = [self._seqs[s] for s in seq_ids]
        beam_rows: dict[str, list[int]] = {}
        for i, (_, group) in enumerate(pairs):
            if group.beam is not None:
                beam_rows.setdefault(group.request_id, []).append(i)
        if beam_rows:
            for rows_of_group in beam_rows.values():
                group = pairs[rows_of_group[0]][1]
                # Rows in the group's beam order (BeamSearch.step relies on it).
                row_of = {pairs[i][0].seq_id: i for i in rows_of_group}
                ordered = [row_of[s.seq_id] for s in group.seqs]
                self._beam_step(group, logits[torch.tensor(ordered)])
            keep = [i for i, (_, g) in enumerate(pairs) if g.beam is None]
            if not keep:
                return
            pairs = [pairs[i] for i in keep]
            logits = logits[torch.tensor(keep)]
        rows = list(range(len(pairs)))
        # Parallel sampling: at a group's first sample its sequence forks into n (or best_of)
        # sequences sharing every prompt block (paper figure 8); each samples from the same logits
        # row with its own seed, derive_seed(seed, i).
        for i in range(len(pairs)):
            seq, group = pairs[i]
            want = max(group.sampling_params.n, group.sampling_params.best_of or 1)
            if len(group.seqs) < want and seq.num_output_tokens == 0:
                for j in range(len(group.seqs), want):
                    child = seq.fork(next(self._seq_ids), derive_seed(seq.seed, j))
                    if seq.detokenizer is not None:
                        child.detokenizer = seq.detokenizer.clone()
                    self.block_manager.fork(seq, child)
                    group.seqs.append(child)
                    self._seqs[child.seq_id] = (child, group)
                    pairs.append((child, group))
                    rows.append(i)
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows)]
        batch = SamplingBatch(
            params=[g.sampling_params for _, g in pairs],
            seeds=[s.seed for s, _ in pairs],
            output_token_ids=[s.output_token_ids for s, _ in pairs],
            prompt_token_ids=[s.prompt_token_ids for s, _ in pairs],
            eos_token_ids=self.eos_token_ids,
        )
        out = self.sampler(logits, batch)
        now = time.monotonic()
        for i, (seq, group) in enumerate(pairs):
            token = out.sampled_token_ids[i]
            seq.append_token(token, out.sampled_logprobs[i])
            self.stats.generation_tokens += 1
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            params = group.sampling_params
            if params.logprobs is not None:
                entry: PositionLogprobs = {
                    token: Logprob(
                        out.sampled_logprobs[i], out.sampled_ranks[i], self._token_text(token)
                    )
                }
                for rank, (tid, lp) in enumerate(out.top_logprobs[i] or [], start=1):
                    entry.setdefault(tid, Logprob(lp, rank, self._token_text(tid)))
                seq.output_logprobs.append(entry)
            self._check_stop(seq, group, token)
            if seq.is_finished() and len(group.seqs) > 1:
                self.scheduler.free_seq(seq)  # a finished sample gives its blocks back at once

    def _beam_step(self, group: SequenceGroup, logits: torch.Tensor) -> None:
        """One beam-search step for a group whose live beams all reached their end.

        Kept candidates become the new live beams, in the order ``BeamSearch.step`` returns
        them: a parent's first child continues the parent's sequence, further children fork its
        blocks (the paper's block tree, figure 9); parents with no child are freed.
        """
        beam = group.beam
        live = group.seqs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        kept = beam.step(logprobs, [(s.output_token_ids, s.cumulative_logprob) for s in live])
        used: set[int] = set()
        new_live: list[Sequence] = []
        plan: list[tuple[Sequence, int, float]] = []
        for parent_row, token, cum in kept:
            parent = live[parent_row]
            if parent_row in used:
                child = parent.fork(next(self._seq_ids), parent.seed)
                self.block_manager.fork(parent, child)
                self._seqs[child.seq_id] = (child, group)
                plan.append((child, token, cum))
                new_live.append(child)
            else:
                used.add(parent_row)
                plan.append((parent, token, cum))
                new_live.append(parent)
        if kept:
            for row, seq in enumerate(live):
                if row not in used:
                    self._drop_seq(seq)
            for seq, token, cum in plan:
                seq.token_ids.append(token)
                seq.cumulative_logprob = cum
                self.stats.generation_tokens += 1
            group.seqs = new_live
        else:
            new_live = live
        if group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        if beam.done or not kept:
            params = group.sampling_params
            group.beam_results = beam.finalize(
                [(s.output_token_ids, s.cumulative_logprob) for s in new_live], params.n
            )
            for seq in new_live:
                seq.status = SequenceStatus.FINISHED_STOPPED

    def _drop_seq(self, seq: Sequence) -> None:
        """A pruned beam: free its blocks and forget it."""
        seq.status = SequenceStatus.FINISHED_ABORTED
        self.scheduler.free_seq(seq)
        self._seqs.pop(seq.seq_id, None)

    def _check_stop(self, seq: Sequence, group: SequenceGroup, token: int) -> None:
        """Apply stop conditions after ``token`` was appended (order as in vLLM)."""
        params = group.sampling_params
        n_out = seq.num_output_tokens
        stopped_by_token = False
        if n_out >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                seq.status = SequenceStatus.FINISHED_STOPPED
                stopped_by_token = True
            elif params.stop_token_ids and token in params.stop_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                stopped_by_token = True
        # A stop token's text is left out unless the user asks for stop strings in the output.
        if seq.detokenizer is not None and (
            not stopped_by_token or params.include_stop_str_in_output
        ):
            new_text = seq.detokenizer.append(token)
            seq.output_text += new_text
            if params.stop and not stopped_by_token and n_out >= params.min_tokens:
                cut = find_stop_string(
                    seq.output_text,
                    len(new_text),
                    list(params.stop),
                    params.include_stop_str_in_output,
                )
                if cut is not None:
                    matched = self._matched_stop(seq.output_text, cut, params)
                    seq.output_text = seq.output_text[:cut]
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    seq.stop_reason = matched
        if not seq.is_finished() and (
            n_out >= group.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.status = SequenceStatus.FINISHED_LENGTH
        if (
            seq.is_finished()
            and seq.detokenizer is not None
            and seq.status != SequenceStatus.FINISHED_STOPPED
        ):
            seq.output_text += seq.detokenizer.flush()

    @staticmethod
    def _matched_stop(text: str, cut: int, params: SamplingParams) -> str | None:
        stops = params.stop or []
        for s in stops:
            if params.include_stop_str_in_output and text[:cut].endswith(s):
                return s
            if not params.include_stop_str_in_output and text.startswith(s, cut):
                return s
        return stops[0] if stops else None

    def _add_prompt_logprobs(
        self, seq: Sequence, group: SequenceGroup, logits: torch.Tensor
    ) -> None:
        """Logits row j of a prompt chunk predicts prompt token start + j + 1."""
        plp = group.prompt_logprobs
        if plp is None or len(plp) >= seq.num_prompt_tokens:
            return  # not asked, or already complete (a recompute after preemption)
        start = len(plp) - 1
        targets = seq.token_ids[start + 1 : start + 1 + logits.shape[0]]
        n = min(len(targets), seq.num_prompt_tokens - len(plp))
        if n <= 0:
            return
        k = group.sampling_params.prompt_logprobs or 0
        lps, ranks, tops = compute_prompt_logprobs(
            logits[:n], torch.tensor(targets[:n], dtype=torch.long), k
        )
        for j in range(n):
            tid = targets[j]
            entry: PositionLogprobs = {tid: Logprob(lps[j], ranks[j], self._token_text(tid))}
            for rank, (alt, lp) in enumerate(tops[j], start=1):
                entry.setdefault(alt, Logprob(lp, rank, self._token_text(alt)))
            plp.append(entry)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        params = group.sampling_params
        if group.beam is not None:
            return self._make_beam_output(group)
        finished = group.is_finished()
        # While running, hold back text that might still turn out to start a stop string.
        holdback = max((len(s) for s in params.stop or []), default=1) - 1
        seqs = group.seqs
        if finished and len(seqs) > params.n:
            # best_of > n: keep the n samples with the highest cumulative logprob (vLLM's rule).
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        else:
            seqs = seqs[: params.n]
        completions = []
        for i, seq in enumerate(seqs):
            text = seq.output_text
            if not seq.is_finished() and holdback:
                text = text[: max(0, len(text) - holdback)]
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=seq.output_token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        complete_plp = group.prompt_logprobs is not None and len(group.prompt_logprobs) >= len(
            group.prompt_token_ids
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=list(group.prompt_logprobs)
            if complete_plp and group.prompt_logprobs
            else None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
        )

    def _make_beam_output(self, group: SequenceGroup) -> RequestOutput:
        """Beam search: the best ``n`` hypotheses once done (before that, the live beams)."""
        params = group.sampling_params
        eos = set(self.eos_token_ids)
        if group.beam_results is not None:
            items = [(h.token_ids, h.cum_logprob, h.finished_by_eos) for h in group.beam_results]
        else:
            items = [
                (s.output_token_ids, s.cumulative_logprob, False) for s in group.seqs[: params.n]
            ]
        completions = []
        for i, (tokens, cum, by_eos) in enumerate(items):
            shown = tokens[:-1] if by_eos and tokens and tokens[-1] in eos else tokens
            completions.append(
                CompletionOutput(
                    index=i,
                    text=str(
                        self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
                    ),
                    token_ids=list(tokens),
                    cumulative_logprob=float(cum),
                    finish_reason=None
                    if group.beam_results is None
                    else ("stop" if by_eos else "length"),
                )
            )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=group.beam_results is not None,
            num_cached_tokens=group.num_cached_tokens,
            metrics=group.metrics,
        )

    def _account(self, sched: SchedulerOutput) -> None:
        bm = self.block_manager
        used = bm.num_used_blocks
        self.stats.blocks_used_sum += used
        self.stats.blocks_unshared_sum += sum(len(t) for t in bm.block_tables.values())
        self.stats.num_steps += 1
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        self.stats.batched_requests_sum += len({rid for rid, _ in sched.scheduled})
        holders = [s for g in self.scheduler.running for s in g.seqs]
        if isinstance(bm, ContiguousKVManager):
            head = self.scheduler.waiting[0].seqs[0] if self.scheduler.waiting else None
            waste = contiguous_waste(bm, holders, head)
        else:
            waste = paged_waste(bm, holders)
        self.stats.add_waste(waste)
        if used:
            # Finished sequences still hold their blocks until free_finished() right after this.
            # Token states count shared blocks once (the waste breakdown's own walk over the
            # block tables, so the tables are walked once per step).
            self.stats.slot_utilization_sum += waste.token_states / (used * bm.block_size)

    def _forget(self, group: SequenceGroup) -> None:
        self.requests.pop(group.request_id, None)
        for seq in group.seqs:
            self._seqs.pop(seq.seq_id, None)
