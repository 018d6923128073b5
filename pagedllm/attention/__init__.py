"""Attention backends behind one interface, chosen per device from a small registry.

A backend has ``forward(query, key, value, key_cache, value_cache, meta, scale, sliding_window=None,
sinks=None) -> out``: it writes the new tokens' K/V into their slots, then attends over each
sequence's paged context (only its last ``sliding_window`` positions when set: every backend
honours it, and the C++ and Triton kernels never read keys before a query's window, so the block
manager may free those blocks; docs/sliding_window.md). ``sinks`` ([H] attention-sink logits,
gpt-oss) join each head's softmax denominator as keys of value zero; every backend implements
them (the C++ kernels in the same order of arithmetic for decode and prefill). Every
tensor it gets (activations, KV cache, ``AttentionMetadata`` index tensors) is on the engine's
device.

Registry (name -> device types it runs on):

==============  ==============  =========================================================
name            devices         implementation
==============  ==============  =========================================================
cpu             cpu             C++ kernels (``attention.cpu``; falls back to torch_native
                                with a warning when the extension cannot be built)
triton          cuda            Triton kernels (``attention.triton_paged``); also cpu while
                                ``TRITON_INTERPRET=1`` (the interpreter, for tests)
torch_native    cpu, cuda       vectorized torch ops (``attention.torch_native``)
reference       cpu, cuda       the slow oracle (``attention.reference``)
==============  ==============  =========================================================

``"auto"`` takes the first usable entry of the device's preference list: cpu -> cpu (when the
C++ extension loads), else torch_native; cuda -> triton (when Triton runs there), else
torch_native, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    Attributes:
        name: the ``attention_backend`` value that selects it.
        devices: device types it runs on ("cpu", "cuda").
        factory: builds an instance (imports lazily, so an unused backend costs nothing).
        usable: for "auto": whether it can run here now (e.g. the extension builds); explicit
            requests skip this check and let the backend itself report why it cannot run.
        extra_devices: device types it runs on only while this returns True (triton on cpu
            under the interpreter).
    """

    name: str
    devices: tuple[str, ...]
    factory: Callable[[], AttentionBackend]
    usable: Callable[[], bool] = lambda: True
    extra_devices: Callable[[], tuple[str, ...]] = lambda: ()

    def supports(self, device_type: str) -> bool:
        return device_type in self.devices or device_type in self.extra_devices()


_REGISTRY: dict[str, BackendEntry] = {}
# Device type -> backend names "auto" tries, in order.
_AUTO: dict[str, list[str]] = {}


def register_attention_backend(entry: BackendEntry, auto_for: tuple[str, ...] = ()) -> None:
    """Add (or replace) a backend; ``auto_for``: device types whose "auto" choice it becomes,
    ahead of those registered before it."""
    _REGISTRY[entry.name] = entry
    for dev in auto_for:
        prefs = _AUTO.setdefault(dev, [])
        if entry.name in prefs:
            prefs.remove(entry.name)
        prefs.insert(0, entry.name)


def attention_backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registration order (``EngineConfig.attention_backend``
    takes these or "auto")."""
    return tuple(_REGISTRY)


def attention_backends_for(device: torch.device | str) -> list[str]:
    """Names of the registered backends that run on ``device`` (sorted)."""
    dev = torch.device(device).type
    return sorted(n for n, e in _REGISTRY.items() if e.supports(dev))


def _torch_native() -> AttentionBackend:
    from pagedllm.attention.torch_native import TorchNativeAttention

    return TorchNativeAttention()


def _reference() -> AttentionBackend:
    from pagedllm.attention.reference import ReferenceAttention

    return ReferenceAttention()


def _cpu() -> AttentionBackend:
    from pagedllm.attention.cpu import CpuPagedAttention

    return CpuPagedAttention()


def _cpu_usable() -> bool:
    from pagedllm.attention.cpu import cpu_ops_available

    return cpu_ops_available()


def _triton() -> AttentionBackend:
    from pagedllm.attention.triton_paged import TritonPagedAttention

    return TritonPagedAttention()


def _triton_usable() -> bool:
    from pagedllm.attention.triton_paged import triton_available

    return triton_available()


def _triton_interpreted() -> tuple[str, ...]:
    import os

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return ()
    from pagedllm.attention.triton_paged import unavailable_reason

    return ("cpu",) if unavailable_reason() is None else ()


register_attention_backend(BackendEntry("reference", ("cpu", "cuda"), _reference))
register_attention_backend(
    BackendEntry("torch_native", ("cpu", "cuda"), _torch_native), auto_for=("cpu", "cuda")
)
register_attention_backend(BackendEntry("cpu", ("cpu",), _cpu, _cpu_usable), auto_for=("cpu",))
register_attention_backend(
    BackendEntry("triton", ("cuda",), _triton, _triton_usable, _triton_interpreted),
    auto_for=("cuda",),
)


def get_attention_backend(
    name: str = "auto", device: torch.device | str = "cpu"
) -> AttentionBackend:
    """A backend instance for ``device``, by name (see the registry in the module docstring).

    Args:
        name: "auto" or a registered name.
        device: the device the model and KV cache live on ("cpu", "cuda", "cuda:N").

    Raises:
        ValueError: naming ``attention_backend`` for an unknown name, or for a backend that does
            not run on ``device`` (the message names the device and the backends that do).
        RuntimeError: from the backend when it is named explicitly but cannot run here (e.g.
            "triton" with a broken Triton install).
    """
    dev = torch.device(device).type
    if name == "auto":
        prefs = _AUTO.get(dev, [])
        for i, candidate in enumerate(prefs):
            entry = _REGISTRY[candidate]
            if entry.usable():
                if i > 0 and dev != "cpu":  # on CPU the extension loader already warned
                    warnings.warn(
                        f"pagedllm: attention backend {prefs[0]!r} cannot run on device "
                        f"{str(device)!r}; using {candidate!r}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return entry.factory()
        raise ValueError(
            f"attention_backend 'auto': no attention backend is registered for device "
            f"{str(device)!r}"
        )
    entry_or_none = _REGISTRY.get(name)
    if entry_or_none is None:
        known = ", ".join(["auto", *sorted(_REGISTRY)])
        raise ValueError(f"attention_backend must be one of {known}, got {name!r}")
    if not entry_or_none.supports(dev):
        ok = ", ".join(["auto", *attention_backends_for(dev)])
        raise ValueError(
            f"attention_backend {name!r} does not run on device {str(device)!r} (it runs on "
            f"{', '.join(entry_or_none.devices)}); for this device use one of {ok}"
        )
    return entry_or_none.factory()


__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "BackendEntry",
    "attention_backends_for",
    "get_attention_backend",
    "register_attention_backend",
    "attention_backend_names",
]
