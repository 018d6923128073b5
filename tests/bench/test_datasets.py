"""Workload loaders on small fixture files (whitespace tokens): exact prompts and lengths."""

from pathlib import Path

import pytest

from pagedllm.bench.datasets import load_dataset, workload_stats

DATA = Path(__file__).parent / "data"


def split(text: str) -> list[int]:
    return list(range(len(text.split())))


def load(name, n=100, **kw):
    return load_dataset(name, split, n, data_dir=DATA, shuffle=False, **kw)


def test_sharegpt_first_human_turn_and_reply_length():
    reqs = load("sharegpt")
    # b: prompt of 2 tokens (< 4) dropped; c: starts with the model; d: no reply.
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("one two three four five", 5, 6),
        ("seven words in this human turn now", 7, 4),
    ]
    assert [r.prompt_len for r in load("sharegpt", max_prompt_len=6)] == [5]
    assert load("sharegpt", max_model_len=10) == []  # 5 + 6 and 7 + 4 are both 11
    assert [r.output_len for r in load("sharegpt", max_output_len=5)] == [5, 4]
    assert len(load("sharegpt", n=1)) == 1


def test_alpaca_instruction_plus_input():
    reqs = load("alpaca")
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("Give three tips please", 4, 4),
        ("Translate this\n\nle chat noir dort", 6, 5),
    ]  # "Say hi" -> "hi" is too short


def test_wmt16_one_shot_prefix():
    reqs = load("wmt16", wmt_shots=1)
    assert reqs[0].prompt == (
        "English: the house\nGerman: das Haus\n\nEnglish: a big red car drives fast\nGerman:"
    )
    assert [(r.prompt_len, r.output_len) for r in reqs] == [(14, 6), (13, 5)]


def test_random_and_shuffle_are_seeded():
    a = load_dataset("random", split, 3, input_len=5, output_len=7, vocab_size=50, seed=1)
    b = load_dataset("random", split, 3, input_len=5, output_len=7, vocab_size=50, seed=1)
    assert a == b and all(len(r.prompt) == 5 and r.output_len == 7 for r in a)
    s1 = load_dataset("alpaca", split, 2, data_dir=DATA, seed=3)
    assert s1 == load_dataset("alpaca", split, 2, data_dir=DATA, seed=3)
    assert workload_stats(load("sharegpt")) == {
        "num_requests": 2,
        "mean_prompt_len": 6.0,
        "mean_output_len": 5.0,
        "max_prompt_len": 7,
        "max_output_len": 6,
    }


def test_bad_input_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="dataset"):
        load("lmsys")
    with pytest.raises(ValueError, match="num_requests"):
        load("alpaca", n=0)
    with pytest.raises(FileNotFoundError, match="PAGEDLLM_DATA"):
        load_dataset("alpaca", split, 1, data_dir=tmp_path)


def test_dataset_path_names_the_file_itself(tmp_path):
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text((DATA / "sharegpt_1024.json").read_text())
    reqs = load_dataset("sharegpt", split, 100, dataset_path=path, data_dir="/nonexistent")
    assert len(reqs) == 2


def test_missing_file_says_where_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_dataset("sharegpt", split, 1, dataset_path=tmp_path / "nope.json")
    msg = str(e.value)
    assert "--dataset-path" in msg and "ShareGPT_V3_unfiltered_cleaned_split.json" in msg
    assert "--dataset random" in msg
