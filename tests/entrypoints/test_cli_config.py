"""Every EngineConfig field is settable from generate, serve, bench throughput and LLM(...).

The flags are parsed with the real ``pagedllm`` parser and the config is built with the real
function of each command (``engine_kwargs`` -> ``EngineConfig``, or ``LLM.build_config``); no
engine is started.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from pagedllm.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser, engine_kwargs
from pagedllm.entrypoints.llm import LLM

pytest.importorskip("fastapi")  # serve's parser needs the server extra

COMMANDS = [["generate"], ["serve"], ["bench", "throughput"]]
FIELDS = dataclasses.fields(EngineConfig)
HINTS = typing.get_type_hints(EngineConfig)
BASELINE = EngineConfig()  # the defaults, resolved (num_threads, executor backend)


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(autouse=True)
def _one_cuda_device(monkeypatch):
    """``--device cuda:0`` is the device field's non-default value: pretend one GPU exists so that
    the config accepts it here (device validation itself: tests/test_device.py)."""
    monkeypatch.setattr("pagedllm.device._cuda_count", lambda: 1)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return str(path)


def non_default(f: dataclasses.Field, template_file: str) -> tuple[list[str], typing.Any, object]:
    """(command-line tokens, LLM kwarg value, expected config value) of a value that differs
    from the default. A new field of a type this cannot invent fails the test, on purpose."""
    flag = "--" + f.name.replace("_", "-")
    special = {
        "model": ("some/model-folder", "some/model-folder"),
        "chat_template": (template_file, template_file),
        "device": ("cuda:0", "cuda:0"),
        "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}',) * 2,
    }
    base = getattr(BASELINE, f.name)
    kinds = [t for t in typing.get_args(HINTS[f.name]) if t is not type(None)] or [HINTS[f.name]]
    if f.name in special:
        text, value = special[f.name]
        return [flag, text], value, value
    if f.metadata.get("size"):
        return [flag, "3MiB"], "3MiB", 3 << 20
    if f.metadata.get("choices"):
        value = next(c for c in f.metadata["choices"] if c != base)
        return [flag, value], value, value
    if kinds[0] is bool:
        return [flag if not base else "--no-" + flag[2:]], not base, not base
    if kinds[0] is int:
        value = base + 1 if base is not None else f.metadata.get("min", 1) + 5
        return [flag, str(value)], value, value
    raise AssertionError(f"add a non-default value for the new field {f.name} here")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_a_flag_of_every_command(parser, template_file, command, field):
    tokens, _, expected = non_default(field, template_file)
    args = parser.parse_args([*command, *tokens])
    config = EngineConfig(**engine_kwargs(args))  # what generate / serve / bench do
    assert getattr(config, field.name) == expected
    assert getattr(config, field.name) != getattr(BASELINE, field.name)
    assert EngineConfig.from_cli_args(args) == config


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_every_field_is_an_llm_keyword(template_file, field):
    _, value, expected = non_default(field, template_file)
    kwargs = {field.name: value}
    config = LLM.build_config(**kwargs)
    assert getattr(config, field.name) == expected


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_no_flags_give_the_default_config(parser, command):
    assert EngineConfig.from_cli_args(parser.parse_args(command)) == BASELINE


def test_llm_refuses_unknown_keywords():
    with pytest.raises(TypeError, match="kv_cache_memry"):
        LLM.build_config(kv_cache_memry="1GiB")
    with pytest.raises(TypeError, match="kv_cache_memry"):
        LLM(kv_cache_memry="1GiB")  # refused before any model is loaded
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM.build_config(kv_cache_memory="1 gigabyte")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_model_positional_or_flag(parser, command):
    for tokens in (["m.gguf"], ["--model", "m.gguf"], ["m.gguf", "--model", "m.gguf"]):
        assert parser.parse_args([*command, *tokens]).model == "m.gguf"
    assert parser.parse_args(command).model is None


@pytest.mark.parametrize("command", [["generate"], ["bench", "throughput"]], ids=" ".join)
def test_two_different_models_are_an_error(parser, capsys, command):
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*command, "a.gguf", "--model", "b.gguf"])
    assert e.value.code == 2
    assert "'a.gguf' and 'b.gguf'" in capsys.readouterr().err


def test_serve_takes_several_models(parser):
    """``serve``: the first model is ``model``, the others (and ``--extra-model``) extra ones."""
    args = parser.parse_args(["serve", "a.gguf", "--model", "b.gguf", "--model", "a.gguf"])
    assert args.model == "a.gguf" and args.extra_model == ["b.gguf"]
    args = parser.parse_args(
        ["serve", "--extra-model", "x", "--model", "a", "--model", "b", "--model", "c"]
    )
    assert args.model == "a" and args.extra_model == ["x", "b", "c"]


def test_old_spellings_still_work(parser):
    args = parser.parse_args(["generate", "--num-kv-blocks", "9", "-tp", "3"])
    config = EngineConfig.from_cli_args(args)
    assert config.num_gpu_blocks_override == 9 and config.tensor_parallel_size == 3
    assert config.distributed_executor_backend == "mp"
    args = parser.parse_args(["serve", "--enable-chunked-prefill", "--max-logprobs", "5"])
    assert args.enable_chunked_prefill is True and args.max_logprobs == 5


@pytest.mark.parametrize(
    ("flag", "text", "num_bytes"),
    [
        ("--kv-cache-memory", "2GiB", 2 << 30),
        ("--kv-cache-memory", "2gb", 2_000_000_000),
        ("--swap-space", "512MiB", 512 << 20),
        ("--swap-space", "1048576", 1 << 20),
    ],
)
def test_size_flags_take_units(parser, flag, text, num_bytes):
    args = parser.parse_args(["serve", flag, text])
    assert getattr(EngineConfig.from_cli_args(args), flag[2:].replace("-", "_")) == num_bytes


def test_bad_size_is_an_argparse_error_naming_the_flag(parser, capsys):
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "throughput", "--swap-space", "12 parsecs"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --swap-space" in err and "GiB" in err


def test_max_body_bytes_takes_a_size_of_at_least_one_byte(parser, capsys):
    assert parser.parse_args(["serve", "--max-body-bytes", "8MiB"]).max_body_bytes == 8 << 20
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["serve", "--max-body-bytes", "0"])  # every body would be a 413
    assert e.value.code == 2
    assert "argument --max-body-bytes: must be at least 1 byte" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help_shows_every_flag_with_its_default(parser, capsys, command):
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in FIELDS:
        assert "--" + f.name.replace("_", "-") in text
    assert "(default: 1GiB = 1073741824 bytes)" in text  # kv_cache_memory
    assert "(default: 16)" in text and "(default: paged)" in text
    assert "bytes, or a number with a unit" in text


def test_serve_defaults_the_served_name_to_the_base_name(parser, monkeypatch, tmp_path):
    from pagedllm.entrypoints.openai import api_server

    seen = []
    monkeypatch.setattr(api_server, "run_server", lambda args: seen.append(args) or 0)
    folder = tmp_path / "My-Model"
    for tokens, name in (
        ([str(folder)], ["My-Model"]),
        ([str(tmp_path / "x-q8_0.gguf")], ["x-q8_0"]),
        ([], ["SmolLM2-135M-Instruct"]),
        ([str(folder), "--served-model-name", "a", "b"], ["a", "b"]),
    ):
        args = parser.parse_args(["serve", *tokens])
        assert args.func(args) == 0
        assert seen[-1].served_model_name == name


def test_top_level_help_names_the_opt_in_features(parser, capsys):
    """`pagedllm --help` lists the opt-in features; each flag it names is a real flag of a
    subcommand (serve's help lists them all)."""
    import re

    from pagedllm.entrypoints.cli import FEATURES_EPILOG

    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    top = capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    serve_help = capsys.readouterr().out
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", FEATURES_EPILOG))
    assert {"--speculative-config", "--quantization", "--kv-cache-dtype", "-pp", "--admission",
            "--data-parallel-size"} <= flags  # fmt: skip
    for flag in flags:
        assert flag in top
        assert re.search(rf"(?<![\w-]){re.escape(flag)}\b", serve_help), flag


def test_version_flag(parser, capsys):
    import torch

    from pagedllm import __version__

    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedllm {__version__} (torch {torch.__version__})"


@pytest.mark.parametrize("port", ["99999", "-1", "http", "80.5"])
def test_serve_rejects_a_bad_port_before_loading(parser, capsys, port):
    """A port outside 0-65535 is an argparse error naming --port (it used to load the model and
    then die in bind() with an OverflowError traceback)."""
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err
    assert parser.parse_args(["serve", "--port", "65535"]).port == 65535
