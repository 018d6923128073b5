"""``pagedllm serve --model A --model B / --extra-model / --model-dir / --models-memory-budget``:
which names the models get, the budget flag, the size estimate before a first load."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.cli_serve import add_serve_parser
from pagedllm.serving.multi_model_cli import (
    _factory,
    check_model_paths,
    estimate_model_bytes,
    model_aliases,
    model_paths,
)


def parse(argv):
    sub = argparse.ArgumentParser().add_subparsers()
    return add_serve_parser(sub).parse_args(argv)


def test_model_paths_from_flags_and_folder(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m2.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    args = parse(["/models/base", "--extra-model", "/x/other", "--model-dir", str(tmp_path)])
    assert args.data_parallel_size == 1 and args.router_policy == "cache_aware"
    assert model_paths(args) == {
        "base": "/models/base",
        "other": "/x/other",
        "m1": str(tmp_path / "m1"),
        "m2": str(tmp_path / "m2.gguf"),
    }


def test_model_paths_errors(tmp_path):
    with pytest.raises(ValueError, match="two models are named 'a'"):
        model_paths(parse(["/p/a", "--extra-model", "/q/a"]))
    with pytest.raises(ValueError, match="--model-dir"):
        model_paths(parse(["/p/a", "--model-dir", str(tmp_path / "missing")]))
    with pytest.raises(SystemExit):
        parse(["--router-policy", "random"])


def test_a_missing_model_is_found_before_the_server_starts(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    check_model_paths({"a": str(tmp_path / "m.gguf"), "b": "gemma-3-270m", "c": None})
    with pytest.raises(ValueError, match=r"^--model: model path not found: /nope/b; .*gemma-3"):
        check_model_paths({"a": str(tmp_path), "b": "/nope/b"})


def test_repeated_model_flag_serves_several_models():
    args = parse(["--model", "/m/a", "--model", "/m/b", "--extra-model", "/m/c"])
    assert model_paths(args) == {"a": "/m/a", "b": "/m/b", "c": "/m/c"}
    args = parse(["/m/a", "--model", "/m/b", "--served-model-name", "first"])
    assert model_paths(args) == {"first": "/m/a", "b": "/m/b"}
    with pytest.raises(ValueError, match="two models are named 'a'"):
        model_paths(parse(["--model", "/p/a", "--model", "/q/a"]))


def test_served_model_name_aliases_name_the_first_model():
    """``--served-model-name first alias``: the first model is served under both names (the
    alias was dropped with several models, and 404 at the front)."""
    args = parse(["/m/a", "--model", "/m/b", "--served-model-name", "first", "alias", "first"])
    paths = model_paths(args)
    assert paths == {"first": "/m/a", "b": "/m/b"}
    assert model_aliases(args, paths) == {"first": ["alias"]}
    assert model_aliases(parse(["/m/a", "--model", "/m/b"]), {"a": "/m/a", "b": "/m/b"}) == {}
    args = parse(["/m/a", "--model", "/m/b", "--served-model-name", "first", "b"])
    with pytest.raises(ValueError, match=r"^--served-model-name: \['b'\] also name"):
        model_aliases(args, model_paths(args))
    seen = {}
    _factory(lambda args, **kw: seen.update(kw), {}, {"api_key": None}, ["first", "alias"], "/m/a")()
    assert seen == {"api_key": None, "served_model_name": ["first", "alias"]}


def test_memory_budget_flag(capsys):
    assert parse(["--models-memory-budget", "6GiB"]).models_memory_budget == 6 << 30
    assert parse(["--models-memory-budget", "1000"]).models_memory_budget == 1000
    assert parse([]).models_memory_budget is None
    for bad in ("6 gigs", "0"):
        with pytest.raises(SystemExit):
            parse(["--models-memory-budget", bad])
        assert "--models-memory-budget" in capsys.readouterr().err


def test_estimate_is_weight_files_plus_kv_pools(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "more.bin").write_bytes(b"x" * 24)
    (tmp_path / "config.json").write_text("{}" * 100)  # not weights
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 77)
    args = {"kv_cache_memory": 1 << 20, "swap_space": 1 << 10}
    kv = (1 << 20) + (1 << 10)
    assert estimate_model_bytes(str(tmp_path), args) == 1000 + 24 + 77 + kv
    assert estimate_model_bytes(str(gguf), args) == 77 + kv
    assert estimate_model_bytes(None, args, replicas=3) == 3 * kv  # the bundled model: KV only
    tp2 = {**args, "tensor_parallel_size": 2}
    assert estimate_model_bytes(str(gguf), tp2) == 77 + 2 * kv
