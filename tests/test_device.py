"""Device plumbing: ``EngineConfig.device`` reaches the weights, the KV cache, the step metadata
and the attention backend registered for that device.

The engine tests run on every device this machine has: "cpu" always, "cuda" where
``torch.cuda.is_available()`` (there the Triton backend must be chosen and the greedy tokens of
the tiny random Llama must equal the CPU engine's and transformers'). The Triton kernels also run
end to end through the engine on the CPU, interpreted (``TRITON_INTERPRET=1``, in a subprocess).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm.attention import attention_backends_for, get_attention_backend
from pagedllm.attention.cpu import cpu_ops_available
from pagedllm.config import EngineConfig
from pagedllm.device import (
    canonical_device,
    device_for_rank,
    dist_backend,
    pin_host_memory,
    resolve_device,
    uses_cpu_ops,
)
from pagedllm.sampling_params import SamplingParams

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")),
]

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog and then", "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def expected_backend(device: str) -> str:
    """The backend the registry must choose for ``device`` under "auto"."""
    if torch.device(device).type == "cuda":
        return "triton"
    return "cpu" if cpu_ops_available() else "torch_native"


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["mps", "xpu:0", "cuda0", "gpu", "", "cpu:x"])
def test_unknown_device_is_a_value_error_naming_device(bad):
    with pytest.raises(ValueError, match="device"):
        resolve_device(bad)
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=bad)


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("dev", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_a_value_error(dev):
    with pytest.raises(ValueError, match="no CUDA device"):
        EngineConfig(device=dev)


def test_bad_device_fails_before_loading_weights():
    """The device is checked when the config is built: a missing model file is never opened."""
    from pagedllm.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="device"):
        LLM(model="/nonexistent/model.gguf", device="mps")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_index_past_the_last_gpu_is_a_value_error():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device=f"cuda:{n}")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(device="cuda:0", tensor_parallel_size=n + 1)


def test_canonical_devices():
    assert canonical_device("cpu") == "cpu"
    assert canonical_device("cpu:0") == "cpu"
    assert canonical_device(torch.device("cpu")) == "cpu"
    assert EngineConfig().device == "cpu"
    assert device_for_rank("cpu", 3) == torch.device("cpu")
    assert dist_backend("cpu") == "gloo" and dist_backend("cuda:1") == "nccl"
    assert not pin_host_memory("cpu") and pin_host_memory("cuda")
    assert uses_cpu_ops("cpu") and not uses_cpu_ops("cuda:0")


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_cuda_rank_devices():
    first = torch.cuda.current_device()
    assert device_for_rank("cuda", 0) == torch.device("cuda", first)
    assert device_for_rank("cuda:0", 1) == torch.device("cuda", 1)


# ---- attention backend registry --------------------------------------------------------------


def test_registry_lists_backends_per_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention_backends_for("cpu") == ["cpu", "reference", "torch_native"]
    assert attention_backends_for("cuda") == ["reference", "torch_native", "triton"]
    assert attention_backends_for("cuda:1") == attention_backends_for("cuda")


def test_auto_picks_the_cpu_backend_on_cpu():
    assert get_attention_backend("auto", "cpu").name == expected_backend("cpu")
    assert get_attention_backend().name == expected_backend("cpu")  # device defaults to cpu


def test_backend_on_a_device_it_does_not_run_on_is_a_value_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend 'triton'.*device 'cpu'"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match=r"attention_backend 'cpu'.*device 'cuda'"):
        get_attention_backend("cpu", "cuda")


def test_triton_runs_on_cpu_only_under_the_interpreter():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    # Importing it sets TRITON_INTERPRET=1 when there is no GPU and triton is not imported yet
    # (the environment is left as the import leaves it: other tests rely on it).
    from pagedllm.attention.triton_paged import interpreting, unavailable_reason

    if HAS_CUDA or not interpreting() or unavailable_reason() is not None:
        pytest.skip("the Triton interpreter is not on in this process")
    assert "triton" in attention_backends_for("cpu")
    assert get_attention_backend("triton", "cpu").name == "triton"


def test_engine_rejects_a_backend_for_another_device(tiny_loaded, monkeypatch):
    """Checked by the worker before it builds the model."""
    from pagedllm.entrypoints.llm import LLM

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device, backend = ("cuda", "cpu") if HAS_CUDA else ("cpu", "triton")
    with pytest.raises(ValueError, match=rf"attention_backend '{backend}'.*device '{device}"):
        LLM(loaded=tiny_loaded, device=device, attention_backend=backend, max_model_len=64)


# ---- placement, end to end -------------------------------------------------------------------


def _worker(llm):
    return llm.engine.executor.worker


@pytest.mark.parametrize("device", DEVICES)
def test_weights_cache_and_step_metadata_live_on_the_device(tiny_llm_factory, device):
    llm = tiny_llm_factory(device=device, block_size=4, swap_space=1 << 20)
    worker = _worker(llm)
    want = device_for_rank(device, 0)
    assert llm.engine.config.device == canonical_device(device)
    assert worker.device == want
    # Weights and buffers (RoPE tables).
    for name, p in worker.model.named_parameters():
        assert p.device == want, name
    for name, b in worker.model.named_buffers():
        assert b.device == want, name
    # KV cache on the device; the swap pool on the host (pinned on CUDA).
    for k, v in worker.cache.kv_caches:
        assert k.device == want and v.device == want
    assert worker.cache.swap_caches, "swap_space should give a host swap pool"
    for k, v in worker.cache.swap_caches:
        assert k.device.type == "cpu" and v.device.type == "cpu"
        assert k.is_pinned() == pin_host_memory(device)
    # The backend registered for the device.
    assert worker.backend.name == expected_backend(device)
    assert worker.model.backend is worker.backend
    # The sampler's C++ helpers only for CPU logits.
    if uses_cpu_ops(device):
        assert (llm.engine.sampler.cpu_ops is not None) == cpu_ops_available()
    else:
        assert llm.engine.sampler.cpu_ops is None

    # Step tensors: record what the model and the attention backend receive.
    seen: list[tuple[str, torch.device]] = []
    model_forward = worker.model.forward
    backend_forward = worker.backend.forward

    def spy_model(input_ids, positions, kv_caches, meta, logits_indices):
        seen.extend([("input_ids", input_ids.device), ("positions", positions.device)])
        seen.append(("logits_indices", logits_indices.device))
        return model_forward(input_ids, positions, kv_caches, meta, logits_indices)

    def spy_backend(query, key, value, key_cache, value_cache, meta, scale):
        for f in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
            t = getattr(meta, f)
            assert t.dtype == torch.int64, f
            seen.append((f, t.device))
        seen.extend([("query", query.device), ("key_cache", key_cache.device)])
        return backend_forward(query, key, value, key_cache, value_cache, meta, scale)

    worker.model.forward = spy_model
    worker.backend.forward = spy_backend
    worker.model.use_fused_layers(None)  # the layers' own forward calls the backend
    try:
        outs = llm.generate(
            PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False
        )
    finally:
        del worker.model.forward, worker.backend.forward
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert {n for n, _ in seen} >= {"input_ids", "slot_mapping", "block_tables", "query"}
    wrong = [(n, d) for n, d in seen if d != want]
    assert not wrong, wrong


@pytest.fixture(scope="module")
def cpu_reference(tiny_loaded):
    """Greedy tokens of the tiny Llama from the CPU engine with the torch_native backend."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(
        loaded=tiny_loaded,
        device="cpu",
        attention_backend="torch_native",
        max_model_len=128,
        kv_cache_memory=1 << 22,
    )
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_on_the_device_equal_the_cpu_reference(
    tiny_llm_factory, cpu_reference, hf_tiny_model, tiny_tokenizer, device
):
    llm = tiny_llm_factory(device=device, block_size=4, max_model_len=128)
    assert _worker(llm).backend.name == expected_backend(device)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == cpu_reference
    # And the CPU reference is transformers' greedy decoding.
    ids = tiny_tokenizer(PROMPTS[0]).input_ids
    hf = hf_tiny_model.generate(
        torch.tensor([ids]),
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    assert cpu_reference[0] == hf


@pytest.mark.parametrize("device", DEVICES)
def test_swap_and_copy_on_write_on_the_device(tiny_llm_factory, cpu_reference, device):
    """A pool too small for the batch forces swapping (device <-> host blocks) and n=2 forks
    share the prompt's last block (copy-on-write on the device): the tokens do not change."""
    llm = tiny_llm_factory(
        device=device,
        block_size=4,
        num_gpu_blocks_override=16,
        max_model_len=64,
        preemption_mode="swap",
        swap_space=1 << 20,
    )
    outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == cpu_reference * 2
    forks = llm.generate(
        PROMPTS[0],
        SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in forks.outputs] == [cpu_reference[0]] * 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_on_cuda_equals_the_cpu_reference(tiny_loaded, cpu_reference):
    """Tensor parallelism on CUDA: one GPU per rank, NCCL collectives, the Triton backend."""
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(
        loaded=tiny_loaded,
        device="cuda:0",
        tensor_parallel_size=2,
        max_model_len=128,
        kv_cache_memory=1 << 22,
    )
    try:
        driver = llm.engine.executor.driver_worker
        assert driver.device == torch.device("cuda", 0) and driver.backend.name == "triton"
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert got == cpu_reference
    finally:
        llm.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_ray_on_cuda_is_refused(tiny_loaded):
    from pagedllm.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(
            loaded=tiny_loaded,
            device="cuda",
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            max_model_len=64,
        )


# ---- Triton through the engine, interpreted on the CPU ---------------------------------------


def run_triton_engine_interpreted() -> None:
    """Entry point of the subprocess below: the tiny engine on device "cpu" with the Triton
    backend (interpreted) and with torch_native; prints both token lists as JSON."""
    conftest_path = Path(__file__).resolve().parent / "conftest.py"
    spec = importlib.util.spec_from_file_location("tiny_conftest", conftest_path)
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)

    from pagedllm.entrypoints.llm import LLM
    from pagedllm.model.loader import LoadedModel

    tok = conftest.make_tiny_tokenizer()
    cfg = conftest.make_tiny_config(len(tok), tok.eos_token_id)
    sd = conftest.make_random_state_dict(cfg)
    loaded = LoadedModel(cfg, sd, tok, Path("<tiny>"), 0)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    result = {}
    for backend in ("triton", "torch_native"):
        llm = LLM(
            loaded=loaded,
            device="cpu",
            attention_backend=backend,
            block_size=4,
            max_model_len=64,
            kv_cache_memory=1 << 20,
            check_invariants=True,
        )
        assert llm.engine.executor.worker.backend.name == backend
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        result[backend] = [o.outputs[0].token_ids for o in outs]
    print("RESULT " + json.dumps(result))


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the Triton backend runs natively above")
def test_triton_backend_runs_the_engine_interpreted_on_cpu():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    code = (
        "import importlib.util; "
        f"spec = importlib.util.spec_from_file_location('td', {__file__!r}); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "m.run_triton_engine_interpreted()"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["triton"] == result["torch_native"]
    assert all(len(t) == 6 for t in result["triton"])
