"""The engine's control surface: every control verb declared once, and what the verbs return.

Three implementers, one body per verb:

- :class:`radixray.Engine` implements :class:`EngineControl` (blocking calls);
- ``EngineWorker`` (actors/engine_worker.py) implements the same verbs, same parameters, as
  coroutines that call the Engine's (an async actor must not block its event loop:
  scheduler-thread verbs are awaited through :meth:`Engine.submit_verb`, the rest run in a
  thread);
- the controller (actors/fleet_ops.py) implements :class:`FleetControl`: the verbs that
  make sense for a whole fleet, applied to every live worker, results keyed by worker id.

tests/cpu/test_control_surface.py checks with ``inspect`` that each implementer defines
every verb of its protocol with the protocol's parameters, and that every engine verb is
either a fleet verb or declared engine-only (:data:`ENGINE_ONLY_VERBS`), so a verb cannot
be added in one place only.

A verb whose body must run on the scheduler thread between steps is marked with
:func:`scheduler_verb`: calling it blocks until the body ran; ``engine.submit_verb(verb,
...)`` returns a :class:`~concurrent.futures.Future` instead.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from radixray.engine.messages import DEFAULT_GROUP
from radixray.engine.weights.version import WeightVersion

if TYPE_CHECKING:
    from radixray.engine.faults import FaultInjector

LOOP_TIMEOUT_S = 60.0  # a scheduler-thread verb that waits longer: the loop is stuck
LONG_LOOP_TIMEOUT_S = 600.0  # verbs that move weights or the KV pool

# The closed sets of the control verbs' arguments, declared once for every layer: pause
# modes (engine/sched/pause.py) and memory tags (engine/mem_cache/memory_saver.py). The
# HTTP protocol, the fleet's weight update and the RL config check their input against
# these; this module imports nothing heavy, so the ingress and the configs may use it.
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")  # cuda_graph: the decode graphs (CUDA)
# A weight update stages the new weights by reading the serving ones, so only the KV pool
# may be released while it runs (the freed pool makes room for the staged copy).
RELEASABLE_DURING_UPDATE = ("kv_cache",)

# The same sets as types, for pydantic schemas (``Literal[("a", "b")]`` is ``Literal["a", "b"]``)
PauseMode = Literal[PAUSE_MODES]
MemoryTag = Literal[MEMORY_TAGS]
ReleasableDuringUpdate = Literal[RELEASABLE_DURING_UPDATE]


def scheduler_verb(timeout: float = LOOP_TIMEOUT_S):
    """Mark an Engine method whose body runs on the scheduler thread between steps.

    The decorated method, called, hands its body to the scheduler's inbox and waits (at most
    ``timeout`` s: TimeoutError) for the result or the exception. Its body stays reachable
    as ``loop_body`` for :meth:`Engine.submit_verb`, so async callers await the same body
    without holding a thread.
    """
    def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(body)
        def verb(self, *args, **kwargs):
            return self._loop_future(functools.partial(body, self, *args, **kwargs)
                                     ).result(timeout)
        verb.loop_body = body
        return verb
    return wrap


@dataclass
class EngineSnapshot:
    """One engine's counters and gauges at one moment (``Engine.snapshot()``), taken on the
    scheduler thread so the numbers agree with each other. A worker reports the serving
    part as its ``WorkerLoad``; benchmarks read the step counters."""

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int  # KV slots held by requests or the cache
    max_total_num_tokens: int  # the KV pool's size
    token_usage: float
    gen_throughput: float  # decode tokens/s over the last log interval; 0 when idle
    prompt_tokens: int
    generation_tokens: int
    prefill_input_tokens: int
    prefill_cached_tokens: int
    num_retracted_reqs: int
    num_aborted_reqs: int
    failed_steps: int
    engine_failed: bool
    paused: str | None  # the pause mode while generation is paused
    kv_slot_leak: int  # the last KV audit's difference (engine/mem_cache/kv_audit.py)
    weight_version: WeightVersion  # an int or a string label (engine/weights/version.py)
    weight_load_seconds: float
    memory_released: list[str] = field(default_factory=list)  # tags released now
    forward_steps: int = 0
    decode_steps: int = 0
    mixed_forwards: int = 0  # prefill forwards that carried decode requests
    pd: dict | None = None  # prefill/decode: PDLink.snapshot() (takes finished transfers)
    eplb: dict | None = None  # with enable_eplb: ExpertBalancer.snapshot()
    hicache: dict | None = None  # with enable_hierarchical_cache: KVManager.tier_snapshot()
    grammar: dict | None = None  # structured output: GrammarManager.snapshot()
    spec: dict | None = None  # with speculative_algorithm: SpecStats.snapshot()
    overlap: dict | None = None  # with enable_overlap_schedule: OverlapStats.snapshot()
    adapters_held: list[str] = field(default_factory=list)  # sched/lora.py held_adapters

    @classmethod
    def of(cls, engine) -> EngineSnapshot:
        """Read ``engine`` (an Engine; scheduler thread only)."""
        from radixray.engine.sched.lora import held_adapters
        s = engine.scheduler
        st = s.stats
        used, usage = s.token_usage()
        eplb = getattr(s.runner, "eplb", None)
        return cls(
            num_running_reqs=s.num_running, num_queue_reqs=s.num_waiting,
            num_used_tokens=used, max_total_num_tokens=s.kv.pool_size, token_usage=usage,
            gen_throughput=st.gen_throughput if s.num_running else 0.0,
            prompt_tokens=st.prompt_tokens, generation_tokens=st.generation_tokens,
            prefill_input_tokens=st.prefill_input_tokens,
            prefill_cached_tokens=st.prefill_cached_tokens,
            num_retracted_reqs=st.num_retracted_reqs, num_aborted_reqs=st.num_aborted_reqs,
            failed_steps=s.faults.total, engine_failed=s.faults.failed is not None,
            paused=s.paused, kv_slot_leak=s.kv_audit.leak,
            weight_version=engine.weights.version,
            weight_load_seconds=s.runner.weight_load_seconds,
            memory_released=sorted(engine.memory.released),
            forward_steps=st.forward_steps, decode_steps=st.decode_steps,
            mixed_forwards=st.mixed_forwards,
            pd=engine.pd.snapshot() if engine.pd is not None else None,
            eplb=eplb.snapshot() if eplb else None, hicache=s.kv.tier_snapshot(),
            grammar=s.grammar.snapshot(),
            spec=s.spec_stats.snapshot() if s.spec_stats is not None else None,
            overlap=s.overlap_stats.snapshot() if s.overlap_stats is not None else None,
            adapters_held=held_adapters(s))


@dataclass(frozen=True)
class ModelFacts:
    """What measurements need to know of the served model (benchmarks' rooflines)."""

    module: Any  # the torch module: read its parameters, do not change them
    dtype: Any  # torch.dtype of the activations
    kv_bytes_per_token: int
    vocab_size: int
    precision: str = ""  # what quantization="auto" became and why (engine/precision.py)
    quantization: str | None = None  # as resolved: what runs
    kv_cache_dtype: str = "auto"  # as resolved
    quantize_lm_head: bool = False  # as resolved


@dataclass
class ForwardTimer:
    """Wall seconds spent in forward passes since it was started (``Engine.time_forwards``);
    set ``seconds`` to 0 to start over."""

    seconds: float = 0.0

    @classmethod
    def around(cls, runner) -> ForwardTimer:
        """A timer that ``runner.forward`` adds each pass's wall time to from now on."""
        timer, inner = cls(), runner.forward

        def timed(batch):
            t0 = time.perf_counter()
            try:
                return inner(batch)
            finally:
                timer.seconds += time.perf_counter() - t0
        runner.forward = timed
        return timer


class EngineControl(Protocol):
    """The control verbs of one engine. ``Engine`` implements them as blocking calls,
    ``EngineWorker`` as coroutines with the same parameters. Unless stated, a verb is
    thread-safe and returns once it took effect."""

    def pause_generation(self, mode: str = "abort") -> int:
        """Stop scheduling: ``abort`` ends every request, ``retract`` sends running ones back
        to the queue (KV freed), ``in_place`` holds them with their KV. New requests wait
        until :meth:`continue_generation`. Returns how many requests the mode touched;
        ValueError names a bad mode."""

    def continue_generation(self) -> bool:
        """Schedule again; False if generation was not paused. ValueError while memory is
        released."""

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Give back the memory of ``tags`` (``kv_cache``, ``weights``; None: both) while
        paused; returns what was freed. ValueError for a tag that cannot be released here."""

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Take back the memory of released ``tags`` (None: every released tag)."""

    def flush_cache(self) -> bool:
        """Drop every cached prefix; False (nothing changes) while requests run."""

    def rebalance_experts(self, timeout: float = 600.0) -> dict:
        """Rebalance the MoE model's expert copies (EPLB) for the recent load; the report as a
        dict. Waits while a weight-update session is open (at most ``timeout`` s)."""

    def check_kv_conservation(self) -> dict:
        """Assert free + request-held + cache-held == pool size now; returns the numbers."""

    def abort(self, rids: str | Sequence[str]) -> None:
        """Abort requests by id (unknown ids are ignored); their KV returns."""

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> list[str]:
        """Abort the request ``rid`` and the choices derived from it (``rid_0``, ``rid_1``,
        ...: engine/request_ids.py), or with ``abort_all`` every request this engine holds
        (waiting, prefilling, running, in a grammar's or a disaggregated side's queue). Each
        ends with finish reason ``abort`` and the output it had; its KV returns. Returns
        the ids aborted (empty for an unknown id). ValueError unless exactly one of ``rid``
        and ``abort_all`` is given."""

    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges now (see :class:`EngineSnapshot`)."""

    def attach_fault_injector(self, injector: FaultInjector | None) -> None:
        """Tests only: consult ``injector`` at every fault point from now on (None: detach)."""

    # ---- weight updates: begin, stage (tensor | disk | distributed), prepare, commit,
    # finish; or end (prepare + commit + finish); abort or rollback on failure.
    def begin_weight_update(self, lora_name: str | None = None) -> None:
        """Open a weight-update session (ValueError if one is open): for the base weights, or
        with ``lora_name`` for that loaded LoRA adapter (ValueError naming an unknown one),
        whose PEFT-named tensors the same calls stage and whose own version the end takes
        (engine/weights/adapter_stage.py; the base version stays)."""

    def update_weights_from_tensor(self, named_tensors) -> dict:
        """Stage Hugging Face-named tensors in the open session."""

    def update_weights_from_disk(self, model_path: str) -> dict:
        """Stage every tensor of a Hugging Face folder's (or one file's) safetensors."""

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                                  timeout_s: float = 600.0) -> dict:
        """Join the trainer's torch.distributed group as rank ``rank_offset``."""

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        """Leave the trainer's group; False if not in it."""

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = DEFAULT_GROUP) -> dict:
        """Receive the trainer's broadcast of ``names`` into the open session."""

    def prepare_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        """First half of ending a session: check and ready the staged weights as
        ``weight_version`` (engine/weights/version.py; None: the next int); nothing serving
        changes. A refused version raises VersionRefused and the session stays open."""

    def commit_weight_update(self) -> WeightVersion:
        """Serve the prepared weights from the next step on; returns the version."""

    def rollback_weight_update(self) -> bool:
        """Serve the weights of before the last commit again (a fleet update failed)."""

    def finish_weight_update(self) -> dict:
        """Close the committed session; the version and each phase's time."""

    def end_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        """Prepare, commit and finish in one call (a refused version: VersionRefused, the
        session stays open with its staged weights)."""

    def abort_weight_update(self) -> bool:
        """Drop the open session; the current weights go on serving."""

    def get_weight_version(self) -> WeightVersion:
        """The version of the weights serving now (an int or a string label)."""

    def update_weight_version(self, new_version: WeightVersion) -> dict:
        """Rename the weights serving now (SGLang's ``update_weight_version``; the weights
        and the prefix cache stay): ``{"weight_version", "previous_version"}``. A refused
        version raises VersionRefused and changes nothing."""

    # ---- LoRA adapters (engine/weights/lora_slots.py)
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """Read the PEFT adapter at ``lora_path`` and serve it as ``lora_name`` (requests
        name it in ``lora_path``); ``{"lora_name", "lora_path", "rank", "loaded_adapters"}``.
        ValueError naming the field: LoRA off, a taken name, a rank above max_lora_rank,
        a missing or unsupported adapter (nothing changes then)."""

    def update_lora_adapter(self, lora_name: str, lora_path: str | None = None,
                            named_tensors=None,
                            lora_version: WeightVersion | None = None) -> dict:
        """Update loaded adapter ``lora_name`` in place (RL with a LoRA policy) in a one-call
        weight-update session: its weights from a PEFT folder (``lora_path``, all of them; a
        .safetensors file: the tensors it holds) or PEFT-named tensors (any subset),
        served from the next step on under ``lora_version`` (its own version, the base
        weights' rules; None: the next int). Only this adapter's outputs change; its old KV
        is never matched again; running requests with it carry the new version in
        ``meta_info.lora_version``. ``{"lora_name", "lora_version", "previous_version",
        "running_requests", "phases"}``; ValueError (nothing changes) for an unknown adapter,
        a weight that does not fit or an open session, VersionRefused for a refused version."""

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """Stop serving adapter ``lora_name`` (its slot and host copy go; its cached KV is
        never matched again); ``{"lora_name", "loaded_adapters"}``. ValueError for an
        unknown adapter or one that queued or running requests use."""


def verbs_of(protocol: type) -> list[str]:
    """The verb names a protocol declares, in declaration order."""
    return [name for name in vars(protocol)
            if not name.startswith("_") and callable(getattr(protocol, name))]


CONTROL_VERBS = verbs_of(EngineControl)
# Engine verbs a fleet does not apply one by one: a fleet update drives the weight steps
# itself (``update_weights``), requests are aborted where they run, snapshots are read per
# worker (``load``), and faults are attached per engine by tests.
ENGINE_ONLY_VERBS = frozenset({
    "abort", "snapshot", "attach_fault_injector", "begin_weight_update",
    "update_weights_from_tensor", "update_weights_from_disk",
    "update_weights_from_distributed", "prepare_weight_update", "commit_weight_update",
    "rollback_weight_update", "finish_weight_update", "end_weight_update",
    "abort_weight_update"})
