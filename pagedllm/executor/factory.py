"""Pick and build the executor for an engine config: uni (tp = 1), mp or ray."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.config import EngineConfig
from pagedllm.device import activate_device, device_for_rank, dist_backend, is_cuda, resolve_device
from pagedllm.distributed import ParallelContext, stage_layer_range
from pagedllm.executor.base import Executor, WorkerInit, threads_per_rank
from pagedllm.model.loader import LoadedModel, resolve_model_path
from pagedllm.model.sharding import TensorParallelShard, shard_state_dict
from pagedllm.worker.worker import Worker


def _model_source(loaded: LoadedModel) -> tuple[Path, str] | None:
    """(path, kind) when the weights can be re-read (sharded) from a file; None for in-memory."""
    src = Path(str(loaded.source))
    if not src.exists():
        return None
    return resolve_model_path(src)


def create_executor(
    config: EngineConfig,
    loaded: LoadedModel,
    num_blocks: int,
    num_swap_blocks: int,
    attention_backend: str = "auto",
) -> Executor:
    """The executor for ``config.tensor_parallel_size`` x ``config.pipeline_parallel_size`` /
    ``config.distributed_executor_backend``.

    With tp > 1 the driver (this process) is rank 0 and uses the already loaded full state dict,
    sliced; the remote ranks re-read only their slices from ``loaded.source`` when it is a file,
    else receive their slices pickled (in-memory models in tests). Under pipeline parallelism
    global rank r is tensor-parallel rank r % tp of stage r // tp (``distributed.pipeline``).

    Every rank computes on ``config.device`` (rank r of a CUDA device on its own GPU,
    ``device.device_for_rank``); the group's collectives use ``device.dist_backend`` (gloo on CPU,
    nccl on CUDA).

    Raises:
        ValueError: naming ``tensor_parallel_size`` when the model cannot be split or there are
            fewer GPUs than ranks; naming ``pipeline_parallel_size`` when there are fewer layers
            than stages; naming ``device`` when it is not available here;
            naming ``distributed_executor_backend`` for Ray on CUDA (not supported).
    """
    from pagedllm.executor.uniproc import UniProcExecutor

    tp = config.tensor_parallel_size
    pp = config.pipeline_parallel_size
    world = tp * pp
    mc = loaded.config
    dtype = config.torch_dtype
    assert config.max_model_len is not None
    # Validated before any process starts; a bare "cuda" becomes this process's current GPU, so
    # that spawned ranks count from the same index.
    device = str(device_for_rank(resolve_device(config.device, tp), 0))
    if config.quantization == "gguf" and loaded.source.suffix.lower() != ".gguf":
        raise ValueError(f"quantization 'gguf' needs a GGUF model file; {loaded.source} is not one")
    if loaded.gguf_blocks_kept and config.quantization != "gguf":
        raise ValueError(
            "this LoadedModel keeps projections in GGUF blocks (load_model(keep_gguf_blocks="
            f"True)), which only quantization 'gguf' reads; got quantization {config.quantization!r}"
        )
    if world == 1:
        worker = Worker(
            mc,
            loaded.state_dict,
            dtype,
            num_blocks,
            config.block_size,
            config.max_model_len,
            attention_backend=attention_backend,
            num_threads=config.num_threads,
            num_swap_blocks=num_swap_blocks,
            device=device,
            kv_cache_dtype=config.torch_kv_cache_dtype,
            gguf_native=loaded.source if config.quantization == "gguf" else None,
            quantization=config.quantization,
        )
        return UniProcExecutor(worker)

    for rank in range(tp):  # fail here, before any process starts
        TensorParallelShard.for_rank(mc, rank, tp)
    stage_layer_range(mc.num_hidden_layers, 0, pp)
    if config.distributed_executor_backend == "ray" and is_cuda(device):
        raise ValueError(
            "distributed_executor_backend 'ray' runs on device 'cpu' only for now (its actors "
            "do not reserve GPUs); use 'mp' with device "
            f"{config.device!r}"
        )
    threads = threads_per_rank(config.num_threads, world)
    source = _model_source(loaded)
    inits = []
    for rank in range(1, world):
        init = WorkerInit(
            config=mc,
            dtype=dtype,
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            attention_backend=attention_backend,
            num_threads=threads,
            num_swap_blocks=num_swap_blocks,
            device=device,
            kv_cache_dtype=config.torch_kv_cache_dtype,
            quantization=config.quantization,
            pipeline_micro_batches=config.pipeline_micro_batches,
        )
        if source is not None:
            init.source, init.source_kind = source
        elif tp == 1:
            init.state_dict = loaded.state_dict
        else:
            shard = TensorParallelShard.for_rank(mc, rank % tp, tp)
            init.state_dict = {
                k: v.contiguous().clone()
                for k, v in shard_state_dict(loaded.state_dict, shard, mc.head_dim).items()
            }
        inits.append(init)

    def make_driver_worker(ctx: ParallelContext) -> Worker:
        assert config.max_model_len is not None
        return Worker(
            mc,
            loaded.state_dict,
            dtype,
            num_blocks,
            config.block_size,
            config.max_model_len,
            attention_backend=attention_backend,
            num_threads=threads,
            num_swap_blocks=num_swap_blocks,
            group=ctx.tp_group,
            device=device,
            kv_cache_dtype=config.torch_kv_cache_dtype,
            pipeline=ctx.pipeline,
            quantization=config.quantization,
            pipeline_micro_batches=config.pipeline_micro_batches,
        )

    # The driver is rank 0: its current CUDA device must be its own before it joins the group.
    activate_device(torch.device(device))
    comm = dist_backend(device)
    if config.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(make_driver_worker, inits, backend=comm, pipeline_parallel_size=pp)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(make_driver_worker, inits, backend=comm, pipeline_parallel_size=pp)
