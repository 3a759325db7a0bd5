"""Deliver a prefill or decode engine's room messages to the other worker of the pair.

The engine's scheduler and KV sender threads hand messages over without blocking; one
delivery thread per worker looks the peer's actor up through the controller (cached per
worker id; looked up again after a failed call, since the peer may have been restarted)
and sends them with ``pd_deliver``. A message that cannot be delivered (the peer is dead
or not serving) goes back to the engine as undeliverable, so a room waiting on it fails
at once instead of at its timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from radixray.cluster.errors import unwrap_ray_error

logger = logging.getLogger("radixray.pd")

LOOKUP_TIMEOUT_S = 10.0


class PDOutbox:
    def __init__(self, controller, undeliverable: Callable[[object, str], None]):
        """``controller``: the fleet's controller handle; ``undeliverable(message, error)``:
        the engine's answer to a message that did not arrive (``Engine.pd_undeliverable``)."""
        self.controller, self.undeliverable = controller, undeliverable
        self._handles: dict[str, object] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="radixray-pd-outbox",
                                        daemon=True)
        self._thread.start()

    def __call__(self, worker_id: str, message) -> None:
        self._queue.put((worker_id, message))

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        import ray
        while True:
            item = self._queue.get()
            if item is None:
                return
            worker_id, message = item
            try:
                handle = self._handles.get(worker_id)
                if handle is None:
                    entry = ray.get(self.controller.worker.remote(worker_id),
                                    timeout=LOOKUP_TIMEOUT_S)
                    handle = self._handles[worker_id] = entry.handle
                ref = handle.pd_deliver.remote(message)
                ref.future().add_done_callback(
                    lambda f, w=worker_id, m=message: self._check(f, w, m))
            except Exception as exc:  # noqa: BLE001 - lookup failed: the peer is not serving
                self._failed(worker_id, message, exc)

    def _check(self, future, worker_id: str, message) -> None:
        exc = future.exception()
        if exc is not None:
            self._failed(worker_id, message, exc)

    def _failed(self, worker_id: str, message, exc: BaseException) -> None:
        self._handles.pop(worker_id, None)
        error = f"worker {worker_id}: {unwrap_ray_error(exc)}"
        logger.warning("room %d: %s not delivered to %s", message.room,
                       type(message).__name__, error)
        self.undeliverable(message, error)
