"""Engine configuration: every engine option, its default and its help, in one place.

``EngineConfig`` is the single source: ``LLM(**kwargs)`` takes its fields as keyword arguments,
and ``pagedllm generate``, ``pagedllm serve`` and ``pagedllm bench throughput`` derive their
flags from its fields with :func:`add_engine_args` (``--<field-with-dashes>``, the type from the
annotation, ``--x/--no-x`` for booleans, choices for enumerations, the help and default from the
field's metadata; the flags are built in ``pagedllm.config_cli``). Values are validated once,
in ``EngineConfig.__post_init__``.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pagedllm.attention import attention_backend_names
from pagedllm.attention.kv_quant import KV_CACHE_DTYPES, parse_kv_cache_dtype
from pagedllm.pooling_params import POOLING_TYPES

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    # vLLM's (and Hugging Face's) other names
    "float": torch.float32,
    "half": torch.float16,
}

# 1 GiB of KV cache by default: for SmolLM2-135M in fp32 (46,080 bytes per token) that is about
# 23,000 tokens, far more than the batch limits below can fill on a 2-core CPU.
DEFAULT_KV_CACHE_MEMORY = 1 << 30

# Host swap space: 256 MiB holds about 5,800 tokens of SmolLM2-135M KV in fp32.
DEFAULT_SWAP_SPACE = 256 << 20

# The enumerations of the config; each is the ``choices`` of its field and of its flag.
DTYPES = ("auto", "float32", "bfloat16", "float16", "float", "half")  # the last two: vLLM's names
# KV memory managers: the paged one and the contiguous (Orca) baselines of paper section 6.1.
KV_MANAGERS = ("paged", "orca-max", "orca-pow2", "orca-oracle")
PREEMPTION_MODES = ("auto", "swap", "recompute")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Server admission control (pagedllm.engine.admission): bound the waiting queue, or also admit
# only what can start at the next step.
ADMISSION_POLICIES = ("queue", "slots")
# The names pagedllm.attention.get_attention_backend accepts: "auto" or a registered backend.
ATTENTION_BACKENDS = ("auto", *attention_backend_names())
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
# Lossy weight formats, opt-in only (None = the weights as loaded, in ``dtype``).
QUANTIZATION_METHODS = ("int8", "gguf")

# The name the bundled model is served under.
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int (bytes) or a string: a number with an optional unit.

    Units (case-insensitive, an optional space before them): none or ``B`` = bytes, ``KiB`` /
    ``MiB`` / ``GiB`` / ``TiB`` = powers of 1024, ``KB`` / ``MB`` / ``GB`` / ``TB`` = powers of
    1000. ``"2GiB"`` -> 2147483648, ``"512 mib"`` -> 536870912, ``"1.5GB"`` -> 1500000000,
    ``"4096"`` -> 4096. Fractions are rounded down to whole bytes.

    Raises:
        ValueError: naming ``name`` when ``value`` is not a size (a negative or bool value, an
            unknown unit, no number).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be a number of bytes or a size like '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 bytes, got {value}")
        return value
    m = _SIZE_RE.fullmatch(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"{name} must be bytes or a number with a unit (KiB, MiB, GiB, TiB: powers of 1024; "
            f"KB, MB, GB, TB: powers of 1000), got {value!r}"
        )
    number = m.group(1)
    if "." in number:
        return int(float(number) * _SIZE_UNITS[unit])
    return int(number) * _SIZE_UNITS[unit]


def format_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that divides it: 1073741824 -> "1GiB"."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _SIZE_UNITS[unit.lower()]
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return str(num_bytes)


def parse_dtype(
    dtype: str | torch.dtype, device: str = "cpu", quantization: str | None = None
) -> torch.dtype:
    """Map "float32" / "bfloat16" / "float16" (the short forms "fp32", "bf16", "fp16", vLLM's
    "float" and "half", or a torch dtype) to a torch dtype; "auto" becomes what
    :func:`pagedllm.platform.auto_dtype_name` picks for ``device``, this CPU and ``quantization``
    (bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16 unless the weights are
    quantized, else float32).

    Raises:
        ValueError: naming ``dtype`` when it is not one of the supported types.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(
                f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}"
            )
        return dtype
    key = str(dtype).lower().replace("torch.", "")
    if key == "auto":
        from pagedllm.platform import auto_dtype_name

        key = auto_dtype_name(device, quantization=quantization)
    if key not in _DTYPES:
        raise ValueError(
            "dtype must be auto, float32 (fp32, float), bfloat16 (bf16) or float16 (fp16, "
            f"half), got {dtype!r}"
        )
    return _DTYPES[key]


def resolve_chat_template(value: str) -> str:
    """The Jinja text of a ``chat_template`` option: the contents of the file ``value`` names, or
    ``value`` itself when it is no file but holds Jinja markup (``{{`` or ``{%``).

    Raises:
        ValueError: naming ``chat_template`` when ``value`` is neither a readable file nor a
            template.
    """
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: cannot read {path}: {e}") from e
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: no such file {value!r} (and not a Jinja template)")


def served_model_name(model: str | os.PathLike[str] | None) -> str:
    """The default name a model is served under: a folder's base name, a GGUF file's stem,
    ``"SmolLM2-135M-Instruct"`` for the bundled model (None)."""
    if model is None:
        return BUNDLED_MODEL_NAME
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name or str(model)


def _option(default: Any, help: str, **meta: Any) -> Any:
    """A config field with its help sentence and CLI metadata: ``choices``, ``min`` (smallest
    valid value), ``size`` (bytes, parsed by :func:`parse_size`), ``aliases`` (more flag
    spellings)."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineConfig:
    """Every option of the engine, in the units the user gives them (see each field's help).

    ``dtype`` defaults to ``"auto"``: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16,
    else float32, and float32 for GGUF weights kept quantized (on CPUs without bf16 matrix
    hardware bf16 matmuls are several times slower; the rule and the figures behind it are in
    docs/dtype.md).
    ``torch_dtype`` holds the resolved torch dtype.
    ``torch_kv_cache_dtype`` holds the KV storage dtype (``kv_cache_dtype``; int8 /
    float8_e4m3fn blocks carry their scales, see ``pagedllm.attention.kv_quant``).
    ``kv_cache_memory`` and ``swap_space`` take bytes or a size string (``"2GiB"``, see
    :func:`parse_size`); they hold bytes after validation. Under tensor parallelism
    ``kv_cache_memory`` is per rank: each rank caches only its KV heads.

    Raises:
        ValueError: naming the field for an invalid value (out of range, not one of the choices,
            an unreadable chat template, an inconsistent executor backend).
    """

    model: str | None = _option(
        None,
        "GGUF file, a folder holding one GGUF file, a Hugging Face folder (config.json + "
        "*.safetensors), or a bundled model's short name (smollm2-135m, gemma-3-270m); "
        "default: the bundled SmolLM2-135M-Instruct",
        positional=True,
    )
    chat_template: str | None = _option(
        None,
        "Jinja chat-template file used instead of the model's own (chat prompts of generate, "
        "/v1/chat/completions of serve); default: the model's template",
    )
    pooling: str = _option(
        "mean",
        "pooling of embeddings (/v1/embeddings, LLM.embed) over the final hidden states: mean "
        "of every prompt position, or the last one (for models trained for last-token "
        "embeddings); a request may choose its own",
        choices=POOLING_TYPES,
    )
    dtype: str | torch.dtype = _option(
        "auto",
        "weight, activation and KV-cache dtype; auto = bfloat16 on CUDA and on CPUs with AMX-BF16 "
        "or AVX512-BF16 (float32 with --quantization gguf), else float32 (see docs/dtype.md)",
        choices=DTYPES,
    )
    kv_cache_dtype: str = _option(
        "auto",
        "KV-cache storage dtype; auto = the model dtype; fp8_e4m3 and int8 (lossy, opt-in) keep "
        "one scale per block and KV head, about 4x the tokens of float32 (docs/kv_cache_dtype.md)",
        choices=KV_CACHE_DTYPES,
    )
    device: str = _option("cpu", "device the model, KV cache and attention run on (cpu, cuda)")
    attention_backend: str = _option(
        "auto",
        "attention kernels: cpu = the C++ kernels, triton = Triton (CUDA), torch_native = "
        "vectorized torch, reference = the slow oracle; auto = triton on CUDA, else cpu when "
        "the C++ kernels build, else torch_native",
        choices=ATTENTION_BACKENDS,
    )
    block_size: int = _option(16, "tokens per KV block (paper section 4.2)", min=1)
    kv_cache_memory: int = _option(
        DEFAULT_KV_CACHE_MEMORY,
        "memory of the KV block pool, per rank; the number of blocks follows from it",
        size=True,
        min=1,
    )
    num_gpu_blocks_override: int | None = _option(
        None,
        "force the number of KV blocks; default: derived from kv_cache_memory",
        min=1,
        aliases=("--num-kv-blocks",),
    )
    max_num_seqs: int = _option(256, "most sequences in one step's batch", min=1)
    max_num_batched_tokens: int | None = _option(
        None,
        "most tokens computed in one step (prefill chunks + decodes); default "
        "max(max_model_len, 2048), or 512 with chunked prefill",
        min=1,
    )
    max_model_len: int | None = _option(
        None,
        "longest sequence, prompt + output tokens; default: the model's context length",
        min=2,
    )
    enable_chunked_prefill: bool = _option(
        False, "split prompts longer than the step's token budget over several steps"
    )
    enable_prefix_caching: bool = _option(
        True, "reuse the KV blocks of earlier requests with the same prefix (paged manager only)"
    )
    swap_space: int = _option(
        DEFAULT_SWAP_SPACE,
        "host memory for KV blocks swapped out by preemption",
        size=True,
        min=0,
    )
    preemption_mode: str = _option(
        "auto",
        "when blocks run out: swap or recompute the preempted request; auto = recompute "
        "single-sequence requests, swap groups",
        choices=PREEMPTION_MODES,
    )
    scheduling_policy: str = _option(
        "fcfs",
        "fcfs = serve requests in arrival order; priority = by each request's priority (lower "
        "first, ties by arrival), preempting less urgent running requests for a more urgent one",
        choices=SCHEDULING_POLICIES,
    )
    prefill_first: bool | None = _option(
        None,
        "when a waiting request can start, run its prefill in a step of its own before the "
        "running requests' next decode (vLLM V0's order) instead of in one batch with them: a "
        "lower time to first token under load for a little less throughput (fcfs only); "
        "default: on with --admission slots and the fcfs policy, off otherwise",
    )
    interrupt_decode_for_prefill: bool | None = _option(
        None,
        "(serve) when a request that can start arrives in the first half of a decode-only step, "
        "stop that step between two layers and run it again with the new prefill: the request "
        "does not wait for the step in flight (fused CPU layers, one process, no speculation); "
        "default: on with --admission slots where the step can be stopped, off otherwise",
    )
    max_waiting_requests: int | None = _option(
        None,
        "most requests waiting for admission; a new one beyond it is refused at once (the "
        "server answers 503 with Retry-After); default: unbounded",
        min=1,
    )
    admission: str = _option(
        "queue",
        "(serve only) which new requests the server refuses at once (503): queue = only beyond "
        "max_waiting_requests; slots = also any request that could not start at the next step "
        "(no free batch slot of max_num_seqs, or no KV room for its prompt), which keeps the "
        "time to first token of admitted requests near the unloaded value under overload",
        choices=ADMISSION_POLICIES,
    )
    seed: int = _option(0, "seeds the random seeds of requests that set none")
    num_threads: int | None = _option(None, "torch intra-op threads; default: every core", min=1)
    max_logprobs: int = _option(20, "most top logprobs a request may ask for", min=0)
    check_invariants: bool = _option(
        False, "check the block manager's invariants after every step (slow; for tests)"
    )
    kv_manager: str = _option(
        "paged",
        "KV memory manager: paged (block tables), or a contiguous Orca baseline of paper "
        "section 6.1 (no prefix caching, sharing or swapping)",
        choices=KV_MANAGERS,
    )
    tensor_parallel_size: int = _option(
        1,
        "ranks the model is split over (paper section 4.6, Megatron-LM sharding)",
        min=1,
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = _option(
        1,
        "pipeline stages the layers are split over (contiguous layer ranges; activations sent "
        "stage to stage); world size = tensor_parallel_size x pipeline_parallel_size; CPU only",
        min=1,
        aliases=("-pp",),
    )
    pipeline_micro_batches: int | None = _option(
        None,
        "micro-batches per step under pipeline parallelism: each step's sequences are split into "
        "this many groups that follow one another through the stages, so the stages compute at "
        "the same time (docs/pipeline_parallel.md); default: pipeline_parallel_size",
        min=1,
        aliases=("--pp-micro-batches",),
    )
    distributed_executor_backend: str | None = _option(
        None,
        "how the ranks run: uni = in-process (tp 1), mp = worker processes, ray = Ray actors; "
        "default: uni for tp 1, else mp",
        choices=EXECUTOR_BACKENDS,
    )
    speculative_config: str | dict[str, Any] | None = _option(
        None,
        "speculative decoding, a JSON object in vLLM's shape, e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        "(fields: pagedllm.spec_decode.config.SpeculativeConfig); default: off",
    )
    quantization: str | None = _option(
        None,
        "lossy weight format (opt-in): int8 = W8A8 at load, int8 weights per output channel and "
        "int8 activations per token (above 6 in float), int32 accumulation (CPU; the LM head "
        "stays in the model dtype); "
        "gguf = keep a GGUF file's quantized blocks (Q4_0, Q4_1, Q4_K, Q5_0, Q6_K, Q8_0) and "
        "compute the linears natively on them (CPU, float32, one rank); default: none, the "
        "weights in dtype",
        choices=QUANTIZATION_METHODS,
    )

    def __post_init__(self) -> None:
        self.torch_dtype = parse_dtype(self.dtype, str(self.device), self.quantization)
        from pagedllm.spec_decode.config import parse_speculative_config  # ValueError: the field

        self.speculative = parse_speculative_config(self.speculative_config)
        if self.speculative is not None and self.kv_manager != "paged":
            raise ValueError(
                f"speculative_config needs kv_manager 'paged', got {self.kv_manager!r}"
            )
        world = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if world == 1 else "mp"
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("size"):
                value = parse_size(value, f.name)
                setattr(self, f.name, value)
            if value is None:
                continue
            choices = f.metadata.get("choices")
            # dtype is checked by parse_dtype, which also takes torch dtypes and short names.
            if choices and f.name != "dtype" and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
            low = f.metadata.get("min")
            if low is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{f.name} must be an integer, got {value!r}")
            if low is not None and value < low:
                unit = " bytes" if f.metadata.get("size") else ""
                raise ValueError(f"{f.name} must be >= {low}{unit}, got {value}")
        self.torch_kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype, self.torch_dtype)
        if self.quantization == "gguf" and world > 1:
            raise ValueError(
                "quantization 'gguf' runs on one rank: it needs tensor_parallel_size and "
                f"pipeline_parallel_size 1, got {self.tensor_parallel_size} and "
                f"{self.pipeline_parallel_size}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one process: it needs "
                f"tensor_parallel_size 1, got {self.tensor_parallel_size}"
            )
        if self.distributed_executor_backend == "uni" and self.pipeline_parallel_size > 1:
            raise ValueError(
                "distributed_executor_backend 'uni' runs one process: it needs "
                f"pipeline_parallel_size 1, got {self.pipeline_parallel_size}"
            )
        if self.pipeline_parallel_size > 1 and str(self.device) != "cpu":
            raise ValueError(
                f"pipeline_parallel_size > 1 runs on device 'cpu' only for now, got {self.device!r}"
            )
        self.chat_template_text: str | None = (
            None if self.chat_template is None else resolve_chat_template(self.chat_template)
        )
        if self.num_threads is None:
            self.num_threads = os.cpu_count() or 1
        from pagedllm.device import canonical_device  # ValueError naming ``device``

        self.device = canonical_device(self.device, self.tensor_parallel_size)
        if self.quantization == "int8" and not str(self.device).startswith("cpu"):
            raise ValueError(
                f"quantization 'int8' runs on device 'cpu' only, got device {self.device!r}"
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The config of a command line parsed with a parser that :func:`pagedllm.config_cli.add_engine_args` filled.

        Raises:
            ValueError: naming the field for an invalid value.
        """
        return cls(**engine_kwargs_from_args(args))

    @property
    def use_prefill_first(self) -> bool:
        """``prefill_first`` resolved: the value given, else (None) on with ``admission`` slots
        and the fcfs policy. ``slots`` admits only requests that can start at the next step; a
        prefill in a step of its own is what lets them start at once: at 3x the sustainable
        rate it held the p99 time to first token at 1.7x the unloaded p99 against 2.0-2.5x with
        mixed steps (docs/benchmarks.md, "Overload")."""
        if self.prefill_first is not None:
            return self.prefill_first
        return self.admission == "slots" and self.scheduling_policy == "fcfs"

    @property
    def use_step_interrupt(self) -> bool:
        """``interrupt_decode_for_prefill`` resolved: the value given, else (None) on with
        ``admission`` slots (where the step can be stopped at all; see ``LLMEngine``)."""
        if self.interrupt_decode_for_prefill is not None:
            return self.interrupt_decode_for_prefill
        return self.admission == "slots"

    def finalize(self, model_max_len: int) -> None:
        """Fill the defaults that depend on the loaded model (called once by the engine).

        Raises:
            ValueError: naming ``max_model_len`` / ``max_num_batched_tokens`` when inconsistent.
        """
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                512 if self.enable_chunked_prefill else max(self.max_model_len, 2048)
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) unless enable_chunked_prefill is set: a whole prompt must "
                "fit in one step"
            )


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from a namespace parsed with
    :func:`pagedllm.config_cli.add_engine_args`.

    Raises:
        AttributeError: naming the field when the parser had no flag for it.
    """
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig)}


def check_engine_kwargs(kwargs: dict[str, Any], caller: str = "EngineConfig") -> None:
    """Refuse keyword arguments that are no ``EngineConfig`` field.

    Raises:
        TypeError: naming every unknown keyword (and ``caller``).
    """
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(
            f"{caller}() got unknown engine option(s) {', '.join(map(repr, unknown))}; "
            f"the options are EngineConfig's fields: {', '.join(sorted(known))}"
        )
