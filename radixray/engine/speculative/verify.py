"""Accepting a draft chain against the target model's next-token distributions.

Row ``i`` of a request's verify logits is the target's prediction after the draft's first
``i`` tokens (row 0 follows the request's last committed token). Both functions return
the tokens to commit: the accepted draft prefix plus one token of the target's own, so
between 1 and ``len(draft) + 1`` tokens.
"""

from __future__ import annotations

import torch


def accept_greedy(targets: list[int], draft: list[int]) -> list[int]:
    """Greedy: ``targets[i]`` is the argmax of row ``i`` (``len(draft) + 1`` rows). Keeps
    the longest draft prefix equal to the argmax, then the argmax after it: exactly the
    tokens greedy decoding without speculation would produce."""
    a = 0
    while a < len(draft) and targets[a] == draft[a]:
        a += 1
    return draft[:a] + [targets[a]]


def accept_sampled(probs: torch.Tensor, draft: list[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """Speculative rejection sampling against a deterministic draft.

    ``probs`` [len(draft) + 1, V]: the target's filtered sampling distribution at each row
    (temperature, top-k/p, min-p applied; rows need not be normalised). The draft proposes
    token ``d`` with probability 1, so it is accepted with probability ``p(d)``; on
    rejection the token is drawn from ``p`` without ``d`` (the normalised ``max(p - q, 0)``),
    and after a fully accepted draft one more token is drawn from the last row. Every
    committed token is then distributed exactly as sampling without speculation.
    """
    k = len(draft)
    p = probs / probs.sum(dim=-1, keepdim=True)
    if k:
        d = torch.tensor(draft, dtype=torch.int64, device=p.device)
        p_draft = p[:k].gather(1, d.unsqueeze(1)).squeeze(1)
        u = torch.rand(k, generator=generator, device=p.device)
        ok = (u < p_draft).tolist()
    else:
        ok = []
    a = ok.index(False) if False in ok else k
    row = p[a]
    if a < k:
        row = row.clone()
        row[draft[a]] = 0.0  # rejected: p(d) < 1, so the rest has mass
    token = int(torch.multinomial(row, 1, generator=generator)[0])
    return draft[:a] + [token]
