"""``neorec bench serve``'s server side: ``neorec serve`` in a subprocess, and the search for the
highest request rate it holds under a latency bound.

``ServerProcess`` starts ``python -m neorec serve DIR --port P`` on a free port, waits for
``GET /healthz`` to answer 200, reads the server's CPU time from ``/proc`` (its share of the
machine beside the load generator), and stops it with SIGTERM (the server drains, then exits).

``held_rate`` walks a geometric ladder of open-loop rates up from ``start`` (down when the first
level already fails) to the first level that fails the bound (p99 above it, or any error), then
bisects (geometrically) between the last level that held and the first that failed; the highest
offered rate that held is the result. ``overload`` then offers a multiple of the first failing
rate and reports how the server refused the excess: 503s with ``Retry-After`` is the contract,
timeouts, dropped connections or a dead server are not.
"""

from __future__ import annotations

import http.client
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neorec.errors import NeorecError

__all__ = ["ServerProcess", "free_port", "held", "held_rate", "overload", "SearchSettings"]

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port of localhost free now (the OS's choice of an ephemeral port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class ServerProcess:
    """``neorec serve artifact --port P *args`` as a subprocess (its output in ``log``)."""

    def __init__(self, artifact: Path, args: list[str], log: Path, start_timeout: float = 120.0):
        self.artifact, self.args, self.log = Path(artifact), list(args), Path(log)
        self.start_timeout = start_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        """Start it and wait for ``/healthz`` (``NeorecError`` with its log's tail when it exits
        or does not answer in time)."""
        self.port = free_port()
        argv = [sys.executable, "-m", "neorec", "serve", str(self.artifact)]
        argv += ["--port", str(self.port), *self.args]
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise NeorecError(
                    f"bench serve: `{' '.join(argv[1:])}` exited with {self.proc.returncode} "
                    f"before answering /healthz: {self.tail()}"
                )
            if self.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        raise NeorecError(
            f"bench serve: the server did not answer /healthz within {self.start_timeout:.0f} s: "
            f"{self.tail()}"
        )

    def healthy(self) -> bool:
        """``GET /healthz`` answers 200."""
        try:
            return _get(self.port, "/healthz")[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def alive(self) -> bool:
        """The process runs and answers ``/healthz``."""
        return self.proc is not None and self.proc.poll() is None and self.healthy()

    def metrics(self) -> str:
        """``GET /metrics`` (Prometheus text), empty when it does not answer."""
        try:
            status, body = _get(self.port, "/metrics")
        except (OSError, http.client.HTTPException):
            return ""
        return body.decode(errors="replace") if status == 200 else ""

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the server process has used (``/proc/PID/stat``)."""
        if self.proc is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tail(self, lines: int = 5) -> str:
        """The last lines of its log, joined on one line."""
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    def stop(self) -> int | None:
        """SIGTERM, then wait (SIGKILL after 30 s); its exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SearchSettings:
    """How ``held_rate`` searches: the bound, the ladder, the bisection."""

    def __init__(self, bound_ms: float, start: float, factor: float, bisect: int, max_rate: float,
                 min_rate: float, precision: float = 1.1) -> None:  # fmt: skip
        self.bound_ms, self.start, self.factor = bound_ms, start, factor
        self.bisect, self.max_rate, self.min_rate = bisect, max_rate, min_rate
        self.precision = precision
        """Stop bisecting when the failing rate is within this factor of the held one."""


def held(level: dict[str, Any], bound_ms: float) -> bool:
    """A level holds: every request answered 200, p99 within the bound."""
    p99 = level.get("p99_ms")
    return level["error_count"] == 0 and p99 is not None and p99 <= bound_ms


def held_rate(run: Callable[[float], dict[str, Any]], s: SearchSettings) -> dict[str, Any]:
    """The highest offered rate of ``run(rate)`` (a level's summary) that holds the bound; the
    levels run, in order, each marked ``held``."""
    levels: list[dict[str, Any]] = []

    def step(rate: float) -> bool:
        lv = run(rate)
        lv["held"] = held(lv, s.bound_ms)
        levels.append(lv)
        return bool(lv["held"])

    ok: float | None = None
    bad: float | None = None
    rate = s.start
    if step(rate):
        ok = rate
        while rate * s.factor <= s.max_rate:
            rate *= s.factor
            if not step(rate):
                bad = rate
                break
            ok = rate
    else:
        bad = rate
        while rate / s.factor >= s.min_rate:
            rate /= s.factor
            if step(rate):
                ok = rate
                break
            bad = rate
    for _ in range(s.bisect):
        if ok is None or bad is None or bad / ok <= s.precision:
            break
        mid = math.sqrt(ok * bad)
        if step(mid):
            ok = mid
        else:
            bad = mid
    return {
        "max_rps": round(ok, 2) if ok is not None else 0.0,
        "first_failing_rps": round(bad, 2) if bad is not None else None,
        "levels": levels,
    }


def overload(level: dict[str, Any], alive: bool) -> dict[str, Any]:
    """The verdict of a level above the held rate: the excess was refused with 503 (with
    ``Retry-After``), nothing timed out or dropped, the server still answers."""
    e = level["errors"]
    clean = e["timeout"] == 0 and e["connection"] == 0 and e["http_5xx"] == 0
    clean = clean and e.get("http_503_no_retry_after", 0) == 0 and e["bad_answer"] == 0
    return {
        **level,
        "server_alive": alive,
        "refused_with_503": e["http_503"],
        "only_503": bool(clean and alive),
    }
