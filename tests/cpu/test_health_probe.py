"""/health_generate runs one probe at a time (the manual's incident: probes that piled up
behind real work, each timed-out one leaving a request behind). Checked on the ingress'
handler itself with a probe the test controls, so nothing depends on timing."""

import asyncio
from types import SimpleNamespace

from radixray.serve.ingress import Ingress


def _ingress(outcomes: list):
    """A stand-in replica whose probe waits for ``gate`` and returns the next outcome."""
    gate = asyncio.Event()
    calls = []

    async def probe_once():
        calls.append(1)
        await gate.wait()
        return outcomes[len(calls) - 1]

    async def serving():
        return None
    return SimpleNamespace(_probe=None, _probe_once=probe_once, _not_serving=serving), gate, calls


async def _settle():
    for _ in range(10):
        await asyncio.sleep(0)


def test_probes_that_arrive_while_one_runs_share_it():
    async def main():
        replica, gate, calls = _ingress([None, "no token within 20.0 s"])
        first = [asyncio.ensure_future(Ingress.health_generate(replica)) for _ in range(8)]
        await _settle()
        assert len(calls) == 1  # eight callers, one probe
        first[0].cancel()  # a caller that leaves does not stop the shared probe
        await _settle()
        gate.set()
        done = await asyncio.gather(*first[1:])
        assert [r.status_code for r in done] == [200] * 7
        gate.clear()
        second = [asyncio.ensure_future(Ingress.health_generate(replica)) for _ in range(3)]
        await _settle()
        assert len(calls) == 2  # the next probe starts only after the last one ended
        gate.set()
        failed = await asyncio.gather(*second)
        assert [r.status_code for r in failed] == [503] * 3
        assert b"no token within 20.0 s" in failed[0].body
    asyncio.run(main())
