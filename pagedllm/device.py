"""Where the engine computes: every device-specific decision in one place.

The engine runs on ``EngineConfig.device``: ``"cpu"`` or a CUDA device (``"cuda"``,
``"cuda:N"``). On that device live the model weights, the KV cache pool and every step's input
tensors (token ids, positions, slot mapping, block tables, sequence lengths); the attention
backend is the one registered for it (``pagedllm.attention.get_attention_backend``). The host swap
pool always stays in host memory, pinned on CUDA so that swaps are DMA copies.

The rest of the code asks this module instead of comparing device strings:

* ``resolve_device`` validates a user's device string (a clear ``ValueError`` naming ``device``
  for a typo or a device this machine does not have) and returns a ``torch.device``;
* ``device_for_rank`` says which device a tensor-parallel rank uses (rank r of ``cuda:i`` on
  ``cuda:i + r``) and ``activate_device`` makes it the process's current CUDA device;
* ``dist_backend`` picks the collective library (gloo on CPU, nccl on CUDA);
* ``pin_host_memory`` says whether host buffers that feed the device should be pinned;
* ``uses_cpu_ops`` says whether the C++ CPU extension may be used (only for CPU tensors).
"""

from __future__ import annotations

import torch

SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str | torch.device, tensor_parallel_size: int = 1) -> torch.device:
    """Check that ``device`` exists here and return it as a ``torch.device``.

    Args:
        device: "cpu" (also "cpu:0"), "cuda" (the current CUDA device) or "cuda:N".
        tensor_parallel_size: ranks that will each take one CUDA device, starting at ``device``'s
            index (ignored on CPU).

    Returns:
        ``torch.device("cpu")`` for any CPU spelling; for CUDA the device as given (index kept,
        None for a bare "cuda").

    Raises:
        ValueError: naming ``device`` when the string is not a device ("cuda0", "gpu"), names a
            device type the engine does not run on ("mps", "xpu:0"), asks for CUDA on a machine
            without a usable CUDA device, or an index past the last GPU; naming
            ``tensor_parallel_size`` when the ranks need more GPUs than there are from the index.
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} (not a device: {e})"
        ) from None
    if dev.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}: the engine has no "
            f"attention kernels for device type {dev.type!r}"
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    count = _cuda_count()
    if count == 0:
        raise ValueError(
            f"device {device!r}: no CUDA device is available here (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use device='cpu'"
        )
    first = dev.index if dev.index is not None else torch.cuda.current_device()
    if first >= count:
        raise ValueError(
            f"device {device!r}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}"
        )
    if first + tensor_parallel_size > count:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs one CUDA device per rank from "
            f"cuda:{first}, but this machine has {count} (device {device!r})"
        )
    return dev


def canonical_device(device: str | torch.device, tensor_parallel_size: int = 1) -> str:
    """``resolve_device`` as a string: "cpu", "cuda" or "cuda:N" (what ``EngineConfig.device``
    holds after validation).

    Raises:
        ValueError: as ``resolve_device``.
    """
    return str(resolve_device(device, tensor_parallel_size))


def is_cuda(device: str | torch.device) -> bool:
    """True for a CUDA device (no validation)."""
    return torch.device(device).type == "cuda"


def device_for_rank(device: str | torch.device, rank: int = 0) -> torch.device:
    """The device tensor-parallel rank ``rank`` computes on.

    CPU: every rank uses the CPU. CUDA: rank r uses ``cuda:(i + r)`` where ``i`` is ``device``'s
    index (the current CUDA device for a bare "cuda"), so each rank has its own GPU, as NCCL
    requires. The index is always explicit, so tensors compare equal to it.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    first = dev.index if dev.index is not None else torch.cuda.current_device()
    return torch.device("cuda", first + rank)


def activate_device(device: torch.device) -> None:
    """Make ``device`` the process's current CUDA device (a no-op on CPU): kernels launched and
    NCCL communicators created later in this process use it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def dist_backend(device: str | torch.device) -> str:
    """The torch.distributed backend for tensor parallelism on ``device``: "nccl" on CUDA (the
    tensors being reduced live on the GPU), "gloo" on CPU."""
    return "nccl" if is_cuda(device) else "gloo"


def pin_host_memory(device: str | torch.device) -> bool:
    """Whether host buffers copied to / from ``device`` should be pinned (page-locked): True on
    CUDA, where pinned memory makes the copies DMA transfers; False on CPU."""
    return is_cuda(device)


def uses_cpu_ops(device: str | torch.device) -> bool:
    """Whether the C++ CPU extension (attention, fused layer ops, sampler helpers) applies:
    only for tensors on the CPU."""
    return torch.device(device).type == "cpu"


__all__ = [
    "SUPPORTED_DEVICE_TYPES",
    "activate_device",
    "canonical_device",
    "device_for_rank",
    "dist_backend",
    "is_cuda",
    "pin_host_memory",
    "resolve_device",
    "uses_cpu_ops",
]
