"""Server processes a benchmark starts and stops itself: ``radixray serve`` and ``llama-server``.

Each binds 127.0.0.1 on a free port, writes its output to a log file, counts as
up once a readiness URL answers 200 (radixray ``/ready``, llama-server ``/health``,
which answers 503 while the model loads), and is stopped with SIGTERM (SIGKILL
after a grace period). ``radixray serve`` drains on SIGTERM and stops the Ray it
started (see serve/supervisor.py).
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

HOST = "127.0.0.1"
LLAMA_CTX_MARGIN = 64  # tokens per slot beyond the prompt and the output (BOS, rounding)
LLAMA_CTX_PAGE = 256


class ServerFailed(RuntimeError):
    """A started server exited, or did not answer its readiness URL in time; the message
    names the server, the URL and its log file, with the log's last lines."""


# Servers started here take ports from below the kernel's ephemeral range (32768-60999 on
# Linux) and above Ray's worker ports (10002-19999): while a fleet starts, Ray's agents bind
# ephemeral ports of their own, and one once took a port chosen here but not yet bound.
SERVER_PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port in :data:`SERVER_PORTS` on 127.0.0.1 that nothing listens on now."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(SERVER_PORTS)
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {SERVER_PORTS.start}..{SERVER_PORTS.stop - 1}")


def radixray_command(port: int, extra: list[str]) -> list[str]:
    """``radixray serve`` as ``make run`` starts it (default model and options), on
    127.0.0.1:``port``, followed by the caller's own serve flags ``extra``."""
    return [sys.executable, "-m", "radixray.cli", "serve", "--host", HOST, "--port", str(port),
            *extra]


def llama_ctx_size(parallel: int, tokens_per_request: int) -> int:
    """llama-server's ``-c``: the context is split between its ``parallel`` slots, so each
    slot gets ``tokens_per_request`` plus a margin, rounded up to 256 tokens."""
    per_slot = math.ceil((tokens_per_request + LLAMA_CTX_MARGIN) / LLAMA_CTX_PAGE) * LLAMA_CTX_PAGE
    return parallel * per_slot


def llama_server_command(binary: str, gguf: str, port: int, threads: int, parallel: int,
                         ctx_size: int, extra: list[str]) -> list[str]:
    """``llama-server`` serving ``gguf`` on 127.0.0.1:``port`` with ``threads`` CPU threads and
    ``parallel`` slots under continuous batching, then the caller's flags ``extra``."""
    return [binary, "-m", gguf, "--host", HOST, "--port", str(port), "-t", str(threads),
            "-np", str(parallel), "--cont-batching", "-c", str(ctx_size), *extra]


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def wait_until_up(name: str, url: str, proc: subprocess.Popen, log_path: str,
                  timeout: float) -> float:
    """Poll ``url`` until it answers 200; return the seconds it took.

    Raises :class:`ServerFailed` when ``proc`` exits first or ``timeout`` passes.
    """
    import httpx
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise ServerFailed(f"{name} exited with status {proc.returncode} before {url} "
                               f"answered; its log {log_path} ends with:\n{_log_tail(log_path)}")
        try:
            if httpx.get(url, timeout=30).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerFailed(f"{name}: {url} did not answer 200 within {timeout:.0f} s; its log "
                       f"{log_path} ends with:\n{_log_tail(log_path)}")


@dataclass
class StartedServer:
    """A server process this benchmark started: its base URL, command line and log."""

    name: str
    url: str
    command: list[str]
    log_path: str
    proc: subprocess.Popen
    startup_s: float = 0.0

    def stop(self, grace: float = 180.0) -> int | None:
        """SIGTERM, then SIGKILL to its process group after ``grace`` seconds; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        return self.proc.returncode


@contextmanager
def started(name: str, command: list[str], port: int, ready_path: str, log_path: str,
            timeout: float) -> Iterator[StartedServer]:
    """Run ``command`` (a server listening on 127.0.0.1:``port``) in a session of its own;
    yield it once ``ready_path`` answers 200, and stop it on the way out, on errors too."""
    url = f"http://{HOST}:{port}"
    print(f"starting {name}: {' '.join(command)}  (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = StartedServer(name, url, command, log_path, proc)
    try:
        server.startup_s = wait_until_up(name, url + ready_path, proc, log_path, timeout)
        print(f"{name} is up at {url} after {server.startup_s:.1f} s", flush=True)
        yield server
    finally:
        status = server.stop()
        print(f"{name} stopped (exit status {status})", flush=True)
