"""A prefill engine and a decode engine in this process, linked by direct calls (the KV
moves over Mooncake's TCP transport between their pools, as in a fleet)."""

from __future__ import annotations

import itertools
import threading

from radixray import Engine
from radixray.engine.disaggregation.messages import PDBootstrap

_rooms = itertools.count(1000)


class EnginePair:
    """``prefill_options`` / ``decode_options`` go to one side only (``tp_size``, say)."""

    def __init__(self, model: str, prefill_options: dict | None = None,
                 decode_options: dict | None = None, **options):
        common = dict(dtype="float32", check_kv_conservation=True, **options)
        self.p = Engine(model=model, worker_id="p0", disaggregation_mode="prefill",
                        **common, **(prefill_options or {}))
        self.d = Engine(model=model, worker_id="d0", disaggregation_mode="decode",
                        **common, **(decode_options or {}))
        self.engines = {"p0": self.p, "d0": self.d}
        self.dropped: list = []  # messages the test chose not to deliver
        self.drop = None  # predicate(worker, message) -> True to drop
        for e in (self.p, self.d):
            e.pd.set_outbox(self._deliver)

    def _deliver(self, worker: str, message) -> None:
        if self.drop is not None and self.drop(worker, message):
            self.dropped.append((worker, message))
            return
        self.engines[worker].pd.deliver(message)

    def generate(self, input_ids, sampling_params: dict, room: int | None = None,
                 rid: str | None = None) -> tuple[dict, dict]:
        """Run one request through the pair: (prefill result, decode result)."""
        room = next(_rooms) if room is None else room
        out: dict = {}

        def prefill():
            out["p"] = self.p.generate(input_ids=input_ids, sampling_params=sampling_params,
                                       bootstrap=PDBootstrap(room, "d0"), rid=rid)
        t = threading.Thread(target=prefill)
        t.start()
        out["d"] = self.d.generate(input_ids=input_ids, sampling_params=sampling_params,
                                   bootstrap=PDBootstrap(room, "p0"), rid=rid)
        t.join(60)
        return out["p"], out["d"]

    def check_kv(self) -> None:
        for e in (self.p, self.d):
            kv = e.check_kv_conservation()
            assert kv["running"] == 0 and kv["waiting"] == 0, kv

    def close(self) -> None:
        for e in (self.p, self.d):
            e.shutdown()
