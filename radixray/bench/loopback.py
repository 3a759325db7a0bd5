"""The machine's loopback TCP rate: the ceiling a KV transfer over TCP between two local
workers can reach, measured with plain sockets between two processes (the sender in
this one, the receiver in a child), so a transfer rate is read as a share of it."""

from __future__ import annotations

import multiprocessing as mp
import socket
import time


def _sink(port: int, chunk: int, rounds: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        buf = memoryview(bytearray(1 << 20))
        for _ in range(rounds):
            got = 0
            while got < chunk:
                n = conn.recv_into(buf, min(len(buf), chunk - got))
                if n == 0:
                    return
                got += n
            conn.sendall(b"k")  # this round's bytes all arrived


def tcp_loopback_rate(chunk_bytes: int = 64 << 20, rounds: int = 5) -> float:
    """Median bytes/second of ``rounds`` sends of ``chunk_bytes`` over one loopback TCP
    connection to another process (each round timed until the receiver confirms it got
    every byte; one more round first, untimed, to warm up)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        child = mp.get_context("spawn").Process(
            target=_sink, args=(server.getsockname()[1], chunk_bytes, rounds + 1))
        child.start()
        conn, _ = server.accept()
    data = bytes(chunk_bytes)
    rates = []
    with conn:
        conn.sendall(data)  # warm-up round (connection, page faults)
        conn.recv(1)
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.sendall(data)
            conn.recv(1)
            rates.append(chunk_bytes / (time.perf_counter() - t0))
    child.join(30)
    rates.sort()
    return rates[len(rates) // 2]
