"""Calling a compiled decode graph with its guards split by how often their inputs change.

torch.compile checks every guard of a compiled function on every call. For the decode
step that is about 8,000 guards: each weight buffer's and KV buffer's dtype, shape, stride
and dimension markings, every module attribute the forward read, aliasing between all of
them. On this project's 2-vCPU CPUs that is 1.5 ms of a 9 ms batch-1 step, nearly all of
it about the model, which changes only when the scheduler runs a control call between
steps (a weight update's commit or rollback, a memory release or resume, an adapter load).

:class:`SplitGuards` splits each of dynamo's compiled entries for one code object in two,
with ``RootGuardManager.clone_manager`` (how dynamo builds its own diff-guard managers):

- the **model** guards (every guard whose source is under ``L['model']``) are checked the
  first time the entry is used at each model epoch (:meth:`SplitGuards.model_changed`
  starts a new one);
- the **call** guards (the batch, the globals the forward read, torch's global state,
  the relational guards) are checked on every call.

When both hold, the entry's transformed bytecode (what dynamo itself runs once its guards
pass) is called directly. When no entry's guards hold, the call goes through the dynamo
function, which checks every guard and compiles a new graph if none matches; the entries
are then read again. The split depends on torch internals (the cache entry list, guard
manager cloning); where they are missing, every call goes through dynamo, as before.

Correctness rests on every change to what the model's guards read going through the
scheduler's control calls, which start a new epoch. Tests hold this to account:
``RADIXRAY_COMPILE_CHECK_GUARDS=1`` (tests/conftest.py sets it) also checks an entry's full
guard tree on every direct call and raises AssertionError naming the guard that failed.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

MODEL_SOURCE = "L['model']"


def check_full_guards() -> bool:
    """Whether direct calls also check the whole guard tree (tests)."""
    return os.environ.get("RADIXRAY_COMPILE_CHECK_GUARDS") == "1"


@dataclass
class _Entry:
    """One compiled graph of the code object: its bytecode as a function, and its guards."""

    run: Callable  # the entry's transformed bytecode as a function
    call_guards: object  # RootGuardManager: checked on every call
    model_guards: object  # RootGuardManager: checked once per model epoch
    full_guards: object  # GuardManagerWrapper: every guard (RADIXRAY_COMPILE_CHECK_GUARDS)
    checked_epoch: int = -1


class SplitGuards:
    """Calls of ``compiled`` (``torch.compile`` of ``fn(model, batch)``, fullgraph) that
    check the model's guards once per model epoch (see the module docstring)."""

    def __init__(self, compiled: Callable, fn: types.FunctionType):
        self.compiled = compiled
        self.fn = fn
        self.epoch = 0
        self.entries: list[_Entry] = []
        self.direct_calls = 0  # calls that ran an entry without dynamo
        self.dynamo_calls = 0
        self.disabled: str | None = None  # why every call goes through dynamo

    def model_changed(self) -> None:
        """Something the model's guards read may have changed: check them again."""
        self.epoch += 1

    def __call__(self, model, batch):
        frame = {"model": model, "batch": batch}
        for entry in self.entries:
            if not entry.call_guards.check(frame):
                continue
            if entry.checked_epoch != self.epoch:
                if not entry.model_guards.check(frame):
                    continue
                entry.checked_epoch = self.epoch
            if check_full_guards():
                self._assert_full(entry, frame)
            self.direct_calls += 1
            return entry.run(model, batch)
        self.dynamo_calls += 1
        out = self.compiled(model, batch)
        if self.disabled is None:
            self._read_entries()
        return out

    def _read_entries(self) -> None:
        """Wrap dynamo's cache entries for ``fn``'s code object (new ones only)."""
        try:
            cache = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(self.fn.__code__)
            known = {id(e.run.__code__): e for e in self.entries}
            self.entries = [known.get(id(c.code)) or self._wrap(c) for c in cache]
        except (AttributeError, RuntimeError, TypeError) as exc:
            self.disabled = f"torch's guard internals are not as expected ({exc})"
            self.entries = []
            logger.warning("compiled decode: every step checks all of dynamo's guards: %s",
                           self.disabled)

    def _wrap(self, cache_entry) -> _Entry:
        root = cache_entry.guard_manager.root
        top = root.get_source()
        model = root.clone_manager(lambda m: m.get_source() == top
                                   or MODEL_SOURCE in m.get_source())
        call = root.clone_manager(lambda m: MODEL_SOURCE not in m.get_source())
        if model is None or call is None:
            raise RuntimeError("a guard tree could not be split")
        run = types.FunctionType(cache_entry.code, self.fn.__globals__, self.fn.__name__)
        return _Entry(run, call, model, cache_entry.guard_manager)

    @staticmethod
    def _assert_full(entry: _Entry, frame: dict) -> None:
        if not entry.full_guards.check(frame):
            failed = entry.full_guards.check_verbose(frame).verbose_code_parts
            raise AssertionError(
                "compiled decode: an entry whose split guards passed fails its full guards "
                f"({failed}): something the model's guards read changed without a new "
                "model epoch (SplitGuards.model_changed)")
