"""Incremental detokenization with stop strings.

Each request keeps two offsets into its token ids (prefix_offset, read_offset),
as in SGLang and vLLM: ids[prefix_offset:read_offset] were already emitted and
serve as decoding context; decoding ids[prefix_offset:] and taking the text
past that context gives the new text. A trailing U+FFFD (an incomplete UTF-8
character) waits for more tokens while the text before it goes out. The wait is
bounded in tokens, so ids that never complete a character cannot make the
decoded window, and so the work per token, grow without bound.

Released text never contains a stop string: after each step the decoded output
is searched for stop strings, which may span token boundaries, and a tail that
could still grow into a stop string is held back until it can not.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context before the first output token.
PROMPT_CONTEXT_TOKENS = 5
# Pending tokens after which read_offset moves to the latest character boundary
# among them, or, where there is none (ids that never complete a character),
# the text is released with its replacement characters.
MAX_PENDING_TOKENS = 8
# Longest decoding context kept behind read_offset while no text is emitted
# (e.g. a run of skipped special tokens).
MAX_CONTEXT_TOKENS = 16


def find_stop_string(
    text: str, stops: Sequence[str], search_from: int = 0
) -> tuple[int, str] | None:
    """Earliest stop string occurrence in ``text`` that may overlap ``text[search_from:]``.

    Matches starting at or after ``search_from - max_stop_len + 1`` count, so
    passing the length of the text already checked finds only matches that end
    in the new part (a stop spanning old and new text included). Returns
    ``(index, stop)``; ties at one index go to the stop listed first.
    """
    stops = [s for s in stops if s]
    if not stops:
        return None
    start = max(0, search_from - max(len(s) for s in stops) + 1)
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


def partial_stop_len(text: str, stops: Sequence[str], limit: int | None = None) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop.

    ``limit`` caps the tail length considered (e.g. the unreleased text).
    """
    longest = 0
    for s in stops:
        n = min(len(s) - 1, len(text))
        if limit is not None:
            n = min(n, limit)
        for k in range(n, longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, chunk by chunk."""

    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        # Context from the prompt tail: decoded only to get the first output
        # token's leading space right, never emitted.
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self._partial = 0
        self._decoded = ""  # all decoded output text: released + held back
        self.text = ""  # released so far
        self.matched_stop: str | None = None
        self.stopped = False

    # ------------------------------------------------------------------ public
    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Add output token ids; return the newly releasable text (may be "")."""
        if self.stopped or not new_ids:
            return ""
        self._ids.extend(int(t) for t in new_ids)
        return self._step(final=False)

    def finish(self) -> str:
        """Flush at the end of the request: release everything still held."""
        if self.stopped:
            return ""
        return self._step(final=True)

    @property
    def held_text(self) -> str:
        """Decoded text not released yet (a possible stop-string prefix)."""
        return self._decoded[len(self.text) :]

    # ------------------------------------------------------------------ internals
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Decode past the released text; advance the offsets; return the new text.

        ids[prefix_offset:read_offset] is context ending on a character
        boundary; ``_partial`` counts characters past it already returned
        while the tail was an incomplete character.
        """
        ids = self._ids
        if self.read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(ids[self.prefix_offset :])
        done = len(prefix_text) + self._partial
        stable = new_text.rstrip(REPLACEMENT_CHAR)
        if not final and len(stable) < len(new_text):
            # Incomplete character at the end: return what precedes it.
            delta = stable[done:]
            done = max(done, len(stable))
            self._partial = done - len(prefix_text)
            if len(ids) - self.read_offset < MAX_PENDING_TOKENS or self._rebase(prefix_text, done):
                return delta
            # No character boundary for many tokens: give up waiting.
            return delta + self._advance(prefix_text, new_text, done)
        return self._advance(prefix_text, new_text, done)

    def _advance(self, prefix_text: str, new_text: str, done: int) -> str:
        """Everything decoded is released: read_offset moves to the end."""
        if len(new_text) > len(prefix_text):
            self.prefix_offset = self.read_offset
        else:  # nothing visible (e.g. skipped special tokens): keep the context
            self.prefix_offset = max(self.prefix_offset, len(self._ids) - MAX_CONTEXT_TOKENS)
        self.read_offset = len(self._ids)
        self._partial = 0
        return new_text[done:]

    def _rebase(self, prefix_text: str, done: int) -> bool:
        """Move read_offset to the latest pending token boundary that ends a character.

        Text past a character boundary decodes the same from any earlier start,
        so ``_partial`` carries over. False when no such boundary exists.
        """
        for k in range(len(self._ids) - 1, self.read_offset, -1):
            text = self._decode(self._ids[self.prefix_offset : k])
            if len(text) > len(prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                self.prefix_offset, self.read_offset = self.read_offset, k
                self._partial = done - len(text)
                return True
        return False

    def _step(self, final: bool) -> str:
        delta = self._decode_new(final)
        checked = len(self._decoded)
        self._decoded += delta
        released = len(self.text)
        if self.stop and delta:
            hit = find_stop_string(self._decoded, self.stop, checked)
            if hit is not None:
                idx = max(hit[0], released)
                self._decoded = self._decoded[:idx]
                self.matched_stop = hit[1]
                self.stopped = True
                return self._release(idx)
        end = len(self._decoded)
        if self.stop and not final:
            end -= partial_stop_len(self._decoded, self.stop, limit=end - released)
        return self._release(end)

    def _release(self, end: int) -> str:
        out = self._decoded[len(self.text) : end]
        if out:
            self.text += out
        return out
