"""Sparse mixture-of-experts feed-forward block (Shazeer et al. 2017; Mixtral, Jiang et al. 2024,
section 2.1; Qwen3-MoE; OLMoE; Granite MoE; Qwen2-MoE's and Granite MoE Shared's shared expert)
with the batch's tokens grouped by expert.

Each token's router picks its top-k of E SwiGLU experts and the block outputs the sum of their
outputs weighted by the router's softmax probabilities (Mixtral renormalises the k weights to sum
to 1; Qwen3-MoE and OLMoE do when ``norm_topk_prob``; Granite MoE takes the softmax over the k
largest logits only). A serving step holds many tokens (the decode
tokens of every running sequence plus prefill chunks), so instead of running k experts per token
the block sorts the step's (token, expert) assignments by expert id and runs every routed expert
ONCE over all of its rows (one gate/up GEMM and one down GEMM per expert and step); experts that
no token picked are not run. The weighted outputs are scatter-added back to their tokens.
Qwen2-MoE adds a shared expert that every token runs, scaled by a sigmoid gate, Granite MoE Shared
one without a gate (:class:`SharedExpertMoeBlock`). GPT-OSS adds biases to the router and to every
expert's projections and its own clamped SwiGLU (``moe_bias`` / ``glu`` arguments); an expert's
down bias is added once across tensor-parallel ranks (on rank 0).

Shapes: T = tokens in the step, d = hidden size, E = experts, k = experts per token,
I = one expert's intermediate width.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.layers.activation import activation_fn, gated_activation
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.packed_linear import PackedLinear, PackedSwiGLU, cpu_gemm_ops

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps


@dataclass(frozen=True)
class MoeCheckpointNames:
    """How a checkpoint names one MoE block's tensors (relative to ``model.layers.N.``).

    Attributes:
        block: the block's module name: "block_sparse_moe" (Mixtral), "mlp" (Qwen3-MoE).
        gate / up / down: one expert's projections: "w1" / "w3" / "w2" (Mixtral),
            "gate_proj" / "up_proj" / "down_proj" (Qwen3-MoE).
    """

    block: str
    gate: str
    up: str
    down: str


MIXTRAL_NAMES = MoeCheckpointNames("block_sparse_moe", "w1", "w3", "w2")
QWEN_MOE_NAMES = MoeCheckpointNames("mlp", "gate_proj", "up_proj", "down_proj")


def _layer_prefix(param_name: str) -> str:
    """``layers.3.mlp.experts.gate_up_weight`` -> ``model.layers.3.``."""
    parts = param_name.split(".")
    return f"model.{parts[0]}.{parts[1]}."


class GateLinear(nn.Module):
    """x W^T (+ b) for the small gating projections of MoE blocks (routers, shared-expert
    gates): plain parameters (not an ``nn.Linear``, which the dense packing would take) on
    ``F.linear``, until :meth:`pack` moves them to pagedllm's own GEMM where it runs.

    Args:
        out_features / in_features: W is [out_features, in_features] of ``dtype``.
        bias: whether there is a b [out_features].
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        self.packed: PackedLinear | None = None

    def pack(self, cpu_ops: CpuOps | None) -> int:
        """Prepack for pagedllm's own GEMM when it runs for this dtype (returns 1), else keep
        ``F.linear`` (returns 0). Why: MKL's sgemm sums a row's products in an order that
        depends on the number of rows, so a token's routing weights (and through them its
        logprobs, ~1e-6) differed alone and in a batch; the own GEMM's rows do not."""
        if cpu_gemm_ops(cpu_ops, self.weight.dtype) is None:
            return 0
        self.packed = PackedLinear(self.weight, cpu_ops, self.bias)
        del self.weight
        self.bias = None
        return 1

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features], x's dtype."""
        if self.packed is not None:
            out: torch.Tensor = self.packed(x)
            return out
        return F.linear(x, self.weight, self.bias)


class MoeRouter(GateLinear):
    """The router ("gate"): logits = x W^T (+ b), W [E, d], b [E] when ``bias`` (GPT-OSS),
    a :class:`GateLinear`.

    Forward: x [T, d] -> (weights [T, k] float32, expert ids [T, k] int64), see
    :func:`route_top_k`.
    """

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        dtype: torch.dtype,
        names: MoeCheckpointNames,
        softmax_after_top_k: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__(num_experts, hidden, dtype, bias)
        self.top_k = top_k
        self.normalize = normalize
        self.softmax_after_top_k = softmax_after_top_k
        self.names = names

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensor of the router weight or bias (``model.weight_map`` hook)."""
        kind = param_name.rpartition(".")[2]
        return [f"{_layer_prefix(param_name)}{self.names.block}.gate.{kind}"]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route_top_k(self.linear(x), self.top_k, self.normalize, self.softmax_after_top_k)


def route_top_k(
    logits: torch.Tensor, top_k: int, normalize: bool, softmax_after_top_k: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, then the k largest; or with
    ``softmax_after_top_k`` the k largest logits, then the softmax over those k (Granite MoE).

    Args:
        logits: [T, E] router logits (any float dtype).
        top_k: experts per token.
        normalize: rescale the k probabilities to sum to 1 (Mixtral; Qwen3-MoE's
            ``norm_topk_prob``); ignored with ``softmax_after_top_k`` (they already do).
        softmax_after_top_k: Granite MoE's order. The same experts, and weights equal to the
            renormalised ones up to rounding; without renormalisation the orders differ.

    Returns:
        (weights [T, k] float32, expert ids [T, k] int64), largest first.
    """
    if softmax_after_top_k:
        top_logits, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class StackedExperts(nn.Module):
    """E SwiGLU experts with stacked weights.

    Parameters (loaded by ``model.weight_map`` through :meth:`checkpoint_names` and
    :meth:`load_weight` from the per-expert checkpoint tensors):
        gate_up_weight: [E, 2I, d] (each expert's gate rows, then its up rows).
        down_weight: [E, d, I].
        gate_up_bias: [E, 2I], down_bias: [E, d]: only with ``bias`` (GPT-OSS).

    Args (beyond the shapes): ``glu``, the gated activation of one expert's [n, 2I] gate/up
    product (gate columns first) -> [n, I], instead of ``act(gate) * up`` (GPT-OSS's
    ``activation.clamped_swiglu``); ``add_down_bias``: False on tensor-parallel ranks other
    than 0, so that the sum over the ranks adds each expert's (whole) down bias once.

    After :meth:`pack` on the CPU (fp32) each expert runs on prepacked GEMMs (the own GEMM with
    the SwiGLU epilogue when available: plain SiLU, no bias; else with the bias added after the
    GEMM, or oneDNN) and the stacked parameters are dropped.

    Raises:
        ValueError: naming ``hidden_act`` for an activation the experts do not know.
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        act: str,
        dtype: torch.dtype,
        names: MoeCheckpointNames,
        bias: bool = False,
        glu: Callable[[torch.Tensor], torch.Tensor] | None = None,
        add_down_bias: bool = True,
    ) -> None:
        super().__init__()
        activation_fn(act)  # validate early
        self.num_experts = num_experts
        self.inter = inter
        self.act = act
        self.names = names
        self.glu = glu
        self.add_down_bias = add_down_bias
        self.gate_up_weight = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden, dtype=dtype), requires_grad=False
        )
        self.down_weight = nn.Parameter(
            torch.empty(num_experts, hidden, inter, dtype=dtype), requires_grad=False
        )
        self.gate_up_bias: nn.Parameter | None = None
        self.down_bias: nn.Parameter | None = None
        if bias:
            self.gate_up_bias = nn.Parameter(
                torch.empty(num_experts, 2 * inter, dtype=dtype), requires_grad=False
            )
            self.down_bias = nn.Parameter(
                torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False
            )
        self.packed_gate_up: nn.ModuleList | None = None
        self.packed_down: nn.ModuleList | None = None
        self.cpu_ops: CpuOps | None = None  # fused SiLU-and-mul when fused ops are on

    def checkpoint_names(self, param_name: str) -> list[str]:
        """Per-expert checkpoint tensors of a stacked parameter, expert by expert
        (``model.weight_map`` hook): gate_up_weight <- experts.e.{gate, up}.weight, down_weight
        <- experts.e.down.weight, e = 0 .. E-1; the biases likewise (``.bias``)."""
        n = self.names
        base = f"{_layer_prefix(param_name)}{n.block}.experts."
        leaf = param_name.rpartition(".")[2]  # gate_up_weight, down_bias, ...
        parts = (n.gate, n.up) if leaf.startswith("gate_up") else (n.down,)
        suffix = "bias" if leaf.endswith("_bias") else "weight"
        return [f"{base}{e}.{p}.{suffix}" for e in range(self.num_experts) for p in parts]

    def load_weight(self, value: torch.Tensor) -> torch.Tensor:
        """The stacked parameter from the concatenated per-expert tensors ([E * rows, cols] ->
        [E, rows, cols]; a bias [E * rows] -> [E, rows])."""
        if value.dim() == 1:
            return value.view(self.num_experts, -1)
        return value.view(self.num_experts, -1, value.shape[-1])

    @property
    def packed(self) -> bool:
        """Whether the experts run on prepacked GEMMs."""
        return self.packed_down is not None

    def pack(self, cpu_ops: CpuOps | None) -> int:
        """Prepack every expert (``model.packed_linear``; call after loading, fp32 CPU only).
        Returns the number of packed matrices (0 when the experts already run packed, e.g. on
        GGUF blocks: ``quant.gguf_model``)."""
        if self.packed:
            return 0
        gemm = cpu_gemm_ops(cpu_ops, self.gate_up_weight.dtype)
        plain = self.glu is None and self.gate_up_bias is None
        fuse = gemm is not None and plain and self.act == "silu" and self.inter % 8 == 0
        gate_up: list[nn.Module] = [
            PackedSwiGLU(w, gemm)
            if fuse and gemm is not None
            else PackedLinear(w, cpu_ops, self._bias(self.gate_up_bias, e))
            for e, w in enumerate(self.gate_up_weight)
        ]
        self.packed_gate_up = nn.ModuleList(gate_up)
        down = self.down_bias if self.add_down_bias else None
        self.packed_down = nn.ModuleList(
            PackedLinear(w, cpu_ops, self._bias(down, e)) for e, w in enumerate(self.down_weight)
        )
        # The packed copies replace them (a packed bias keeps its row of the stacked one).
        del self.gate_up_weight, self.down_weight
        self.gate_up_bias = self.down_bias = None
        return 2 * self.num_experts

    @staticmethod
    def _bias(stacked: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return None if stacked is None else stacked[expert]

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``expert`` over its rows: down(act(gate(x)) * up(x)), or with biases and
        ``glu``: down(glu(gate_up(x) + b_gu)) + b_down.

        Args:
            expert: expert index in [0, E).
            x: [n, d] the rows routed to it.

        Returns:
            [n, d], x's dtype.
        """
        if self.packed_gate_up is not None and self.packed_down is not None:
            gate_up = self.packed_gate_up[expert]
            h = gate_up(x)
            if not getattr(gate_up, "fused_activation", False):
                h = self._activation(h)
            out: torch.Tensor = self.packed_down[expert](h)
            return out
        h = self._activation(
            F.linear(x, self.gate_up_weight[expert], self._bias(self.gate_up_bias, expert))
        )
        down = self.down_bias if self.add_down_bias else None
        return F.linear(h, self.down_weight[expert], self._bias(down, expert))

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2I] -> [n, I]: ``glu`` when set, else act(gate) * up."""
        if self.glu is not None:
            return self.glu(gate_up)
        return gated_activation(gate_up, self.inter, self.act, self.cpu_ops)


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward block of one decoder layer (replaces the dense ``GatedMLP``).

    Args:
        hidden: model width d.
        inter: one expert's intermediate width I.
        num_experts: E.
        top_k: k, experts per token.
        normalize: renormalise the k routing weights (Mixtral: always; Qwen3-MoE:
            ``norm_topk_prob``).
        act: Hugging Face activation name of the experts ("silu").
        dtype: parameter dtype.
        names: the checkpoint's tensor names (:data:`MIXTRAL_NAMES`, :data:`QWEN_MOE_NAMES`).
        group: tensor-parallel group or None. Under tensor parallelism every rank holds a
            1 / tp slice of every expert's intermediate width (``inter`` is this rank's share;
            Megatron-LM column / row split per expert), routes all tokens itself (the router is
            replicated) and the partial outputs are summed by one all-reduce.
        softmax_after_top_k: route as Granite MoE (:func:`route_top_k`).
        bias: the router and every expert's projections have biases (GPT-OSS); an expert's
            down bias is added on tensor-parallel rank 0 only (:class:`StackedExperts`).
        glu: the experts' gated activation instead of ``act`` (:class:`StackedExperts`).

    Forward: x [T, d] -> [T, d]; with ``residual`` ([T, d], this step's own activation) the
    result is added into it in place and ``residual`` is returned (as ``GatedMLP``).

    Raises:
        ValueError: naming ``num_experts_per_tok`` when k is not in [1, E].
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        act: str,
        dtype: torch.dtype,
        names: MoeCheckpointNames,
        group: TensorParallelGroup | None = None,
        softmax_after_top_k: bool = False,
        bias: bool = False,
        glu: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        if not 1 <= top_k <= num_experts:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]"
            )
        self.gate = MoeRouter(
            hidden, num_experts, top_k, normalize, dtype, names, softmax_after_top_k, bias
        )
        first_rank = group is None or group.rank == 0
        self.experts = StackedExperts(
            hidden, inter, num_experts, act, dtype, names, bias, glu, add_down_bias=first_rank
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        moe = self.add_shared_expert(x, self.routed_experts(x))
        if self.group is not None:
            moe = self.group.all_reduce(moe)  # sum of the ranks' intermediate slices
        return moe if residual is None else residual.add_(moe)

    def add_shared_expert(self, x: torch.Tensor, moe: torch.Tensor) -> torch.Tensor:
        """``moe`` (the routed experts' sum [T, d], this rank's partial one under tensor
        parallelism) plus what every token's shared expert adds; here nothing
        (:class:`SharedExpertMoeBlock` adds its gated shared expert)."""
        return moe

    def routed_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's top-k experts, [T, d], each routed expert run once
        over its grouped rows; under tensor parallelism this rank's partial sum (not reduced)."""
        weights, ids = self.gate(x)  # [T, k]
        k = ids.shape[1]
        flat = ids.reshape(-1)  # assignment a = t * k + j
        # Group the assignments by expert (stable: within an expert, tokens stay in order).
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.num_experts).tolist()
        rows = order // k  # the token of each grouped assignment
        grouped = x.index_select(0, rows)  # [T * k, d], expert 0's rows first
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts):
            if n:  # unrouted experts are skipped
                out[start : start + n] = self.experts(expert, grouped[start : start + n])
                start += n
        out.mul_(weights.reshape(-1)[order].unsqueeze(1).to(out.dtype))
        # Sum into zeros first (as the reference does), then add the residual: same rounding.
        return torch.zeros_like(x).index_add_(0, rows, out)

    def forward_per_token(self, x: torch.Tensor) -> torch.Tensor:
        """The naive baseline: every token runs its k experts on its own row (T * k expert
        calls instead of at most E). Same result as :meth:`forward` up to rounding; for
        ``benchmarks/moe_step.py`` and the tests."""
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for t, (w_row, id_row) in enumerate(zip(weights.tolist(), ids.tolist(), strict=True)):
            for w, expert in zip(w_row, id_row, strict=True):
                out[t] += self.experts(expert, x[t : t + 1])[0] * w
        out = self.add_shared_expert(x, out)
        return out if self.group is None else self.group.all_reduce(out)


_WHOLE_VECTORS = 64  # a multiple of ATen's vectorized-loop step (2 vectors) on every ISA


class SharedExpertGate(GateLinear):
    """The shared expert's scalar gate: sigmoid(x w^T), w [1, d] (Qwen2-MoE's
    ``shared_expert_gate``), a :class:`GateLinear`. Replicated under tensor parallelism.

    Forward: x [T, d] -> [T, 1], x's dtype.
    """

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__(1, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ATen's vectorized sigmoid and its scalar tail round differently, and a [T, 1] input
        # puts a token in the tail or not depending on T: each row is widened to 64 lanes
        # (whole vectors on every ISA) so that its gate is the same float alone and batched.
        gate = self.linear(x)
        return torch.sigmoid(gate.expand(-1, _WHOLE_VECTORS).contiguous())[:, :1]


class SharedExpertMoeBlock(SparseMoeBlock):
    """A :class:`SparseMoeBlock` plus a shared expert every token runs (Qwen2-MoE, Granite MoE
    Shared): a SwiGLU ``GatedMLP`` of width ``shared_inter`` whose output, scaled per token by
    :class:`SharedExpertGate` when ``gated`` (Qwen2-MoE), is added to the routed experts' sum.

    Args:
        shared_inter: the shared expert's inner width (this rank's share under tensor
            parallelism: it is split like a dense MLP and its partial output joins the routed
            experts' partial sum before the block's one all-reduce).
        gated: the shared expert has a sigmoid gate (Qwen2-MoE); False = added as it is.
        other arguments: as :class:`SparseMoeBlock`.

    Checkpoint names (``model.layers.N.mlp.``, whatever ``names.block`` is):
    ``shared_expert.{gate,up,down}_proj.weight`` and, when gated, ``shared_expert_gate.weight``.
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        shared_inter: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        act: str,
        dtype: torch.dtype,
        names: MoeCheckpointNames,
        group: TensorParallelGroup | None = None,
        softmax_after_top_k: bool = False,
        gated: bool = True,
    ) -> None:
        super().__init__(
            hidden, inter, num_experts, top_k, normalize, act, dtype, names, group,
            softmax_after_top_k,
        )  # fmt: skip
        # No group: its down projection's partial sum is reduced with the routed experts'.
        self.shared_expert = GatedMLP(hidden, shared_inter, act, dtype)
        self.shared_expert_gate = SharedExpertGate(hidden, dtype) if gated else None

    def add_shared_expert(self, x: torch.Tensor, moe: torch.Tensor) -> torch.Tensor:
        """``moe + sigmoid(gate(x)) * shared_expert(x)``, or ``moe + shared_expert(x)`` without
        a gate (in place into ``moe``)."""
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared.mul_(self.shared_expert_gate(x))
        return moe.add_(shared)
