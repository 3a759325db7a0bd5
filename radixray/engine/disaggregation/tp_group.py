"""Prefill-decode disaggregation on a tensor-parallel worker: every rank's KV pool is
registered with a transport of its own, and every rank writes its own KV heads.

At start-up the ranks of a prefill or decode worker exchange their transfer sessions and
pool layouts (an all-gather on the step channel, :func:`open_rank_kv`), so the driver can describe the whole
group as one :class:`~radixray.engine.disaggregation.messages.KVEndpoint`: a decode
driver sends it in its ``KVDestination``, a prefill driver writes into it.

The prefill driver's KV sender paces its group's writes, one job at a time: it sends a
:class:`KVWriteOp` over the step channel (a follower takes it between two forward passes,
so the KV it names was computed by a pass the follower already ran), writes its own share,
then waits until every follower has reported its share in a TCPStore the driver hosts
(:class:`GroupWrites`). A room's outcome goes out only then, so no follower write is in
flight when the decode side frees or reuses the room's slots, and a room that failed has
no later write dispatched at all.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import queue
import threading
from dataclasses import dataclass

import torch

from radixray.engine.disaggregation.layout import pool_layout
from radixray.engine.disaggregation.messages import KVEndpoint, KVLayout
from radixray.engine.disaggregation.staging import SliceStager

logger = logging.getLogger("radixray.pd")


@dataclass
class KVWriteOp:
    """Driver -> followers: write your share of ``src_slots`` into ``dst_slots`` of
    ``dest``, then report ``seq``."""

    seq: int
    dest: KVEndpoint
    src_slots: torch.Tensor
    dst_slots: torch.Tensor


def rank_heads(runner) -> tuple[int, ...]:
    """The model's KV heads this rank's pool holds, in the order of its rows."""
    shard = getattr(runner.model, "tp_shard", None)
    local = runner.kv_pool.k_buffers[0].shape[1]
    start = shard.kv_head_start if shard is not None and runner.tp.size > 1 else 0
    return tuple(range(start, start + local))


def runner_layout(runner) -> KVLayout:
    pool = runner.kv_pool
    return pool_layout(pool.k_buffers, pool.v_buffers, rank_heads(runner))


def register_pool(transport, kv_pool) -> None:
    for buf in kv_pool.k_buffers + kv_pool.v_buffers:
        transport.register(buf.data_ptr(), buf.numel() * buf.element_size())


def fault_in_pool(kv_pool) -> None:
    """Touch a decode pool's pages in slot order. Peers write into it over the network, and
    a write into never-touched (huge) pages waits on the page faults, ~10x slower than into
    faulted ones (measured: 0.16 vs 1.0-1.5 GB/s). Contents are unchanged, so this may run
    in the background beside the first transfers."""
    from radixray.engine.mem_cache.hugepages import populate_rows
    seconds = populate_rows(kv_pool.k_buffers + kv_pool.v_buffers, 4096)
    if seconds:
        logger.info("decode KV pool faulted in (%.1f GB) in %.1f s",
                    kv_pool.bytes_per_token * (kv_pool.size + 1) / 1e9, seconds)
    else:
        logger.info("decode KV pool left to fault on first write (no MADV_POPULATE_WRITE)")


@dataclass
class RankKV:
    """One rank's part of a prefill or decode worker: its transport (its pool registered),
    its pool's layout, the whole worker's endpoint, and the prefill driver's store address
    (None for a decode worker or a single rank)."""

    transport: object
    layout: KVLayout
    endpoint: KVEndpoint
    store_address: str | None


def open_rank_kv(runner, config, transport=None, store_address: str | None = None) -> RankKV:
    """Every rank of a prefill or decode worker calls this once, at start-up: a transport on
    ``disaggregation_transfer_host`` (unless given) with the rank's pool registered, then,
    with tensor parallelism, an all-gather on the step channel of every rank's session and
    layout (the driver passes its ``store_address``, the followers receive it). A decode
    pool is faulted in, in the background."""
    from radixray.engine.disaggregation.mooncake import MooncakeTransport
    transport = transport or MooncakeTransport(config.disaggregation_transfer_host
                                               or "127.0.0.1",
                                               config.disaggregation_transfer_protocol)
    register_pool(transport, runner.kv_pool)
    layout, tp = runner_layout(runner), runner.tp
    endpoint = KVEndpoint((transport.session,), (layout,))
    if tp.size > 1:
        import torch.distributed as dist
        entries: list = [None] * tp.size
        dist.all_gather_object(entries, (transport.session, layout, store_address),
                               group=tp.channel_group)
        endpoint = KVEndpoint(tuple(e[0] for e in entries), tuple(e[1] for e in entries))
        store_address = entries[0][2]
    if config.disaggregation_mode == "decode":
        threading.Thread(target=fault_in_pool, args=(runner.kv_pool,), daemon=True,
                         name="radixray-kv-populate").start()
    return RankKV(transport, layout, endpoint, store_address)


def _store(host: str, port: int, master: bool, timeout_s: float):
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class GroupWrites:
    """The prefill driver's side: dispatch a job to the followers, wait for their reports.
    Thread-safe (the KV sender thread and a handshake probe may both use it)."""

    def __init__(self, tp, host: str, timeout_s: float):
        self.tp, self.timeout_s = tp, timeout_s
        self.store = _store(host, 0, True, timeout_s)
        self.address = f"{host}:{self.store.port}"
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def dispatch(self, dest: KVEndpoint, src_slots: torch.Tensor, dst_slots: torch.Tensor
                 ) -> int:
        with self._lock:
            seq = next(self._seq)
        self.tp.send(KVWriteOp(seq, dest, src_slots, dst_slots))
        return seq

    def wait(self, seq: int) -> tuple[str | None, int]:
        """(the first follower's error or None, the bytes the followers wrote) for job
        ``seq``; a follower that does not report within the group's timeout is an error."""
        keys = [f"kv/{seq}/{rank}" for rank in range(1, self.tp.size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - DistStoreError: a follower is gone
            return (f"a tensor-parallel rank did not report its KV write within "
                    f"{self.timeout_s:.0f} s: {exc}"), 0
        values = [v.decode() for v in self.store.multi_get(keys)]
        for key in keys:
            self.store.delete_key(key)
        errors = [f"rank {r}: {v[6:]}" for r, v in enumerate(values, 1) if v.startswith("error:")]
        written = sum(int(v[3:]) for v in values if v.startswith("ok:"))
        return (errors[0] if errors else None), written


class FollowerKV:
    """A follower rank's side: its transport with its pool registered, its place in the
    group's endpoint, and a thread writing the :class:`KVWriteOp` s the driver sends (its
    rows re-sliced through a :class:`~radixray.engine.disaggregation.staging.SliceStager`
    where a decode rank holds fewer heads)."""

    def __init__(self, runner, config, tp):
        self.rank = tp.rank
        kv = open_rank_kv(runner, config)
        self.transport, self.endpoint, self.store = kv.transport, kv.endpoint, None
        self.stager = SliceStager(kv.transport, runner.kv_pool.k_buffers,
                                  runner.kv_pool.v_buffers)
        if kv.store_address is not None:  # a prefill worker: report each job there
            host, port = kv.store_address.rsplit(":", 1)
            self.store = _store(host, int(port), False, config.tp_timeout_s)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="radixray-kv-follower")
        self._thread.start()
        logger.info("tensor-parallel rank %d: KV transfer endpoint %s, KV heads %s",
                    self.rank, self.transport.session, list(kv.layout.heads))

    def put(self, op: KVWriteOp) -> None:
        self._queue.put(op)

    def _run(self) -> None:
        from radixray.engine.disaggregation.sender import write_share
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                written = write_share(self.transport, self.endpoint, self.rank, op.src_slots,
                                      op.dest, op.dst_slots, self.stager)
                value = f"ok:{written}"
            except Exception as exc:  # noqa: BLE001 - the driver fails the room
                value = f"error:{exc}"
            try:
                self.store.set(f"kv/{op.seq}/{self.rank}", value)
            except Exception:  # noqa: BLE001 - the driver is gone; the group is ending
                logger.warning("rank %d: could not report KV write %d", self.rank, op.seq)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # else a write still holds it: the process ends
            self.stager.close()
        self.transport.close()
