"""Stopping a step's forward pass between two decoder layers, at another thread's request.

A decode step on a CPU takes tens of milliseconds and cannot take a new request in once it has
started, so a request that arrives just after a decode step began waits for all of it before its
prefill. With ``EngineConfig.interrupt_decode_for_prefill`` the server's event loop may ask the
step in flight to stop (:meth:`StepInterrupt.request`) when a request arrives early in a
decode-only step and a batch slot is free: the fused decoder op (``csrc/cpu/fused_layer.cpp``)
checks the flag before each layer and returns early, the model raises :class:`StepInterrupted`,
and the engine discards the step (no token is sampled, no ``num_computed_tokens`` advances, no
block is registered in the prefix cache). The next step schedules the same decodes again together
with the new request's prefill (with ``prefill_first``, the prefill runs alone first and the
decodes in the step after it); the K/V the stopped step wrote for those decodes is rewritten with
the same values. Both options are on by default under ``admission="slots"``.
"""

from __future__ import annotations

import torch


class StepInterrupted(Exception):
    """The forward pass stopped before its last layer; nothing of the step may be kept."""


class StepInterrupt:
    """The flag shared by the thread that asks (:meth:`request`) and the forward pass.

    ``flag`` is an int32 [2] tensor: element 0 nonzero = stop before the next layer; element 1 =
    layers the fused op has run (it writes it).
    """

    def __init__(self) -> None:
        self.flag = torch.zeros(2, dtype=torch.int32)
        self._view = self.flag.numpy()  # plain stores from any thread, without torch dispatch

    def request(self) -> None:
        """Ask the step in flight (if any) to stop before its next layer."""
        self._view[0] = 1

    def clear(self) -> None:
        """Before a step: no stop requested, no layer run."""
        self._view[:] = 0

    def stopped_early(self, num_layers: int) -> bool:
        """After the fused op: whether it ran fewer than ``num_layers`` layers."""
        return int(self._view[1]) < num_layers
