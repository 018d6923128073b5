"""EngineConfig on its own: sizes with units, generic validation, chat templates, served names."""

import pytest

from pagedllm.config import (
    EngineConfig,
    check_engine_kwargs,
    format_size,
    parse_size,
    resolve_chat_template,
    served_model_name,
)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [
        ("4096", 4096),
        (4096, 4096),
        ("0", 0),
        ("12B", 12),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        ("2 GIB", 2 << 30),
        ("512MiB", 512 << 20),
        ("64KiB", 64 << 10),
        ("1TiB", 1 << 40),
        ("3KB", 3000),
        ("5mb", 5_000_000),
        ("2GB", 2_000_000_000),
        ("1.5GiB", 3 << 29),
        (" 7 ", 7),
    ],
)
def test_parse_size_units(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("bad", ["", "GiB", "2XB", "-1", "2 GiB extra", "1e9", True, 1.5, -3])
def test_parse_size_rejects_and_names_the_field(bad):
    with pytest.raises(ValueError, match="swap_space"):
        parse_size(bad, "swap_space")


def test_format_size():
    assert format_size(1 << 30) == "1GiB"
    assert format_size(256 << 20) == "256MiB"
    assert format_size(1000) == "1000"
    assert format_size(0) == "0"


def test_config_takes_sizes_with_units():
    cfg = EngineConfig(kv_cache_memory="2GiB", swap_space="512MiB")
    assert (cfg.kv_cache_memory, cfg.swap_space) == (2 << 30, 512 << 20)
    assert EngineConfig(swap_space=0).swap_space == 0
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory must be >= 1 bytes"):
        EngineConfig(kv_cache_memory=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"num_threads": 0}, "num_threads"),
        ({"max_logprobs": -1}, "max_logprobs"),
        ({"preemption_mode": "never"}, "preemption_mode"),
        ({"kv_manager": "contiguous"}, "kv_manager"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "uni"),
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"pipeline_parallel_size": 2, "distributed_executor_backend": "uni"}, "pipeline_para"),
        ({"dtype": "int8"}, "dtype"),
        ({"block_size": "16"}, "block_size must be an integer"),
        ({"max_model_len": 2.5}, "max_model_len must be an integer"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_pipeline_parallel_defaults_to_worker_processes():
    config = EngineConfig(pipeline_parallel_size=2)
    assert config.distributed_executor_backend == "mp"
    assert EngineConfig(pipeline_parallel_size=1).distributed_executor_backend == "uni"


def test_dtype_aliases_still_accepted():
    import torch

    assert EngineConfig(dtype="bf16").torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="auto").torch_dtype == torch.float32
    assert EngineConfig(dtype=torch.float16).torch_dtype == torch.float16


def test_check_engine_kwargs_names_unknown_options():
    check_engine_kwargs({"block_size": 8, "swap_space": "1GiB"})
    with pytest.raises(TypeError, match=r"LLM\(\).*'blok_size'.*'kv_cache'"):
        check_engine_kwargs({"blok_size": 8, "kv_cache": 1, "seed": 1}, "LLM")


def test_chat_template_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert resolve_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert resolve_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    cfg = EngineConfig(chat_template=str(f))
    assert cfg.chat_template == str(f) and cfg.chat_template_text == f.read_text()
    assert EngineConfig().chat_template_text is None
    with pytest.raises(ValueError, match="chat_template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))


def test_served_model_name_is_a_base_name(tmp_path):
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Llama-3.2-1B-Instruct") == "Llama-3.2-1B-Instruct"
    assert served_model_name("/models/Llama-3.2-1B-Instruct/") == "Llama-3.2-1B-Instruct"
    assert served_model_name("/gguf/smollm2-135m-q8_0.gguf") == "smollm2-135m-q8_0"
    assert served_model_name(tmp_path) == tmp_path.name
