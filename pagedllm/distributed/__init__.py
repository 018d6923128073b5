"""Tensor- and pipeline-parallel process groups, collectives and stage links (paper section 4.6).

``TensorParallelGroup`` wraps one torch.distributed process group (gloo on CPU, nccl on CUDA:
``pagedllm.device.dist_backend`` chooses from the engine's device) owned by an engine; there is
no process-global default group, so several engines can live in one process one after the other.
"""

from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    create_store,
    host_ip,
)
from pagedllm.distributed.pipeline import (
    ParallelContext,
    PipelineGroup,
    init_parallel_groups,
    max_stage_layers,
    stage_layer_range,
)

__all__ = [
    "ParallelContext",
    "PipelineGroup",
    "TensorParallelGroup",
    "create_store",
    "host_ip",
    "init_parallel_groups",
    "max_stage_layers",
    "stage_layer_range",
]
