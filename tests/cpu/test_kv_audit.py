"""The always-on KV accounting audit (engine/mem_cache/kv_audit.py): quiet and zero while every slot
is placed, a signed difference and one log line naming the owners when one is not."""

import logging
from types import SimpleNamespace

from radixray.engine.mem_cache.kv_audit import KVAudit
from radixray.engine.mem_cache.kv_manager import KVManager
from radixray.engine.mem_cache.pool import ReqToTokenPool, TokenSlotAllocator
from radixray.engine.mem_cache.radix_cache import RadixCache
from radixray.engine.request import Req
from radixray.engine.sampling import SamplingParams


def _scheduler():
    alloc = TokenSlotAllocator(64)
    kv = KVManager(alloc, ReqToTokenPool(4, 64), RadixCache(alloc))
    req = Req("held-by-r1", [1, 2, 3, 4], SamplingParams())
    assert kv.admit(req, kv.match(req)) and kv.extend(req, 4) is not None
    req.commit_kv(4)
    holders = [req]
    return SimpleNamespace(kv=kv, kv_holders=lambda: holders), holders


def test_a_lost_slot_is_counted_and_its_owners_logged_once(caplog):
    scheduler, holders = _scheduler()
    audit = KVAudit(interval_steps=2)
    caplog.set_level(logging.INFO, logger="radixray.engine.mem_cache.kv_audit")
    for _ in range(4):
        audit.after_step(scheduler)
    assert (audit.checks, audit.leak) == (2, 0) and not caplog.records
    stolen = scheduler.kv.allocator.alloc(3)  # held by nobody the scheduler knows
    for _ in range(4):
        audit.after_step(scheduler)
    assert audit.leak == 3
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1  # once per change, not every audit
    assert "off by 3" in errors[0] and "held-by-r1: 4 owned + 0 reserved" in errors[0]
    scheduler.kv.allocator.free(stolen)
    holders.clear()  # a holder the scheduler forgot: its slots count as lost the other way
    assert audit.check(scheduler) == 4


def test_interval_zero_turns_it_off():
    scheduler, _ = _scheduler()
    audit = KVAudit(interval_steps=0)
    for _ in range(10):
        audit.after_step(scheduler)
    assert audit.checks == 0


def test_an_engine_audits_while_serving(tiny_llama_dir):
    from radixray import Engine
    with Engine(model=tiny_llama_dir, dtype="float32", max_total_tokens=2048,
                kv_audit_interval_steps=1) as eng:
        outs = eng.generate(["the cat sat", "a b c d e"], {"max_new_tokens": 8,
                                                          "temperature": 0.0})
        assert all(o["meta_info"]["completion_tokens"] == 8 for o in outs)
        audit = eng.scheduler.kv_audit
        # 8 tokens take at least 8 steps; the last one's audit may still be running when
        # generate returns, the first 7 have certainly been audited
        assert audit.checks >= 7 and audit.leak == 0
