"""One engine over a Ray cluster spanning network namespaces ("hosts" on one machine, see
``netns``): greedy tokens of tp = 2 and pp = 2 with ranks in other namespaces equal one rank's;
every rank binds its own namespace's address; killing a remote rank fails the engine with a clear
error within 30 s. The bundled model runs pp = 2 and tp = 3 (9 query / 3 KV heads) the same way.

Root only (skips otherwise); one module-scoped cluster (~1-2 min to start on a loaded machine).
The driver runs in the head's namespace as a subprocess (``netns_driver``)."""

import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.netns import NetnsCluster, netns_unavailable_reason
from tests.distributed.tp_utils import greedy_tokens, small_llm, tiny_variant

pytest.importorskip("ray")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster():
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    c = NetnsCluster(num_nodes=3, cpus_per_worker=2)
    try:
        c.create_network()
        c.start_ray()
        yield c
    finally:
        c.teardown()


def run_driver(cluster, tmp_path, job, timeout=600):
    job_file, out_file = tmp_path / "job.pkl", tmp_path / "out.json"
    job_file.write_bytes(pickle.dumps(job))
    env = {
        "RAY_ADDRESS": cluster.ray_address,
        "PAGEDLLM_HOST_IP": cluster.addresses[0],
        "PYTHONPATH": str(REPO),
        "PAGEDLLM_AUTO_DTYPE": "float32",
    }
    argv = [sys.executable, "-m", "tests.distributed.netns_driver", str(job_file), str(out_file)]
    res = cluster.run_in(0, argv, env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out_file.read_text())


def tiny_job(tiny_loaded, tp, pp, mode="greedy"):
    loaded = tiny_variant(tiny_loaded, num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, loaded.config.vocab_size, (n,), generator=g).tolist()
               for n in (4, 17, 40)]  # fmt: skip
    job = dict(loaded=loaded, tp=tp, pp=pp, prompts=prompts, max_tokens=MAX_TOKENS, mode=mode)
    if mode == "kill":  # room for the long requests that run while the rank is killed
        job.update(max_model_len=512, num_blocks=256)
    return loaded, prompts, job


def assert_ranks_on_other_nodes(cluster, out, world):
    assert out["driver_host"] == cluster.addresses[0]
    assert len(out["rank_hosts"]) == world - 1
    assert set(out["rank_hosts"]) <= set(cluster.addresses[1:])


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_tiny_across_namespaces_equals_one_rank(cluster, tmp_path, tiny_loaded, tp, pp):
    loaded, prompts, job = tiny_job(tiny_loaded, tp, pp)
    ref = greedy_tokens(small_llm(loaded), prompts, MAX_TOKENS)
    out = run_driver(cluster, tmp_path, job)
    assert_ranks_on_other_nodes(cluster, out, tp * pp)
    assert out["tokens"] == ref
    if pp > 1:
        print(f"pp={pp} idle share per stage: {out['idle_share']}")
        assert len(out["idle_share"]) == pp


def test_killed_remote_rank_fails_within_30s(cluster, tmp_path, tiny_loaded):
    _, _, job = tiny_job(tiny_loaded, 1, 2, mode="kill")
    out = run_driver(cluster, tmp_path, job)
    assert out["error"] is not None and "WorkerDiedError" in out["error"], out
    assert out["seconds"] < 30.0


@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1)], ids=["pp2", "tp3"])
def test_bundled_across_namespaces_equals_one_rank(cluster, tmp_path, smollm, tp, pp):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (6, 23)]
    ref = greedy_tokens(small_llm(smollm, max_model_len=256), prompts, MAX_TOKENS)
    job = dict(model=str(smollm.source), tp=tp, pp=pp, prompts=prompts, max_tokens=MAX_TOKENS,
               mode="greedy")  # fmt: skip
    out = run_driver(cluster, tmp_path, job)
    assert_ranks_on_other_nodes(cluster, out, tp * pp)
    assert out["tokens"] == ref
