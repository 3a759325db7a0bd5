"""common/passing_thread.py: work on a thread that ends with it."""

import threading

import pytest
import torch

from radixray.common.passing_thread import in_passing_thread


def test_the_work_runs_on_a_thread_that_has_ended_with_the_callers_thread_count():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = in_passing_thread(lambda: (threading.current_thread(), torch.get_num_threads()))
    finally:
        torch.set_num_threads(before)
    thread, count = seen
    assert thread is not threading.current_thread() and not thread.is_alive()
    assert count == 1
    assert in_passing_thread(torch.arange(6).reshape, 2, 3).shape == (2, 3)


def test_an_exception_reaches_the_caller():
    def fails():
        raise ValueError("from the passing thread")
    with pytest.raises(ValueError, match="from the passing thread"):
        in_passing_thread(fails)
