"""The EngineWorker's niceness reset (actors/niceness.py): every thread of the process is
moved to the target, or nothing changes and the error says what to do."""

from __future__ import annotations

import os
import threading

import pytest

from radixray.actors.niceness import set_niceness, thread_ids
from radixray.cluster.config import ConfigError, ServeConfig


def _niced_thread(nice: int):
    """A thread that sets itself to ``nice`` (lowering priority needs no privilege) and waits."""
    ready, done, tid = threading.Event(), threading.Event(), []

    def body():
        tid.append(threading.get_native_id())
        os.setpriority(os.PRIO_PROCESS, tid[0], nice)
        ready.set()
        done.wait()

    t = threading.Thread(target=body, daemon=True)
    t.start()
    ready.wait()
    return t, done, tid[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="Linux thread ids")
def test_set_niceness_moves_every_thread_or_explains():
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t, done, tid = _niced_thread(min(main + 7, 19))
    try:
        assert tid in thread_ids()
        changed, error = set_niceness(main)
        if error is None:  # privileged (CI runs as root): the niced thread is back
            assert changed >= 1 and os.getpriority(os.PRIO_PROCESS, tid) == main
            assert set_niceness(main) == (0, None)  # nothing left to change
        else:
            assert "RAY_worker_niceness" in error and os.getpriority(os.PRIO_PROCESS, tid) == min(main + 7, 19)
    finally:
        done.set()
        t.join()


def test_worker_niceness_is_validated():
    assert ServeConfig.parse({}).server.worker_niceness == 0
    assert ServeConfig.parse({"server": {"worker_niceness": None}}).server.worker_niceness is None
    with pytest.raises(ConfigError, match="worker_niceness"):
        ServeConfig.parse({"server": {"worker_niceness": 40}})
