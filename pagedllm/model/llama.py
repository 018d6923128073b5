"""A Llama-family decoder over a flat token batch with a paged KV cache.

Shapes: T = new tokens in the step (all sequences concatenated), S = sampled positions,
d = hidden size, H / KVH = query / key-value heads, D = head dim, V = vocabulary.

Projections are fused at load time (Q, K and V in one matrix; gate and up in another) so that a
layer does four matmuls instead of seven.

Tensor parallelism (paper section 4.6; Megatron-LM sharding, see ``model.sharding``): with a
``TensorParallelGroup`` each rank holds H / tp query heads and the KV heads they read, a
1 / tp slice of the SwiGLU width and of the vocabulary; o_proj, down_proj and the embedding end in
an all-reduce and the logits are gathered to rank 0. Without a group (tp = 1) the layers are
plain ``nn.Linear`` / ``nn.Embedding`` and nothing communicates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import LlamaArchConfig
from pagedllm.model.packed_linear import PackedLinear, pack_linear_layers, pack_swiglu_layers
from pagedllm.model.parallel_layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from pagedllm.model.sharding import TensorParallelShard

if TYPE_CHECKING:
    from pagedllm.ops import CpuOps

_M = TypeVar("_M", bound=nn.Module)

Rotate = Callable[[torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 (Zhang & Sennrich 2019)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32, CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None and x.dim() == 2:
            out = torch.empty_like(x)
            self.cpu_ops.rms_norm(out, x, self.weight, self.eps)
            return out
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(config: LlamaArchConfig) -> torch.Tensor:
    """Inverse frequencies [D / 2] float32, with the config's RoPE scaling applied.

    Base: theta^(-2i / D) (Su et al. 2021, RoFormer eq. 15). Scaling: "linear" divides every
    frequency by ``factor``; "llama3" (Llama 3.1) keeps high frequencies, divides low ones by
    ``factor`` and interpolates smoothly between ``low_freq_factor`` and ``high_freq_factor``.

    Raises:
        ValueError: naming ``rope_scaling`` for an unsupported type.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = config.rope_scaling
    kind = (sc or {}).get("rope_type", (sc or {}).get("type", "default"))
    if sc is None or kind == "default":
        return inv
    factor = float(sc["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low, high = float(sc.get("low_freq_factor", 1.0)), float(sc.get("high_freq_factor", 4.0))
        old_len = float(sc.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout of Hugging Face checkpoints, with a
    cos/sin table precomputed for every position up to ``max_positions``."""

    def __init__(self, config: LlamaArchConfig, max_positions: int) -> None:
        super().__init__()
        inv = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)  # [P, D/2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32, CPU)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a step's positions, [T, 1, D/2] each; computed once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(
            dtype
        )

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotate:
        """The step's rotation: a function taking [T, heads, D] (a strided view is fine) and
        returning it rotated by ``positions`` ([T] int64). With the C++ kernel (fp32 on the CPU)
        it rotates in place with no temporaries; otherwise it returns a new tensor."""
        ops = self.cpu_ops
        if ops is not None and dtype == torch.float32 and positions.device.type == "cpu":
            cos, sin = self.cos, self.sin
            positions = positions.contiguous()

            def rotate_in_place(x: torch.Tensor) -> torch.Tensor:
                ops.rotary_embedding(x, positions, cos, sin)
                return x

            return rotate_in_place
        cos_t, sin_t = self.lookup(positions, dtype)  # gathered once per step, not per layer
        return lambda x: apply_rotary(x, cos_t, sin_t)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by the step's angles (``RotaryEmbedding.lookup``); same shape."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _uninitialized(cls: type[_M], *args: Any, **kwargs: Any) -> _M:
    """``cls(*args, **kwargs)`` for a linear layer, without its random weight init
    (``torch.nn.utils.skip_init``): every weight is overwritten by ``load_weights``, and drawing
    the random numbers cost ~1 s of SmolLM2-135M's start-up. The weight goes to the current
    default device (``with torch.device(...)``, as the worker builds the model), like every other
    tensor the model allocates, not to skip_init's default, the CPU."""
    kwargs.setdefault("device", torch.get_default_device())
    return nn.utils.skip_init(cls, *args, **kwargs)


def _linear_out(
    in_features: int, out_features: int, group: TensorParallelGroup | None, dtype: torch.dtype
) -> nn.Linear:
    """The second linear of a block: row-parallel (all-reduce) under tensor parallelism."""
    if group is None:
        return _uninitialized(nn.Linear, in_features, out_features, bias=False, dtype=dtype)
    return _uninitialized(RowParallelLinear, in_features, out_features, group, dtype)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: LlamaArchConfig,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = shard.num_heads if shard else config.num_attention_heads
        self.num_kv_heads = shard.num_kv_heads if shard else config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_proj = _uninitialized(
            nn.Linear, hidden, self.q_size + 2 * self.kv_size, bias=False, dtype=dtype
        )
        self.o_proj = _linear_out(self.q_size, hidden, group, dtype)

    def forward(
        self,
        rotate: Rotate,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) D]
        # Q and K heads are rotated together: one rotary op per layer.
        qk = rotate(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].reshape(t, self.num_kv_heads, self.head_dim)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(
        self,
        config: LlamaArchConfig,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.inter = shard.intermediate_size if shard else config.intermediate_size
        self.gate_up_proj = _uninitialized(
            nn.Linear, config.hidden_size, 2 * self.inter, bias=False, dtype=dtype
        )
        self.down_proj = _linear_out(self.inter, config.hidden_size, group, dtype)
        self.cpu_ops: CpuOps | None = None  # the C++ kernels when fused ops are on (fp32, CPU)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[T, d] -> [T, d]; with ``residual`` ([T, d], this step's own activation) the result
        is added into it in place and ``residual`` is returned."""
        if getattr(self.gate_up_proj, "fused_activation", False):
            act = self.gate_up_proj(x)  # PackedSwiGLU: the activation straight from the GEMM
        else:
            gate_up = self.gate_up_proj(x)
            if self.cpu_ops is not None and gate_up.dim() == 2:
                act = gate_up.new_empty(gate_up.shape[0], self.inter)
                self.cpu_ops.silu_and_mul(act, gate_up)
            else:
                gate, up = gate_up.split(self.inter, dim=-1)
                act = F.silu(gate) * up
        if residual is None:
            return self.down_proj(act)
        if isinstance(self.down_proj, PackedLinear):
            return self.down_proj.forward_add_(residual, act)  # the add in the GEMM's epilogue
        return residual.add_(self.down_proj(act))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: LlamaArchConfig,
        dtype: torch.dtype,
        shard: TensorParallelShard | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, dtype, shard, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, shard, group)

    def forward(
        self,
        rotate: Rotate,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        a = self.self_attn(rotate, self.input_layernorm(x), kv_cache, meta, backend)
        norm = self.post_attention_layernorm
        if norm.cpu_ops is not None:
            # One pass: x += a (x is this step's own activation, free to overwrite), a = norm(x).
            norm.cpu_ops.fused_add_rms_norm(a, x, norm.weight, norm.eps)
            return self.mlp(a, residual=x)  # x += mlp(a), in place
        h = x + a
        return h + self.mlp(norm(h))


class LlamaForCausalLM(nn.Module):
    """The whole decoder with an LM head that only computes the logits it is asked for.

    Args:
        config: architecture.
        dtype: parameter and activation dtype (float32 or bfloat16).
        backend: paged-attention implementation.
        max_positions: size of the RoPE table (the engine's max_model_len).
        group: the tensor-parallel group; None = the whole model in this process (tp = 1).

    Raises:
        ValueError: naming ``tensor_parallel_size`` when the model cannot be split that way.
    """

    def __init__(
        self,
        config: LlamaArchConfig,
        dtype: torch.dtype,
        backend: AttentionBackend,
        max_positions: int | None = None,
        group: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backend = backend
        self.group = group
        self.shard = (
            TensorParallelShard.for_rank(config, group.rank, group.world_size) if group else None
        )
        shard = self.shard
        self.embed_tokens: nn.Module
        if group is None or shard is None:
            # ``_weight`` skips the random init (skip_init's meta-device normal_ would first
            # import torch._refs, ~3 s); load_weights fills it.
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=dtype),
            )
        else:
            self.embed_tokens = VocabParallelEmbedding(
                shard.vocab_shard_size, shard.vocab, config.hidden_size, group, dtype
            )
        vocab_rows = shard.vocab_shard_size if shard else config.vocab_size
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, dtype, shard, group) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(
                torch.empty(vocab_rows, config.hidden_size, dtype=dtype),
                requires_grad=False,
            )
        self.lm_head_packed: PackedLinear | None = None
        self.requires_grad_(False)

    def use_cpu_layer_ops(self, ops: CpuOps | None) -> None:
        """Run RMSNorm, the SwiGLU activation and the rotary embedding with the fused C++ kernels
        of ``ops`` (``pagedllm.ops.load_cpu_ops()``); fp32 only, so other
        dtypes are ignored."""
        if self.dtype != torch.float32:
            return
        for m in self.modules():
            if isinstance(m, (RMSNorm, LlamaMLP, RotaryEmbedding)):
                m.cpu_ops = ops

    def pack_linears(self, cpu_ops: CpuOps | None = None) -> int:
        """Prepack every projection and the LM head (``model.packed_linear``: pagedllm's own GEMM
        when ``cpu_ops``, the C++ CPU kernels, run the avx2 variant, oneDNN otherwise); call after
        ``load_weights``. Returns the number of packed matrices."""
        # Gate/up with the SwiGLU epilogue first (own GEMM only), then every other projection;
        # row-parallel layers (all-reduce) stay as they are.
        count = pack_swiglu_layers(self.layers, cpu_ops)
        count += pack_linear_layers(self.layers, cpu_ops)
        if self.group is not None:
            return count  # the LM head is a vocabulary shard gathered to rank 0
        self.lm_head_packed = PackedLinear(self.lm_head_weight, cpu_ops)
        return count + 1

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: [T] int64 new tokens; positions: [T] int64 their positions (both on
                the weights' device, as every tensor here).
            kv_caches: per layer (key_cache, value_cache), each
                [KVH, num_blocks, block_size, D], on the weights' device.
            meta: batch layout and slots.
            logits_indices: [S] int64 rows of the batch whose next-token logits are wanted.

        Returns:
            logits [S, V] float32; under tensor parallelism only on rank 0, the other ranks
            return an empty [S, 0] tensor.
        """
        h = self.embed_tokens(input_ids)
        rotate = self.rotary.for_step(positions, h.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h = layer(rotate, h, kv, meta, self.backend)
        h = self.norm(h[logits_indices])
        if self.group is None:
            if self.lm_head_packed is not None:
                return self.lm_head_packed(h).float()
            return F.linear(h, self.lm_head_weight).float()
        logits = vocab_parallel_logits(h, self.lm_head_weight, self.group, self.config.vocab_size)
        return h.new_empty(h.shape[0], 0) if logits is None else logits.float()

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, fusing q/k/v and gate/up.

        Under tensor parallelism ``state_dict`` holds this rank's slices
        (``model.sharding.shard_state_dict`` or a sharded loader); a short last vocabulary shard
        is padded with zero rows.

        Raises:
            ValueError: naming a missing tensor or one with the wrong shape.
        """

        def get(name: str) -> torch.Tensor:
            if name not in state_dict:
                raise ValueError(f"weight {name!r} is missing from the checkpoint")
            return state_dict[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if (
                self.shard is not None
                and name in ("model.embed_tokens.weight", "lm_head.weight")
                and value.shape[0] < param.shape[0]
                and value.shape[1:] == param.shape[1:]
            ):
                param.zero_()
                param = param[: value.shape[0]]
            if param.shape != value.shape:
                raise ValueError(
                    f"weight {name!r}: expected {tuple(param.shape)}, got {tuple(value.shape)}"
                )
            param.copy_(value.to(param.dtype))

        with torch.no_grad():
            put(
                cast(torch.Tensor, self.embed_tokens.weight),
                get("model.embed_tokens.weight"),
                "model.embed_tokens.weight",
            )
            put(self.norm.weight, get("model.norm.weight"), "model.norm.weight")
            if not self.config.tie_word_embeddings:
                put(self.lm_head_weight, get("lm_head.weight"), "lm_head.weight")
            for i, module in enumerate(self.layers):
                layer = cast(LlamaDecoderLayer, module)
                p = f"model.layers.{i}."
                put(
                    layer.input_layernorm.weight,
                    get(p + "input_layernorm.weight"),
                    p + "input_layernorm",
                )
                put(
                    layer.post_attention_layernorm.weight,
                    get(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm",
                )
                qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
                put(layer.self_attn.qkv_proj.weight, qkv, p + "self_attn.qkv_proj")
                put(
                    layer.self_attn.o_proj.weight,
                    get(p + "self_attn.o_proj.weight"),
                    p + "self_attn.o_proj",
                )
                gate_up = torch.cat(
                    [get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0
                )
                put(layer.mlp.gate_up_proj.weight, gate_up, p + "mlp.gate_up_proj")
                put(
                    layer.mlp.down_proj.weight, get(p + "mlp.down_proj.weight"), p + "mlp.down_proj"
                )

    def weight_bytes(self) -> int:
        """Bytes of parameters (tied embeddings counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total
