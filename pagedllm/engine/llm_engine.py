"""The synchronous engine: the public facade over input processing, the engine core and output
processing (vLLM v1's split).

``add_request``: ``InputProcessor`` tokenizes and validates the request and builds its
``SequenceGroup``; ``EngineCore`` queues it. ``step()``: ``EngineCore`` runs schedule -> execute ->
update (paper section 4.5) and returns the requests that made progress; ``OutputProcessor`` makes
their ``RequestOutput``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch

from pagedllm import malloc_tuning
from pagedllm.attention.kv_quant import is_quantized
from pagedllm.config import EngineConfig
from pagedllm.core.kv_manager import (
    ContextLengthExceededError,
    KVManager,
    create_kv_manager,
    uniform_sliding_window,
)
from pagedllm.core.scheduler import Scheduler, SchedulerConfig
from pagedllm.device import uses_cpu_ops
from pagedllm.distributed import max_stage_layers
from pagedllm.engine.admission import QueueFullError
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.stats import EngineStats, KVStatsObserver
from pagedllm.executor.factory import create_executor
from pagedllm.model.layers.rope_scaling import prompt_frequency_key
from pagedllm.model.loader import LoadedModel, load_model
from pagedllm.model.packed_linear import own_gemm_runs
from pagedllm.model.sharding import TensorParallelShard
from pagedllm.model.step_interrupt import StepInterrupt
from pagedllm.outputs import RequestOutput
from pagedllm.platform import cpu_flags
from pagedllm.sampling.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import SequenceGroup
from pagedllm.spec_decode.draft_model import (
    DraftModelProposer,
    build_draft_worker,
    draft_kv_split,
    load_draft_model,
)
from pagedllm.spec_decode.speculator import Speculator
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.worker.cache_engine import kv_block_bytes, num_blocks_for_memory

# Re-exported: callers import them from here.
__all__ = ["ContextLengthExceededError", "EngineStats", "LLMEngine", "QueueFullError"]

logger = logging.getLogger(__name__)


def check_cache_salt(cache_salt: str | None) -> None:
    """Check a request's prefix-cache salt.

    Raises:
        ValueError: naming ``cache_salt`` when it is set but not a non-empty string (an empty
            one would silently mean no salt).
    """
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")


def check_priority(priority: int, policy: str) -> None:
    """Check a request's ``priority`` against the scheduling policy.

    Raises:
        ValueError: naming ``priority`` when it is not an integer, or nonzero under ``fcfs``
            (as vLLM: only the priority policy orders by it).
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if priority != 0 and policy != "priority":
        raise ValueError(
            f"priority must be 0 under scheduling_policy {policy!r} (got {priority}); start "
            "the engine with scheduling_policy='priority' (--scheduling-policy priority)"
        )


class LLMEngine:
    """Owns the tokenizer, the KV manager, the scheduler, the executor and the three stages.

    Args:
        config: engine options.
        loaded: an already loaded model (tests share one); None = load ``config.model``.
            The attention backend is ``config.attention_backend``.

    Attributes:
        stats: ``EngineStats``; the paper-figure accounting in it runs only after
            ``enable_kv_stats()``.
        block_manager: the KV manager (``core.kv_manager.KVManager``) ``config.kv_manager``
            names.

    Raises:
        FileNotFoundError / ValueError: from loading or an inconsistent config.
    """

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config
        # quantization="gguf" computes the projections on the file's blocks (float32 on the
        # CPU): leave them unexpanded, so no float32 copy of those weights ever exists.
        keep = (
            config.quantization == "gguf"
            and config.torch_dtype == torch.float32
            and str(config.device) == "cpu"
        )
        loaded = loaded or load_model(config.model, config.torch_dtype, keep_gguf_blocks=keep)
        if config.chat_template_text is not None:
            loaded = loaded.with_chat_template(config.chat_template_text)
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        mc = loaded.config
        config.finalize(mc.max_position_embeddings)
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        if mc.position_offset is not None and config.max_model_len > mc.max_position_embeddings:
            # Learned absolute positions (OPT, GPT-2) have no embedding past the table.
            raise ValueError(
                f"max_model_len ({config.max_model_len}) exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings}), the size of its "
                "learned position table"
            )
        if config.max_model_len > mc.max_position_embeddings:
            # Rotary positions run on past the table, but the model never saw them trained.
            logger.warning(
                "max_model_len (%d) exceeds the model's max_position_embeddings (%d): positions "
                "past it are beyond the model's training, and its output may degrade there",
                config.max_model_len,
                mc.max_position_embeddings,
            )
        self.max_model_len: int = config.max_model_len
        eos_token_ids: list[int] = list(mc.eos_token_ids)

        dtype = config.torch_dtype
        # Under tensor parallelism the driver counts the blocks for every rank: each rank's
        # block holds only its KV heads (the same number on every rank), and kv_cache_memory
        # is per rank.
        # Under pipeline parallelism each stage holds its layers' KV; the largest stage sets the
        # block count (num_blocks = min over stages, kv_cache_memory being per rank).
        tp = config.tensor_parallel_size
        rank_kv_heads = TensorParallelShard.for_rank(mc, 0, tp).num_kv_heads if tp > 1 else None
        pp = config.pipeline_parallel_size
        stage_layers = max_stage_layers(mc.num_hidden_layers, pp) if pp > 1 else None
        kv_dtype = config.torch_kv_cache_dtype  # storage; int8 / fp8 blocks hold their scales
        self.block_bytes = kv_block_bytes(
            mc, config.block_size, kv_dtype, rank_kv_heads, stage_layers
        )
        # A draft model's cache mirrors the target's blocks: the budget is split by block bytes.
        spec = config.speculative
        draft = load_draft_model(config, loaded) if spec and spec.method == "draft_model" else None
        draft_block_bytes = (
            kv_block_bytes(draft.config, config.block_size, kv_dtype) if draft is not None else 0
        )
        num_blocks = config.num_gpu_blocks_override or num_blocks_for_memory(
            mc, config.block_size, kv_dtype,
            draft_kv_split(config.kv_cache_memory, self.block_bytes, draft_block_bytes),
            rank_kv_heads, stage_layers,
        )  # fmt: skip
        self.num_blocks = num_blocks  # per rank under tensor / pipeline parallelism
        self.weight_bytes: int = loaded.weight_bytes  # all ranks together
        if loaded.gguf_blocks_kept:  # the projections' blocks, not in the expanded state dict
            from pagedllm.model.quant.gguf_model import native_block_bytes

            self.weight_bytes += native_block_bytes(mc, loaded.source)
        num_swap_blocks = config.swap_space // (self.block_bytes + draft_block_bytes)
        #: KV capacity per GiB of kv_cache_memory (per rank), scales included.
        self.kv_tokens_per_gib = (1 << 30) // self.block_bytes * config.block_size
        logger.info(
            "model: %s | weights %.1f MiB%s | KV cache dtype %s (requested %s): %.1f bytes/token "
            "(2 x %d layers x %d kv heads x %d dims, scales included), %d tokens per GiB | "
            "%d blocks x %d tokens = %d tokens in cache (%.1f MiB)",
            loaded.source,
            self.weight_bytes / 2**20,
            (
                " (the GGUF projections in blocks)"
                if loaded.gguf_blocks_kept
                else f" as loaded, before quantization={config.quantization}"
            )
            if config.quantization
            else "",
            str(kv_dtype).replace("torch.", ""),
            config.kv_cache_dtype,
            self.block_bytes / config.block_size,
            mc.num_hidden_layers,
            mc.num_key_value_heads,
            mc.head_dim,
            self.kv_tokens_per_gib,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            num_blocks * self.block_bytes / 2**20,
        )
        logger.info(
            "dtype %s (requested %s) on %s; CPU flags: %s; malloc keeps freed memory "
            "(pagedllm.malloc_tuning): %s",
            str(dtype).replace("torch.", ""),
            config.dtype,
            config.device,
            cpu_flags().summary(),
            "yes" if malloc_tuning.malloc_tuned else "no",
        )
        on_cpu = str(config.device) == "cpu"
        if config.speculative is not None and on_cpu and dtype != torch.float32 and not (
            own_gemm_runs(dtype)
        ):
            # ATen's (and oneDNN's) half-precision matmuls round differently for different row
            # counts, so a verify pass (k + 1 rows) can flip a near-tied greedy token (found by
            # new-user tests); the own GEMM computes every row on its own.
            logger.warning(
                "speculative decoding with dtype %s on CPU: its matmuls run on ATen/oneDNN, "
                "whose results depend on the number of rows, so greedy output can differ from "
                "speculation off where the two best logits nearly tie (and, as the drafts "
                "verified per step follow measured step times, between runs); float32, and "
                "bfloat16 where pagedllm's own GEMM runs it (CPUs with AVX512-BF16), give the "
                "same tokens",
                str(dtype).replace("torch.", ""),
            )
        if config.speculative is not None and is_quantized(config.torch_kv_cache_dtype):
            # A verification writes the drafts' K/V rows; one may raise its block's scale and
            # requantize the rows before it, which the rollback of a rejected draft keeps.
            logger.warning(
                "speculative decoding with kv_cache_dtype %s: the drafts' K/V rows can change "
                "how a block's earlier rows are rounded (docs/kv_cache_dtype.md), so output can "
                "differ from speculation off; a float32 / bfloat16 KV cache gives the same tokens",
                config.kv_cache_dtype,
            )
        if tp > 1:
            logger.info(
                "tensor parallel: %d ranks (%s executor), %s KV heads per rank; block counts are "
                "per rank",
                tp,
                config.distributed_executor_backend,
                rank_kv_heads,
            )

        window = uniform_sliding_window([mc.layer_window(i) for i in range(mc.num_hidden_layers)])
        pool_tokens = num_blocks * config.block_size
        if pool_tokens < self.max_model_len and window is None:  # a window frees blocks
            logger.warning(
                "the KV pool holds %d tokens, fewer than max_model_len (%d): a request gets at "
                "most what the pool holds (prompt + output; longer ones are a 400), and a "
                "request without max_tokens the room the pool leaves; raise kv_cache_memory or "
                "lower max_model_len",
                pool_tokens,
                self.max_model_len,
            )
        self.block_manager: KVManager = create_kv_manager(
            config, num_blocks, num_swap_blocks, self.max_model_len, window
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                preemption_mode=config.preemption_mode,
                policy=config.scheduling_policy,
                prefill_first=config.use_prefill_first,
            ),
            self.block_manager,
        )
        # The Orca baselines take no swap space: the manager says what it uses.
        self.executor = create_executor(
            config,
            loaded,
            num_blocks,
            self.block_manager.num_swap_blocks,
            attention_backend=config.attention_backend,
        )
        # Worker processes never outlive the engine: shutdown() on garbage collection and at
        # interpreter exit.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        sampler_ops = None
        if uses_cpu_ops(config.device) and config.attention_backend in ("auto", "cpu"):
            from pagedllm.attention.cpu import load_cpu_ops

            sampler_ops = load_cpu_ops()  # already built by the worker: a cached import
        self.sampler = Sampler(mc.vocab_size, cpu_ops=sampler_ops)
        self.stats = EngineStats()
        seq_ids = itertools.count()  # shared: new requests and their forks
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            eos_token_ids,
            self.block_manager,
            seq_ids,
            functools.partial(prompt_frequency_key, mc.rope_scaling, mc.max_position_embeddings),
        )
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, eos_token_ids)
        self.engine_core = EngineCore(
            self.scheduler,
            self.block_manager,
            self.executor,
            self.sampler,
            self.output_processor,
            self.stats,
            eos_token_ids,
            seq_ids,
            check_invariants=config.check_invariants,
            structured=self.structured,
            speculator=(
                Speculator(config.speculative, self.max_model_len, self._draft_proposer(draft))
                if config.speculative is not None
                else None
            ),
        )
        if config.use_step_interrupt:
            self._enable_step_interrupt(warn=config.interrupt_decode_for_prefill is True)
        if config.admission == "slots":
            logger.info(
                "admission=slots: prefill-first steps %s, decode steps stopped for arrivals %s",
                "on" if config.use_prefill_first else "off",
                "on" if self.engine_core.step_interrupt is not None else "off",
            )

    def _enable_step_interrupt(self, warn: bool) -> None:
        """``interrupt_decode_for_prefill``: share one ``StepInterrupt`` between the model's
        fused layers and the engine core (``model.step_interrupt``). Nothing where the step
        cannot be stopped (another executor, no fused layers, speculation), with a warning if
        ``warn`` (the option was asked for, not on by default)."""
        model = getattr(getattr(self.executor, "worker", None), "model", None)
        if (
            model is None
            or self.engine_core.speculator is not None
            or getattr(model, "fused_stack", None) is None
        ):
            if warn:
                logger.warning(
                    "interrupt_decode_for_prefill is ignored: it needs one process, the fused "
                    "CPU decoder layers and no speculative decoding"
                )
            return
        interrupt = StepInterrupt()
        model.step_interrupt = interrupt
        self.engine_core.step_interrupt = interrupt

    def _draft_proposer(self, draft: LoadedModel | None) -> DraftModelProposer | None:
        """The draft-model proposer (its worker in this process, a KV cache of the target's
        block count), or None for the other methods."""
        if draft is None:
            return None
        worker = build_draft_worker(
            self.config, draft, self.num_blocks, self.block_manager.num_swap_blocks
        )
        logger.info(
            "speculative decoding: draft model %s, %d KV blocks mirroring the target's",
            draft.source, self.num_blocks,
        )  # fmt: skip
        return DraftModelProposer(worker, self.sampler, list(self.model_config.eos_token_ids))

    def shutdown(self) -> None:
        """Stop the executor's workers (no process is left behind); idempotent."""
        self.structured.shutdown()
        self._finalizer()

    def enable_kv_stats(self, enabled: bool = True) -> None:
        """Switch the per-step paper-figure accounting on or off (``engine.stats``).

        On, every step walks the block tables to add the figure 2 memory-waste breakdown, the
        figure 13 batched requests, the figure 15 sharing saving and the slot utilization to
        ``stats`` (means over the steps it watched). Off (the default), only the cheap counters
        are kept: steps, prompt / generation tokens, preemptions, peak blocks in use.
        """
        core = self.engine_core
        if not enabled:
            core.stats_observer = None
        elif core.stats_observer is None:
            core.stats_observer = KVStatsObserver(self.stats)

    @property
    def kv_stats_enabled(self) -> bool:
        """Whether ``enable_kv_stats`` is on."""
        return self.engine_core.stats_observer is not None

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids (EOS stop check, ``min_tokens``, beam search)."""
        return self.engine_core.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        # Every stage reads them: new requests and the next steps see the new ids.
        ids = list(ids)
        self.input_processor.eos_token_ids = ids
        self.output_processor.eos_token_ids = ids
        self.engine_core.eos_token_ids = ids
        self.structured.stop_token_ids = list(ids)  # read when the grammar tables are built

    # ---- requests --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (valid token ids are ``0 .. vocab_size - 1``)."""
        return self.model_config.vocab_size

    @property
    def requests(self) -> dict[str, SequenceGroup]:
        """The live requests by id (waiting, running or swapped out)."""
        return self.engine_core.requests

    def tokenize(self, prompt: str) -> list[int]:
        """The prompt's token ids under the model's tokenizer."""
        return self.input_processor.tokenize(prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request before it enters the engine; returns its effective max_tokens.

        A ``structured_outputs`` constraint is compiled here (waiting for it; cached, so the
        engine finds it ready; the server awaits ``structured.compile_future`` first instead).

        Raises:
            ValueError / ContextLengthExceededError: see ``InputProcessor.validate``; a
                constraint that does not compile names ``structured_outputs.<field>``.
        """
        max_tokens = self.input_processor.validate(prompt_token_ids, params)
        self.structured.validate(params.structured_outputs)
        return max_tokens

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request.

        Args:
            request_id: unique among live requests.
            prompt: text (tokenized with the model's tokenizer) or token ids.
            params: sampling parameters (default ``SamplingParams()``).
            arrival_time: ``time.monotonic()`` seconds; default now.
            cache_salt: requests with different salts never share prefix-cache blocks.
            priority: lower = served first under ``scheduling_policy="priority"`` (ties by
                arrival); must be 0 under ``fcfs``.

        Raises:
            ValueError: see ``validate_request``; a duplicate ``request_id``; a nonzero
                ``priority`` under ``fcfs`` (``check_priority``); an empty or non-string
                ``cache_salt`` (``check_cache_salt``).
            QueueFullError: ``max_waiting_requests`` requests are waiting already.
        """
        params = params or SamplingParams()
        if request_id in self.engine_core.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        check_priority(priority, self.config.scheduling_policy)
        check_cache_salt(cache_salt)
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.scheduler.waiting) >= limit:
            raise QueueFullError(
                f"the server is overloaded: {limit} requests are waiting already "
                "(max_waiting_requests); retry later"
            )
        group = self.input_processor.process(
            request_id, prompt, params, arrival_time, cache_salt, priority
        )
        self.engine_core.add_request(group)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Returns False if it was not live."""
        return self.engine_core.abort_request(request_id)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes of finished requests (``BlockManager.reset_prefix_cache``);
        returns how many blocks were dropped from the cache."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or swapped out."""
        return self.scheduler.num_unfinished()

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns an output for every request that made progress."""
        return [self.output_processor.make_output(g) for g in self.engine_core.step()]
