"""Fault campaign of ``neorec serve`` (issue 53): bad bodies, huge bodies, slow and vanishing
clients, a damaged model folder at start. Each case gets one clear error (a 4xx with one JSON
line naming the field, or one ``neorec: error:`` line) and the server keeps serving: a good
request right after every case is answered, with the same predictions as before."""

from __future__ import annotations

import copy
import json
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faults import Campaign, campaign
from serve_http_util import GUARD_S, Server, ThreadServer, json_rows, read_response, trained_export

from neorec.cli import build_parser
from neorec.serve.server import ServeOptions, serve

MB10 = 10 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    m = trained_export(tmp_path_factory.mktemp("serve_faults"))
    m.row = json_rows(*m.predictor.inputs_from_raw(m.lines[:1], labels=True))[0]
    return m


@pytest.fixture(scope="module")
def srv(model: SimpleNamespace) -> Iterator[Server]:
    s = Server(model.art)
    yield s
    s.close()


def _row(model: SimpleNamespace, edit: Callable[[dict], None]) -> dict:
    row = copy.deepcopy(model.row)
    edit(row)
    return {"rows": [row]}


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict], None]:
    def edit(row: dict) -> None:
        node = row
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value

    return edit


def _bodies(model: SimpleNamespace) -> list[tuple[str, Any, int, str]]:
    """(case, body, status, what the error must name)."""
    r = lambda edit: _row(model, edit)  # noqa: E731
    dense12 = model.row["dense"][:12]
    return [
        ("malformed JSON", b'{"rows": [', 400, "body: not JSON"),
        ("not UTF-8", b'\xff\xfe{"rows"', 400, "body: not JSON"),
        ("empty body", b"", 400, "body: not JSON"),
        ("deeply nested JSON", b"[" * 100_000, 400, "body: not JSON"),
        ("a JSON list", b"[1, 2]", 400, "body: a JSON object"),
        ("neither rows nor raw", {}, 400, "exactly one of rows, raw"),
        ("unknown field", {"rows": [], "extra": 1}, 400, "unknown field 'extra'"),
        ("rows not a list", {"rows": {"a": 1}}, 400, "rows: a list"),
        ("row not an object", {"rows": [1]}, 400, "rows[0]:"),
        ("row without dense", r(lambda row: row.pop("dense")), 400, "missing field 'dense'"),
        ("dense a string", r(_set(("dense",), "1,2")), 400, "rows[0].dense: a list"),
        ("dense value a string", r(_set(("dense", 3), "1.5")), 400, "rows[0].dense[3]"),
        ("dense value a bool", r(_set(("dense", 0), True)), 400, "rows[0].dense[0]"),
        ("dense value null", r(_set(("dense", 1), None)), 400, "rows[0].dense[1]"),
        ("dense of 12", r(_set(("dense",), dense12)), 400, "12 values, the model reads 13"),
        ("NaN dense", r(_set(("dense", 5), float("nan"))), 400, "rows[0].dense[5]: nan"),
        ("Infinity dense", r(_set(("dense", 2), float("inf"))), 400, "rows[0].dense[2]: inf"),
        ("dense over float32", r(_set(("dense", 4), 1e39)), 400, "dense[4]: 1e+39 is not a finite"),
        ("dense integer of 400 digits", r(_set(("dense", 4), 10**400)), 400, "dense[4]"),
        ("sparse a list", r(_set(("sparse",), [])), 400, "rows[0].sparse: an object"),
        ("missing feature", r(lambda row: row["sparse"].pop("C5")), 400, "missing feature 'C5'"),
        ("unknown feature", r(_set(("sparse", "C99"), [1])), 400, 'unknown feature "C99"'),
        ("id a float", r(_set(("sparse", "C1"), [1.0])), 400, "sparse.C1[0]: 1.0 is not an"),
        ("id a string", r(_set(("sparse", "C1"), ["1"])), 400, "sparse.C1[0]"),
        ("ids not a list", r(_set(("sparse", "C1"), 7)), 400, "sparse.C1: a list of integer"),
        (
            "id out of range",
            r(_set(("sparse", "C1"), [2, 51])),
            400,
            "C1[1]: id 51 outside [0, 51)",
        ),
        ("negative id", r(_set(("sparse", "C2"), [-1])), 400, "C2[0]: id -1 outside [0, 52)"),
        (
            "dynamic id over int64",
            r(_set(("sparse", "C3"), [2**63])),
            400,
            "C3[0]: id 9223372036854775808",
        ),
        (
            "weights of the wrong length",
            r(_set(("sparse", "C1"), {"ids": [1, 2], "weights": [1.0]})),
            400,
            "sparse.C1.weights: a list of 2 numbers",
        ),
        (
            "NaN weight",
            r(_set(("sparse", "C1"), {"ids": [1], "weights": [float("nan")]})),
            400,
            "sparse.C1.weights[0]",
        ),
        ("bag without ids", r(_set(("sparse", "C1"), {"weights": []})), 400, "sparse.C1: a list"),
        ("raw row of 38 fields", {"raw": ["\t" * 37]}, 400, "raw: row 0: 38 fields"),
        ("raw bad hex", {"raw": ["\t" * 13 + "zz" + "\t" * 25]}, 400, "raw: row 0: field C1"),
        ("raw not a list", {"raw": "x"}, 400, "raw: a list"),
        ("labels not a bool", {"raw": [], "labels": 1}, 400, "labels: true or false"),
        ("labels with rows", {"rows": [], "labels": True}, 400, "labels: only with raw"),
        ("batch_info not a bool", {"rows": [], "batch_info": "yes"}, 400, "batch_info"),
        ("body just over 1 MiB", b" " * ((1 << 20) + 1), 413, "body: over 1048576 bytes"),
        ("10 MB body", b" " * MB10, 413, "body: over 1048576 bytes"),
    ]


def _judged(c: Campaign, name: str, status: int, body: Any, want: int, match: str) -> None:
    if status == want and isinstance(body, dict) and set(body) == {"error"}:
        msg = body["error"]
        ok = match in msg and "\n" not in msg
        c.record(name, "clear error" if ok else "crash", f"{status} {msg}")
    elif 200 <= status < 300:
        c.record(name, "silently accepted", f"{status} {body!r:.200}")
    else:
        c.record(name, "crash", f"{status} (want {want}) {body!r:.300}")


def _want(model: SimpleNamespace, srv: Any) -> list[float]:
    """The good row's prediction, asked once (tests of this file may run in any order)."""
    if not hasattr(model, "want"):
        status, first = srv.predict({"rows": [model.row]})
        assert status == 200, first
        model.want = first["predictions"]
    return list(model.want)


def _still_serving(c: Campaign, srv: Any, model: SimpleNamespace, after: str) -> None:
    want = _want(model, srv)
    status, out = srv.predict({"rows": [model.row]})
    if status != 200 or out["predictions"] != want:
        c.record(f"good request after {after}", "crash", f"{status} {out!r:.200}")


def test_bad_requests_get_one_line_naming_the_field(model: SimpleNamespace, srv: Server) -> None:
    c = campaign("HTTP server")
    _want(model, srv)
    for name, body, want, match in _bodies(model):
        status, _, out = srv.request("POST", "/predict", body)
        _judged(c, name, status, out, want, match)
        _still_serving(c, srv, model, name)
    chunks = (b" " * (1 << 16) for _ in range(MB10 >> 16))  # no Content-Length: chunked
    status, _, out = srv.request("POST", "/predict", chunks)  # type: ignore[arg-type]
    _judged(c, "10 MB chunked body", status, out, 413, "body: over")
    for name, method, path, want in (
        ("GET /predict", "GET", "/predict", 405),
        ("unknown path", "POST", "/nope", 404),
    ):
        status, _, out = srv.request(method, path, {"rows": []})
        _judged(c, name, status, out, want, path)
    with srv.connect() as sock:  # not HTTP at all: uvicorn's own 400, before the app
        sock.sendall(b"GARBAGE\x00\r\n\r\n")
        resp = sock.recv(4096)
    ok = resp.startswith(b"HTTP/1.1 400")
    c.record("not HTTP", "clear error" if ok else "crash", resp[:80].decode(errors="replace"))
    _still_serving(c, srv, model, "the campaign")
    assert srv.metric('neorec_serve_errors_total{code="400"}') >= 30
    c.check()


def test_huge_body_with_expect_continue_is_refused_unsent(
    model: SimpleNamespace, srv: Server
) -> None:
    """A client that asks first (``Expect: 100-continue``, as curl does) is told 413 before it
    sends the 10 MB."""
    c = campaign("HTTP server")
    with srv.connect() as sock:
        sock.sendall(
            b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % MB10
        )
        status, out = read_response(sock)
    _judged(c, "10 MB body, Expect: 100-continue", status, out, 413, "body: over")
    _still_serving(c, srv, model, "Expect: 100-continue")
    c.check()


def _head(n: int) -> bytes:
    return b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n


def test_slow_and_vanishing_clients_stall_nothing(model: SimpleNamespace, srv: Server) -> None:
    """A client sending its body in pieces holds only its own connection: other requests are
    answered meanwhile, then it is answered too. Clients that leave mid-body, or after sending
    and before the answer, leave the server serving (499 counted)."""
    c = campaign("HTTP server")
    body = json.dumps({"rows": [model.row] * 3}).encode()
    slow = srv.connect()
    slow.sendall(_head(len(body)))
    pieces = [body[i : i + len(body) // 5 + 1] for i in range(0, len(body), len(body) // 5 + 1)]
    for piece in pieces:
        slow.sendall(piece)
        _still_serving(c, srv, model, "a slow client's piece")  # answered in between
    status, out = read_response(slow)
    slow.close()
    if status == 200 and len(out["predictions"]) == 3:
        c.record("slow client (body in 5 pieces)", "handled", "answered after the others")
    else:
        c.record("slow client (body in 5 pieces)", "crash", f"{status} {out!r:.200}")

    gone_before = srv.metric('neorec_serve_requests_total{path="/predict",code="499"}')
    with srv.connect() as sock:  # leaves mid-body
        sock.sendall(_head(len(body)) + body[: len(body) // 2])
    with srv.connect() as sock:  # leaves after sending, before the answer
        sock.sendall(_head(len(body)) + body)
        sock.shutdown(socket.SHUT_RDWR)
    deadline = time.monotonic() + GUARD_S  # a failure guard, not a measured window
    while srv.metric('neorec_serve_requests_total{path="/predict",code="499"}') <= gone_before:
        assert time.monotonic() < deadline, "the client that left mid-body was never noticed"
        time.sleep(0.05)
    c.record("client leaves mid-body", "handled", "counted as 499")
    _still_serving(c, srv, model, "clients that left")
    c.check()


def test_read_timeout_answers_408(model: SimpleNamespace) -> None:
    """A body that does not arrive within --read-timeout-s gets 408 (in-process server)."""
    c = campaign("HTTP server")
    ts = ThreadServer(model.predictor, read_timeout_s=0.5)
    try:
        with ts.connect() as sock:
            sock.sendall(_head(100) + b'{"rows": ')  # and never the rest
            status, out = read_response(sock)
        _judged(c, "body never completed (slowloris)", status, out, 408, "--read-timeout-s")
        _still_serving(c, ts, model, "a 408")
    finally:
        ts.close()
    c.check()


def _damaged(model: SimpleNamespace, tmp: Path, name: str, damage: Callable[[Path], None]) -> Path:
    d = tmp / name
    shutil.copytree(model.art, d)
    damage(d)
    return d


def _truncate(rel: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        p = d / rel
        p.write_bytes(p.read_bytes()[:-8])

    return damage


def _flip(rel: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        p = d / rel
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))

    return damage


def test_bad_model_folder_or_flags_fail_at_start(
    model: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged export folder, a taken port, a bad flag: one line, a non-zero exit, before the
    port is bound."""
    c = campaign("HTTP server start")
    manifest = json.loads((model.art / "manifest.json").read_text())
    table = manifest["tables"][0]["files"]["weight"]
    dense = manifest["dense"]["file"]
    damages = [
        ("table file truncated", _truncate(table), Path(table).name),
        ("dense program damaged", _flip(dense), Path(dense).name),
        ("manifest edited", _flip("manifest.json"), "manifest.json"),
        ("manifest missing", lambda d: (d / "manifest.json").unlink(), "manifest.json"),
    ]
    opts = ServeOptions(port=0)
    for i, (name, damage, names) in enumerate(damages):
        d = _damaged(model, tmp_path, f"d{i}", damage)
        c.expect_error(name, lambda d=d: serve(str(d), opts), ("neorec serve", names))
    c.expect_error("no such folder", lambda: serve(str(tmp_path / "none"), opts), "manifest.json")
    c.expect_cli_error(  # the command line: exit 2, one line on stderr
        "table file truncated (neorec serve)",
        ["serve", str(tmp_path / "d0"), "--port", "0"],
        Path(table).name,
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        c.expect_error(
            "port taken", lambda: serve(str(model.art), ServeOptions(port=port)), "cannot listen"
        )
    for flag, value in (("--max-batch", "0"), ("--queue", "0"), ("--max-wait-ms", "-1")):
        argv = ["serve", str(model.art), flag, value]
        c.expect_error(f"{flag} {value}", lambda a=argv: _main_raising(a), flag)
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn: ImportError
    c.expect_error(
        "without the [serve] extra",
        lambda: _main_raising(["serve", str(model.art)]),
        "pip install 'neorec[serve]'",
    )
    c.check()


def _main_raising(argv: list[str]) -> None:
    """``neorec ARGV`` with its ``NeorecError`` raised (``main`` prints it as one line)."""
    args = build_parser([argv[0]]).parse_args(argv)
    args.func(args)


def test_inflight_cap_answers_503_before_the_body(model: SimpleNamespace) -> None:
    """--max-inflight 1: while a slow client holds the one slot, the next request gets 503 with
    Retry-After (its body unread); then both sides carry on (in-process server)."""
    c = campaign("HTTP server")
    ts = ThreadServer(model.predictor, max_inflight=1)
    try:
        want = _want(model, ts)  # (asked before the slot is taken)
        body = json.dumps({"rows": [model.row]}).encode()
        with ts.connect() as slow:
            slow.sendall(_head(len(body)) + body[:10])
            while ts.state.inflight < 1:  # the slow request holds the slot
                time.sleep(0.05)
            status, headers, out = ts.request("POST", "/predict", {"rows": [model.row]})
            ok = status == 503 and headers.get("retry-after") == "1"
            _judged(c, "over --max-inflight", status, out, 503, "--max-inflight")
            assert ok, (status, headers)
            slow.sendall(body[10:])
            status, out = read_response(slow)
        assert status == 200 and out["predictions"] == want
        _still_serving(c, ts, model, "--max-inflight")
    finally:
        ts.close()
    c.check()
