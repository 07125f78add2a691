"""The load generator of ``neorec bench serve``: worker processes with keep-alive connections.

``LoadGen(host, port, bodies)`` starts ``workers`` processes (``spawn``: nothing of the parent's
torch state is inherited), each holding ``connections`` keep-alive ``http.client`` connections to
the server, one thread per connection. A level runs in every worker at once from a common start
time (``time.monotonic``, one clock for every process on Linux):

- open loop (``Level.open``): each worker draws its own Poisson arrivals at ``rate / workers``
  (their superposition is a Poisson process at ``rate``); a request's latency counts from its
  *scheduled* send time, so a request that waited for a free connection, or behind a slow one,
  carries that wait (no coordinated omission). The sends' lag behind their schedule is reported
  (``client_lag_p99_ms``): a large lag means the client, not the server, was short.
- closed loop (``Level.closed``): ``concurrency`` connections each send their next request as soon
  as the previous one is answered; latency from send to answer.

Each level reports the offered and achieved rate, p50 / p90 / p99 / max latency of the answered
requests (HTTP 200), the errors by kind (``ERROR_KINDS``), and the CPU the client's own processes
used (``client_cores``: CPU seconds over wall seconds), so a reader sees how much of the machine
the load generator took. This module imports nothing beyond the standard library and NumPy.
"""

from __future__ import annotations

import http.client
import json
import math
import multiprocessing as mp
import random
import socket
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["ERROR_KINDS", "Level", "LoadGen", "summarize", "request_body"]

ERROR_KINDS = ("http_503", "http_4xx", "http_5xx", "timeout", "connection", "bad_answer")
"""How a request failed: 503 (overload), another 4xx, another 5xx, no answer within the timeout,
a refused / reset / closed connection, an answer 200 without ``predictions``."""

PATH = "/predict"
START_DELAY = 0.2
"""Seconds between sending a level to the workers and its common start."""


def request_body(rows: list[dict[str, Any]]) -> bytes:
    """The ``POST /predict`` body of ``rows`` (``{"rows": [...]}``, compact JSON)."""
    return json.dumps({"rows": rows}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Level:
    """One load level: open loop at ``rate`` requests/s for ``requests`` requests, or closed loop
    at ``concurrency`` connections for ``seconds``."""

    mode: str
    rate: float = 0.0
    requests: int = 0
    concurrency: int = 0
    seconds: float = 0.0
    seed: int = 0

    @staticmethod
    def open(rate: float, seconds: float, min_requests: int, seed: int = 0) -> Level:
        """Open loop at ``rate``/s, long enough for ``seconds`` and ``min_requests``."""
        n = max(int(min_requests), math.ceil(rate * seconds))
        return Level("open", rate=float(rate), requests=n, seed=seed)

    @staticmethod
    def closed(concurrency: int, seconds: float) -> Level:
        """Closed loop at ``concurrency`` connections for ``seconds``."""
        return Level("closed", concurrency=int(concurrency), seconds=float(seconds))


# ---- in a worker process -----------------------------------------------------------------------
class _Connection(http.client.HTTPConnection):
    """A keep-alive connection with Nagle's algorithm off (a request is one small write)."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Conns:
    """A worker's keep-alive connections, one per thread, made on first use."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.conns: dict[int, http.client.HTTPConnection] = {}

    def get(self, k: int) -> http.client.HTTPConnection:
        if k not in self.conns:
            self.conns[k] = _Connection(self.host, self.port, timeout=self.timeout)
        return self.conns[k]


def _send(conn: http.client.HTTPConnection, body: bytes) -> str:
    """One request on ``conn``: ``"ok"`` or an error kind (the connection closed after an error,
    so that the next request opens a fresh one)."""
    try:
        conn.request("POST", PATH, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        status = resp.status
    except TimeoutError:
        conn.close()
        return "timeout"
    except (OSError, http.client.HTTPException):
        conn.close()
        return "connection"
    if status == 200:
        return "ok" if b'"predictions"' in data else "bad_answer"
    if status == 503:
        return "http_503" if resp.getheader("Retry-After") else "http_503_no_retry_after"
    return "http_4xx" if 400 <= status < 500 else "http_5xx"


class _Record:
    """What a worker's threads saw during one level (appended under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.latency: list[float] = []
        self.lag: list[float] = []
        self.errors: Counter[str] = Counter()
        self.last_done = 0.0

    def add(self, outcome: str, latency: float, lag: float, done: float) -> None:
        with self.lock:
            if outcome == "ok":
                self.latency.append(latency)
            else:
                self.errors[outcome] += 1
            self.lag.append(lag)
            self.last_done = max(self.last_done, done)


def _open_thread(
    conn: http.client.HTTPConnection,
    schedule: list[float],
    nxt: list[int],
    bodies: list[bytes],
    rec: _Record,
) -> None:
    while True:
        with rec.lock:
            i = nxt[0]
            nxt[0] += 1
        if i >= len(schedule):
            return
        due = schedule[i]
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        sent = time.monotonic()
        outcome = _send(conn, bodies[i % len(bodies)])
        done = time.monotonic()
        rec.add(outcome, done - due, sent - due, done)


def _closed_thread(
    conn: http.client.HTTPConnection, start: float, end: float, offset: int, bodies: list[bytes],
    rec: _Record,
) -> None:  # fmt: skip
    wait = start - time.monotonic()
    if wait > 0:
        time.sleep(wait)
    i = offset
    while time.monotonic() < end:
        sent = time.monotonic()
        outcome = _send(conn, bodies[i % len(bodies)])
        done = time.monotonic()
        rec.add(outcome, done - sent, 0.0, done)
        i += 7919  # another body next (a prime stride over the pool)


def _run_level(
    level: Level, start: float, index: int, workers: int, conns: _Conns, bodies: list[bytes],
    threads: int,
) -> dict[str, Any]:  # fmt: skip
    """This worker's share of ``level``, from ``start``; its record as plain data."""
    rec = _Record()
    cpu0 = time.process_time()
    if level.mode == "open":
        rng = random.Random(level.seed * 1000 + index)
        n = level.requests // workers + (1 if index < level.requests % workers else 0)
        t, schedule = start, []
        for _ in range(n):
            t += rng.expovariate(level.rate / workers)
            schedule.append(t)
        nxt = [0]
        args = [(conns.get(k), schedule, nxt, bodies, rec) for k in range(threads)]
        pool = [threading.Thread(target=_open_thread, args=a) for a in args]
    else:
        mine = range(index, level.concurrency, workers)
        end = start + level.seconds
        pool = [
            threading.Thread(
                target=_closed_thread, args=(conns.get(k), start, end, k * 131, bodies, rec)
            )
            for k in mine
        ]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return {
        "latency": rec.latency,
        "lag": rec.lag,
        "errors": dict(rec.errors),
        "last_done": rec.last_done,
        "cpu": time.process_time() - cpu0,
    }


def _worker(pipe: Any, host: str, port: int, bodies: list[bytes], threads: int, timeout: float,
            index: int, workers: int) -> None:  # fmt: skip
    """A worker process: runs the levels it is sent until it is sent None."""
    conns = _Conns(host, port, timeout)
    pipe.send("ready")
    while True:
        msg = pipe.recv()
        if msg is None:
            return
        level, start = msg
        pipe.send(_run_level(Level(**level), start, index, workers, conns, bodies, threads))


# ---- in the parent ------------------------------------------------------------------------------
def _pct(a: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(a, q)) * 1e3, 3) if a.size else None


def summarize(level: Level, parts: list[dict[str, Any]], start: float) -> dict[str, Any]:
    """One level's result from its workers' records (latencies in ms)."""
    lat = np.asarray([x for p in parts for x in p["latency"]], dtype=np.float64)
    lag = np.asarray([x for p in parts for x in p["lag"]], dtype=np.float64)
    errors: Counter[str] = Counter()
    for p in parts:
        errors.update(p["errors"])
    end = max([p["last_done"] for p in parts] + [start])
    wall = max(end - start, 1e-9)
    if level.mode == "closed":
        wall = max(wall, level.seconds)
    out: dict[str, Any] = {"mode": level.mode}
    if level.mode == "open":
        out["offered_rps"] = round(level.rate, 2)
    else:
        out["concurrency"] = level.concurrency
    out.update(
        requests=int(lat.size + sum(errors.values())),
        ok=int(lat.size),
        achieved_rps=round(lat.size / wall, 2),
        seconds=round(wall, 3),
        p50_ms=_pct(lat, 50),
        p90_ms=_pct(lat, 90),
        p99_ms=_pct(lat, 99),
        max_ms=round(float(lat.max()) * 1e3, 3) if lat.size else None,
        errors={k: int(errors.get(k, 0)) for k in ERROR_KINDS},
        client_cores=round(sum(p["cpu"] for p in parts) / wall, 3),
    )
    extra = {k: int(v) for k, v in errors.items() if k not in ERROR_KINDS}
    if extra:  # e.g. 503 without Retry-After: an error of the server, named
        out["errors"].update(extra)
    out["error_count"] = int(sum(errors.values()))
    if level.mode == "open":
        out["client_lag_p99_ms"] = _pct(lag, 99)
    return out


class LoadGen:
    """Worker processes sending ``bodies`` (round robin) to ``host:port`` (see the module
    docstring); a context manager."""

    def __init__(
        self, host: str, port: int, bodies: list[bytes], workers: int = 2, connections: int = 16,
        timeout: float = 2.0,
    ) -> None:  # fmt: skip
        if not bodies:
            raise ValueError("LoadGen needs at least one request body")
        ctx = mp.get_context("spawn")
        self.workers = workers
        self.connections = connections
        self.procs: list[Any] = []
        self.pipes: list[Any] = []
        for i in range(workers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(theirs, host, port, bodies, connections, timeout, i, workers),
                daemon=True,
            )
            p.start()
            self.procs.append(p)
            self.pipes.append(mine)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a load generator worker did not start")

    def run(self, level: Level) -> dict[str, Any]:
        """Run ``level`` in every worker from a common start; its summary."""
        if level.mode == "closed" and level.concurrency > self.workers * self.connections:
            raise ValueError(
                f"closed loop at {level.concurrency} connections: the load generator has "
                f"{self.workers} x {self.connections}"
            )
        start = time.monotonic() + START_DELAY
        for pipe in self.pipes:
            pipe.send((asdict(level), start))
        parts = [pipe.recv() for pipe in self.pipes]
        return summarize(level, parts, start)

    def close(self) -> None:
        """Stop the workers (they end when told, else when their parent's pipe closes)."""
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)

    def __enter__(self) -> LoadGen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
