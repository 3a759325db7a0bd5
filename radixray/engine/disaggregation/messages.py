"""What a prefill engine and a decode engine tell each other about one bootstrap room.

The decode side sends :class:`KVDestination` (where to write), the prefill side answers
with :class:`KVArrival` (the KV is written, here is the first token; or it failed).
Either side sends :class:`CancelRoom` when it gives up on a room. :class:`TransferOutcome`
stays inside the prefill engine (sender thread -> scheduler).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MAX_ROOM = 2**63  # rooms are random 63-bit integers
PD_FAILED_STATUS = 503  # a failed pair is retried on other workers before the first token
TIMEOUT_SCAN_S = 0.25  # rooms are checked for timeouts at most this often


class PDState(enum.Enum):
    """Where one request stands on one side of a pair (see the package docstring)."""

    BOOTSTRAPPING = "Bootstrapping"
    WAITING_FOR_INPUT = "WaitingForInput"
    TRANSFERRING = "Transferring"
    SUCCESS = "Success"
    FAILED = "Failed"


@dataclass(slots=True)
class PDBootstrap:
    """What a request sent to a prefill or decode engine carries: its room and the other
    worker of its pair."""

    room: int
    peer: str

    def __post_init__(self) -> None:
        if not isinstance(self.room, int) or isinstance(self.room, bool) \
                or not 0 <= self.room < MAX_ROOM:
            raise ValueError(f"bootstrap_room must be an integer in [0, 2**63), got "
                             f"{self.room!r}")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where one rank's KV pool lives: per layer, the base address of the key and the value
    buffer (one row of ``slot_bytes`` per slot: its KV heads side by side), and which of the
    model's KV heads those are (``heads``, in the row's order; a tensor-parallel rank holds
    some of them). Two pools exchange KV only when they agree on layers, bytes per head and
    dtype."""

    k_addrs: tuple[int, ...]
    v_addrs: tuple[int, ...]
    slot_bytes: int
    dtype: str
    heads: tuple[int, ...] = (0,)

    @property
    def num_layers(self) -> int:
        return len(self.k_addrs)

    @property
    def head_bytes(self) -> int:
        return self.slot_bytes // len(self.heads)

    def mismatch(self, other: KVLayout) -> str | None:
        """Why KV of ``other``'s pool cannot be written into this one (None: it can)."""
        mine = (self.num_layers, self.head_bytes, self.dtype)
        theirs = (other.num_layers, other.head_bytes, other.dtype)
        if mine != theirs:
            return (f"KV layouts differ (layers, bytes per KV head, dtype): {mine} here, "
                    f"{theirs} there; both workers must serve the same model and kv_cache_dtype")
        return None


@dataclass(frozen=True, slots=True)
class KVEndpoint:
    """Where a worker's KV lives: one transfer session and pool layout per tensor-parallel
    rank, in rank order (one of each without tensor parallelism)."""

    sessions: tuple[str, ...]
    layouts: tuple[KVLayout, ...]

    @property
    def session(self) -> str:
        """The driver rank's session (what /fleet shows)."""
        return self.sessions[0]

    @property
    def tp_size(self) -> int:
        return len(self.layouts)

    def heads(self) -> set[int]:
        return {h for layout in self.layouts for h in layout.heads}

    def mismatch(self, other: KVEndpoint) -> str | None:
        """Why KV of ``other``'s ranks cannot be written into this worker's (None: it can):
        the pools must agree per head, and together hold the same KV heads."""
        error = self.layouts[0].mismatch(other.layouts[0])
        if error is None and self.heads() != other.heads():
            error = (f"the workers hold different KV heads ({sorted(self.heads())} here, "
                     f"{sorted(other.heads())} there); both must serve the same model")
        return error


@dataclass(slots=True)
class KVDestination:
    """Decode -> prefill: write the KV of prompt positions ``start ..`` into ``slots``
    (one per position, the same in every rank's pool) of the decode worker's ``endpoint``."""

    room: int
    decode_worker: str
    endpoint: KVEndpoint
    slots: list[int]
    start: int


@dataclass(slots=True)
class KVArrival:
    """Prefill -> decode: the room's KV is written (``ok``) and its first output token(s)
    follow; or the prefill side failed (``error``)."""

    room: int
    prefill_worker: str
    ok: bool
    error: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list | None = None
    cached_tokens: int = 0  # the prefill worker's prefix-cache hit
    generator_state: object = None  # a seeded request's generator after the first draw
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class CancelRoom:
    """Either side gave up on ``room`` (abort, timeout, failure); ``reason`` says why."""

    room: int
    sender: str
    reason: str


@dataclass(slots=True)
class TransferOutcome:
    """Sender thread -> prefill scheduler: every queued write of ``room`` is done
    (``final``), or one failed mid-prefill (not final: the scheduler queues a fence)."""

    room: int
    ok: bool
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    final: bool = True
    write_failed: bool = False  # a write failed (not only cancelled by a fence)


@dataclass(slots=True)
class PeerGone:
    """A message for ``room`` could not be delivered to the peer worker (it is gone)."""

    room: int
    error: str
