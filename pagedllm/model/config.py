"""Architecture hyper-parameters of a decoder-only model, independent of the file format.

One dataclass describes every supported architecture: the Llama fields every decoder has, plus
switches for what other families add (QKV bias, q/k norms, sliding windows, Gemma's norm and
embedding conventions). ``architecture`` names the model class (``pagedllm.model.registry``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelArchConfig:
    """Shape of a decoder-only transformer.

    Attributes:
        vocab_size: number of token ids (rows of the embedding).
        hidden_size: model width d (elements).
        intermediate_size: gated-MLP inner width (elements).
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when < query heads).
        head_dim: elements per head (usually hidden_size // num_attention_heads).
        rms_norm_eps: epsilon inside RMSNorm.
        rope_theta: RoPE base frequency (of the global layers when ``rope_local_theta`` is set).
        rope_scaling: Hugging Face style scaling dict (``{"rope_type": "llama3" | "linear" |
            "default", "factor": ..., ...}``) or None; global layers only.
        max_position_embeddings: the model's trained context length (tokens).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        bos_token_id: beginning-of-sequence id or None.
        eos_token_ids: every id that ends generation (model EOS, generation-config EOS, the chat
            template's end-of-turn token).
        architecture: the Hugging Face class name (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ...); the registry key of the pagedllm model class.
        hidden_act: the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU).
        attention_bias: q, k and v projections have a bias (Qwen2; Llama's ``attention_bias``).
        o_proj_bias: the output projection has a bias (Llama's ``attention_bias``).
        qk_norm: RMSNorm over each query / key head before RoPE (Qwen3, Gemma 3).
        qk_norm_full_width: the q/k RMSNorms span the whole projection (width heads * head_dim
            for q, kv_heads * head_dim for k; OLMo 2) instead of one head.
        qk_layer_norm: a LayerNorm (mean-subtracting, weight only) over each query / key head
            before RoPE, with one weight row per head ([heads, head_dim]; Cohere's
            ``use_qk_norm``, StableLM's ``qk_layernorm``), instead of the RMSNorms of ``qk_norm``.
        sliding_window: tokens a windowed layer sees (its own included), or None.
        layer_types: per layer "full_attention" or "sliding_attention"; None = every layer is
            windowed when ``sliding_window`` is set (Mistral), else full.
        rope_local_theta: RoPE base of the sliding layers (Gemma 3), or None = ``rope_theta``.
        nope_layers: indices of the layers whose queries and keys get no rotary embedding at all
            (SmolLM3's NoPE layers); None = every layer rotates.
        partial_rotary_factor: fraction of each head's dimensions that RoPE rotates.
        norm_weight_offset: checkpoints store RMSNorm weights as ``w - offset`` (Gemma: 1.0,
            the norm multiplies by ``1 + w``); folded into the weight at load time.
        sandwich_norm: extra RMSNorms after attention and around the MLP (Gemma 2 / 3).
        embedding_scale: multiplier of the embedding output (Gemma: sqrt(hidden_size)), or None.
        query_pre_attn_scalar: attention scale is its -1/2 power (Gemma); None = head_dim.
        attention_scale: the attention softmax scale itself (Granite's ``attention_multiplier``);
            None = ``query_pre_attn_scalar`` (or head_dim) to the -1/2 power.
        residual_multiplier: each attention / MLP output is multiplied by it before the
            residual add (Granite); folded into o_proj and down_proj at load time. None = 1.
        logits_scaling: the logits are divided by it (Granite); None = 1.
        final_logit_softcapping: logits = cap * tanh(logits / cap) when set (Gemma 2).
        layer_norm_eps: epsilon inside LayerNorm (OPT, GPT-2, GPT-NeoX).
        layer_norm_bias: the LayerNorms have a bias; False = weight only (Cohere).
        logit_scale: the logits are multiplied by it (Cohere); None = 1.
        mlp_bias: the MLP projections have biases (OPT, GPT-2, GPT-NeoX).
        parallel_residual: x + attn(ln1(x)) + mlp(ln2(x)) in one residual step (GPT-NeoX).
        norm_before: pre-norm layers; False = the norm follows each residual add (OPT-350m).
        shared_input_norm: with ``parallel_residual``, attention and MLP both read the one
            LayerNorm of the layer input, x + attn(ln(x)) + mlp(ln(x)), and the layer has no
            second norm (Phi-1/1.5/2; StableLM with ``use_parallel_residual``).
        lm_head_bias: the LM head adds a bias over the vocabulary (Phi-1/1.5/2).
        position_offset: learned absolute position embeddings are in use, position p reading
            row p + offset (OPT: 2, GPT-2: 0); None = no learned positions (RoPE models). Such
            a model has no rows past ``max_position_embeddings``, which caps max_model_len.
        attn_logit_softcapping: attention scores = cap * tanh(scores / cap) when set (Gemma 2);
            such layers run on the torch_native attention (``layers.attention``).
        num_experts: routed experts of a mixture-of-experts layer (Mixtral, Qwen3-MoE); 0 =
            dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: one expert's intermediate width; None = ``intermediate_size``.
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        moe_layers: indices of the MoE layers (the others have a dense MLP of
            ``intermediate_size``); None = every layer when ``num_experts``.
        shared_expert_intermediate_size: width of the SwiGLU shared expert every token of a MoE
            layer also runs (Qwen2-MoE, Granite MoE Shared); None = no shared expert.
        shared_expert_gated: the shared expert's output is scaled per token by a sigmoid gate
            (Qwen2-MoE); False = added as it is (Granite MoE Shared).
        router_top_k_then_softmax: the router takes the k largest logits first and the softmax
            over those k only (Granite MoE), instead of the k largest of the softmax over all
            experts; the k weights then sum to 1 (equal to renormalising, up to rounding).
        clip_qkv: q, k and v are clamped to [-clip_qkv, clip_qkv] after their projections (and
            after the q/k norms when there are any; OLMoE), or None.
        attention_sinks: every attention layer has a learned sink logit per query head that
            joins its softmax's denominator as a key of value zero (GPT-OSS,
            ``self_attn.sinks``).
        moe_bias: the MoE router and every expert's gate, up and down projections have biases
            (GPT-OSS).
        swiglu_limit: the experts' gated activation is GPT-OSS's clamped SwiGLU,
            ``(clamp(up, -L, L) + 1) * g * sigmoid(swiglu_alpha * g)`` with
            ``g = clamp(gate, max=L)``, L = swiglu_limit; None = ``hidden_act`` as usual.
        swiglu_alpha: the sigmoid's gain in that activation (GPT-OSS: 1.702).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    qk_norm_full_width: bool = False
    qk_layer_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    nope_layers: list[int] | None = None
    partial_rotary_factor: float = 1.0
    norm_weight_offset: float = 0.0
    sandwich_norm: bool = False
    embedding_scale: float | None = None
    query_pre_attn_scalar: float | None = None
    attention_scale: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    final_logit_softcapping: float | None = None
    layer_norm_eps: float = 1e-5
    layer_norm_bias: bool = True
    logit_scale: float | None = None
    mlp_bias: bool = False
    parallel_residual: bool = False
    norm_before: bool = True
    shared_input_norm: bool = False
    lm_head_bias: bool = False
    position_offset: int | None = None
    attn_logit_softcapping: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None
    shared_expert_intermediate_size: int | None = None
    shared_expert_gated: bool = True
    router_top_k_then_softmax: bool = False
    clip_qkv: float | None = None
    attention_sinks: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers"
            )
        if self.shared_input_norm and not self.parallel_residual:
            raise ValueError("shared_input_norm needs parallel_residual (one norm, both branches)")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (tokens), or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_uses_rope(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` rotates its queries and keys (False on a NoPE
        layer, ``nope_layers``)."""
        return self.nope_layers is None or layer not in self.nope_layers

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a sparse mixture-of-experts MLP."""
        if not self.num_experts:
            return False
        return self.moe_layers is None or layer in self.moe_layers

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token occupies: 2 (K and V) x layers x kv_heads x head_dim x bytes.

        This is the paper's "2 x hidden x layers x bytes" (section 3) with grouped-query attention,
        where only ``num_key_value_heads * head_dim`` of the hidden width is cached.
        """
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def hf_rope_parameters(
    cfg: dict[str, Any], rope_params: dict[str, Any] | None = None, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from a ``config.json`` dict: the transformers 4 keys
    ``rope_theta`` / ``rope_scaling``, else ``rope_params`` (default: the transformers 5
    ``rope_parameters`` dict); ``default_theta`` where neither names a base (the
    architecture's ``default_rope_theta``). A "default" scaling is None; ``type`` is renamed
    ``rope_type``."""
    params = rope_params if rope_params is not None else (cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", default_theta))
    scaling = cfg.get("rope_scaling") if rope_params is None else None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type") == "default":
            scaling = None
    return float(theta), scaling


# The name every caller used before the model registry; the same class.
LlamaArchConfig = ModelArchConfig
