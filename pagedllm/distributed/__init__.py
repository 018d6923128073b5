"""Tensor-parallel process groups and collectives (paper section 4.6).

``TensorParallelGroup`` wraps one torch.distributed process group (gloo on CPU, nccl on CUDA:
``pagedllm.device.dist_backend`` chooses from the engine's device) owned by an engine; there is
no process-global default group, so several engines can live in one process one after the other.
"""

from pagedllm.distributed.parallel_state import (
    TensorParallelGroup,
    create_store,
    init_tensor_parallel_group,
)

__all__ = ["TensorParallelGroup", "create_store", "init_tensor_parallel_group"]
