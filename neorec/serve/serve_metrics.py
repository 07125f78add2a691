"""The server's counters and histograms, written as Prometheus text (``GET /metrics``).

Hand-written (about 100 lines) rather than ``prometheus_client``: the server exports a dozen series
of one process, and the text format (version 0.0.4) is a few lines per series; one dependency
less in the ``[serve]`` extra. Every method takes one lock: the event loop records requests, the
inference thread records batches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["Histogram", "ServeMetrics", "CONTENT_TYPE", "LATENCY_BUCKETS_S"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency histograms: fine around the 20 ms p99 target."""


def _fmt(v: float) -> str:
    return repr(float(v)) if v != int(v) or abs(v) >= 1e15 else str(int(v))


class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound, the sum and the count."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        """Count one value (the caller holds the lock)."""
        for i, b in enumerate(self.bounds):
            if v <= b:
                self.counts[i] += 1
                break
        self.total += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        """``name_bucket{le=...}`` (cumulative), ``name_sum`` and ``name_count``."""
        out, run = [], 0
        for b, c in zip(self.bounds, self.counts):
            run += c
            out.append(f'{name}_bucket{{le="{_fmt(b)}"}} {run}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_fmt(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


def _pow2_bounds(top: int) -> list[float]:
    out, b = [], 1
    while b < top:
        out.append(float(b))
        b *= 2
    return [*out, float(top)]


class ServeMetrics:
    """What ``neorec serve`` counts: responses by path and code, rows, batches (rows and requests
    per batch, inference time), request latency, the queue's depth (read at scrape time)."""

    def __init__(self, max_batch: int, queue_depth: Callable[[], int], capacity: int) -> None:
        self._lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = {}
        self.rows = 0
        self.batch_rows = Histogram(_pow2_bounds(max(max_batch, 1)))
        self.batch_requests = Histogram(_pow2_bounds(max(max_batch, 1)))
        self.latency = Histogram(LATENCY_BUCKETS_S)
        self.inference = Histogram(LATENCY_BUCKETS_S)
        self._depth = queue_depth
        self.capacity = capacity

    def response(self, path: str, code: int, seconds: float | None) -> None:
        """One answered request (``seconds``: its latency, for ``/predict``)."""
        with self._lock:
            key = (path, int(code))
            self.responses[key] = self.responses.get(key, 0) + 1
            if seconds is not None:
                self.latency.observe(seconds)

    def batch(self, rows: int, requests: int, seconds: float) -> None:
        """One batch run by the inference thread."""
        with self._lock:
            self.rows += rows
            self.batch_rows.observe(rows)
            self.batch_requests.observe(requests)
            self.inference.observe(seconds)

    def count(self, path: str, code: int) -> int:
        """Responses of ``path`` with status ``code`` so far."""
        with self._lock:
            return self.responses.get((path, code), 0)

    def render(self) -> str:
        """The Prometheus text of every series."""
        p = "neorec_serve_"
        out: list[str] = []
        depth = self._depth()  # outside our lock: the queue has its own

        def head(name: str, kind: str, text: str) -> None:
            out.extend([f"# HELP {p}{name} {text}", f"# TYPE {p}{name} {kind}"])

        with self._lock:
            head("requests_total", "counter", "HTTP requests answered, by path and status code.")
            for (path, code), n in sorted(self.responses.items()):
                out.append(f'{p}requests_total{{path="{path}",code="{code}"}} {n}')
            head("errors_total", "counter", "Requests answered with a 4xx or 5xx, by code.")
            errors: dict[int, int] = {}
            for (_, code), n in self.responses.items():
                if code >= 400:
                    errors[code] = errors.get(code, 0) + n
            for code, n in sorted(errors.items()):
                out.append(f'{p}errors_total{{code="{code}"}} {n}')
            head("rows_total", "counter", "Rows predicted.")
            out.append(f"{p}rows_total {self.rows}")
            for name, h, text in (
                ("batch_rows", self.batch_rows, "Rows per inference batch."),
                ("batch_requests", self.batch_requests, "Requests per inference batch."),
                ("request_latency_seconds", self.latency, "POST /predict: arrival to answer."),
                ("inference_seconds", self.inference, "Model time of one batch."),
            ):
                head(name, "histogram", text)
                out.extend(h.lines(p + name))
            head("queue_depth", "gauge", "Requests waiting for the inference thread.")
            out.append(f"{p}queue_depth {depth}")
            head("queue_capacity", "gauge", "Requests the queue holds before answering 503.")
            out.append(f"{p}queue_capacity {self.capacity}")
        return "\n".join(out) + "\n"
