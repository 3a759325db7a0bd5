"""Named tensors as Ray moves them without copies: numpy arrays in the object store.

Ray stores numpy arrays out of band and a reader on the same node maps them from
shared memory without a copy; torch tensors would be pickled by value. So a
colocated trainer sends ``to_payload(named)`` (``ray.put`` it once for many
workers) and each worker reads it with :func:`from_payload`. bfloat16 has no numpy
type: its bits travel as uint16 and are viewed back.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import torch

Payload = list[tuple[str, np.ndarray, str]]


def to_payload(named: Iterable[tuple[str, torch.Tensor]] | dict) -> Payload:
    """``[(name, array, dtype name)]`` for ``(name, tensor)`` pairs (CPU copies of GPU ones)."""
    items = named.items() if isinstance(named, dict) else named
    out: Payload = []
    for name, tensor in items:
        t = tensor.detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        array = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        out.append((name, array, dtype))
    return out


def from_payload(payload: Payload) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` over the payload's arrays, sharing their (read-only) memory:
    read them, never write them."""
    for name, array, dtype in payload:
        with warnings.catch_warnings():  # the object store's arrays are read-only
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.from_numpy(array)
        if dtype == "bfloat16":
            tensor = tensor.view(torch.bfloat16)
        yield name, tensor


def is_payload(value) -> bool:
    """Whether ``value`` is a :func:`to_payload` list (not ``(name, tensor)`` pairs)."""
    return isinstance(value, list) and bool(value) and len(value[0]) == 3 \
        and isinstance(value[0][1], np.ndarray)
