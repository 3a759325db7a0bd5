"""EngineWorker: one engine inside a Ray actor, speaking token ids only.

The scheduler loop runs continuously on the engine's own thread. Serving clients
(ingress replicas) open one *channel* each, one message per scheduler step with the new
tokens of all of that client's requests, over TCP (:meth:`open_socket_channel`,
cluster/step_socket.py) or a Ray streaming generator (:meth:`stream`); requests enter
with :meth:`submit`. When a channel's reader goes away (the connection closes, the
generator is cancelled, its owner dies) its unfinished requests are aborted.

Messages on a channel are either one step's list of
:class:`~radixray.engine.messages.RequestUpdate` or a
:class:`~radixray.cluster.messages.ChannelState` (on opening, and when the worker
starts or stops draining).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Sequence

from radixray.actors.lifecycle import start_owner_watch
from radixray.actors.niceness import set_niceness
from radixray.actors.tp_ranks import TPPlacement, TPRanks
from radixray.cluster.errors import WorkerDraining, WorkerQueueFull, WorkerUnavailable
from radixray.cluster.messages import ChannelState, SubmitRequest, WorkerInfo, WorkerLoad
from radixray.cluster.metrics import WorkerMetrics, worker_load
from radixray.cluster.node_address import node_ip, node_local_options
from radixray.cluster.shared_weights import SharedWeightsHandle, on_this_node, read_shared
from radixray.cluster.step_socket import SocketEndpoint, StepSocketServer, write_messages
from radixray.cluster.tensor_payload import from_payload, is_payload
from radixray.engine.control import EngineSnapshot
from radixray.engine.engine import Engine
from radixray.engine.faults import EngineFailed, EngineHealth, FaultInjector
from radixray.engine.inputs import attach_bootstrap, build_requests
from radixray.engine.messages import DEFAULT_GROUP
from radixray.engine.streams import StepChannel
from radixray.engine.weights.version import WeightVersion

logger = logging.getLogger("radixray.worker")

WARMUP_PROMPT = "The capital city of France is"


class EngineWorker:
    """Wraps :class:`radixray.Engine` for serving. Use ``ray.remote(EngineWorker)``
    (see :func:`worker_actor_class`) or call it directly in tests.

    Its control verbs are the engine's (:class:`~radixray.engine.control.EngineControl`),
    same names and parameters, as coroutines that call the Engine: scheduler-thread verbs
    are awaited (no thread held while a step runs), blocking ones run in a thread."""

    def __init__(self, engine_options: dict, worker_id: str = "worker-0", warmup: bool = True,
                 log_level: str = "INFO", cores_shared_by: int = 1, niceness: int | None = 0,
                 fleet=None, compute_nice_offset: int = 0, slo: tuple[float, float] = (2.0, 0.1),
                 max_queued_requests: int | None = None, retry_after_s: int = 1,
                 generation: int = 0, owner: tuple[str, str] | None = None,
                 tp_ranks: TPPlacement | None = None):
        """``cores_shared_by``: how many workers share this node's cores; without an explicit
        ``num_threads`` each gets an equal share (at least one thread). ``niceness``: what
        this process's threads are set to before the engine starts (see actors/niceness.py;
        None keeps Ray's). ``fleet``: the controller's handle, through which a prefill or
        decode worker finds the other worker of each pair. ``compute_nice_offset``: a
        prefill or decode worker runs its forward passes this much nicer than its other
        threads, so the KV transfer's threads get a busy core when they need it. ``slo``: the
        (TTFT, TPOT) targets in seconds that goodput is counted against.
        ``max_queued_requests``: past this many requests waiting for admission, submit
        refuses new ones (WorkerQueueFull, ``retry_after_s`` for the client).
        ``generation``: which incarnation of its slot this actor is (reported by
        :meth:`info`, so a restarted controller knows it). ``owner``: the controller's
        (name, namespace); the worker stops itself once it is gone for good
        (actors/lifecycle.py). ``tp_ranks``: with ``tp_size`` > 1, where the follower ranks'
        actors go (actors/tp_ranks.py); None starts them as processes beside this one."""
        logging.basicConfig(level=log_level.upper(), format="[%(asctime)s] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S")
        constructed = time.perf_counter()
        if niceness is not None:
            self._set_niceness(niceness)
        options = dict(engine_options)
        if not options.get("num_threads"):
            # Ray pins OMP_NUM_THREADS to the actor's CPU count; the forward pass wants the
            # cores, split evenly between the workers placed on this node and the ranks of
            # each (a tensor-parallel worker's ranks share the node too, unless spread).
            ranks = max(1, cores_shared_by) * options.get("tp_size", 1)
            options["num_threads"] = max(1, len(os.sched_getaffinity(0)) // ranks)
        self._tp_ranks = None
        if tp_ranks is not None and options.get("tp_size", 1) > 1:
            self._tp_ranks = TPRanks(tp_ranks, options, worker_id, log_level)
            options["tp_init_method"] = self._tp_ranks.init_method
        self.worker_id = worker_id
        self._warned_remote_shared = False  # logged once: weights via the object store
        self.generation = generation
        try:
            self.engine = Engine(worker_id=worker_id, **node_local_options(options))
        except BaseException:
            if self._tp_ranks is not None:
                self._tp_ranks.stop(wait_s=0)
            raise
        self.role = options.get("disaggregation_mode") or "unified"
        self._outbox = None
        paired = self.role != "unified"
        if paired:
            from radixray.actors.pd_outbox import PDOutbox
            if fleet is None:
                raise ValueError(f"a {self.role} worker needs the fleet's controller handle")
            self._outbox = PDOutbox(fleet, self.engine.pd_undeliverable)
            self.engine.connect_pd_outbox(self._outbox)
        if niceness is not None:
            self._set_niceness(niceness)  # threads the engine started meanwhile
        if paired and compute_nice_offset:
            self._lower_compute_priority(compute_nice_offset)
        self.metrics = WorkerMetrics(worker_id, *slo)
        self.max_queued_requests, self.retry_after_s = max_queued_requests, retry_after_s
        self.pd_metrics = None
        if paired:
            from radixray.cluster.pd_metrics import PDMetrics
            self.pd_metrics = PDMetrics(worker_id, self.role)
        self.draining = False
        self._channels: dict[str, tuple[StepChannel, set[str]]] = {}
        # the TCP channels' listener (it listens from the first offer on)
        self._sockets = StepSocketServer(node_ip() or "127.0.0.1", self._serve_socket)
        self.started_at = time.time()
        if warmup:
            t0 = time.perf_counter()
            out = self.engine.warm_up(WARMUP_PROMPT)
            reason = out["meta_info"]["finish_reason"]
            if reason["type"] == "error":  # the model cannot serve one token: do not start
                raise RuntimeError(f"worker {worker_id} warm-up failed: {reason['message']}")
            logger.info("worker %s warmed up in %.2f s", worker_id, time.perf_counter() - t0)
        gc.collect()
        gc.freeze()  # long-lived objects leave the collector's generations: no pauses scanning them
        self.startup_seconds = time.perf_counter() - constructed
        self._owner_watch = start_owner_watch(owner, f"worker {worker_id}",
                                              on_orphaned=self.shutdown)
        logger.info("worker %s ready", worker_id)

    def _lower_compute_priority(self, offset: int) -> None:
        tid = self.engine.scheduler_thread_id
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid) + offset
            os.setpriority(os.PRIO_PROCESS, tid, min(nice, 19))
            logger.info("worker %s: forward passes at niceness %d (KV transfer threads keep "
                        "theirs)", self.worker_id, min(nice, 19))
        except OSError as exc:
            logger.warning("worker %s: cannot lower the scheduler thread's priority: %s",
                           self.worker_id, exc)

    @staticmethod
    def _set_niceness(target: int) -> None:
        changed, error = set_niceness(target)
        if error:
            logger.warning("EngineWorker: %s", error)
        elif changed:
            logger.info("EngineWorker: %d threads set to niceness %d", changed, target)

    # ---- serving -----------------------------------------------------------------
    async def stream(self, channel_id: str):
        """Open channel ``channel_id`` and yield its messages until the reader goes away
        (a Ray streaming generator; :meth:`open_socket_channel` is the TCP way)."""
        messages = self._channel(channel_id)
        try:
            async for msg in messages:
                yield msg
        finally:
            await messages.aclose()

    async def open_socket_channel(self, channel_id: str) -> SocketEndpoint:
        """Offer channel ``channel_id`` over TCP (cluster/step_socket.py): where to connect
        and the one-time token. The channel opens when the reader connects with it and
        lasts until either end closes the connection."""
        return await self._sockets.offer(channel_id)

    async def _serve_socket(self, channel_id: str, reader, writer) -> None:
        await write_messages(self._channel(channel_id), reader, writer)  # until either closes

    async def _channel(self, channel_id: str):
        """Channel ``channel_id``'s messages: the hello, then each step's, until closed (its
        unfinished requests are aborted then)."""
        queue: asyncio.Queue = asyncio.Queue()
        channel = StepChannel(asyncio.get_running_loop(), queue)
        rids: set[str] = set()
        self._channels[channel_id] = (channel, rids)
        try:
            yield ChannelState(self.worker_id, self.draining)
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                if isinstance(msg, list):
                    self.metrics.observe(msg)
                    for u in msg:
                        if u.finished:
                            rids.discard(u.rid)
                yield msg
        finally:
            self._channels.pop(channel_id, None)
            self.engine.abort(list(rids))
            for rid in rids:
                self.metrics.forget(rid)
            if rids:
                logger.info("channel %s closed: aborted %d unfinished request(s)", channel_id,
                            len(rids))

    async def submit(self, channel_id: str, requests: list[SubmitRequest]) -> None:
        """Validate and schedule requests; output goes to channel ``channel_id``.

        Raises ValueError naming the bad field (nothing is scheduled then),
        WorkerDraining, or WorkerUnavailable once the engine failed.
        """
        if self.draining:
            raise WorkerDraining(f"worker {self.worker_id} is draining and takes no new requests")
        entry = self._channels.get(channel_id)
        if entry is None:
            raise RuntimeError(f"channel {channel_id!r} is not open; call stream() first")
        self._check_queue(len(requests))
        reqs = []
        for r in requests:
            built, _ = build_requests(None, r.input_ids, r.sampling_params,
                                      self.engine.tokenizer, self.engine.limits, r.rid,
                                      r.priority, r.lora_path, self.engine.adapters)
            attach_bootstrap(built, r.bootstrap)
            reqs.extend(built)
        channel, rids = entry
        try:
            self.engine.submit_to_channel(reqs, channel)
        except EngineFailed as exc:
            raise WorkerUnavailable(f"engine worker {self.worker_id}: {exc}") from None
        rids.update(r.rid for r in reqs)

    def _check_queue(self, incoming: int) -> None:
        """WorkerQueueFull when the requests waiting for admission (the scheduler's queue
        and its inbox not yet drained) would pass server.max_queued_requests."""
        limit = self.max_queued_requests
        if limit is None:
            return
        queued = self.engine.num_queued()
        if queued + incoming > limit:
            raise WorkerQueueFull(
                f"worker {self.worker_id} has {queued} requests waiting for admission "
                f"(server.max_queued_requests={limit}); retry in {self.retry_after_s} s",
                self.retry_after_s)

    async def abort(self, rids: str | Sequence[str]) -> None:
        self.engine.abort(rids)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> list[str]:
        return await self._later(self.engine.abort_request, rid, abort_all)

    # ---- control -------------------------------------------------------------------
    async def _later(self, verb, *args):
        """Await a scheduler-thread verb of the engine without blocking this actor's loop."""
        return await asyncio.wrap_future(self.engine.submit_verb(verb, *args))

    async def info(self) -> WorkerInfo:
        """Static facts the ingress needs: limits, model path, worker id."""
        limits = self.engine.limits
        endpoint = self.engine.pd_endpoint()
        return WorkerInfo(self.worker_id, self.engine.config.model, limits.context_len,
                          limits.vocab_size, limits.max_total_tokens, self.draining, self.role,
                          endpoint.session if endpoint else None, endpoint, self.generation,
                          self.started_at, self.engine.get_weight_version(), os.getpid(),
                          node_ip(), await self._tp_places())

    async def _tp_places(self) -> list[dict]:
        """Every rank's node address and process id (one entry, rank 0, without TP)."""
        ranks = [{"rank": 0, "node_ip": node_ip(), "pid": os.getpid()}]
        if self._tp_ranks is not None:
            ranks += await asyncio.to_thread(self._tp_ranks.where)
        return ranks

    # ---- prefill-decode disaggregation (engine/disaggregation/, actors/pd_outbox.py) -----
    async def pd_deliver(self, message) -> None:
        """A room message from the other worker of a pair."""
        self.engine.pd_deliver(message)

    async def pd_status(self) -> dict:
        """Rooms of this worker's side by state, and whether a test stall holds the sender."""
        return await self._later(self.engine.pd_status)

    async def pd_probe(self, decode_worker: str, endpoint) -> float:
        """Handshake (prefill worker): write every rank's padding slot into ``decode_worker``'s
        (its ``endpoint``) over the transport, every layer; returns the seconds it took."""
        return await asyncio.to_thread(self.engine.pd_probe, endpoint)

    async def snapshot(self) -> EngineSnapshot:
        return await self._later(self.engine.snapshot)

    async def load(self) -> WorkerLoad:
        """Running / queued requests, KV usage, weight version and released memory now."""
        snap = await self.snapshot()
        if snap.pd is not None:
            self.pd_metrics.observe(snap.pd)
        return worker_load(snap, role=self.role, startup_seconds=self.startup_seconds,
                           inflight=self.num_inflight(), **self.metrics.latency)

    def num_inflight(self) -> int:
        return sum(len(rids) for _, rids in self._channels.values())

    async def inflight_rids(self) -> list[str]:
        return sorted(rid for _, rids in self._channels.values() for rid in rids)

    async def ping(self) -> EngineHealth:
        """Liveness of the scheduler, not only of this actor: whether its thread runs and the
        engine serves. Answered without waiting for a step, so a long forward pass does not
        make a healthy worker look dead."""
        health = self.engine.health()
        lost = self._tp_ranks.dead() if self._tp_ranks is not None else None
        if lost and health.failed is None:
            return dataclasses.replace(health, failed=lost)
        return health

    async def wait_until_failed(self) -> str:
        """Return (with the reason) once the engine fails; the controller keeps one call
        open per worker, so a failed scheduler is replaced at once instead of at a ping."""
        loop = asyncio.get_running_loop()
        failed: asyncio.Future = loop.create_future()

        def tell(reason: str) -> None:  # scheduler thread
            loop.call_soon_threadsafe(lambda: failed.done() or failed.set_result(reason))
        self.engine.on_failure(tell)
        return await failed

    async def attach_fault_injector(self, injector: FaultInjector | None) -> None:
        """Tests only: the engine's fault points consult ``injector`` (this actor's copy of
        it) from now on; None detaches it."""
        self.engine.attach_fault_injector(injector)

    async def resume(self) -> None:
        """Take requests again after :meth:`drain`."""
        if self.draining:
            self.draining = False
            logger.info("worker %s resumed", self.worker_id)
            for channel, _ in self._channels.values():
                channel.push(ChannelState(self.worker_id, False))

    async def drain(self) -> int:
        """Stop taking requests; tell every channel; return how many are still in flight."""
        if not self.draining:
            self.draining = True
            logger.info("worker %s draining: %d request(s) in flight", self.worker_id,
                        self.num_inflight())
            for channel, _ in self._channels.values():
                channel.push(ChannelState(self.worker_id, True))
        return self.num_inflight()

    async def close_channels(self) -> None:
        """End every channel's stream (a drained worker about to stop): its readers see
        an orderly end instead of a dead actor."""
        for channel, _ in list(self._channels.values()):
            channel.push(None)

    async def pause_generation(self, mode: str = "abort") -> int:
        return await self._later(self.engine.pause_generation, mode)

    async def continue_generation(self) -> bool:
        return await self._later(self.engine.continue_generation)

    async def rebalance_experts(self, timeout: float = 600.0) -> dict:
        """Waits for a weight-update session to end off the actor's event loop."""
        return await asyncio.to_thread(self.engine.rebalance_experts, timeout)

    async def flush_cache(self) -> bool:
        return await self._later(self.engine.flush_cache)

    async def check_kv_conservation(self) -> dict:
        return await self._later(self.engine.check_kv_conservation)

    async def generate_group(self, input_ids: list[int], n: int, sampling_params: dict | list,
                             priority: int = 0) -> list[dict]:
        """``n`` samples of one prompt (an RL group) in one batch: the prompt is prefilled once
        and the other samples reuse its KV through the radix cache. ``sampling_params``: one
        dict, or one per sample (seeds). Results as :meth:`radixray.Engine.generate` gives
        them, ``meta_info.worker_id`` set."""
        if self.draining:
            raise WorkerDraining(f"worker {self.worker_id} is draining")
        outs = await asyncio.to_thread(self.engine.generate, input_ids=[list(input_ids)] * n,
                                       sampling_params=sampling_params, priority=priority)
        for out in outs:
            out["meta_info"]["worker_id"] = self.worker_id
        return outs

    # ---- RL control: memory and weights (engine/mem_cache/memory_saver.py, engine/weights/)
    async def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self._later(self.engine.release_memory_occupation, tags)

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        return await self._later(self.engine.resume_memory_occupation, tags)

    async def begin_weight_update(self, lora_name: str | None = None) -> None:
        self.engine.begin_weight_update(lora_name)

    async def update_weights_from_tensor(self, named_tensors) -> dict:
        """``named_tensors``: ``(name, tensor)`` pairs, a :class:`~radixray.cluster.
        shared_weights.SharedWeightsHandle` (a colocated trainer's shared-memory file, read in
        place; on another node, its ``elsewhere`` payload from the object store), or a
        :func:`~radixray.cluster.tensor_payload.to_payload` list (passed as a top-level
        ObjectRef, Ray maps it from the object store)."""
        if isinstance(named_tensors, SharedWeightsHandle) and not on_this_node(named_tensors):
            if not named_tensors.elsewhere:
                raise ValueError(f"the shared weights file is on node {named_tensors.node_ip}, "
                                 "not this worker's, and no payload came with it")
            if not self._warned_remote_shared:
                self._warned_remote_shared = True
                logger.info("the trainer's shared weights file is on another node (%s): "
                            "taking the weights from the object store", named_tensors.node_ip)
            named_tensors = await named_tensors.elsewhere[0]
        if isinstance(named_tensors, SharedWeightsHandle):
            named_tensors = read_shared(named_tensors)
        elif is_payload(named_tensors):
            named_tensors = list(from_payload(named_tensors))
        return await asyncio.to_thread(self.engine.update_weights_from_tensor, named_tensors)

    async def update_weights_from_disk(self, model_path: str) -> dict:
        return await asyncio.to_thread(self.engine.update_weights_from_disk, model_path)

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int,
                                        group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                                        timeout_s: float = 600.0) -> dict:
        return await asyncio.to_thread(self.engine.init_weights_update_group, master_address,
                                       master_port, rank_offset, world_size, group_name, backend,
                                       timeout_s)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        return await asyncio.to_thread(self.engine.destroy_weights_update_group, group_name)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                              group_name: str = DEFAULT_GROUP) -> dict:
        return await asyncio.to_thread(self.engine.update_weights_from_distributed, names, dtypes,
                                       shapes, group_name)

    async def prepare_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        """The first half of ending a session (fleet updates: every worker prepares, then
        every worker commits); nothing serving changes. A refused version leaves the session
        open with its staged weights."""
        return await asyncio.to_thread(self.engine.prepare_weight_update, weight_version)

    async def commit_weight_update(self) -> WeightVersion:
        return await self._later(self.engine.commit_weight_update)

    async def rollback_weight_update(self) -> bool:
        return await self._later(self.engine.rollback_weight_update)

    async def finish_weight_update(self) -> dict:
        return self.engine.finish_weight_update()

    async def abort_weight_update(self) -> bool:
        return self.engine.abort_weight_update()

    async def end_weight_update(self, weight_version: WeightVersion | None = None) -> dict:
        return await asyncio.to_thread(self.engine.end_weight_update, weight_version)

    async def get_weight_version(self) -> WeightVersion:
        return self.engine.get_weight_version()

    async def update_weight_version(self, new_version: WeightVersion) -> dict:
        return await self._later(self.engine.update_weight_version, new_version)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        return await asyncio.to_thread(self.engine.load_lora_adapter, lora_name, lora_path)

    async def update_lora_adapter(self, lora_name: str, lora_path: str | None = None,
                                  named_tensors=None,
                                  lora_version: WeightVersion | None = None) -> dict:
        return await asyncio.to_thread(self.engine.update_lora_adapter, lora_name, lora_path,
                                       named_tensors, lora_version)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        return await self._later(self.engine.unload_lora_adapter, lora_name)

    async def metric_families(self) -> list:
        """This worker's Prometheus families (picklable) for the ingress's /metrics."""
        load = await self.load()
        families = self.metrics.families(load)
        if load.pd is not None:
            families += self.pd_metrics.families(load.pd)
        return families

    async def shutdown(self) -> None:
        self.engine.shutdown()
        if self._tp_ranks is not None:
            await asyncio.to_thread(self._tp_ranks.stop)
        if self._outbox is not None:
            self._outbox.close()
        self._sockets.close()


def worker_actor_class():
    """The Ray actor class (created lazily so importing this module needs no Ray)."""
    import ray
    return ray.remote(EngineWorker)
