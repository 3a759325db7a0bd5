"""StopChecker: the scheduler-side stop conditions, fed one token at a time."""

from __future__ import annotations

from functools import lru_cache

import pytest
from model_fixtures import byte_bpe_tokenizer

from radixray.engine.request import Req
from radixray.engine.sampling import SamplingParams
from radixray.engine.stop import StopChecker


@lru_cache(maxsize=1)
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (words carry a leading '▁'; decoding drops the space of
    the first token), trained in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz:"),
                                  show_progress=False)
    tok.train_from_iterator(["foo bar baz qux Answer: yes no"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def feed(checker: StopChecker, tokens: list[int], context_len: int = 1000, prompt_len: int = 3,
         **params):
    """Append tokens one by one as the scheduler does; return (tokens consumed, reason)."""
    req = Req(rid="r", prompt_ids=[1] * prompt_len, sampling=SamplingParams(**params))
    for tok in tokens:
        req.output_ids.append(tok)
        reason = checker.check(req, context_len)
        if reason is not None:
            return len(req.output_ids), reason.to_dict()
    return len(req.output_ids), None


def test_stop_string_ending_in_the_leading_space_of_a_token():
    """' bar' decodes alone as 'bar': the space before it is new text too."""
    tok = metaspace_tokenizer()
    ids = tok.encode("foo bar baz", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["foo", "bar", "baz"]
    checker = StopChecker(tok, {tok.eos_token_id})
    assert feed(checker, ids, stop=["foo "]) == (2, {"type": "stop", "matched": "foo "})
    assert feed(checker, ids, stop=[" baz"]) == (3, {"type": "stop", "matched": " baz"})
    assert feed(checker, ids, stop=["o b"]) == (2, {"type": "stop", "matched": "o b"})
    assert feed(checker, ids, stop=["zzz"], max_new_tokens=10) == (3, None)


def test_stop_string_spanning_byte_tokens():
    tok = byte_bpe_tokenizer()
    text = "ab 日本語 🚀 cd"
    ids = tok.encode(text)
    checker = StopChecker(tok, {0})
    for stop in ["日本", "本語 🚀", "🚀", "🚀 c", "b 日"]:
        n, reason = feed(checker, ids, stop=[stop])
        assert reason == {"type": "stop", "matched": stop}
        # It stops at the token that completes the stop string, not later.
        assert stop in tok.decode(ids[:n]) and stop not in tok.decode(ids[:n - 1])


def test_stop_condition_order():
    tok = byte_bpe_tokenizer()
    hello = tok.encode("Hello world")
    checker = StopChecker(tok, {0})
    # A stop string wins over EOS on the same token; EOS is skipped text.
    assert feed(checker, hello + [0], stop=["world"])[1]["matched"] == "world"
    assert feed(checker, hello + [0, 5])[1] == {"type": "stop", "matched": 0}
    assert feed(checker, hello + [0, 5], ignore_eos=True, max_new_tokens=len(hello) + 2)[1] == {
        "type": "length", "length": len(hello) + 2}
    assert feed(checker, [7, 8, 9], stop_token_ids=[8], ignore_eos=True) == (
        2, {"type": "stop", "matched": 8})
    assert feed(checker, [7, 8, 9], max_new_tokens=2) == (2, {"type": "length", "length": 2})
    # The context limit ends a request like max_new_tokens does.
    assert feed(checker, [7, 8, 9, 10], context_len=5, prompt_len=3) == (
        2, {"type": "length", "length": 2})


@pytest.mark.parametrize("skip", [True, False])
def test_stop_string_after_special_token(skip):
    tok = byte_bpe_tokenizer()
    ids = tok.encode("Hello") + [0] + tok.encode(" world")
    checker = StopChecker(tok, {0})
    n, reason = feed(checker, ids, stop=["Hello world"], ignore_eos=True,
                     skip_special_tokens=skip)
    if skip:  # the skipped EOS leaves "Hello world" in the text
        assert reason == {"type": "stop", "matched": "Hello world"}
    else:
        assert reason is None and n == len(ids)
