"""radixray.Engine: the in-process engine (no Ray), with a background scheduler thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from radixray.engine.config import EngineConfig
from radixray.engine.detokenizer import IncrementalDetokenizer
from radixray.engine.ep.eplb import ExpertBalancer, request_rebalance
from radixray.engine.executor.model_runner import ModelRunner
from radixray.engine.faults import ENGINE_FAILED_STATUS, EngineFailed, EngineHealth
from radixray.engine.grammar.spec import no_structured_output
from radixray.engine.inputs import Limits, build_requests
from radixray.engine.mem_cache.memory_saver import MemorySaver
from radixray.engine.messages import MetaInfo, RequestUpdate
from radixray.engine.request import Req
from radixray.engine.sched.inbox import AbortCommand, CallInLoop
from radixray.engine.sched.scheduler import Scheduler
from radixray.engine.stop import StopChecker, eos_token_ids
from radixray.engine.weights.loader import resolve_model
from radixray.engine.weights.session import DEFAULT_GROUP, WeightUpdater

logger = logging.getLogger(__name__)


class StepChannel:
    """Carries one list of updates per scheduler step to an asyncio queue in another thread.

    Several requests share a channel (one per serving client), so a step with
    many running requests costs one hand-off instead of one per request. A message
    is a list of :class:`~radixray.engine.messages.RequestUpdate` (one step), or a
    control message of the channel's owner.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop = loop
        self.queue = queue

    def push(self, updates: list[RequestUpdate] | object) -> bool:
        """Hand one message (a step's updates, or a control dict) to the reader's loop;
        False when that loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, updates)
            return True
        except RuntimeError:
            return False


@dataclass
class _Subscriber:
    """Where one request's progress goes: an event (blocking call), an asyncio queue
    (one stream) or a shared StepChannel (serving)."""

    done: threading.Event = field(default_factory=threading.Event)
    loop: asyncio.AbstractEventLoop | None = None
    queue: asyncio.Queue | None = None
    channel: StepChannel | None = None


def take_update(req: Req, weight_version: int = 0) -> RequestUpdate:
    """The output ``req`` produced since its last update (and its MetaInfo once finished;
    ``weight_version``: the engine's current one)."""
    update = RequestUpdate(req.rid, req.output_ids[req.emitted:])
    if req.sampling.return_logprob:
        update.logprobs = req.output_logprobs[req.emitted:]
        if req.sampling.top_logprobs_num:
            update.top_logprobs = req.output_top_logprobs[req.emitted:]
    req.emitted = len(req.output_ids)
    if req.finished:
        update.meta = MetaInfo.of(req, weight_version)
        if req.finish_reason.type == "error":
            update.error, update.status = req.finish_reason.message, req.finish_reason.status
    return update


class Engine:
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
                 **options):
        """``worker_id`` names this engine to a disaggregated peer, ``kv_transport`` replaces
        its Mooncake transport (tests); ``ep_rank`` / ``ep_init_method``: its EP rendezvous."""
        self.config = EngineConfig.from_kwargs(model=model, **options)
        source = resolve_model(self.config.model)
        self.tokenizer = source.tokenizer
        self.hf_config = source.config
        self.runner = ModelRunner(self.config, source, ep_rank, ep_init_method)
        stop_checker = StopChecker(self.tokenizer, eos_token_ids(self.tokenizer, source.config))
        self.scheduler = Scheduler(self.config, self.runner, stop_checker, self._on_output)
        self.limits = Limits(self.runner.vocab_size, self.runner.context_len,
                             self.runner.max_total_tokens, moe=self.runner.routes_experts,
                             no_structured_output=no_structured_output(self.config))
        self._subs: dict[str, _Subscriber] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._failure_listeners: list = []
        self.scheduler.on_failed = self._on_failed
        self.memory = MemorySaver(self.runner, self.scheduler)
        self.pd = None  # the prefill or decode half of a pair (engine/disaggregation/)
        if self.config.disaggregation_mode is not None:
            from radixray.engine.disaggregation.setup import PDLink
            self.pd = PDLink(self.config.disaggregation_mode, worker_id, self.scheduler,
                             self.runner.kv_pool, self.config, kv_transport)
        self.weights = WeightUpdater(self.runner, self.scheduler, self.memory)
        self.runner.eplb = ExpertBalancer.create(self.config, self.runner.model,
                                                 self.weights.exclusive, self.runner.ep)
        self._thread = threading.Thread(target=self._loop, name="radixray-scheduler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # OpenMP's thread count is per thread: a new thread starts from OMP_NUM_THREADS
        # (Ray sets it to the actor's CPU count, often 1), not from the count the
        # model runner chose on the constructing thread. Set it here, where the
        # forward passes run.
        torch.set_num_threads(self.runner.num_threads)
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

    # ---- output path (scheduler thread) ----------------------------------------------
    def _on_output(self, reqs: list[Req]) -> None:
        """Hand each request's new output to its subscriber. With ``stream_interval`` N > 1 a
        running request's tokens are held until N of them wait (the first token and the
        finish always go at once), which cuts per-token work downstream by about N."""
        batches: dict[int, tuple[StepChannel, list[dict], list[Req]]] = {}
        interval = self.config.stream_interval
        for req in reqs:
            sub = self._subs.get(req.rid)
            if sub is None:
                continue
            if interval > 1 and not req.finished and req.emitted \
                    and len(req.output_ids) - req.emitted < interval:
                continue
            if sub.channel is not None:
                entry = batches.setdefault(id(sub.channel), (sub.channel, [], []))
                entry[1].append(take_update(req, self.weights.version))
                entry[2].append(req)
                if req.finished:
                    with self._lock:
                        self._subs.pop(req.rid, None)
                continue
            if sub.queue is not None:
                chunk = take_update(req, self.weights.version)
                try:
                    sub.loop.call_soon_threadsafe(sub.queue.put_nowait, chunk)
                except RuntimeError:  # the reader's event loop is closed: nobody reads on
                    self._drop_readerless([req])
                    continue
            if req.finished:
                sub.done.set()
        for channel, updates, sent in batches.values():
            if not channel.push(updates):
                self._drop_readerless(sent)

    def _drop_readerless(self, reqs: list[Req]) -> None:
        """Nobody reads these requests' output any more: forget them and abort the unfinished."""
        with self._lock:
            for req in reqs:
                self._subs.pop(req.rid, None)
        for req in reqs:
            if not req.finished:
                self.scheduler.submit(AbortCommand(req.rid))

    # ---- public API ------------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, rid=None, priority=None,
                 bootstrap=None):
        """Run prompts to completion. One prompt -> a dict; a list of prompts -> a list of dicts.

        Each dict has ``text``, ``output_ids``, ``meta_info`` (see :class:`MetaInfo`)
        and, when requested, ``output_token_logprobs`` / ``output_top_logprobs``.
        Raises ValueError naming the bad field before anything is scheduled.
        ``bootstrap``: on a prefill or decode engine, one PDBootstrap per prompt (or one).
        """
        reqs, is_batch = build_requests(prompt, input_ids, sampling_params, self.tokenizer,
                                        self.limits, rid, priority)
        attach_bootstrap(reqs, bootstrap)
        subs = self._submit(reqs)
        for sub in subs:
            while not sub.done.wait(1.0):
                self._raise_if_dead()
        for req in reqs:
            _raise_if_engine_failed(req, self.scheduler)
        results = [self._result(r) for r in reqs]
        return results if is_batch else results[0]

    async def generate_stream(self, prompt=None, sampling_params=None, input_ids=None, rid=None,
                              priority=None) -> AsyncIterator[dict]:
        """Yield ``{"text": delta, "output_ids": new ids, "finished": bool, "meta_info"?}`` chunks.

        Text is released incrementally: incomplete UTF-8 characters and text that
        may still become a stop string are held back. Closing the generator early
        aborts the request.
        """
        reqs, is_batch = build_requests(prompt, input_ids, sampling_params, self.tokenizer,
                                        self.limits, rid, priority)
        if is_batch:
            raise ValueError("generate_stream takes one prompt")
        req = reqs[0]
        sub = _Subscriber(loop=asyncio.get_running_loop(), queue=asyncio.Queue())
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                       skip_special_tokens=req.sampling.skip_special_tokens,
                                       stop=req.sampling.stop)
        self._submit([req], [sub])
        finished = False
        try:
            while not finished:
                update = await sub.queue.get()
                finished = update.meta is not None
                text = detok.add_tokens(update.ids)
                if finished and not detok.stopped:
                    text += detok.finish()
                chunk = {"text": text, "output_ids": update.ids, "finished": finished}
                if update.logprobs is not None:
                    chunk["output_token_logprobs"] = update.logprobs
                if finished:
                    _raise_if_engine_failed(req, self.scheduler)
                    chunk["meta_info"] = update.meta.to_json()
                yield chunk
        finally:
            with self._lock:
                self._subs.pop(req.rid, None)
            if not finished:
                self.scheduler.submit(AbortCommand(req.rid))

    def submit_to_channel(self, reqs: list[Req], channel: StepChannel) -> None:
        """Schedule already-validated requests whose output goes to ``channel`` (serving path)."""
        self._submit(reqs, [_Subscriber(channel=channel) for _ in reqs])

    def warm_up(self, prompt: str) -> dict:
        """One greedy token of ``prompt`` run here, whatever this engine's role."""
        reqs, _ = build_requests(prompt, None, {"max_new_tokens": 1, "temperature": 0.0},
                                 self.tokenizer, self.limits)
        sub = self._submit(reqs, local=True)[0]
        while not sub.done.wait(1.0):
            self._raise_if_dead()
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

    def inject_faults(self, count: int, message: str = "injected fault") -> None:
        """Test hook: the next ``count`` forward passes raise (-1: every one; 0: stop)."""
        self.scheduler.faults.inject(count, message)

    def abort(self, rid: str) -> None:
        """Abort a request by id; its KV returns to the pool or the cache."""
        self.scheduler.submit(AbortCommand(rid))

    def call_in_loop(self, fn, timeout: float = 60.0):
        """Run ``fn(scheduler)`` on the scheduler thread between steps and return its result."""
        future: Future = Future()
        self.scheduler.submit(CallInLoop(fn, future))
        return future.result(timeout)

    def pause_generation(self, mode: str = "abort") -> int:
        """Stop scheduling: ``abort`` ends every request, ``retract`` sends running ones back
        to the queue (KV freed), ``in_place`` holds them with their KV (see engine/sched/pause.py).
        New requests wait until :meth:`continue_generation`. Returns how many requests the
        mode touched; ValueError names a bad mode."""
        return self.call_in_loop(lambda s: s.pause(mode))

    def continue_generation(self) -> bool:
        """Schedule again after :meth:`pause_generation`; False if it was not paused."""
        return self.call_in_loop(lambda s: s.resume())

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Give back the memory of ``tags`` (``kv_cache``, ``weights``; None: both) while
        generation is paused (see engine/mem_cache/memory_saver.py); returns what was freed."""
        self.check_memory_release(tags)
        return self.call_in_loop(lambda s: self.memory.release(tags), timeout=600)

    def check_memory_release(self, tags: list[str] | None) -> None:
        """ValueError when ``tags`` cannot be released here: a prefill or decode engine's KV
        pool is registered with its transfer engine, and peers write into it by address."""
        if self.pd is not None and (tags is None or "kv_cache" in tags):
            raise ValueError(f"release_memory_occupation: the KV pool of a "
                             f"{self.pd.mode} worker is registered for KV transfer and cannot "
                             f"be released; release tags=['weights'] only")

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        """Take back the memory of released ``tags`` (None: every released tag)."""
        return self.call_in_loop(lambda s: self.memory.resume(tags), timeout=600)

    # ---- weight updates (engine/weights/session.py) ------------------------------------
    def begin_weight_update(self) -> None:
        """Open a weight-update session (ValueError if one is open)."""
        self.weights.begin()

    def update_weights_from_tensor(self, named_tensors) -> dict:
        """Stage Hugging Face-named tensors (pairs or a dict) in the open session."""
        return self.weights.update_from_tensor(named_tensors)

    def update_weights_from_disk(self, model_path: str) -> dict:
        """Stage every tensor of a Hugging Face folder's (or one file's) safetensors."""
        return self.weights.update_from_disk(model_path)

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                  world_size: int, group_name: str = DEFAULT_GROUP,
                                  backend: str = "gloo", timeout_s: float = 600.0) -> dict:
        """Join the trainer's torch.distributed group as rank ``rank_offset`` (blocks until all
        ranks joined, at most ``timeout_s``; the same timeout bounds each broadcast)."""
        return self.weights.init_group(master_address, master_port, rank_offset, world_size,
                                       group_name, backend, timeout_s)

    def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        """Leave the trainer's group (False if not in it); a new group may be joined after."""
        return self.weights.destroy_group(group_name)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = DEFAULT_GROUP) -> dict:
        """Receive the trainer's broadcast of ``names`` (in order) into the open session."""
        return self.weights.update_from_distributed(names, dtypes, shapes, group_name)

    def end_weight_update(self, weight_version: int) -> dict:
        """Make the session's weights serve from the next step on, as ``weight_version``
        (greater than the current one). Returns the version and the time of each phase."""
        self.weights.prepare(weight_version)
        try:
            self.call_in_loop(self.weights.commit)
        except BaseException:
            self.weights.abort()
            raise
        return self.weights.finish()

    def abort_weight_update(self) -> bool:
        """Drop the open session; the current weights go on serving."""
        return self.weights.abort()

    def get_weight_version(self) -> int:
        return self.weights.version

    # ---- expert placement (engine/ep/eplb.py) ---------------------------------------------
    def rebalance_experts(self, timeout: float = 600.0) -> dict:
        """Rebalance the MoE model's expert copies for the last ``eplb_window_size`` forward
        passes' load (with every rank of an EP group); the ``RebalanceReport`` as a dict.
        Waits while a weight-update session is open (at most ``timeout`` s: TimeoutError);
        ValueError without ``enable_eplb`` or while the weights are released."""
        return request_rebalance(self.runner.eplb, self.call_in_loop, self.weights, timeout)

    def flush_cache(self) -> bool:
        """Drop all cached prefixes. False while requests are running (nothing changes then)."""
        return self.call_in_loop(lambda s: s.kv.flush_cache())

    def check_kv_conservation(self) -> dict:
        """Assert free + request-held + cache-held == pool size now; return the four numbers."""
        def check(s: Scheduler) -> dict:
            s.check_kv_conservation()
            return {"free": s.kv.allocator.available_size(), "cached": s.kv.cache.total_size(),
                    "pool": s.kv.pool_size, "running": s.num_running, "waiting": s.num_waiting}
        return self.call_in_loop(check)

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ---- helpers ---------------------------------------------------------------------
    def _submit(self, reqs: list[Req], subs: list[_Subscriber] | None = None,
                local: bool = False) -> list[_Subscriber]:
        """Subscribe to each request's output and schedule it.

        A rid still in use, a shut-down engine, or (on a prefill or decode engine) a request
        without a bootstrap room is an error, and nothing changes then. ``local``: run here
        whatever the role (warm-up).
        """
        subs = subs or [_Subscriber() for _ in reqs]
        self._raise_if_dead()
        if self.pd is not None and not local:
            for req in reqs:
                self.pd.check_request(req.pd)
        with self._lock:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            busy = [r.rid for r in reqs if r.rid in self._subs]
            if busy:
                raise ValueError(f"rid {busy[0]!r} is already in use by an unfinished request")
            for req, sub in zip(reqs, subs):
                self._subs[req.rid] = sub
            self.scheduler.submit(reqs)
        return subs

    def _raise_if_dead(self) -> None:
        """EngineFailed when the engine failed or its scheduler thread is gone."""
        health = self.health()
        if not health.ok and not self._stopping:
            raise EngineFailed(f"the engine cannot serve: {health.reason}")

    def _result(self, req: Req) -> dict:
        with self._lock:
            self._subs.pop(req.rid, None)
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                       skip_special_tokens=req.sampling.skip_special_tokens,
                                       stop=req.sampling.stop)
        text = detok.add_tokens(req.output_ids)
        if not detok.stopped:
            text += detok.finish()
        out = {"text": text, "output_ids": list(req.output_ids),
               "meta_info": MetaInfo.of(req, self.weights.version).to_json()}
        if req.sampling.return_logprob:
            out["output_token_logprobs"] = list(req.output_logprobs)
            if req.sampling.top_logprobs_num:
                out["output_top_logprobs"] = list(req.output_top_logprobs)
        return out


def attach_bootstrap(reqs: list[Req], bootstrap) -> None:
    """Give each request its PDBootstrap (one for all, or a list with one per request)."""
    if bootstrap is None:
        return
    items = bootstrap if isinstance(bootstrap, list) else [bootstrap] * len(reqs)
    if len(items) != len(reqs):
        raise ValueError(f"bootstrap: {len(items)} given for {len(reqs)} prompts")
    if len({b.room for b in items}) != len(items):
        raise ValueError("bootstrap: every prompt needs its own bootstrap room")
    for req, b in zip(reqs, items):
        req.pd = b


def _raise_if_engine_failed(req: Req, scheduler: Scheduler) -> None:
    """A request ended because the whole engine failed: raise that (a batch fault or a
    failed disaggregated transfer is not raised; it is the request's own result, finish
    reason ``error``)."""
    reason = req.finish_reason
    if reason is not None and reason.type == "error" and reason.status == ENGINE_FAILED_STATUS \
            and scheduler.faults.failed is not None:
        raise EngineFailed(reason.message)
