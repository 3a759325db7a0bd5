"""radixray.Engine: the in-process engine (no Ray), with a background scheduler thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future

import torch

from radixray.engine.allocator import keep_freed_memory
from radixray.engine.compute_thread import start_compute_thread
from radixray.engine.config import EngineConfig
from radixray.engine.control import (
    LONG_LOOP_TIMEOUT_S,
    EngineSnapshot,
    ForwardTimer,
    ModelFacts,
    scheduler_verb,
)
from radixray.engine.ep.eplb import ExpertBalancer, request_rebalance
from radixray.engine.executor.model_runner import ModelRunner
from radixray.engine.executor.prompt_logprobs import no_prompt_logprobs
from radixray.engine.faults import EngineFailed, EngineHealth, FaultInjector, raise_if_engine_failed
from radixray.engine.grammar.spec import no_structured_output
from radixray.engine.inputs import Limits, attach_bootstrap, build_requests
from radixray.engine.mem_cache.memory_saver import MemorySaver
from radixray.engine.pd_verbs import PDVerbs
from radixray.engine.request import Req
from radixray.engine.sched.inbox import AbortCommand, CallInLoop
from radixray.engine.sched.scheduler import Scheduler
from radixray.engine.stop import StopChecker, eos_token_ids
from radixray.engine.streams import (
    StepChannel,
    StreamChunks,
    Subscriber,
    Subscribers,
    finished_result,
)
from radixray.engine.weights.adapter_stage import update_adapter
from radixray.engine.weights.loader import resolve_model
from radixray.engine.weights.lora_slots import read_adapter_for, register_adapter, unload_adapter
from radixray.engine.weights.session import DEFAULT_GROUP, WeightUpdater
from radixray.engine.weights.version import WeightVersion

logger = logging.getLogger(__name__)

ABORT_REQUEST_MESSAGE = "aborted by abort_request"


class Engine(PDVerbs):
    """Serve one model in this process.

    ``Engine(model="default", max_total_tokens=..., ...)`` accepts every field of
    :class:`EngineConfig`. ``generate`` blocks until its prompts finish;
    ``generate_stream`` yields chunks as tokens arrive. Both may be called from
    many threads or tasks at once: every call joins the same continuous batch.

    A request whose batch hit a fault finishes with finish reason ``error``; once
    the engine has failed (repeated faults, or its scheduler thread died) both
    raise :class:`EngineFailed` instead of waiting (see :meth:`health`).
    """

    def __init__(self, model: str = "default", *, worker_id: str = "engine",
                 kv_transport=None, ep_rank: int = 0, ep_init_method: str | None = None,
                 tp_init_method: str | None = None, **options):
        """``worker_id`` names this engine to a disaggregated peer, ``kv_transport`` replaces
        its Mooncake transport (tests); ``ep_rank`` / ``ep_init_method`` / ``tp_init_method``:
        its group rendezvous (TP: as rank 0; None starts local follower processes)."""
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.worker_id = worker_id
        keep_freed_memory()  # before the first pass allocates (engine/allocator.py)
        # built and run on one thread (engine/compute_thread.py)
        self._thread = start_compute_thread(
            lambda: self._build(kv_transport, ep_rank, ep_init_method, tp_init_method),
            self._loop, "radixray-scheduler", torch.get_num_threads())

    def _build(self, kv_transport, ep_rank: int, ep_init_method: str | None,
               tp_init_method: str | None) -> None:
        """Everything the engine holds, built on its scheduler thread."""
        source = resolve_model(self.config.model)
        self.tokenizer = source.tokenizer
        self.hf_config = source.config
        self.runner = ModelRunner(self.config, source, ep_rank, ep_init_method, 0, tp_init_method)
        stop_checker = StopChecker(self.tokenizer, eos_token_ids(self.tokenizer, source.config))
        self._subs = Subscribers(self.config.stream_interval, lambda: self.weights.version,
                                 self.abort)
        self.scheduler = Scheduler(self.config, self.runner, stop_checker, self._subs.deliver)
        # what build_requests checks a lora_path against (LoraSlots; None without LoRA)
        self.adapters = self.runner.lora
        self.limits = Limits(self.runner.vocab_size, self.runner.context_len,
                             self.runner.max_total_tokens, moe=self.runner.routes_experts,
                             no_structured_output=no_structured_output(self.config),
                             no_prompt_logprobs=no_prompt_logprobs(self.config))
        self._lock = threading.Lock()
        self._faults: FaultInjector | None = None  # tests only (attach_fault_injector)
        self._stopping = False
        self._failure_listeners: list = []
        self.scheduler.on_failed = self._on_failed
        self.memory = MemorySaver(self.runner, self.scheduler)
        self.pd = None  # the prefill or decode half of a pair (engine/disaggregation/)
        if self.config.disaggregation_mode is not None:
            from radixray.engine.disaggregation.setup import PDLink
            self.pd = PDLink(self.config.disaggregation_mode, self.worker_id, self.scheduler,
                             self.runner, self.config, kv_transport)
        self.weights = WeightUpdater(self.runner, self.scheduler, self.memory)
        self.runner.eplb = ExpertBalancer.create(self.config, self.runner.model,
                                                 self.weights.exclusive, self.runner.ep)

    def _loop(self) -> None:
        try:
            self.scheduler.run_forever(lambda: self._stopping)
        except BaseException as exc:  # noqa: BLE001 - run_forever contains Exceptions; the rest
            logger.exception("scheduler thread died")  # ends the thread (logged once, here)
            self.scheduler.fail_engine(f"the scheduler thread died: {type(exc).__name__}: {exc}")
        finally:
            self.scheduler.close()

    def _on_failed(self, reason: str) -> None:
        """Scheduler thread: the engine failed; tell every listener (see :meth:`on_failure`)."""
        with self._lock:
            listeners, self._failure_listeners = self._failure_listeners, []
        for fn in listeners:
            try:
                fn(reason)
            except Exception:  # noqa: BLE001 - one listener must not silence the others
                logger.exception("engine failure listener raised")

    # ---- public API ------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, rid=None, priority=None,
                 bootstrap=None, lora_path=None):
        """Run prompts to completion. One prompt -> a dict; a list of prompts -> a list of dicts.

        Each dict has ``text``, ``output_ids``, ``meta_info`` (see :class:`MetaInfo`)
        and, when requested, ``output_token_logprobs`` / ``input_token_logprobs`` and their
        ``*_top_logprobs`` (see :func:`~radixray.engine.streams.finished_result`).
        Raises ValueError naming the bad field before anything is scheduled.
        ``bootstrap``: on a prefill or decode engine, one PDBootstrap per prompt (or one).
        ``lora_path``: a LoRA adapter's name, for all prompts or per prompt (None: the base).
        """
        reqs, is_batch = build_requests(prompt, input_ids, sampling_params, self.tokenizer,
                                        self.limits, rid, priority, lora_path, self.adapters)
        attach_bootstrap(reqs, bootstrap)
        self._wait(self._submit(reqs))
        for req in reqs:
            raise_if_engine_failed(req, self.scheduler.faults)
        results = [self._result(r) for r in reqs]
        return results if is_batch else results[0]

    async def generate_stream(self, prompt=None, sampling_params=None, input_ids=None, rid=None,
                              priority=None, lora_path=None) -> AsyncIterator[dict]:
        """Yield ``{"text": delta, "output_ids": new ids, "finished": bool, "meta_info"?}`` chunks
        (see :class:`~radixray.engine.streams.StreamChunks`). Closing the generator early
        aborts the request."""
        reqs, is_batch = build_requests(prompt, input_ids, sampling_params, self.tokenizer,
                                        self.limits, rid, priority, lora_path, self.adapters)
        if is_batch:
            raise ValueError("generate_stream takes one prompt")
        req = reqs[0]
        sub = Subscriber(loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        chunks = StreamChunks(self.tokenizer, req)
        self._submit([req], [sub])
        finished = False
        try:
            while not finished:
                update = await sub.queue.get()
                finished = update.meta is not None
                if finished:
                    raise_if_engine_failed(req, self.scheduler.faults)
                yield chunks.of(update)
        finally:
            self._subs.discard(req.rid)
            if not finished:
                self.abort(req.rid)

    def submit_to_channel(self, reqs: list[Req], channel: StepChannel) -> None:
        """Schedule already-validated requests whose output goes to ``channel`` (serving path)."""
        self._submit(reqs, [Subscriber(channel=channel) for _ in reqs])

    def warm_up(self, prompt: str) -> dict:
        """One greedy token of ``prompt`` run here, whatever this engine's role."""
        reqs, _ = build_requests(prompt, None, {"max_new_tokens": 1, "temperature": 0.0},
                                 self.tokenizer, self.limits)
        self._wait(self._submit(reqs, local=True))
        return self._result(reqs[0])

    @property
    def scheduler_thread_id(self) -> int | None:
        """The kernel id of the scheduler thread (the one that runs the forward passes)."""
        return self._thread.native_id

    def health(self) -> EngineHealth:
        """Whether the scheduler thread runs and the engine serves (thread-safe)."""
        faults = self.scheduler.faults
        return EngineHealth(alive=self._thread.is_alive(), failed=faults.failed,
                            failed_steps=faults.total,
                            consecutive_failed_steps=faults.consecutive)

    def on_failure(self, callback) -> None:
        """Call ``callback(reason)`` once when the engine fails (at once if it has); it runs
        on the scheduler thread, so it must only hand the news on."""
        with self._lock:
            failed = self.scheduler.faults.failed
            if failed is None:
                self._failure_listeners.append(callback)
        if failed is not None:
            callback(failed)

    def attach_fault_injector(self, injector: FaultInjector | None) -> None:
        """Tests only: this engine's fault points (forward passes, the KV sender, the weight
        update's prepare and commit) consult ``injector`` from now on; None detaches it."""
        self._faults = self.scheduler.faults.injector = injector
        if self.pd is not None:
            self.pd.attach_fault_injector(injector)

    def abort(self, rids: str | Sequence[str]) -> None:
        """Abort requests by id (one or several; unknown ids are ignored); their KV returns to
        the pool or the cache."""
        for rid in [rids] if isinstance(rids, str) else rids:
            self.scheduler.submit(AbortCommand(rid))

    @scheduler_verb()
    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> list[str]:
        """The verb behind POST /abort_request: see :class:`EngineControl`."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort_request: give exactly one of rid or abort_all=True")
        return self.scheduler.abort_matching(None if abort_all else rid, ABORT_REQUEST_MESSAGE)

    def num_queued(self) -> int:
        """Requests waiting for admission (the queue and the inbox not yet drained); any
        thread, an estimate while the scheduler runs."""
        return self.scheduler.num_queued()

    def call_in_loop(self, fn, timeout: float = 60.0):
        """Run ``fn(scheduler)`` on the scheduler thread between steps and return its result.
        For the engine's own parts and for tests: code outside the engine calls the typed
        verbs instead (tests/cpu/test_layering.py checks)."""
        return self._loop_future(lambda: fn(self.scheduler)).result(timeout)

    def _loop_future(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` on the scheduler thread between steps; its result (or exception)
        goes to the returned Future."""
        future: Future = Future()
        self.scheduler.submit(CallInLoop(lambda _: fn(), future))
        return future

    def submit_verb(self, verb: Callable, *args, **kwargs) -> Future:
        """Start ``verb`` (a :func:`~radixray.engine.control.scheduler_verb` of this engine,
        e.g. ``engine.flush_cache``) without waiting: its result as a Future, for async
        callers that must not hold a thread while the scheduler finishes a step."""
        body = getattr(verb, "loop_body", None)
        if body is None or getattr(verb, "__self__", None) is not self:
            raise TypeError(f"{verb!r} is not a scheduler-thread verb of this engine")
        return self._loop_future(lambda: body(self, *args, **kwargs))

    # ---- control verbs (engine/control.py declares them) ------------------------------
    @scheduler_verb()
    def pause_generation(self, mode: str = "abort") -> int:
        """The modes: engine/sched/pause.py."""
        return self.scheduler.pause(mode)

    @scheduler_verb()
    def continue_generation(self) -> bool:
        return self.scheduler.resume()

    @scheduler_verb(LONG_LOOP_TIMEOUT_S)
    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Give back the memory of ``tags`` (``kv_cache``, ``weights``; None: both) while
        generation is paused (see engine/mem_cache/memory_saver.py); returns what was freed.
        A prefill or decode engine's KV pool is registered with its transfer engine and peers
        write into it by address: releasing it there is a ValueError."""
        if self.pd is not None and (tags is None or "kv_cache" in tags):
            raise ValueError(f"release_memory_occupation: the KV pool of a "
                             f"{self.pd.mode} worker is registered for KV transfer and cannot "
                             f"be released; release tags=['weights'] only")
        return self.memory.release(tags)

    @scheduler_verb(LONG_LOOP_TIMEOUT_S)
    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Take back the memory of released ``tags`` (None: every released tag)."""
        return self.memory.resume(tags)

    @scheduler_verb()
    def flush_cache(self) -> bool:
        """Drop all cached prefixes. False while requests are running (nothing changes then)."""
        return self.scheduler.kv.flush_cache()

    @scheduler_verb()
    def check_kv_conservation(self) -> dict:
        """Assert free + request-held + cache-held == pool size now; return the four numbers
        and the running and waiting requests."""
        s = self.scheduler
        s.check_kv_conservation()
        return {"free": s.kv.allocator.available_size(), "cached": s.kv.cache.total_size(),
                "pool": s.kv.pool_size, "running": s.num_running, "waiting": s.num_waiting}

    @scheduler_verb()
    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges now, read in one go between steps (see :class:`EngineSnapshot`;
        a disaggregated engine's finished transfers are reported once)."""
        return EngineSnapshot.of(self)

    def rebalance_experts(self, timeout: float = 600.0) -> dict:
        """Rebalance the MoE model's expert copies for the last ``eplb_window_size`` forward
        passes' load (with every rank of an EP group); the ``RebalanceReport`` as a dict.
        Waits while a weight-update session is open (at most ``timeout`` s: TimeoutError);
        ValueError without ``enable_eplb`` or while the weights are released."""
        return request_rebalance(self.runner.eplb, self.call_in_loop, self.weights, timeout)

    # ---- measurement (benchmarks) ------------------------------------------------------
    def model_facts(self) -> ModelFacts:
        return self.runner.facts()

    @contextlib.contextmanager
    def profiling(self, profiler) -> Iterator:
        """Run ``profiler`` (torch.profiler) on the scheduler thread, where the steps run,
        for the ``with`` block."""
        self._loop_future(profiler.start).result(LONG_LOOP_TIMEOUT_S)
        try:
            yield profiler
        finally:
            self._loop_future(profiler.stop).result(LONG_LOOP_TIMEOUT_S)

    def time_forwards(self) -> ForwardTimer:
        """Sum the wall time of every forward pass from now on into the returned timer."""
        return ForwardTimer.around(self.runner)

    @scheduler_verb()
    def evict_cache(self, host_tier: bool = False) -> None:
        """Evict every cached prefix from the KV pool (a hierarchical cache's host tier keeps
        its copies unless ``host_tier``)."""
        kv = self.scheduler.kv
        kv.cache.evict(kv.cache.total_size())
        if host_tier:
            kv.host_cache.reset()

    @scheduler_verb()
    def retune_prefill(self, chunked_prefill_size: int, enable_mixed_chunk: bool,
                       max_itl_ms: float | None) -> None:
        """Between benchmark runs: prefill in chunks of this size, mixing or not, mixed steps
        sized by ``max_itl_ms`` (0 or None: fixed chunks), from the next step on, with the
        scheduler's counters and new-token ratio started over (its step-time model kept)."""
        self.scheduler.reconfigure(chunked_prefill_size=chunked_prefill_size,
                                   enable_mixed_chunk=enable_mixed_chunk, max_itl_ms=max_itl_ms)
        self.scheduler.reset_stats()

    # ---- weight updates (engine/weights/session.py; contracts: control.EngineControl) ----
    def begin_weight_update(self, lora_name: str | None = None) -> None:
        self.weights.begin(lora_name)

    def update_weights_from_tensor(self, named_tensors) -> dict:
        return self.weights.update_from_tensor(named_tensors)

    def update_weights_from_disk(self, model_path: str) -> dict:
        return self.weights.update_from_disk(model_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = DEFAULT_GROUP,
                                  backend: str = "gloo", timeout_s: float = 600.0) -> dict:
        """Blocks until every rank joined (at most ``timeout_s``, which also bounds each
        broadcast)."""
        return self.weights.init_group(master_address, master_port, rank_offset, world_size,
                                       group_name, backend, timeout_s)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        return self.weights.destroy_group(group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = DEFAULT_GROUP) -> dict:
        return self.weights.update_from_distributed(names, dtypes, shapes, group_name)

    def prepare_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        self._weight_fault_point("prepare")
        return self.weights.prepare(weight_version)

    @scheduler_verb(LONG_LOOP_TIMEOUT_S)
    def commit_weight_update(self) -> WeightVersion:
        self._weight_fault_point("commit")
        return self.weights.commit(self.scheduler)

    @scheduler_verb(LONG_LOOP_TIMEOUT_S)
    def rollback_weight_update(self) -> bool:
        return self.weights.rollback(self.scheduler)

    def finish_weight_update(self) -> dict:
        return self.weights.finish()

    def end_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        """Serve the session's weights from the next step on as ``weight_version`` (an int
        greater than every int served before, or a string label; None: the next int); the
        version and the time of each phase. A refused version (VersionRefused) leaves the
        session open with its staged weights, to end again with a valid version."""
        return self.weights.end(weight_version, self.call_in_loop)

    def abort_weight_update(self) -> bool:
        return self.weights.abort()

    def get_weight_version(self) -> WeightVersion:
        return self.weights.version

    @scheduler_verb()
    def update_weight_version(self, new_version: WeightVersion) -> dict:
        return self.weights.relabel(self.scheduler, new_version)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        adapter = read_adapter_for(self.adapters, lora_name, lora_path)  # off the loop
        return self.call_in_loop(lambda _: register_adapter(self.adapters, adapter))

    def update_lora_adapter(self, lora_name: str, lora_path: str | None = None,
                            named_tensors=None,
                            lora_version: WeightVersion | None = None) -> dict:
        return update_adapter(self.weights, lora_name, lora_path, named_tensors, lora_version,
                              self.call_in_loop)

    @scheduler_verb()
    def unload_lora_adapter(self, lora_name: str) -> dict:
        return unload_adapter(self.adapters, self.scheduler.held_requests(), lora_name)

    def lora_adapters(self) -> dict[str, str]:
        """The loaded LoRA adapters: name -> path (any thread)."""
        return self.adapters.adapters() if self.adapters is not None else {}

    def _weight_fault_point(self, phase: str) -> None:
        if self._faults is not None:
            self._faults.before_weight_update(phase, self.worker_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat, formatted with the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        # The template already holds any BOS/special tokens it wants.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shutdown(self) -> None:
        """Stop the scheduler; requests still unfinished end with finish_reason abort."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True  # no request is submitted after this
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            # Nobody steps the scheduler any more: end what is left, so no caller waits forever.
            self.scheduler.abort_all("engine shut down")
        self.weights.close()
        if self.pd is not None:
            self.pd.close()
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- helpers ---------------------------------------------------------------------
    def _submit(self, reqs: list[Req], subs: list[Subscriber] | None = None,
                local: bool = False) -> list[Subscriber]:
        """Subscribe to each request's output and schedule it.

        A rid still in use, a shut-down engine, or (on a prefill or decode engine) a request
        without a bootstrap room is an error, and nothing changes then. ``local``: run here
        whatever the role (warm-up).
        """
        subs = subs or [Subscriber() for _ in reqs]
        self._raise_if_dead()
        if self.pd is not None and not local:
            for req in reqs:
                self.pd.check_request(req.pd)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            self._subs.add(reqs, subs)
            self.scheduler.submit(reqs)
        return subs

    def _wait(self, subs: list[Subscriber]) -> None:
        """Block until every subscriber's request is done; EngineFailed if the engine dies."""
        for sub in subs:
            while not sub.done.wait(1.0):
                self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        """EngineFailed when the engine failed or its scheduler thread is gone."""
        health = self.health()
        if not health.ok and not self._stopping:
            raise EngineFailed(f"the engine cannot serve: {health.reason}")

    def _result(self, req: Req) -> dict:
        self._subs.discard(req.rid)
        return finished_result(req, self.tokenizer, self.weights.version)

