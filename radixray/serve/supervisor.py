"""Keep `radixray serve`'s drain alive when its whole process group gets the signal.

`timeout`, some container inits and service managers send SIGTERM to every process of
the group. The processes of a Ray that ``ray.init`` starts (GCS, raylet, workers) are
in the CLI's group, so such a signal killed them in the middle of the drain ("Failed to
connect to GCS within 60 seconds", exit status 1). With a local Ray the CLI therefore
runs the server in a child process in a session of its own and waits for it: SIGTERM,
SIGINT and SIGHUP reaching the parent, alone or with its group, are passed on to the
child (SIGINT as SIGINT, the others as SIGTERM), which drains and then stops Ray; the
parent exits with the child's status. If the parent dies without a word (SIGKILL), the
child gets SIGTERM from the kernel (Linux) and drains all the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

SUPERVISED_ENV = "RADIXRAY_SERVE_SUPERVISED"


def supervised() -> bool:
    """True in the child (it serves); False in a CLI that should start one."""
    return os.environ.get(SUPERVISED_ENV) == "1"


def _term_when_parent_dies() -> None:
    """In the child before exec (Linux): SIGTERM it when the parent dies, even by SIGKILL,
    so the server drains and stops instead of running on unseen."""
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def run_supervised(argv: list[str]) -> int:
    """Run ``radixray <argv>`` in its own session, forwarding stop signals; its status."""
    child = subprocess.Popen([sys.executable, "-m", "radixray.cli", *argv],
                             env={**os.environ, SUPERVISED_ENV: "1"}, start_new_session=True,
                             preexec_fn=_term_when_parent_dies if sys.platform == "linux"
                             else None)

    def forward(signum, _frame) -> None:
        try:
            child.send_signal(signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    return child.wait()
