"""``neorec bench serve``: the load generator's error kinds over real HTTP on localhost, the
held-rate search on a known latency curve, and the whole pipeline on a tiny model (keys only: no
timing is asserted, a loaded machine must pass)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from neorec.bench import serve
from neorec.bench.serve_load import ERROR_KINDS, Level, LoadGen, request_body
from neorec.bench.serve_search import SearchSettings, held, held_rate, overload
from neorec.errors import ConfigError

BODY = request_body([{"dense": [0.0], "sparse": {"t0": [1, 2]}}])


def _handler(status: int, retry_after: bool) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1  # one write per answer

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b'{"predictions":[0.5]}' if status == 200 else b'{"error":"busy"}'
            self.send_response(status)
            if retry_after:
                self.send_header("Retry-After", "1")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@contextlib.contextmanager
def _server(status: int, retry_after: bool = True) -> Iterator[int]:
    """A stdlib HTTP server on a free localhost port answering every POST with ``status``."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(status, retry_after))
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield int(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_level_of_503s_is_reported_as_refused_not_as_latency() -> None:
    with _server(503) as port, LoadGen("127.0.0.1", port, [BODY], 1, 2, timeout=10) as lg:
        lv = lg.run(Level.open(400, 0.0, 12))
        closed = lg.run(Level.closed(2, 0.05))
    assert lv["requests"] == 12 and lv["ok"] == 0 and lv["error_count"] == 12
    assert lv["errors"] == {**dict.fromkeys(ERROR_KINDS, 0), "http_503": 12}
    assert lv["p99_ms"] is None and not held(lv, 1e9)
    verdict = overload(lv, alive=True)
    assert verdict["only_503"] and verdict["refused_with_503"] == 12
    assert not overload(lv, alive=False)["only_503"]  # a server that died is no clean refusal
    assert closed["ok"] == 0 and closed["errors"]["http_503"] == closed["requests"] > 0


def test_503_without_retry_after_and_other_errors_are_named() -> None:
    with _server(503, retry_after=False) as port, LoadGen("127.0.0.1", port, [BODY], 1, 2) as lg:
        lv = lg.run(Level.open(400, 0.0, 5))
    assert lv["errors"]["http_503_no_retry_after"] == 5 and lv["errors"]["http_503"] == 0
    assert not overload(lv, alive=True)["only_503"]
    with _server(500) as port, LoadGen("127.0.0.1", port, [BODY], 1, 2) as lg:
        assert lg.run(Level.open(400, 0.0, 4))["errors"]["http_5xx"] == 4
    with _server(200) as port:
        pass  # closed: nothing listens on the port any more
    with LoadGen("127.0.0.1", port, [BODY], 1, 2, timeout=5) as lg:
        lv = lg.run(Level.open(400, 0.0, 3))
    assert lv["errors"]["connection"] == 3 and lv["ok"] == 0


def test_answered_requests_count_once_each_over_two_workers() -> None:
    with _server(200) as port, LoadGen("127.0.0.1", port, [BODY, BODY], 2, 3, timeout=10) as lg:
        lv = lg.run(Level.open(500, 0.0, 21))
    assert lv["requests"] == lv["ok"] == 21 and lv["error_count"] == 0
    assert lv["p50_ms"] <= lv["p90_ms"] <= lv["p99_ms"] <= lv["max_ms"]
    assert held(lv, 1e9) and lv["client_cores"] >= 0


def _curve(p99_per_rps: float, errors_above: float) -> Any:
    """A fake server: p99 grows linearly with the rate; errors above a rate."""

    def run(rate: float) -> dict[str, Any]:
        return {"offered_rps": rate, "p99_ms": rate * p99_per_rps,
                "error_count": int(rate > errors_above)}  # fmt: skip

    return run


def test_held_rate_ladder_then_bisection_finds_the_bound() -> None:
    s = SearchSettings(20.0, start=50, factor=2, bisect=6, max_rate=1e6, min_rate=1, precision=1.01)
    found = held_rate(_curve(0.1, 1e9), s)  # p99 = 20 ms at 200/s
    rates = [lv["offered_rps"] for lv in found["levels"]]
    assert rates[:4] == [50, 100, 200, 400]  # the ladder, to the first failure
    assert found["max_rps"] == 200 and found["first_failing_rps"] <= 400
    assert all(lv["held"] == (lv["offered_rps"] <= 200) for lv in found["levels"])
    # errors fail a level even under the bound; the first level failing walks down
    found = held_rate(_curve(0.001, 30), s)
    assert [lv["offered_rps"] for lv in found["levels"]][:2] == [50, 25]
    assert 25 <= found["max_rps"] <= 30
    nothing = held_rate(_curve(1.0, 0), s)  # never holds: 0, not the lowest rate tried
    assert nothing["max_rps"] == 0.0


def test_bad_flags_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="--quantize 'int3'"):
        serve.parse_args(["--quantize", "none,int3"])
    with pytest.raises(ConfigError, match="--closed 200"):
        serve.parse_args(["--closed", "200", "--workers", "1", "--connections", "8"])
    with pytest.raises(ConfigError, match="--rows-per-request"):
        serve.parse_args(["--rows-per-request", "0"])


def test_quick_pipeline_prints_the_check_keys(tmp_path: Path, capsys: Any) -> None:
    """Train, export, serve with batching on and off, search, overload, closed loop,
    characterize: the JSON line's keys (no timing asserted)."""
    assert serve.main(["--quick", "--workdir", str(tmp_path)]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    m = line["max_rps_p99_20ms"]
    assert set(m) == {"batched", "unbatched"} and all(v >= 0 for v in m.values())
    assert "batching_gain" in line and line["headline"] == "default/fp32/r1"
    assert [v["batching"] for v in line["variants"]] == [True, False]
    for v in line["variants"]:
        assert v["server_exit"] == 0  # SIGTERM: drained, exit 0
        assert v["levels"] and all("held" in lv for lv in v["levels"])
        o = v["overload"]
        assert set(o["errors"]) >= set(ERROR_KINDS) and "only_503" in o and o["server_alive"]
        assert o["errors"]["timeout"] == o["errors"]["connection"] == 0
        assert v["closed"][0]["concurrency"] == 2
    rows = line["characterize"]["default/fp32"]
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["total_ms"] > 0 and r["embedding_ms"] > 0 and r["dense_ms"] > 0
