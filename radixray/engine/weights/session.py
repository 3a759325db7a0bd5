"""Weight-update sessions and the weight version of one engine (RL: the trainer pushes weights).

A session is ``begin`` -> any number of ``update_from_tensor`` / ``update_from_disk`` /
``update_from_distributed`` calls (Hugging Face names, any subset, in any order) ->
``end(version)``. Tensors are staged beside the serving weights
(:mod:`radixray.engine.weights.layout`), so generation goes on while they arrive and a
failed session leaves the old weights serving: an unknown name or a wrong shape
ends the session at once with a ValueError naming the tensor.

``end`` is three steps, kept apart for fleet-wide updates that must land on every
worker or on none: :meth:`WeightUpdater.prepare` (fill rows not sent, repack int8
layers once; nothing serving changes), :meth:`WeightUpdater.commit` (on the scheduler
thread between steps: swap the new tensors in, bump the version, start a new
``weight_spans`` entry on every live request, retire the prefix cache's old KV) and
:meth:`WeightUpdater.finish` (drop the old tensors); :meth:`WeightUpdater.rollback`
undoes a commit not yet finished.

Versions (:mod:`radixray.engine.weights.version`) are ints that only grow (the first load
is 0) or string labels as in SGLang (``"v1"``). A refused version leaves the session open
with its staged weights: the caller ends it again with a valid version. The prefix cache
is keyed by :attr:`WeightUpdater.generation`, which every commit and rollback advances,
never by the version, so a label named twice never lets KV of other weights match.

A session begun with ``lora_name`` updates that LoRA adapter instead of the base weights
(engine/weights/adapter_stage.py): the same transports stage PEFT-named tensors, ``end``
serves them under the adapter's own version (the base version and generation stay, only
that adapter's cached KV is retired), and rollback serves the old adapter again.

A session stages against the expert placement it began on (EPLB: which slots hold
copies of which expert), so the placement must hold still from ``begin`` to
``finish``: a rebalance takes :meth:`WeightUpdater.exclusive` and runs only when no
session is open, and ``begin`` waits while a rebalance holds it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from radixray.engine.messages import DEFAULT_GROUP  # noqa: F401 - part of this module's API
from radixray.engine.tp.weights import WeightRelay
from radixray.engine.weights.adapter_stage import (
    AdapterCommit,
    AdapterStage,
    PreparedAdapter,
    commit_adapter,
)
from radixray.engine.weights.layout import Prepared, Undo, WeightLayout, WeightStage
from radixray.engine.weights.loader import safetensors_files
from radixray.engine.weights.sync import broadcast, close_group, dtype_from_name, open_group
from radixray.engine.weights.version import (
    WeightVersion,
    check_version,
    default_version,
    raise_floor,
)

logger = logging.getLogger(__name__)

SESSION_OPEN = "a weight-update session is open"  # WeightUpdater.exclusive's reason


class WeightUpdater:
    """The session state and weight version of one engine. Session calls are thread-safe
    (one at a time); :meth:`commit` and :meth:`rollback` run on the scheduler thread."""

    def __init__(self, runner, scheduler, memory):
        self.runner = runner
        self.scheduler = scheduler
        self.memory = memory
        self.version: WeightVersion = 0  # the label of the weights serving now
        self.floor = 0  # the greatest int version served (version.check_version)
        self.generation = 0  # +1 per commit and rollback: the prefix cache's key
        self._layout: WeightLayout | None = None
        self._stage: WeightStage | AdapterStage | None = None
        self._prepared: tuple[WeightVersion, Prepared] | PreparedAdapter | None = None
        # base: (version, floor, undo); an adapter's session: its AdapterCommit
        self._undo: tuple[WeightVersion, int, Undo] | AdapterCommit | None = None
        self._groups: dict[str, tuple[object, int]] = {}  # name -> (process group, our rank)
        self._phases: dict[str, float] = {}
        self._lock = threading.RLock()
        # tensor parallelism: every session step is mirrored on the followers (engine/tp/)
        self.relay = WeightRelay(runner.tp) if runner.tp.size > 1 else None
        self._ended = threading.Condition(self._lock)  # notified when a session ends
        self.last: dict | None = None  # the result of the last finished update

    # ---- session -----------------------------------------------------------------------
    @property
    def session_open(self) -> bool:
        """From ``begin`` until the session is finished, aborted or rolled back."""
        return self._stage is not None or self._undo is not None

    @contextmanager
    def exclusive(self) -> Iterator[str | None]:
        """Hold sessions off while the body rewrites weights in place (an EPLB rebalance on
        the scheduler thread). Yields None when it may, else why not: a session is open,
        a session call holds the lock now, or the weights are released. Never blocks."""
        if not self._lock.acquire(blocking=False):
            yield SESSION_OPEN
            return
        try:
            if self.session_open:
                yield SESSION_OPEN
            elif "weights" in self.memory.released:
                yield "the weights are released (resume_memory_occupation first)"
            else:
                yield None
        finally:
            self._lock.release()

    def wait_until_closed(self, timeout: float) -> bool:
        """Block until no session is open (True) or ``timeout`` seconds pass (False)."""
        with self._lock:
            return self._ended.wait_for(lambda: not self.session_open, timeout)

    def _closed(self) -> None:
        """A session ended (lock held): wake whoever waits for it."""
        self._ended.notify_all()

    def begin(self, lora_name: str | None = None) -> None:
        """Open a session for the base weights, or for loaded LoRA adapter ``lora_name``
        (ValueError naming it when it is not loaded). ValueError if one is open."""
        with self._lock:
            if self._stage is not None or self._undo is not None:
                raise ValueError("a weight update session is already open: end_weight_update or "
                                 "abort_weight_update first")
            if lora_name is not None:  # LoRA and tensor parallelism exclude each other: no relay
                self._stage = AdapterStage(self.runner.lora, lora_name)
                self._prepared, self._phases = None, {"transfer": 0.0}
                return
            if self._layout is None or self._layout.stale():
                self._layout = WeightLayout(self.runner.model)
            # Released weights mean a colocated trainer just ran: memory is fragmented, and
            # faulting huge pages would wait on compaction (see WeightStage).
            self._stage = WeightStage(self._layout,
                                      fault_huge_pages="weights" not in self.memory.released)
            self._prepared = None
            self._phases = {"transfer": 0.0}
            self._relay("begin")
            if self.relay is not None:
                self._stage.on_add = self.relay.tensor

    def abort(self) -> bool:
        """Drop the open session (nothing serving changes); False if none was open. A commit
        not yet finished is rolled back by :meth:`rollback`, not here."""
        with self._lock:
            was = self._stage is not None
            self._stage = self._prepared = None
            self._closed()
            self._relay("abort")
            return was

    def _stage_or_raise(self, call: str) -> WeightStage:
        if self._stage is None:
            raise ValueError(f"{call}: no weight update session is open; call begin_weight_update "
                             f"first")
        if self._prepared is not None:
            raise ValueError(f"{call}: the session is already prepared; commit or abort it")
        return self._stage

    def _staging(self, call: str, fill) -> dict:
        """Run ``fill(stage)``; any failure ends the session (all or nothing) and re-raises."""
        with self._lock:
            stage = self._stage_or_raise(call)
            before, t0 = (stage.tensors, stage.bytes), time.perf_counter()
            try:
                fill(stage)
            except Exception as exc:
                self._stage = None
                self._closed()
                self._relay("abort")
                logger.warning("weight update session failed and was dropped: %s", exc)
                raise
            if self.relay is not None:
                self.relay.flush()
            self._phases["transfer"] += time.perf_counter() - t0
            return {"tensors": stage.tensors - before[0], "bytes": stage.bytes - before[1]}

    def update_from_tensor(self, named: Iterable[tuple[str, torch.Tensor]] | dict) -> dict:
        """Stage ``(name, tensor)`` pairs (or a dict); numpy arrays are taken as tensors."""
        items = named.items() if isinstance(named, dict) else named

        def fill(stage: WeightStage | AdapterStage) -> None:
            stage.add_all((name, torch.as_tensor(tensor)) for name, tensor in items)
        return self._staging("update_weights_from_tensor", fill)

    def update_from_disk(self, path: str) -> dict:
        """Stage every tensor of a Hugging Face folder's (or one file's) safetensors. A folder
        is a whole checkpoint: one that lacks a tensor fails the session (a truncated copy
        must not serve); a single file may hold any subset (a delta). An adapter's session
        reads a PEFT folder (the whole adapter) or one file of PEFT-named tensors."""
        from safetensors import safe_open

        def fill(stage: WeightStage | AdapterStage) -> None:
            if isinstance(stage, AdapterStage):
                return stage.read_disk(path)
            if self.relay is not None:  # each follower reads the files itself
                self.relay.paused = True
            try:
                for file in safetensors_files(path):
                    with safe_open(file, framework="pt") as st:
                        for name in st.keys():
                            stage.add(name, st.get_tensor(name))
            finally:
                if self.relay is not None:
                    self.relay.paused = False
            missing = stage.missing() if os.path.isdir(path) else []
            if missing:
                raise ValueError(f"checkpoint folder {path!r} is missing {len(missing)} tensors, "
                                 f"e.g. {missing[:3]}")
            self._relay("disk", path)
        return self._staging("update_weights_from_disk", fill)

    # ---- torch.distributed -------------------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str = DEFAULT_GROUP, backend: str = "gloo",
                   timeout_s: float = 600.0) -> dict:
        """Join ``group_name`` as rank ``rank_offset`` (the trainer is rank 0); blocks until
        every rank joined."""
        if group_name in self._groups:
            raise ValueError(f"weight update group {group_name!r} already exists on this engine")
        if rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got {rank_offset}")
        group = open_group(master_address, master_port, rank_offset, world_size, group_name, backend,
                           timeout_s)
        self._groups[group_name] = (group, rank_offset)
        return {"group_name": group_name, "rank": rank_offset, "world_size": world_size}

    def destroy_group(self, group_name: str = DEFAULT_GROUP) -> bool:
        """Leave ``group_name``; False if this engine is not in it."""
        entry = self._groups.pop(group_name, None)
        if entry is not None:
            close_group(entry[0])
        return entry is not None

    def close(self) -> None:
        """Leave every weight-update group (engine shutdown)."""
        for name in list(self._groups):
            self.destroy_group(name)

    def update_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                group_name: str = DEFAULT_GROUP) -> dict:
        """Receive one broadcast from rank 0 per name, in order, and stage it. The names and
        shapes are checked before the first receive, so a bad request fails before the
        trainer sends (the trainer then sees its broadcast fail or time out)."""
        if group_name not in self._groups:
            raise ValueError(f"no weight update group {group_name!r}: call "
                             f"init_weights_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names, dtypes and shapes must have one entry per tensor; got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")
        group, _ = self._groups[group_name]
        device = self.runner.device

        def fill(stage: WeightStage | AdapterStage) -> None:
            kinds = [dtype_from_name(d) for d in dtypes]
            for name, shape in zip(names, shapes):  # validate everything before receiving
                stage.check_shape(name, shape)
            for name, dtype, shape in zip(names, kinds, shapes):
                target = stage.buffer_for(name, dtype)
                if target is not None and target.is_contiguous():
                    broadcast(group, target)
                    stage.mark_written(name)
                    continue
                tmp = torch.empty(tuple(shape), dtype=dtype, device=device)
                broadcast(group, tmp)
                stage.add(name, tmp)
        return self._staging("update_weights_from_distributed", fill)

    # ---- ending a session ----------------------------------------------------------------
    def prepare(self, version: WeightVersion | None = None) -> dict:
        """Validate the version (None: the next integer) and finish the staged weights
        (nothing serving changes). A refused version (VersionRefused) keeps the session and
        its staged weights open, so the caller may prepare again with a valid one; any
        other failure ends the session. An adapter's session checks the version against
        the adapter's own (lora_slots.py)."""
        with self._lock:
            stage = self._stage_or_raise("end_weight_update")
            if isinstance(stage, AdapterStage):
                self._prepared = stage.prepare(version)
                return {"lora_name": stage.name, "lora_version": self._prepared.version,
                        "tensors": stage.tensors, "bytes": stage.bytes}
            version = check_version(default_version(self.floor) if version is None else version,
                                    self.floor)
            t0 = time.perf_counter()
            try:
                missing = stage.missing() if "weights" in self.memory.released else []
                if missing:
                    raise ValueError(
                        f"the weights are released, so an update must replace all of them (or "
                        f"resume_memory_occupation(['weights']) first); {len(missing)} tensors "
                        f"were not sent, e.g. {missing[:3]}")
                prepared = stage.prepare()
            except Exception:
                self._stage = None
                self._closed()
                self._relay("abort")
                raise
            self._relay("prepare")
            self._prepared = (version, prepared)
            self._phases["load"] = time.perf_counter() - t0
            return {"weight_version": version, "tensors": prepared.tensors, "bytes": prepared.bytes}

    def commit(self, scheduler) -> WeightVersion:
        """Scheduler thread: the prepared weights go live; returns the new version (an
        adapter's session: the adapter's). A failure changes nothing (the caller aborts)."""
        with self._lock:
            if self._prepared is None:
                raise ValueError("commit: no prepared weight update (call prepare first)")
            t0 = time.perf_counter()
            if isinstance(self._prepared, PreparedAdapter):
                self._undo = commit_adapter(self._prepared, self.runner.lora,
                                            scheduler.held_requests())
                self._stage = self._prepared = None
                self._phases["commit"] = time.perf_counter() - t0
                return self._undo.version
            version, prepared = self._prepared
            self._relay("commit")
            self._undo = (self.version, self.floor, prepared.commit())
            self.runner.weights_moved()
            self._stage = self._prepared = None
            self.floor = raise_floor(self.floor, version)
            self._set_version(scheduler, version)
            self._phases["commit"] = time.perf_counter() - t0
            return version

    def rollback(self, scheduler) -> bool:
        """Scheduler thread: undo a commit not yet finished (the old weights and version
        serve again); False if there is none."""
        with self._lock:
            if self._undo is None:
                return False
            if isinstance(self._undo, AdapterCommit):
                self._undo.rollback(scheduler.held_requests())
                logger.warning("LoRA adapter %s update rolled back; version %r serves again",
                               self._undo.name, self._undo.old_version)
                self._undo = None
                self._closed()
                return True
            old_version, self.floor, undo = self._undo
            self._relay("rollback")
            undo.rollback()
            self.runner.weights_moved()
            self._undo = None
            self._closed()
            self._set_version(scheduler, old_version)
            logger.warning("weight update rolled back; weight version %r serves again", old_version)
            return True

    def finish(self) -> dict:
        """Forget the old weights of the last commit (their memory goes) and report it:
        ``{"weight_version", "previous_version", "phases"}``, or for an adapter's session
        ``{"lora_name", "lora_version", "previous_version", "running_requests", "phases"}``."""
        with self._lock:
            if self._undo is None:
                raise ValueError("finish: no committed weight update to finish")
            if isinstance(self._undo, AdapterCommit):  # the old adapter's host copy goes
                report = {**self._undo.report(), "phases": dict(self._phases)}
                self._undo = None
                self._closed()
                return report
            previous = self._undo[0]
            self._undo = None
            self._closed()
            self._relay("finish")
            # Released weights were replaced whole: only what no update sends (the rotary
            # tables) is read back; a rollback before this point still finds them released.
            self.memory.replaced()
            self.last = {"weight_version": self.version, "previous_version": previous,
                         "phases": dict(self._phases)}
            logger.info("weights updated to version %r (from %r): %s", self.version, previous,
                        ", ".join(f"{k} {v:.3f} s" for k, v in self._phases.items()))
            return dict(self.last)

    def end(self, version: WeightVersion | None, call_in_loop) -> dict:
        """prepare, commit on the scheduler thread (``call_in_loop(fn)`` runs ``fn(scheduler)``
        there), finish. A refused version (VersionRefused, from prepare) leaves the session
        open with its staged weights; a failed commit aborts the session."""
        self.prepare(version)
        try:
            call_in_loop(self.commit)
        except BaseException:
            self.abort()
            raise
        return self.finish()

    def relabel(self, scheduler, version: WeightVersion) -> dict:
        """Scheduler thread: name the weights serving now ``version`` (SGLang's
        ``update_weight_version``). The weights stay, so cached KV stays valid; each live
        request's current span takes the new name. VersionRefused by the rules of
        :func:`check_version`; ValueError between prepare and finish (the prepared version
        was checked against the names before)."""
        with self._lock:
            if self._prepared is not None or self._undo is not None:
                raise ValueError("update_weight_version: a weight update is between prepare "
                                 "and finish; rename after it")
            version = check_version(version, self.floor)
            previous, self.version = self.version, version
            self.floor = raise_floor(self.floor, version)
            scheduler.kv.rename_weights(version)
            for req in scheduler.scheduled_requests():
                rename_last_span(req, version)
            logger.info("weight version %r renamed %r", previous, version)
            return {"weight_version": version, "previous_version": previous}

    def _relay(self, kind: str, *args) -> None:
        """Mirror one session step on the tensor-parallel followers (none without TP)."""
        if self.relay is not None:
            self.relay.op(kind, *args)

    def _set_version(self, scheduler, version: WeightVersion) -> None:
        """Serve new weights as ``version``: a new cache generation (KV of the weights before
        is never matched again) and a new span on each live request."""
        self.version = version
        self.generation += 1
        scheduler.kv.on_weight_version(self.generation, version)
        for req in scheduler.scheduled_requests():
            start_new_span(req, version)


def start_new_span(req, version: WeightVersion) -> None:
    """From its next token on, ``req``'s output comes from weights ``version``."""
    spans = req.weight_spans
    if not spans:  # not admitted yet: everything it will produce comes from ``version``
        return
    n = len(req.output_ids)
    if spans[-1][1] == n:  # the last version produced nothing for it
        spans[-1][0] = version
        if len(spans) > 1 and spans[-2][0] == version:
            spans.pop()
    else:
        spans.append([version, n])


def rename_last_span(req, version: WeightVersion) -> None:
    """The weights ``req`` runs on now are called ``version`` (no new weights). A span
    stays a span even when the name equals the one before: they are other weights."""
    if req.weight_spans:  # else not admitted yet: it starts under the new name
        req.weight_spans[-1][0] = version
