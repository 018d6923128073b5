"""``pagedllm serve --extra-model / --model-dir``: which names the models get."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.cli_serve import add_serve_parser
from pagedllm.serving.multi_model_cli import model_paths


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
