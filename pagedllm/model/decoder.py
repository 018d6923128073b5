"""The skeleton every decoder-only model shares: embedding, a stack of layers, the final norm and
an LM head that only computes the logits it is asked for, over a flat token batch with a paged KV
cache.

Shapes: T = new tokens in the step (all sequences concatenated), S = sampled positions,
d = hidden size, V = vocabulary.

A model file subclasses :class:`DecoderForCausalLM` and implements ``make_layer`` (one decoder
layer); the layers receive a :class:`StepContext` holding the step's rotary functions (computed
once per step, one per RoPE table), the attention metadata and the backend.

Tensor parallelism (paper section 4.6; Megatron-LM sharding, see ``model.sharding``): with a
``TensorParallelGroup`` each rank holds H / tp query heads and the KV heads they read, a 1 / tp
slice of the MLP width and of the vocabulary; o_proj, down_proj and the embedding end in an
all-reduce and the logits are gathered to rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from pagedllm.attention import AttentionBackend, AttentionMetadata
from pagedllm.distributed import TensorParallelGroup
from pagedllm.model.config import ModelArchConfig
from pagedllm.model.layers.embedding import scale_embedding, token_embedding
from pagedllm.model.layers.logits import lm_head_logits
from pagedllm.model.layers.mlp import GatedMLP
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.parallel import pack_row_parallel_layers
from pagedllm.model.layers.rotary import RotaryEmbedding, Rotate
from pagedllm.model.packed_linear import (
    PackedLinear,
    cpu_gemm_ops,
    pack_linear_layers,
    pack_swiglu_layers,
)
from pagedllm.model.sharding import TensorParallelShard
from pagedllm.model.step_interrupt import StepInterrupt
from pagedllm.model.weight_map import load_named_weights

#: Per layer (key_cache, value_cache), each [KVH, num_blocks, block_size, D].
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

if TYPE_CHECKING:
    from pagedllm.model.layers.fused_layer import FusedDecoderStack
    from pagedllm.ops import CpuOps


@dataclass
class StepContext:
    """What every layer of one step shares.

    Attributes:
        rotations: rotary function per RoPE table name ("global", "local"), see
            ``RotaryEmbedding.for_step``.
        meta: the step's attention metadata.
        backend: the attention backend.
        rotary: the RoPE tables by name, for ``rotary_tables``.
        positions: [T] int64 positions of the step's tokens, for ``rotary_tables``.
    """

    rotations: dict[str, Rotate]
    meta: AttentionMetadata
    backend: AttentionBackend
    rotary: dict[str, RotaryEmbedding] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    _tables: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )

    def rotary_tables(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(cos [N, R/2], sin [N, R/2], rows [T] int64 contiguous) of RoPE table ``name`` for
        this step (``RotaryEmbedding.step_tables``; computed once per step), or None when the
        context has no such table or no positions."""
        got = self._tables.get(name)
        if got is None:
            rotary = self.rotary.get(name)
            if rotary is None or self.positions is None:
                return None
            cos, sin, rows = rotary.step_tables(self.positions, self.meta)
            got = self._tables[name] = (cos, sin, rows.contiguous())
        return got


class DecoderForCausalLM(nn.Module):
    """Base class of the model files: the whole decoder with its LM head.

    Args:
        config: architecture.
        dtype: parameter and activation dtype (float32 or bfloat16).
        backend: paged-attention implementation.
        max_positions: size of the RoPE tables (the engine's max_model_len).
        group: the tensor-parallel group; None = the whole model in this process (tp = 1).

    Class attributes a model file sets:
        gguf_architectures: GGUF ``general.architecture`` values it reads.
        gguf_tensor_names: llama.cpp per-layer tensor name -> Hugging Face suffix, on top of
            ``loader.gguf_loader.GGUF_LAYER_NAMES``.
        layer_class: the decoder layer ``make_layer`` builds (a model whose layers differ by
            index overrides ``make_layer`` instead).
        gguf_permute_qk: llama.cpp permuted the q/k rows of this architecture (Llama only).
        splits_hf_weights: ``split_hf_weight`` rewrites some tensors (fused QKV, transposed
            Conv1D), so a tensor-parallel rank must read them whole before slicing.
        folded_projections: projections (name suffixes, ``"mlp.down_proj"``) whose weights
            ``load_weights`` changes after reading them (Granite folds a multiplier in), so
            ``quantization="gguf"`` keeps them float instead of rebuilding them from the file.
        default_rope_theta: the RoPE base of a ``config.json`` that names none: transformers'
            default for the architecture's config class (``Config().rope_theta``), which
            ``tests/model/test_rope_theta_default.py`` checks for every registry entry.
        unused_checkpoint_tensors: regular expressions (searched in the pagedllm checkpoint
            names) of tensors a checkpoint may hold that the model legitimately ignores;
            ``load_weights`` refuses any other tensor no parameter reads
            (``weight_map.unused_tensors``). Keep it short and say why for each entry.

    Raises:
        ValueError: naming ``tensor_parallel_size`` when the model cannot be split that way.
    """

    gguf_tensor_names: ClassVar[dict[str, str]] = {}
    gguf_permute_qk: ClassVar[bool] = False
    splits_hf_weights: ClassVar[bool] = False
    folded_projections: ClassVar[tuple[str, ...]] = ()
    default_rope_theta: ClassVar[float] = 10000.0
    # Older transformers (before 4.31) saved each layer's RoPE inverse frequencies as a
    # persistent buffer, and some trainers (ColossalAI) its cos / sin caches: pagedllm
    # recomputes them from the config.
    unused_checkpoint_tensors: ClassVar[tuple[str, ...]] = (
        r"\.rotary_emb\.(inv_freq|cos_cached|sin_cached)$",
    )

    def __init__(
        self,
        config: ModelArchConfig,
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
        self.embed_tokens = token_embedding(
            config.vocab_size, config.hidden_size, dtype, shard, group
        )
        self.layers = nn.ModuleList(
            self.make_layer(config, i, dtype, shard, group) for i in range(config.num_hidden_layers)
        )
        self.norm: nn.Module = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype, config.norm_weight_offset
        )
        self.rotary = nn.ModuleDict(self.make_rotary(config, max_positions))
        vocab_rows = shard.vocab_shard_size if shard else config.vocab_size
        self.lm_head_weight: Any
        if config.tie_word_embeddings:
            self.lm_head_weight = self.embed_tokens.weight
        else:
            self.lm_head_weight = nn.Parameter(
                torch.empty(vocab_rows, config.hidden_size, dtype=dtype), requires_grad=False
            )
        #: The LM head's bias [vocab rows] (``config.lm_head_bias``: Phi), or None.
        self.lm_head_bias: nn.Parameter | None = None
        if config.lm_head_bias:
            self.lm_head_bias = nn.Parameter(
                torch.zeros(vocab_rows, dtype=dtype), requires_grad=False
            )
        #: The decoder layers this process runs (all of them unless ``keep_stage_layers``).
        self.stage_layers = range(config.num_hidden_layers)
        self.lm_head_packed: nn.Module | None = None  # PackedLinear, or Int8Linear
        self.unloaded_params: list[str] = []  # meta placeholders left by load_weights
        #: This stage's layers as one C++ op (``use_fused_layers``), or None.
        self.fused_stack: FusedDecoderStack | None = None
        # Set by the engine (interrupt_decode_for_prefill): lets another thread stop a fused
        # step between layers (model.step_interrupt).
        self.step_interrupt: StepInterrupt | None = None
        self.requires_grad_(False)

    def keep_stage_layers(self, layers: range) -> None:
        """Pipeline parallelism: keep only the decoder layers ``layers`` (a contiguous range),
        replacing the others by parameterless placeholders before the weights are loaded, so
        that this stage loads and holds only its layers (indices, hence weight names, stay).
        The embedding, final norm and LM head stay on every stage (small next to the layers)."""
        for i in range(len(self.layers)):
            if i not in layers:
                self.layers[i] = _OtherStageLayer()
        self.stage_layers = layers

    # -- what a model file provides ----------------------------------------------------------

    #: The decoder-layer class a model file names (``make_layer`` builds it); a model whose
    #: layers differ by index overrides ``make_layer`` instead.
    layer_class: ClassVar[type[nn.Module] | None] = None

    def make_layer(
        self,
        config: ModelArchConfig,
        index: int,
        dtype: torch.dtype,
        shard: TensorParallelShard | None,
        group: TensorParallelGroup | None,
    ) -> nn.Module:
        """Decoder layer ``index``: a module called as ``layer(h, kv_cache, ctx) -> h``; by
        default ``layer_class(config, index, dtype, shard, group)``."""
        if self.layer_class is None:
            raise NotImplementedError(f"{type(self).__name__} names no layer_class")
        return self.layer_class(config, index, dtype, shard, group)

    @staticmethod
    def make_rotary(
        config: ModelArchConfig, max_positions: int | None
    ) -> dict[str, RotaryEmbedding]:
        """The RoPE tables by name: "global" (``rope_theta`` with ``rope_scaling``, partial
        rotary applied), plus "local" (``rope_local_theta``, unscaled) when the config has it."""
        n = max_positions or config.max_position_embeddings
        rot = int(config.head_dim * config.partial_rotary_factor)
        trained = config.max_position_embeddings
        tables = {
            "global": RotaryEmbedding(rot, config.rope_theta, config.rope_scaling, n, trained)
        }
        if config.rope_local_theta is not None:
            tables["local"] = RotaryEmbedding(rot, config.rope_local_theta, None, n, trained)
        return tables

    @classmethod
    def hf_config_fields(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``ModelArchConfig`` fields this architecture reads from a Hugging Face
        ``config.json`` dict beyond the common ones (``loader.hf_loader.hf_arch_config``)."""
        return {}

    @classmethod
    def gguf_config_fields(cls, meta: Callable[[str], Any]) -> dict[str, Any]:
        """``ModelArchConfig`` fields this architecture reads from GGUF metadata beyond the
        common ones; ``meta(key)`` returns ``<arch>.<key>`` or None."""
        return {}

    @classmethod
    def gguf_tensor_fields(cls, tensor_names: Collection[str]) -> dict[str, Any]:
        """``ModelArchConfig`` fields this architecture reads from which tensors a GGUF file
        holds, where no metadata key records a variant (Cohere's q/k norms); applied after
        :meth:`gguf_config_fields`."""
        return {}

    @classmethod
    def standardize_hf_config(cls, cfg: dict[str, Any]) -> dict[str, Any]:
        """``cfg`` (a ``config.json`` dict) with the common keys (``hidden_size``,
        ``intermediate_size``, ``num_hidden_layers``, ...) under the names
        ``loader.hf_loader.hf_arch_config`` reads; a model whose config spells them otherwise
        (GPT-2's ``n_embd``) returns a renamed copy."""
        return cfg

    @classmethod
    def hf_weight_name(cls, name: str) -> str | None:
        """The pagedllm checkpoint name (Llama's Hugging Face names: ``model.layers.N.self_attn.
        q_proj.weight``, ...) of the file's tensor ``name``; None = not a weight (a stored
        buffer such as a causal mask), skipped."""
        return name

    @classmethod
    def split_hf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """The tensors that the renamed checkpoint tensor ``name`` becomes (a fused QKV split in
        q/k/v, a transposed Conv1D weight); only called when ``splits_hf_weights``."""
        return {name: tensor}

    @classmethod
    def dequantize_mxfp4(
        cls, name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The tensor ``name`` of a checkpoint that stores it as an MXFP4 pair
        (``<name>_blocks`` / ``<name>_scales``, ``model.quant.mxfp4``), in ``dtype`` and in the
        layout of the unquantized tensor of that name; called before ``hf_weight_name``.

        Raises:
            ValueError: here (the default), naming the tensor and the architecture: only
                architectures whose checkpoints come so (GPT-OSS) know their layout.
        """
        raise ValueError(
            f"checkpoint tensor {name!r} is stored as MXFP4 ({name}_blocks / {name}_scales), "
            f"which {cls.__name__} does not read"
        )

    @classmethod
    def stack_hf_weights(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (renamed, split Hugging Face tensors) with the tensors that a checkpoint
        stores apart but one parameter holds stacked (StableLM's per-head q/k LayerNorms)
        replaced by the stacked tensor. Called on the whole state dict of a folder, and on a
        tensor-parallel rank's before the stacked tensors are cut. Default: ``state`` as is."""
        return state

    @classmethod
    def split_gguf_weight(
        cls, name: str, tensor: torch.Tensor, config: ModelArchConfig
    ) -> dict[str, torch.Tensor]:
        """As ``split_hf_weight`` for a tensor of a llama.cpp GGUF file, already renamed and in
        PyTorch ``[out, in]`` order; only called when ``splits_hf_weights``. Default: the Hugging
        Face split (llama.cpp keeps Phi-3's fused tensors as they are)."""
        return cls.split_hf_weight(name, tensor, config)

    # -- shared machinery --------------------------------------------------------------------

    def use_cpu_layer_ops(self, ops: CpuOps | None) -> None:
        """Run RMSNorm, the SiLU gate and the rotary embedding with the fused C++ kernels of
        ``ops`` (``pagedllm.ops.load_cpu_ops()``); fp32 and bf16 only, other dtypes are
        ignored."""
        if self.dtype not in (torch.float32, torch.bfloat16):
            return
        for m in self.modules():
            if isinstance(m, (RMSNorm, GatedMLP, RotaryEmbedding)):
                m.cpu_ops = ops

    def use_fused_layers(self, ops: CpuOps | None) -> int:
        """Run the decoder layers as one C++ op per step (``layers.fused_layer``) when every
        layer allows it: Llama-shaped layers whose projections are GGUF blocks, int8 records,
        fp32 / bf16 panels of the own GEMM or oneDNN packed weights, RoPE on the C++ kernel, no
        tensor parallelism (a bf16 model's residual stream is fp32 inside the op). Call after
        the linears are packed or quantized and after ``use_cpu_layer_ops``. ``ops`` None (or
        ``PAGEDLLM_DISABLE_FUSED_LAYER=1``) turns it off. Returns the number of layers fused
        (all of this stage's, or 0)."""
        from pagedllm.model.layers.fused_layer import (
            FusedDecoderLayer,
            FusedDecoderStack,
            fused_layers_enabled,
        )

        self.fused_stack = None
        if "global" not in self.rotary:  # learned positions (GPT-2, OPT): not Llama-shaped
            return 0
        rotary = cast(RotaryEmbedding, self.rotary["global"])
        if (
            ops is None
            or not fused_layers_enabled()
            or self.group is not None
            or self.dtype not in (torch.float32, torch.bfloat16)
            or rotary.cpu_ops is None
        ):
            return 0
        layers = self.layers[self.stage_layers.start : self.stage_layers.stop]
        fused = [FusedDecoderLayer.build(layer, rotary.rotary_dim) for layer in layers]
        if not fused or any(f is None for f in fused):
            return 0
        self.fused_stack = FusedDecoderStack(ops, [f for f in fused if f is not None])
        return len(fused)

    def pack_linears(self, cpu_ops: CpuOps | None = None) -> int:
        """Prepack every projection and the LM head (``model.packed_linear``: pagedllm's own GEMM
        when ``cpu_ops``, the C++ CPU kernels, run the avx2 variant, oneDNN otherwise); call after
        ``load_weights``. An LM head already set (a GGUF layer built before packing) is kept.
        Returns the number of packed matrices."""
        # Gate/up with the SwiGLU epilogue first (own GEMM only), then every other projection;
        # row-parallel layers (all-reduce) only where the own GEMM runs them.
        count = pack_swiglu_layers(self.layers, cpu_ops)
        count += pack_linear_layers(self.layers, cpu_ops)
        if self.group is not None:
            count += pack_row_parallel_layers(self.layers, cpu_ops)
            if not cpu_gemm_ops(cpu_ops, self.lm_head_weight.dtype):
                return count  # the vocabulary shard stays on ATen, as the layers above
        if self.lm_head_packed is not None:
            return count  # the LM head already runs on the GGUF file's blocks
        # Under a group this is the rank's vocabulary shard (gathered to rank 0).
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
        h = self.run_layers(input_ids, positions, kv_caches, meta)
        return self.compute_logits(h, logits_indices)

    @torch.inference_mode()
    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVCaches,
        meta: AttentionMetadata,
        h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The embedding and every layer (writing the step's K/V): the residual stream
        [T, H] in the model dtype, BEFORE the final norm (``self.norm`` of its rows gives the
        final hidden states that pooling / embedding requests reduce; replicated on every
        tensor-parallel rank).

        Under pipeline parallelism only ``stage_layers`` run (``kv`` then holds their caches,
        in order) and a later stage passes the previous stage's output as ``h`` [T, H] instead
        of embedding ``input_ids``."""
        if h is None:
            h = self.embed(input_ids, positions)
        rotary = {name: cast(RotaryEmbedding, r) for name, r in self.rotary.items()}
        ctx = StepContext({}, meta, self.backend, rotary, positions)
        if self.fused_stack is not None:
            # The op keeps the residual stream in fp32 (a bf16 model's linears read bf16 panels).
            h32 = h.float()
            if self.fused_stack(h32, kv, ctx, self.step_interrupt):
                return h32.to(h.dtype)  # every layer ran in the C++ op, on h32 in place
        # The per-layer path's rotary functions, built only when it runs.
        ctx.rotations = {name: r.for_step(positions, h.dtype, meta) for name, r in rotary.items()}
        start, stop = self.stage_layers.start, self.stage_layers.stop
        for layer, layer_kv in zip(list(self.layers)[start:stop], kv, strict=True):
            h = layer(h, layer_kv, ctx)
        return h

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Next-token logits [S, V] float32 of the rows ``logits_indices`` of ``run_layers``'
        output (final norm, LM head with its bias if any; under tensor parallelism only on
        rank 0, the other ranks return an empty [S, 0] tensor)."""
        return lm_head_logits(
            self.norm(h[logits_indices]),
            self.lm_head_weight,
            self.lm_head_packed,
            self.group,
            self.config.vocab_size,
            self.config.final_logit_softcapping,
            self.lm_head_bias,
        )

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0: [T] int64 ids (and their [T] positions, for
        models with learned positions) -> [T, d]; here the token embedding, scaled."""
        return scale_embedding(self.embed_tokens(input_ids), self.config.embedding_scale)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named weights in, stacking q/k/v and gate/up
        (``model.weight_map``).

        Under tensor parallelism ``state_dict`` holds this rank's slices
        (``model.sharding.shard_state_dict`` or a sharded loader); a short last vocabulary shard
        is padded with zero rows.

        Parameters whose tensors are meta placeholders (projections kept in GGUF blocks) are
        left unloaded and listed in ``unloaded_params``; ``quantize_linears`` must replace them
        before the model runs (``Worker``).

        Raises:
            ValueError: naming a missing tensor or one with the wrong shape, or the tensors no
                parameter reads (the checkpoint is a variant this class does not implement).
        """
        self.unloaded_params = load_named_weights(self, state_dict, pad_vocab=self.shard is not None)

    def weight_bytes(self) -> int:
        """Bytes of parameters (tied embeddings counted once)."""
        seen: set[int] = set()
        total = 0
        for p in self.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total


class _OtherStageLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds (no parameters)."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this decoder layer lives on another pipeline stage")
