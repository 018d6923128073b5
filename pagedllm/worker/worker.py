"""A worker: owns the device, the model weights and the KV cache; executes scheduler outputs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedllm.attention import get_attention_backend
from pagedllm.attention.cpu import CpuPagedAttention
from pagedllm.core.scheduler_output import SchedulerOutput
from pagedllm.device import activate_device, device_for_rank, resolve_device, uses_cpu_ops
from pagedllm.distributed import PipelineGroup, TensorParallelGroup, stage_layer_range
from pagedllm.model.config import LlamaArchConfig
from pagedllm.model.packed_linear import packed_linear_available
from pagedllm.model.quant.int8 import Int8Linear, int8_lm_head_enabled, quantize_model
from pagedllm.model.registry import model_class
from pagedllm.model.sharding import shard_state_dict
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.model_runner import ModelRunner, ModelRunnerOutput

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

logger = logging.getLogger(__name__)


class Worker:
    """Builds the model from a state dict and the KV cache on its device, then runs steps.

    Everything a step touches lives on ``self.device``: the weights (allocated there, then filled
    from the host ``state_dict``), the KV pool, the step's input tensors and attention metadata
    (``ModelRunner``) and the attention backend's work (the backend registered for the device,
    ``pagedllm.attention``). Only the swap pool stays on the host. The C++ CPU extension (fused
    layer ops, packed linears, block copies) is used only on the CPU.

    Under tensor parallelism (paper section 4.6) there is one worker per rank; each holds its
    shard of the weights and of the KV cache (its KV heads, ``num_blocks`` blocks like every other
    rank) and runs every step's forward; only rank 0's logits are real. On CUDA rank r computes on
    ``cuda:(i + r)`` (``pagedllm.device.device_for_rank``).

    Args:
        config: model shape.
        state_dict: Hugging Face-named weights (host tensors): the full model, or this rank's
            slices when ``weights_sharded``.
        dtype: compute and cache dtype.
        num_blocks: KV blocks to allocate.
        block_size: tokens per block.
        max_model_len: longest sequence (sizes the RoPE table).
        attention_backend: backend name (see ``pagedllm.attention``); "auto" = the one
            registered for ``device``.
        num_threads: torch intra-op threads.
        num_swap_blocks: host swap-space blocks.
        group: the tensor-parallel group; None = tp 1.
        pipeline: the pipeline links; None = pp 1. The worker then holds only its stage's
            layers (``distributed.stage_layer_range``) and their KV caches.
        weights_sharded: ``state_dict`` already holds only this rank's slices.
        device: "cpu", "cuda" or "cuda:N" (``EngineConfig.device``; rank r adds r to the CUDA
            index).
        kv_cache_dtype: KV storage dtype (``EngineConfig.torch_kv_cache_dtype``); None = ``dtype``.
        gguf_native: a GGUF file whose quantized blocks replace the float linears
            (``EngineConfig.quantization == "gguf"``, ``model.quant.gguf_model``); None = off.
            ``state_dict`` may then leave those projections as meta placeholders
            (``load_model(keep_gguf_blocks=True)``): they are built from the file before any
            packing, or, where the blocks cannot run (no C++ kernels, a dtype other than
            float32), the file is expanded after all.
        quantization: ``EngineConfig.quantization``; under "int8" the decoder linears
            become W8A8 ``Int8Linear`` layers after loading and sharding (``model.quant.int8``).
        pipeline_micro_batches: micro-batches per step under pipeline parallelism
            (``EngineConfig.pipeline_micro_batches``); None = the number of stages.

    Attributes:
        device: the device this rank computes on (an explicit index on CUDA).
        backend: the attention backend instance.

    Raises:
        ValueError: naming ``device`` when it is not available here, or ``attention_backend``
            when the backend does not run on it (both before any weight is copied).
    """

    def __init__(
        self,
        config: LlamaArchConfig,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        num_threads: int | None = None,
        num_swap_blocks: int = 0,
        group: TensorParallelGroup | None = None,
        weights_sharded: bool = False,
        device: torch.device | str = "cpu",
        kv_cache_dtype: torch.dtype | None = None,
        gguf_native: Path | None = None,
        pipeline: PipelineGroup | None = None,
        quantization: str | None = None,
        pipeline_micro_batches: int | None = None,
    ) -> None:
        world = group.world_size if group is not None else 1
        rank = group.rank if group is not None else 0
        self.device = device_for_rank(resolve_device(device, world), rank)
        if num_threads:
            torch.set_num_threads(num_threads)
        activate_device(self.device)
        backend = get_attention_backend(attention_backend, self.device)
        self.backend = backend
        # Every tensor the model allocates (weights, RoPE table) goes straight to the device.
        with torch.device(self.device):
            self.model = model_class(config.architecture)(
                config, dtype, backend, max_positions=max_model_len, group=group
            )
        layers = range(config.num_hidden_layers)
        if pipeline is not None:
            layers = stage_layer_range(
                config.num_hidden_layers, pipeline.stage, pipeline.num_stages
            )
            self.model.keep_stage_layers(layers)
        shard = self.model.shard
        if shard is not None and not weights_sharded:
            state_dict = shard_state_dict(state_dict, shard, config.head_dim)
        self.model.load_weights(state_dict)  # host -> device copies
        self.model.eval()
        on_cpu = uses_cpu_ops(self.device)
        cpu_ops = backend.ops if on_cpu and isinstance(backend, CpuPagedAttention) else None
        if self.model.unloaded_params:
            self._load_kept_gguf_blocks(gguf_native, dtype, cpu_ops)
        if quantization == "int8":  # "gguf" is applied below, from the file's blocks
            quantize_model(self.model, quantization, cpu_ops)
        if on_cpu and packed_linear_available(dtype, self.device, cpu_ops=cpu_ops):
            self.model.pack_linears(cpu_ops)
        if quantization == "int8" and int8_lm_head_enabled() and self.model.group is None:
            self.model.lm_head_packed = Int8Linear(self.model.lm_head_weight, None, cpu_ops)
        if cpu_ops is not None:
            self.model.use_cpu_layer_ops(cpu_ops)
        if gguf_native is not None:
            self._quantize_gguf(gguf_native, dtype, cpu_ops)
        if cpu_ops is not None:
            fused = self.model.use_fused_layers(cpu_ops)
            logger.debug("%d decoder layers run in one C++ op per step", fused)
        self.cache = CacheEngine(
            config,
            num_blocks,
            block_size,
            dtype if kv_cache_dtype is None else kv_cache_dtype,
            device=self.device,
            num_swap_blocks=num_swap_blocks,
            use_cpu_kernels=cpu_ops is not None,
            num_kv_heads=shard.num_kv_heads if shard else None,
            num_layers=len(layers),
        )
        self.runner = ModelRunner(
            self.model,
            self.cache.kv_caches,
            block_size,
            self.device,
            pipeline,
            micro_batches=pipeline_micro_batches,
        )
        logger.debug(
            "worker rank %d on %s: attention backend %s, %d KV blocks",
            rank,
            self.device,
            backend.name,
            num_blocks,
        )

    def _load_kept_gguf_blocks(
        self, path: Path | None, dtype: torch.dtype, cpu_ops: CpuOps | None
    ) -> None:
        """Fill the projections ``load_weights`` left unloaded (GGUF blocks kept by the loader):
        ``GGUFLinear`` layers from ``path`` where the kernels run them, else the float weights
        expanded from the file after all.

        Raises:
            ValueError: the state dict has placeholders but no GGUF file was given.
            RuntimeError: a placeholder parameter that no GGUF layer replaced (the loader and
                ``quantize_linears`` disagree: a bug).
        """
        from pagedllm.model.loader.gguf_loader import load_gguf_weights
        from pagedllm.model.quant.gguf_model import quantize_linears, unloaded_parameter_ids

        if path is None:
            raise ValueError(
                "the weights keep projections in GGUF blocks (load_model(keep_gguf_blocks=True)) "
                "but quantization is not 'gguf'"
            )
        if cpu_ops is None or dtype != torch.float32:
            _, state = load_gguf_weights(path, dtype)  # _quantize_gguf warns about the reason
            self.model.load_weights(state)
            return
        unloaded = unloaded_parameter_ids(self.model)
        quantize_linears(self.model, path, cpu_ops)  # the LM head too: it is not packed then
        if id(self.model.lm_head_weight) in unloaded and self.model.lm_head_packed is not None:
            # A head left in blocks (untied, or tied to an embedding now a GGUFEmbedding): the
            # GGUF layer computes the logits (one rank, so lm_head_logits never reads the float
            # rows); drop the unloaded parameter.
            del self.model.lm_head_weight
            self.model.lm_head_weight = torch.empty(0, self.model.config.hidden_size)
        left = [n for n, p in self.model.named_parameters() if id(p) in unloaded]
        if left:
            raise RuntimeError(f"GGUF projections left unloaded: {', '.join(left[:5])}")
        self.model.unloaded_params = []

    def _quantize_gguf(self, path: Path, dtype: torch.dtype, cpu_ops: CpuOps | None) -> None:
        """Swap the float linears for ``GGUFLinear`` on ``path``'s blocks (needs the C++ CPU
        kernels and float32; otherwise the float model stays, with a warning)."""
        from pagedllm.model.quant.gguf_model import quantize_linears
        from pagedllm.model.quant.gguf_native import GGUFLinear

        if cpu_ops is None or dtype != torch.float32:
            logger.warning(
                "quantization=gguf needs the C++ CPU kernels and dtype float32 (have %s, %s); "
                "running the dequantized float weights",
                "kernels" if cpu_ops is not None else "no kernels",
                dtype,
            )
            return
        quantize_linears(self.model, path, cpu_ops)  # the LM head, and the layers if not yet
        logger.info(
            "quantization=gguf: %d matrices computed on GGUF blocks, %d output rows per record, "
            "%s integer steps",
            sum(isinstance(m, GGUFLinear) for m in self.model.modules()),
            cpu_ops.gguf_group_rows,
            cpu_ops.gguf_isa,
        )

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the step's block moves (swap out, swap in, copy-on-write, in that order: a block
        freed by a swap-out may be reused in the same step), then run the forward pass.

        Returns:
            the runner's output; its logits are on ``self.device``.
        """
        self.cache.swap_out(sched.blocks_to_swap_out)
        self.cache.swap_in(sched.blocks_to_swap_in)
        self.cache.copy_blocks(sched.blocks_to_copy)
        with torch.inference_mode():
            return self.runner.execute(sched)
