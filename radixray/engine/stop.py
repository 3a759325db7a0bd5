"""Stop conditions checked by the scheduler after each sampled token.

Order: stop strings first (a string can end on a token that is also EOS), then
stop token ids and EOS, then the max_new_tokens and context limits.
"""

from __future__ import annotations

from radixray.engine.detokenizer import REPLACEMENT_CHAR, find_stop_string
from radixray.engine.request import FinishReason, Req


class StopChecker:
    """Decides whether a request is finished after its latest token."""

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, req: Req, context_len: int) -> FinishReason | None:
        sp = req.sampling
        token = req.output_ids[-1]
        if sp.stop:
            # A stop string of b UTF-8 bytes spans at most b tokens; one more token
            # of context covers a match that started inside the previous token.
            tail_tokens = max(len(s.encode()) for s in sp.stop) + 1
            window = req.output_ids[-tail_tokens:]
            skip = sp.skip_special_tokens
            tail = self.tokenizer.decode(window, skip_special_tokens=skip)
            last = self.tokenizer.decode([token], skip_special_tokens=skip)
            # Where the new text starts. A token decoded alone can lose its leading space
            # (SentencePiece), so the text before it counts too; an incomplete character at
            # its end is not text yet. The earlier of the two is safe: an earlier match would
            # have stopped the request already.
            before = self.tokenizer.decode(window[:-1], skip_special_tokens=skip)
            new_from = min(len(tail) - len(last), len(before.rstrip(REPLACEMENT_CHAR)))
            hit = find_stop_string(tail, sp.stop, search_from=max(0, new_from))
            if hit is not None:
                return FinishReason("stop", matched=hit[1])
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return FinishReason("stop", matched=token)
        if len(req.output_ids) >= sp.max_new_tokens:
            return FinishReason("length", length=len(req.output_ids))
        if req.seq_len >= context_len:
            return FinishReason("length", length=len(req.output_ids))
        return None


def eos_token_ids(tokenizer, hf_config, generation_config=None) -> set[int]:
    """Every id that ends generation: the tokenizer's EOS and the model config's eos_token_id(s)."""
    ids: set[int] = set()
    for source in (hf_config, generation_config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
