"""Compiled decode on the CPU (``enable_torch_compile``): the decode forward through torch.compile.

On the CPU a small decode step is hundreds of small torch ops (views, slices, casts
between the fused kernels) each dispatched from Python; CUDA graphs remove that on a GPU
(engine/executor/cuda_graph.py). Here torch.compile traces the model's decode forward
once and inductor turns it into one generated function: the C++ kernels stay single
opaque calls (their shapes come from kernels/fake_ops.py), the glue between them is fused
or disappears, and the per-op Python is gone. The kernels compute what they compute
eagerly, so a compiled step's logits are the eager step's, bit for bit
(tests/cpu/test_compiled_decode.py).

Two graphs cover every decode batch up to ``torch_compile_max_bs`` requests: batch 1
(torch specializes size-1 dimensions) and any batch from 2 up, traced with a symbolic
batch size. Both take the context length as a symbolic size too, so neither is traced
again as requests grow. With LoRA, two more cover the decode batches whose requests use
adapters: each LoRA update is one opaque op (kernels/lora.py ``lora_add_segments``) whose
per-batch row plan has unbacked symbolic sizes (any count of rows and slots, one included,
in one graph).
Each of the four kinds of batch runs through a compiled function of its own (a copy of
:func:`decode_logits` with its own code object), so a step checks only its kind's guards,
and of those the model's only after a control call (engine/executor/guard_split.py); the
graphs carry no size asserts (:func:`inductor_options`).
A larger batch, an extend or mixed batch, or one that records routes runs eagerly; the
first such batch is logged with the reason. The graphs are compiled at start-up (the log
says how long) into inductor's cache under ``~/.cache/radixray/inductor``
(``RADIXRAY_CACHE_DIR``), which a restart reuses: the KV pool's token count, which follows
the memory free at start, is a symbolic size too, so it does not change the graphs' keys.

Weights and the KV pool are read through the modules on every call (inductor's freezing
is off), so a weight update's commit or a memory release needs nothing here.
"""

from __future__ import annotations

import logging
import os
import time
import types

import torch

from radixray.engine.executor.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LargestDecodeBatch,
)
from radixray.engine.executor.guard_split import SplitGuards
from radixray.engine.weights.lora_slots import LoraBatch, LoraSlots

logger = logging.getLogger(__name__)

# The two warm-up batches' context length: above 1, which torch would specialize on.
_WARMUP_LEN = 2



def inductor_options() -> dict:
    """Inductor's options for the decode graphs. No size asserts unless
    ``RADIXRAY_COMPILE_SIZE_ASSERTS=1``: the generated code checks each input's and each C++
    op output's sizes and strides on every call (about 500 checks, 0.2 ms of a 10 ms batch-1
    step); dynamo's guards have checked the inputs already, and the tests compile with the
    asserts on, which holds kernels/fake_ops.py's shapes to the kernels."""
    return {"size_asserts": os.environ.get("RADIXRAY_COMPILE_SIZE_ASSERTS") == "1"}


def compile_unavailable(runner, config) -> str | None:
    """Why decode steps are not compiled on ``runner`` (None: they can be)."""
    if config.enable_torch_compile is None:
        return "off (enable_torch_compile unset: on only with the fast CPU precision)"
    if not config.enable_torch_compile:
        return "off (enable_torch_compile=false)"
    if config.disaggregation_mode == "prefill":
        return "a prefill worker runs no decode step"
    if str(runner.device) != "cpu":
        return f"device {runner.device}: CUDA decode uses CUDA graphs instead"
    if runner.attn_backend.name != "cpu_paged":
        return f"attention backend {runner.attn_backend.name!r} (compiled decode runs cpu_paged)"
    if not runner.kernels.active:
        return "the C++ kernels did not load (the compiled step keeps them as its ops)"
    if config.deterministic:
        return "deterministic mode runs its batch-invariant kernels eagerly"
    if runner.routes_experts:
        return "a mixture-of-experts model dispatches its tokens on the host"
    if runner.tp.size > 1:
        return "tensor parallelism (the followers run eagerly)"
    return None


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code across restarts (set before the first compile)."""
    root = os.environ.get("RADIXRAY_CACHE_DIR", os.path.expanduser("~/.cache/radixray"))
    return os.path.join(root, "inductor")


def use_inductor_cache(path: str) -> None:
    """Point inductor's cache at ``path`` unless the user chose a folder of their own
    (``TORCHINDUCTOR_CACHE_DIR`` set to anything but torch's per-user temporary default)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


class CompiledDecode:
    """The compiled decode forward of one model runner (see the module docstring)."""

    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.max_bs = max_bs
        use_inductor_cache(inductor_cache_dir())
        # A graph per weight layout a session may swap in, for each kind of batch below.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        # One compiled function per kind of batch (batch 1 or more, adapters or not), each
        # with a code object of its own: dynamo keeps its graphs per code object and checks
        # their guards one after the other, so a step checks only its own kind's.
        self._forwards: dict[tuple[bool, bool], SplitGuards] = {}
        self.largest = LargestDecodeBatch(max_bs, "a decode batch of %d requests runs eagerly: "
                                          "the compiled decode step covers up to %d (raise "
                                          "torch_compile_max_bs to cover more)", logger)
        self.steps = 0  # decode steps run compiled

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The compiled logits of ``batch`` (compiled on first use of its kind)."""
        kind = (batch.batch_size == 1, batch.lora is not None)
        compiled = self._forwards.get(kind)
        if compiled is None:
            code = decode_logits.__code__.replace()  # a code object (and graph cache) of its own
            fn = types.FunctionType(code, decode_logits.__globals__, decode_logits.__name__)
            compiled = SplitGuards(torch.compile(fn, fullgraph=True, dynamic=False,
                                                 options=inductor_options()), fn)
            self._forwards[kind] = compiled
        return compiled(self.runner.model, batch)

    def model_changed(self) -> None:
        """A control call ran between steps: each graph checks the model's guards again on
        its next use (engine/executor/guard_split.py)."""
        for compiled in self._forwards.values():
            compiled.model_changed()

    def can_run(self, batch: ForwardBatch) -> bool:
        lora_ok = batch.lora is None or batch.lora.traceable
        return batch.decode_only and lora_ok and self.largest.admits(batch)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The logits of ``batch`` (a decode batch :meth:`can_run` accepted); the attention
        backend's metadata is built eagerly first, as for an eager step."""
        self.runner.attn_backend.init_forward_metadata(batch)
        self._mark_dynamic(batch)
        self.steps += 1
        return self.forward(batch)

    @staticmethod
    def _mark_dynamic(batch: ForwardBatch) -> None:
        """Tell the tracer which sizes vary: the context length always, the batch size from
        two requests up, the LoRA row plan's always, unbacked (a size of 1 is not
        specialized), so the same graph serves them all."""
        meta = batch.attn_metadata
        torch._dynamo.maybe_mark_dynamic(meta["kv_indices"], 1)
        rows = [batch.input_ids, batch.positions, batch.out_cache_loc, meta["kv_indices"],
                meta["seq_lens"]]
        if batch.lora is not None:
            plan = batch.lora.segments
            for t in (plan.gather, plan.slots, plan.scales, plan.places, plan.runs):
                torch._dynamo.decorators.mark_unbacked(t, 0)
        if batch.batch_size > 1:
            for t in rows:
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def compile_all(self) -> None:
        """Trace and compile every graph now, on padding batches (slot 0 through request
        table row 0, as CUDA graph capture uses them; with LoRA, the same rows on adapter
        slot 0 too), and log the time it took."""
        from radixray.common.progress import Ticker
        t0 = time.perf_counter()
        sizes = [1, 2] if self.max_bs > 1 else [1]
        lora = self.runner.lora

        def message(elapsed: float) -> str:
            return f"compiling the decode step (torch.compile, inductor): {elapsed:.0f} s"
        pool = self.runner.kv_pool
        for buf in pool.k_buffers + pool.v_buffers:
            # the pool's token count follows the memory free at start: a graph that took it
            # as a constant would miss inductor's cache on every start
            torch._dynamo.maybe_mark_dynamic(buf, 0)
        # built as the scheduler builds them: outside inference mode
        batches = [padding_batch(bs) for bs in sizes]
        if lora is not None:
            batches += [padding_batch(bs, lora) for bs in sizes]
        with Ticker(message, logger, 10.0), torch.inference_mode():
            for batch in batches:
                self.run(batch)
        logger.info("compiled the decode step for batch sizes 1..%d%s in %.1f s (inductor "
                    "cache: %s)", self.max_bs, "" if lora is None else ", with LoRA adapters and "
                    "without", time.perf_counter() - t0, os.environ["TORCHINDUCTOR_CACHE_DIR"])


def decode_logits(model, batch: ForwardBatch) -> torch.Tensor:
    """What a compiled decode step runs (each kind of batch through a copy of its own)."""
    return model.logits(batch)


def padding_batch(bs: int, lora: LoraSlots | None = None) -> ForwardBatch:
    """``bs`` decode rows that read and write only the pool's padding slot 0 (with ``lora``:
    on its adapter slot 0, whatever it holds)."""
    zeros = torch.zeros(bs, dtype=torch.int64)
    return ForwardBatch(mode=ForwardMode.DECODE, input_ids=zeros, positions=zeros.clone(),
                        out_cache_loc=zeros.clone(), req_rows=zeros.clone(),
                        prefix_lens=[_WARMUP_LEN - 1] * bs, extend_lens=[1] * bs,
                        seq_lens=[_WARMUP_LEN] * bs,
                        lora=None if lora is None else LoraBatch(lora, zeros.clone(), True))


def build_compiled_decode(runner, config) -> tuple[CompiledDecode | None, str]:
    """The runner's compiled decode step, or None, and what the log says about it."""
    reason = compile_unavailable(runner, config)
    if reason is not None:
        return None, reason
    max_bs = min(config.torch_compile_max_bs, runner.max_running_requests)
    return CompiledDecode(runner, max_bs), f"batch sizes 1..{max_bs}"
