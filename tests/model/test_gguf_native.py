"""GGUF weights kept quantized (``quantization="gguf"``, ``model.quant.gguf_native``): the
repacking is exact against ``gguf.quants.dequantize``, each kernel equals the dequantized float32
product within the activation rounding, and the bundled model agrees with its float32 run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from pagedllm.model.quant.gguf_native import (
    BLOCK_BYTES,
    KERNEL_BYTES_PER_32,
    SUPPORTED_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    PackedBlocks,
    dequantize_packed,
    interleave,
    repack,
)

# (M, N, K): N not a multiple of 8 exercises the padded last row group; (1, 9, 576) is a decode
# row of the bundled model's width; (1, 200, 576) has enough row groups to split over threads.
SHAPES = [(1, 5, 256), (3, 17, 512), (8, 64, 768), (1, 9, 576), (2, 8, 64), (1, 200, 576)]


def gguf_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, k] weights of GGUF type ``qtype`` as raw bytes [n, row bytes]: ``gguf.quants.quantize``
    of normal weights where the package implements it, else random blocks with small positive
    float16 super-block scales (every byte pattern of the quants is a valid K-quant block)."""
    w = rng.standard_normal((n, k)).astype(np.float32)
    try:
        return np.asarray(quantize(w, GGMLQuantizationType[qtype]))
    except NotImplementedError:
        pass
    nbytes, per = BLOCK_BYTES[qtype]
    data = rng.integers(0, 256, (n, k // per * nbytes), dtype=np.uint8)
    blocks = data.reshape(-1, nbytes)
    offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[qtype]
    for o in offsets:
        scale = rng.uniform(1e-3, 2e-2, len(blocks)).astype(np.float16)
        blocks[:, o : o + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data


def reference(qtype: str, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(
        np.asarray(dequantize(data, GGMLQuantizationType[qtype]), dtype=np.float32).reshape(n, k)
    )


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_repack_is_exact(qtype: str) -> None:
    rng = np.random.default_rng(1)
    data = gguf_blocks(qtype, 6, 512, rng)
    packed = repack(qtype, data, 6)
    assert packed.kind == ("q4" if qtype.startswith("Q4") else "q8")
    assert torch.equal(dequantize_packed(packed), reference(qtype, data, 6, 512))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_embedding_rows_equal_the_float32_expansion(qtype: str) -> None:
    """A token embedding kept in blocks looks up exactly the rows ``gguf.quants.dequantize``
    expands, for ids of any shape (repeated ids included)."""
    rng = np.random.default_rng(5)
    data = gguf_blocks(qtype, 40, 512, rng)
    table = reference(qtype, data, 40, 512)
    embedding = GGUFEmbedding(repack(qtype, data, 40))
    ids = torch.tensor([[39, 0, 7], [7, 21, 3]])
    out = embedding(ids)
    assert out.shape == (2, 3, 512) and out.dtype == torch.float32
    assert torch.equal(out, table[ids])
    assert torch.equal(embedding(torch.arange(40)), table)
    assert embedding(torch.empty(0, dtype=torch.long)).shape == (0, 512)
    for bad in (-1, 40):
        with pytest.raises(IndexError, match=r"\[0, 40\)"):
            embedding(torch.tensor([3, bad]))
    assert embedding.weight_bytes() == 40 * 512 // 32 * KERNEL_BYTES_PER_32[qtype]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q6_K"])
def test_scales_are_float16_where_exact(qtype: str) -> None:
    """Formats whose scales are float16 in the file keep them so (q8: one per 32); Q6_K's
    products d * sc stay float32, one per 16."""
    rng = np.random.default_rng(2)
    packed = repack(qtype, gguf_blocks(qtype, 3, 512, rng), 3)
    if qtype == "Q6_K":
        assert packed.scales.dtype == torch.float32 and packed.scales.shape == (3, 32)
    else:
        assert packed.scales.dtype == torch.float16
        expected = (3, 16, 2) if packed.kind == "q4" else (3, 16)
        assert packed.scales.shape == expected
    wide = packed.widened()
    assert wide.scales.dtype == torch.float32
    assert torch.equal(dequantize_packed(wide), dequantize_packed(packed))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(1, 13, 576), (4, 8, 1536)])
def test_float16_scales_equal_float32_scales(ops, qtype: str, m: int, n: int, k: int) -> None:  # noqa: ANN001
    """The kernel on float16 scales (one per 32) gives bit-identical results to the same scales
    widened to float32 (q8: one per 16)."""
    rng = np.random.default_rng(m + n)
    packed = repack(qtype, gguf_blocks(qtype, n, k, rng), n)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    assert torch.equal(GGUFLinear([packed], ops)(x), GGUFLinear([packed.widened()], ops)(x))


def test_activation_rounding_ties_to_even(ops) -> None:  # noqa: ANN001
    """Activations quantize as round-half-to-even of x / (max|x| / 127) (llama.cpp's Q8_0): a
    row of exact halves against an identity Q8_0 weight gives back the rounded codes."""
    k = 64
    x = torch.zeros(1, k)
    x[0, 0] = 127.0  # block max: scale exactly 1
    x[0, 1:6] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5])
    x[0, 32] = -127.0
    x[0, 33:36] = torch.tensor([3.5, -3.5, 4.5])
    blocks = np.zeros((k, k // 32, 34), np.uint8)  # Q8_0 identity: d = 1, q = 1 on the diagonal
    blocks[:, :, 0:2] = np.array([1.0], np.float16).view(np.uint8)
    for i in range(k):
        blocks[i, i // 32, 2 + i % 32] = 1
    y = GGUFLinear([repack("Q8_0", blocks.reshape(k, -1), k)], ops)(x)
    assert torch.equal(y, torch.round(x))  # torch.round: half to even


@pytest.mark.parametrize("group_rows", [8, 16])
@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_interleave_layout(qtype: str, group_rows: int) -> None:
    """Record [g, b] holds row G g + r's 4-byte chunk c at bytes 4 G c + 4r (q4: the block's
    Q4_1 bytes 4c..4c+3; q8: elements 4c..4c+3), then the scales row by row (q4: d[G], m[G]; q8:
    d[G], or d0[G], d1[G] for one per 16); the padding rows of the last group are zero."""
    rng = np.random.default_rng(4)
    n, k, G = 2 * group_rows - 5, 512, group_rows
    p = repack(qtype, gguf_blocks(qtype, n, k, rng), n)
    w = interleave(p, G)
    nb = k // 32
    quant_bytes = (16 if p.kind == "q4" else 32) * G
    per_block = p.scales[0].numel() // nb
    assert w.shape == (2, nb, quant_bytes + G * per_block * p.scales.element_size())
    qs = p.qs.view(torch.uint8).reshape(n, nb, -1)
    scales = p.scales.reshape(n, nb, per_block)
    for g, b, r in [(0, 0, 0), (0, 5, G - 1), (1, 15, 2), (1, 3, 1)]:
        row = G * g + r
        for c in range(quant_bytes // (4 * G)):
            chunk = w[g, b, 4 * G * c + 4 * r : 4 * G * c + 4 * r + 4]
            assert torch.equal(chunk, qs[row, b, 4 * c : 4 * c + 4])
        got = w[g, b, quant_bytes:].contiguous().view(p.scales.dtype).reshape(per_block, G)
        assert torch.equal(got[:, r], scales[row, b])
    padding = w[1, :, :quant_bytes].reshape(nb, -1, G, 4)[:, :, G - 5 :]
    assert padding.numel() and not padding.any()
    with pytest.raises(ValueError, match="group_rows"):
        interleave(p, 12)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_sixteen_row_records_equal_eight_row_records_bit_for_bit(ops, qtype: str) -> None:  # noqa: ANN001
    """The 512-bit loops (16 rows per record, ``csrc/cpu/quant_gguf_512.h``) give the int32
    block sums and float operations of the 8-row loops, so every output is the same float: 1-9
    activation rows (the passes of 4 and their remainders), N = 37 pads the last group of
    either size, float16 and float32 scales."""
    if ops.gguf_group_rows != 16:
        from pagedllm.platform import cpu_flags

        flags = cpu_flags()
        missing = [f for f in ("avx512_vnni", "avx512bw") if not getattr(flags, f, False)]
        why = f"the CPU lacks {', '.join(missing)}" if missing else f"the {ops.variant} kernel variant"
        pytest.skip(f"16-row records (512-bit loops) are off: {why}")
    rng = np.random.default_rng(21)
    n, k = 37, 512
    packed = repack(qtype, gguf_blocks(qtype, n, k, rng), n)
    run = ops.gguf_q4_linear if packed.kind == "q4" else ops.gguf_q8_linear
    for p in (packed, packed.widened()):
        eight, sixteen = interleave(p, 8), interleave(p, 16)
        for m in (1, 2, 3, 4, 5, 9):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            assert torch.equal(run(x, sixteen, n), run(x, eight, n)), (m, p.scales.dtype)


_REFUSE_SIXTEEN = """
import numpy as np
import pytest
import torch
from pagedllm.ops import load_cpu_ops
from pagedllm.model.quant.gguf_native import interleave, repack
from tests.model.test_gguf_native import gguf_blocks

ops = load_cpu_ops()
assert ops.gguf_group_rows == 8
p = repack("Q4_1", gguf_blocks("Q4_1", 16, 64, np.random.default_rng(5)), 16)
with pytest.raises(RuntimeError, match="16-row records need"):
    ops.gguf_q4_linear(torch.randn(1, 64), interleave(p, 16), 16)
"""


def test_sixteen_row_records_refused_where_their_loops_are_off() -> None:
    """With the 512-bit loops off (``PAGEDLLM_GGUF_ISA=avx2``, a fresh process) the kernels
    report 8 rows per group and refuse 16-row records with an error naming them."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAGEDLLM_GGUF_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", _REFUSE_SIXTEEN], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_kernel_rejects_a_weight_of_the_wrong_shape(ops) -> None:  # noqa: ANN001
    p = repack("Q4_1", gguf_blocks("Q4_1", 16, 64, np.random.default_rng(5)), 16)
    w, x = interleave(p), torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="row groups"):
        ops.gguf_q4_linear(x, w, 17)
    with pytest.raises(RuntimeError, match="blocks per row"):
        ops.gguf_q4_linear(torch.randn(1, 96), w, 16)
    with pytest.raises(RuntimeError, match="bytes per record"):
        ops.gguf_q8_linear(x, w, 16)


def test_repack_rejects_other_types() -> None:
    with pytest.raises(ValueError, match="Q5_1"):
        repack("Q5_1", np.zeros((1, 24), np.uint8), 1)


def int8_activation_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T with x rounded as the kernel rounds it: per 32, to int8 with scale max|x|/127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks))
    return (q * d).reshape(x.shape) @ w.T


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_kernel_matches_dequantized_fp32(ops, qtype: str, m: int, n: int, k: int) -> None:  # noqa: ANN001
    rng = np.random.default_rng(m * 1000 + n)
    if k % BLOCK_BYTES[qtype][1]:
        pytest.skip(f"{qtype} needs K a multiple of {BLOCK_BYTES[qtype][1]}")
    data = gguf_blocks(qtype, n, k, rng)
    w = reference(qtype, data, n, k)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    y = GGUFLinear([repack(qtype, data, n)], ops)(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    # Same arithmetic as the kernel up to float summation order: tight.
    emulated = int8_activation_reference(x, w)
    scale = (x.abs() @ w.abs().T).clamp_min(1e-6)
    assert ((y - emulated).abs() / scale).max() < 1e-5
    # Against the float32 product: the activation rounding (<= 1/254 of each block's max).
    exact = x @ w.T
    assert ((y - exact).abs() / scale).max() < 1e-2


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K", "Q8_0", "Q6_K"])
def test_rows_do_not_depend_on_the_batch(ops, qtype: str) -> None:  # noqa: ANN001
    """The kernels pass over a row group's blocks once for up to 4 activation rows: every
    output row is bit-identical whether computed alone or in a call of 2, 3, 5 or 11 rows
    (float16 and float32 scale layouts of both kinds; N = 17 pads the last row group)."""
    rng = np.random.default_rng(11)
    n, k = 17, 256
    lin = GGUFLinear([repack(qtype, gguf_blocks(qtype, n, k, rng), n)], ops)
    x = torch.from_numpy(rng.standard_normal((11, k)).astype(np.float32))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(11)])
    for size in (2, 3, 5, 11):
        batched = torch.cat([lin(x[i : i + size]) for i in range(0, 11, size)])
        assert torch.equal(batched, alone), size


_PATH_OUTPUTS = """
import sys
import numpy as np
import torch
import pagedllm
from pagedllm.ops import load_cpu_ops
from pagedllm.model.quant.gguf_native import SUPPORTED_TYPES, GGUFLinear, repack
from tests.model.test_gguf_native import gguf_blocks

ops = load_cpu_ops()
out = {}
for qtype in SUPPORTED_TYPES:
    for m in (1, 3, 4, 9):
        rng = np.random.default_rng(m)
        n, k = 19, 512
        lin = GGUFLinear([repack(qtype, gguf_blocks(qtype, n, k, rng), n)], ops)
        out[f"{qtype}-{m}"] = lin(torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)))
        lin16 = GGUFLinear([repack(qtype, gguf_blocks(qtype, n, k, rng), n).widened()], ops)
        out[f"{qtype}-{m}-f32"] = lin16(torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)))
out["isa"] = ops.gguf_isa
torch.save(out, sys.argv[1])
"""


@pytest.mark.parametrize("isa", ["avx512_vnni", "avx_vnni"])
def test_vnni_loops_equal_the_avx2_loops_bit_for_bit(ops, tmp_path, isa: str) -> None:  # noqa: ANN001
    """On a CPU with AVX512-VNNI the q4 / q8 loops run vpdpbusd (on 16-row records where the
    CPU also has AVX512-BW), on one with AVX-VNNI its VEX form (``PAGEDLLM_GGUF_ISA=avx_vnni``
    forces it where both exist); the same int32 block sums and float operations as the 8-row
    maddubs loops (``PAGEDLLM_GGUF_ISA=avx2``; fresh processes: the choice is made once per
    process), so every output is the same float."""
    import os
    import subprocess
    import sys

    from pagedllm.platform import cpu_flags

    if not getattr(cpu_flags(), isa):
        pytest.skip(f"{isa} loops: the CPU lacks the {isa} flag")
    if ops.gguf_isa == "scalar":
        pytest.skip(f"{isa} loops: the {ops.variant} kernel variant has no SIMD GGUF loops")
    outs = {}
    for forced in ("auto" if isa == "avx512_vnni" else isa, "avx2"):
        env = {**os.environ, "PAGEDLLM_GGUF_ISA": forced}
        path = tmp_path / f"{forced}.pt"
        done = subprocess.run([sys.executable, "-c", _PATH_OUTPUTS, str(path)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outs[forced] = torch.load(path)
    vnni, avx2 = outs.values()
    assert vnni.pop("isa") == isa and avx2.pop("isa") == "avx2"
    assert vnni.keys() == avx2.keys()
    for key, y in vnni.items():
        assert torch.equal(y, avx2[key]), key


def test_mixed_parts_bias_and_leading_dims(ops) -> None:  # noqa: ANN001
    """q/k/v of different types in one GGUFLinear (Q4_K_M stores v as Q6_K), with a bias."""
    rng = np.random.default_rng(7)
    k = 256
    parts, ws = [], []
    for qtype, n in (("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4), ("Q8_0", 3)):
        data = gguf_blocks(qtype, n, k, rng)
        parts.append(repack(qtype, data, n))
        ws.append(reference(qtype, data, n, k))
    bias = torch.arange(19, dtype=torch.float32)
    lin = GGUFLinear(parts, ops, bias)
    assert [p.kind for p in lin.parts] == ["q4", "q8"]  # adjacent kinds merged
    x = torch.from_numpy(rng.standard_normal((2, 3, k)).astype(np.float32))
    y = lin(x)
    w = torch.cat(ws)
    emulated = int8_activation_reference(x.reshape(6, k), w) + bias
    assert y.shape == (2, 3, 19)
    assert torch.allclose(y.reshape(6, 19), emulated, rtol=1e-4, atol=1e-3)


def test_take_rows_permutes_blocks() -> None:
    rng = np.random.default_rng(3)
    data = gguf_blocks("Q4_1", 4, 64, rng)
    p = repack("Q4_1", data, 4)
    order = torch.tensor([2, 0, 3, 1])
    assert torch.equal(dequantize_packed(p.take_rows(order)), dequantize_packed(p)[order])
    with pytest.raises(ValueError, match="q4 and q8"):
        PackedBlocks.concat([p, repack("Q8_0", gguf_blocks("Q8_0", 1, 64, rng), 1)])


def test_config_validates_quantization() -> None:
    from pagedllm.config import EngineConfig

    assert EngineConfig(quantization="gguf").quantization == "gguf"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="gguf", tensor_parallel_size=2)


TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. Steam "
    "engines, first used to pump water out of mines, were soon driving looms and locomotives. "
    "Cities grew quickly as workers left farms for factories, and new railways connected markets "
    "that had been days apart. Historians still debate why it started where it did: coal was "
    "close to the surface, capital was available, and inventors could protect their ideas."
)


@pytest.mark.slow
def test_bundled_model_agrees_with_fp32(ops, smollm) -> None:  # noqa: ANN001
    """Teacher-forced next-token argmaxes (prompt_logprobs=1) of the bundled Q4_1 SmolLM2 with
    quantization="gguf" equal the dequantized float32 run's on >= 95% of positions."""
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    argmaxes = []
    for quant in (None, "gguf"):
        llm = LLM(loaded=smollm, dtype="float32", quantization=quant)
        if quant == "gguf":
            runner_model = llm.engine.executor.worker.model
            assert isinstance(runner_model.lm_head_packed, GGUFLinear)
            linears = sum(isinstance(m, GGUFLinear) for m in runner_model.modules())
            assert linears == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
        out = llm.generate(TEXT, params, use_tqdm=False)[0]
        argmaxes.append(
            [next(t for t, lp in e.items() if lp.rank == 1) for e in out.prompt_logprobs[1:]]
        )
    ref, got = argmaxes
    agree = sum(a == b for a, b in zip(ref, got, strict=True)) / len(ref)
    assert len(ref) > 60 and agree >= 0.95, agree


@pytest.mark.slow
def test_bundled_gguf_recompute_and_speculation_change_nothing(ops, smollm) -> None:  # noqa: ANN001
    """quantization="gguf" on the bundled model: requests preempted by recompute (prefilled
    again with their output) and requests decoded with n-gram speculation report the same
    tokens and the same logprob floats as each request alone. Before the attention kernels
    shared one order of arithmetic, a re-prefilled token's logprob was up to 0.15 off its decode
    and the outputs parted after a few dozen tokens."""
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "List five fruits: apple, banana, cherry, apple,",
               "def fibonacci(n):", "Write a short story about a robot who"]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)

    def run(llm: LLM, batch: list[str]) -> list[list[float]]:
        outs = llm.generate(batch, params, use_tqdm=False)
        return [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                strict=True)] + list(o.outputs[0].token_ids)
                for o in outs]  # fmt: skip

    base = {"loaded": smollm, "dtype": "float32", "quantization": "gguf", "block_size": 16,
            "max_model_len": 256, "enable_prefix_caching": False}  # fmt: skip
    # 8 blocks hold any one request (3 blocks) but not all four together.
    small = LLM(**base, num_gpu_blocks_override=8, preemption_mode="recompute")
    alone = [run(small, [p])[0] for p in prompts]
    assert small.engine.scheduler.num_preemptions == 0
    assert run(small, prompts) == alone
    assert small.engine.scheduler.preemptions_by_mode["recompute"] > 0
    del small
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
            "learn_step_cost": False}  # fmt: skip
    speculative = LLM(**base, speculative_config=spec)
    assert run(speculative, prompts) == alone
    assert speculative.engine.stats.spec_accepted_tokens > 0


@pytest.mark.slow
def test_kept_gguf_blocks_skip_the_float_expansion(ops, smollm) -> None:  # noqa: ANN001
    """``load_model(keep_gguf_blocks=True)`` (what ``LLM(quantization="gguf")`` loads) leaves
    every layer's seven projections and the token embedding as meta entries, so their float32
    expansion never exists; the worker builds them from the file's blocks before packing (the
    embedding's rows equal the expansion's bit for bit), and the outputs (tokens and
    logprob floats) equal those of the fully expanded load quantized after packing. Where the
    blocks cannot run (bfloat16), the worker expands the file after all; an engine without
    quantization "gguf" refuses such a load by name."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.loader import load_model

    kept = load_model(None, torch.float32, keep_gguf_blocks=True)
    meta = [n for n, t in kept.state_dict.items() if t.is_meta]
    assert "model.embed_tokens.weight" in meta  # Q8_0: looked up from its blocks
    meta.remove("model.embed_tokens.weight")
    assert len(meta) == 30 * 7 and all(".self_attn." in n or ".mlp." in n for n in meta)
    assert kept.gguf_blocks_kept and not smollm.gguf_blocks_kept
    assert kept.state_dict.keys() == smollm.state_dict.keys()
    assert all(t.shape == smollm.state_dict[n].shape for n, t in kept.state_dict.items())
    assert kept.weight_bytes < smollm.weight_bytes / 100  # the norms

    prompts = ["The capital of France is", "def fibonacci(n):", "Name three colors:"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)

    def run(loaded: object, dtype: str) -> list[list[float]]:
        llm = LLM(loaded=loaded, dtype=dtype, quantization="gguf", max_model_len=256)
        model = llm.engine.executor.worker.model
        assert model.unloaded_params == []
        assert not any(p.is_meta for p in model.parameters())
        if dtype == "float32":
            native = [m for m in model.modules() if isinstance(m, GGUFLinear)]
            assert len(native) == 30 * 4 + 1
        if loaded is kept and dtype == "float32":  # the blocks left out count as weights
            assert isinstance(model.embed_tokens, GGUFEmbedding)
            assert model.lm_head_weight.numel() == 0  # the tied head runs on its GGUF layer
            ids = torch.tensor([[0, 1, 49151], [7042, 30, 198]])
            table = smollm.state_dict["model.embed_tokens.weight"]
            assert torch.equal(model.embed_tokens(ids), table[ids])  # bit for bit
            native.append(model.embed_tokens)  # the layers', the LM head's, the embedding's
            blocks = sum(m.weight_bytes() for m in native)
            extra = llm.engine.weight_bytes - kept.weight_bytes
            assert abs(extra - blocks) < 0.01 * blocks, (extra, blocks)  # padding rows
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) + [e[t].logprob for e, t in
                zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs]  # fmt: skip

    assert run(kept, "float32") == run(smollm, "float32")
    assert run(kept, "bfloat16") == run(smollm, "bfloat16")
    with pytest.raises(ValueError, match="keeps projections in GGUF blocks"):
        LLM(loaded=kept, dtype="float32", max_model_len=256)


@pytest.mark.parametrize("value", ["AVX2", " avx2", "bogus"])
def test_unknown_isa_override_warns(monkeypatch, caplog, value: str) -> None:  # noqa: ANN001
    """The kernels compare PAGEDLLM_GGUF_ISA exactly, so a value they ignore is named in a
    warning (the best path stays on); the values they take pass quietly."""
    import logging

    from pagedllm.ops.loader import warn_unknown_isa_overrides

    monkeypatch.setenv("PAGEDLLM_GGUF_ISA", value)
    monkeypatch.setenv("PAGEDLLM_INT8_ISA", "scalar")
    with caplog.at_level(logging.WARNING, logger="pagedllm.ops.loader"):
        warn_unknown_isa_overrides()
    assert [r.getMessage() for r in caplog.records] == [
        f"PAGEDLLM_GGUF_ISA={value!r} is not one of auto, avx2, avx_vnni (exact, lower case); "
        "the best path stays on"
    ]
