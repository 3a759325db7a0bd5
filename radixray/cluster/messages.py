"""What crosses a process boundary between the ingress, the engine workers and the
controller (besides the engine's own :mod:`radixray.engine.messages`).

Dataclasses, so both sides read fields by name and a misspelt key is an error where
it is written rather than a silent ``None`` where it is read. Ray pickles them by
reference to this module. The JSON documents of the admin endpoints (``/fleet``) are
views built for HTTP, not messages.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from radixray.engine.disaggregation.messages import KVEndpoint, PDBootstrap
from radixray.engine.sampling import SamplingParams


@dataclass(slots=True)
class SubmitRequest:
    """One request an ingress replica asks a worker to run (token ids only)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    priority: int | None = None
    bootstrap: PDBootstrap | None = None  # prefill/decode workers: its room and peer
    lora_path: str | None = None  # the LoRA adapter it runs with (None: the base model)


@dataclass(slots=True)
class ChannelState:
    """Sent on a worker channel when it opens and whenever the worker starts or stops
    draining (a draining worker finishes what it has and takes nothing new)."""

    worker_id: str
    draining: bool


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Static facts about a worker that the ingress and the controller need."""

    worker_id: str
    model: str
    context_len: int
    vocab_size: int
    max_total_tokens: int
    draining: bool
    role: str = "unified"
    kv_session: str | None = None  # prefill/decode: the driver rank's KV transfer session
    kv_endpoint: KVEndpoint | None = None  # prefill/decode: every rank's session and pool
    generation: int = 0  # the incarnation of its slot (the controller's count)
    started_at: float = 0.0  # wall clock when the actor was created
    weight_version: int | str = 0  # an int or a string label (engine/weights/version.py)
    pid: int = 0  # the actor's process
    node_ip: str | None = None  # the address of the Ray node it runs on
    tp_ranks: list | None = None  # each rank's {"rank", "node_ip", "pid"} (rank 0: this actor)


@dataclass(slots=True)
class WorkerLoad:
    """A worker's scheduler counters and gauges at one moment (``load()``, ``/metrics``)."""

    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_input_tokens: int = 0
    prefill_cached_tokens: int = 0
    num_retracted_reqs: int = 0
    num_aborted_reqs: int = 0
    failed_steps: int = 0
    engine_failed: bool = False
    paused: str | None = None  # the pause mode while generation is paused
    inflight: int = 0  # requests of this worker's open channels not finished yet
    weight_version: int | str = 0
    memory_released: list[str] = field(default_factory=list)  # tags released now
    num_used_tokens: int = 0  # KV slots held by requests or the cache
    max_total_num_tokens: int = 0  # the KV pool's size
    startup_seconds: float = 0.0  # the worker's constructor: model load, pool, warm-up
    weight_load_seconds: float = 0.0
    role: str = "unified"
    kv_slot_leak: int = 0  # the last KV accounting audit's difference (engine/mem_cache/kv_audit.py)
    pd: dict | None = None  # prefill/decode: queues, failures, finished transfers (pd_metrics)
    adapters_held: list[str] = field(default_factory=list)  # LoRA: in its slots or queue
    eplb: dict | None = None  # with enable_eplb: ExpertBalancer.snapshot() (engine/ep/eplb.py)
    hicache: dict | None = None  # with enable_hierarchical_cache: KVManager.tier_snapshot()
    grammar: dict | None = None  # structured output: GrammarManager.snapshot() (engine/grammar/)
    spec: dict | None = None  # with speculative_algorithm: SpecStats.snapshot() (engine/speculative/)
    # finished requests' time to first token and per output token since the worker started
    # (sum, count): the autoscaler's latency signals (cluster/autoscaling.py)
    ttft_s_sum: float = 0.0
    ttft_s_count: int = 0
    tpot_s_sum: float = 0.0
    tpot_s_count: int = 0

    def as_json(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class WorkerEntry:
    """The controller's answer to "which actor is worker X now"."""

    worker_id: str
    handle: object
    generation: int
    state: str


@dataclass(slots=True)
class FleetHealth:
    """Whether the fleet takes requests; ``errors`` says why each down worker went down."""

    draining: bool
    routable: int
    workers: dict[str, int] = field(default_factory=dict)  # state -> count
    errors: dict[str, str] = field(default_factory=dict)  # worker id -> its last error
    # prefill-decode fleets: routable workers per role and the handshake (None: unified)
    disaggregation: dict | None = None
