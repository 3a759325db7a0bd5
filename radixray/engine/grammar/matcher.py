"""One request's grammar state, and the batch's token bitmask applied to the logits.

The grammar covers output tokens only: a cached or recomputed prompt never moves it. A
retracted request keeps its output and re-enters with it, so its matcher stays where it
was; :meth:`GrammarState.sync` rebuilds the matcher over the output whenever the two
disagree (any path that rewrote the output), so the mask always follows the tokens.
"""

from __future__ import annotations

import importlib.util

import torch

from radixray.engine.request import FinishReason


class GrammarState:
    """An xgrammar matcher plus the number of output tokens it has accepted."""

    def __init__(self, matcher_factory, compiled):
        self._factory = matcher_factory
        self._compiled = compiled
        self.matcher = matcher_factory(compiled)
        self.accepted = 0  # output tokens the matcher has taken

    def sync(self, output_ids: list[int]) -> None:
        """Make the matcher's state that after ``output_ids`` (normally a no-op)."""
        if self.accepted == len(output_ids):
            return
        self.matcher = self._factory(self._compiled)
        self.accepted = 0
        for token in output_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            self.accepted += 1
        self.accepted = len(output_ids)  # tokens past a rejection were already returned

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of ``bitmask``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> FinishReason | None:
        """Advance over the sampled ``token``. Returns ``stop`` once the grammar has ended
        (the matcher took a stop token after a complete match), an ``error`` (status 500)
        if the token was not allowed (the mask was not applied), else None."""
        self.accepted += 1
        if not self.matcher.accept_token(token):
            return FinishReason("error", message=f"structured output: token {token} is not "
                                "allowed by the request's grammar", status=500)
        if self.matcher.is_terminated():
            return FinishReason("stop", matched=token)
        return None


def apply_masks(logits: torch.Tensor, reqs: list, vocab_size: int) -> None:
    """Set the logits of every token a constrained request's grammar forbids to -inf, in
    place (rows of unconstrained requests are untouched). ``logits``: [len(reqs), V]."""
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
    for i in rows:
        state = reqs[i].grammar
        state.sync(reqs[i].output_ids)
        state.fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size,
                                    indices=rows, backend=mask_backend(logits.device))


def mask_backend(device: torch.device) -> str:
    """xgrammar's kernel for logits on ``device``: its C++ loop on the CPU, triton on CUDA
    where triton is installed (the CPU install leaves it out), else plain torch."""
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch_native"
