"""Who schedules in a tensor-parallel group: the driver rank, with followers that mirror its
forward passes.

Rank 0 is a whole engine (scheduler, radix cache, grammars, sampling, detokenizing); the
other ranks hold only a model runner: their shard of the weights and a KV pool of their
heads, with the same number of slots. Before each forward pass the driver sends the batch
(:class:`StepMessage`: token ids, positions, KV slots, lengths, and the KV slots of the
prefix of each request a follower has not seen in its row yet) and every rank runs the same
forward, meeting in its collectives; only the driver samples. So a follower never decides
anything: it cannot diverge from the driver, and everything the scheduler does (admission,
chunking, retraction, the radix cache, pause modes, grammars) works at any ``tp_size``
without a line of its own. docs/tensor_parallelism.md says why this design and not
SGLang's (an identical scheduler on every rank).

The step channel is a gloo group of its own whose timeout is long: a follower waits for the
next step as long as the driver is idle; a driver that dies closes its sockets, and the
followers' receive fails at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixray.engine.disaggregation.tp_group import KVWriteOp
from radixray.engine.executor.forward_batch import ForwardBatch, ForwardMode
from radixray.engine.executor.prompt_logprobs import projection_chunks
from radixray.engine.mem_cache.memory_saver import MemoryOp
from radixray.engine.mem_cache.storage_saver import StorageSaver
from radixray.engine.tp.weights import FollowerWeights, WeightOp

logger = logging.getLogger(__name__)


@dataclass
class StepMessage:
    """One forward pass, as a follower needs it. ``prefixes[i]``: request ``i``'s KV slots
    before its new tokens, when the follower's table row does not hold them yet (else
    None); ``prompt_rows``: how many rows prompt logprobs project after the pass."""

    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_rows: torch.Tensor
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    all_logits: bool
    num_decode: int
    prefixes: list[torch.Tensor | None]
    prompt_rows: torch.Tensor | None

    def batch(self) -> ForwardBatch:
        from radixray.engine.executor.prompt_logprobs import PromptLogprobRows
        rows = None
        if self.prompt_rows is not None:
            rows = PromptLogprobRows(self.prompt_rows, torch.zeros_like(self.prompt_rows), [])
        return ForwardBatch(self.mode, self.input_ids, self.positions, self.out_cache_loc,
                            self.req_rows, self.prefix_lens, self.extend_lens, self.seq_lens,
                            all_logits=self.all_logits, prompt_rows=rows,
                            num_decode=self.num_decode)


@dataclass
class Stop:
    """The driver is shutting down: followers leave their loop."""


class DriverMirror:
    """The driver's record of what each follower table row holds, so a row's prefix slots
    are sent once per lease of the row (a new request, a retracted one readmitted, a
    prefill-decode request whose KV arrived by transfer), not on every step."""

    def __init__(self, req_pool):
        self.req_pool = req_pool
        self._sent: dict[int, tuple[int, int]] = {}  # row -> (its lease, slots the row holds)

    def message(self, batch: ForwardBatch) -> StepMessage:
        table, leases = self.req_pool.table, self.req_pool.leases
        prefixes: list[torch.Tensor | None] = []
        for i, (row, prefix) in enumerate(zip(batch.req_rows.tolist(), batch.prefix_lens)):
            held = self._sent.get(row)
            stale = held is None or held[0] != leases[row] or held[1] < prefix
            prefixes.append(table[row, :prefix].clone() if stale and prefix else None)
            self._sent[row] = (leases[row], batch.seq_lens[i])
        rows = batch.prompt_rows.rows if batch.prompt_rows is not None else None
        return StepMessage(batch.mode, batch.input_ids, batch.positions, batch.out_cache_loc,
                           batch.req_rows, batch.prefix_lens, batch.extend_lens, batch.seq_lens,
                           batch.all_logits, batch.num_decode, prefixes, rows)


def apply_to_table(message: StepMessage, table: torch.Tensor) -> None:
    """A follower: write the step's slots into its request table as the driver's holds them."""
    at = 0
    out = message.out_cache_loc
    for i, row in enumerate(message.req_rows.tolist()):
        prefix, n = message.prefix_lens[i], message.extend_lens[i]
        if message.prefixes[i] is not None:
            table[row, :prefix] = message.prefixes[i]
        table[row, prefix:prefix + n] = out[at:at + n]
        at += n


def mirror_memory_op(memory: StorageSaver, op: MemoryOp) -> None:
    """A follower: free or restore its shard's memory as the driver just did."""
    if op.kind == "release":
        memory.release(list(op.tags))
    elif op.kind == "resume":
        memory.resume(list(op.tags))
    elif op.kind == "replaced":
        memory.replaced()
    else:
        raise ValueError(f"unknown memory op {op.kind!r}")


def follow(runner, tp, kv=None) -> None:
    """A follower rank's life: run every forward pass the driver sends, and mirror its
    weight-update sessions (engine/tp/weights.py) and memory releases, until it stops (or
    the channel breaks: the driver died). ``kv`` (a prefill-decode worker's
    :class:`~radixray.engine.disaggregation.tp_group.FollowerKV`) takes its KV writes."""
    table = runner.req_pool.table
    weights = FollowerWeights(runner.model)
    memory = StorageSaver(runner)
    while True:
        message = tp.receive()
        if isinstance(message, Stop):
            logger.info("tensor-parallel rank %d: the driver stopped", tp.rank)
            return
        if isinstance(message, WeightOp):
            weights.apply(message)
            if message.kind in ("commit", "rollback"):
                runner.weights_moved()
            continue
        if isinstance(message, MemoryOp):
            mirror_memory_op(memory, message)
            runner.weights_moved()
            continue
        if isinstance(message, KVWriteOp):
            kv.put(message)
            continue
        apply_to_table(message, table)
        batch = message.batch()
        if runner.device != "cpu":  # the driver sent its host tensors
            batch.to_device(runner.device)
        with torch.inference_mode():
            runner.run_model(batch)
            if batch.prompt_rows is not None:  # the driver projects them in these chunks
                hidden = batch.prompt_rows.hidden
                for start, stop in projection_chunks(hidden.shape[0], runner.vocab_size):
                    runner.model.project(hidden[start:stop])
