"""``neorec serve DIR``: an HTTP server of an exported model (Starlette on uvicorn; the ``[serve]``
extra).

Endpoints: ``POST /predict`` (``serve.http_inputs``: rows of dense values and sparse ids, or raw
rows through the manifest's transforms) answers ``{"predictions": [...]}``; ``GET /healthz``
(200 while the inference thread takes requests, with what a request must hold); ``GET /metrics``
(Prometheus text, ``serve.serve_metrics``).

A request is read (at most ``max_body`` bytes within ``read_timeout_s``: a slow or vanished
client holds only its own connection), checked (4xx with one JSON line naming the field), then
queued for the one inference thread (``serve.batcher``); a full queue answers 503 with
``Retry-After``. SIGTERM (or Ctrl-C): the port stops accepting, requests in flight are answered,
then the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import signal
import socket
import sys
import threading
import time
from collections.abc import Generator
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from neorec.errors import NeorecError
from neorec.serve import standalone
from neorec.serve.batcher import Batcher, Draining, QueueFull
from neorec.serve.http_inputs import BadRequest, ModelInputs, parse_body
from neorec.serve.serve_metrics import CONTENT_TYPE, ServeMetrics

__all__ = ["ServeOptions", "ServeState", "build_app", "make_server", "serve", "check_options"]

PATHS = ("/predict", "/healthz", "/metrics")
CLIENT_GONE = 499
"""Recorded (never sent) when the client went away before its answer: nginx's code."""
BACKLOG = 2048
DRAIN_CAP = 64
"""A body over the limit is read and dropped up to this many times the limit before the 413 (a
client still sending when the connection closes would get a reset instead of the answer)."""


@dataclass(frozen=True)
class ServeOptions:
    """The flags of ``neorec serve`` (docs/serving.md, "The server")."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 128
    max_wait_ms: float = 2.0
    queue: int = 512
    threads: int = 1
    max_body: int = 1 << 20
    read_timeout_s: float = 30.0
    drain_timeout_s: float = 30.0
    max_inflight: int = 1024
    """``POST /predict`` requests being read, checked, queued or run at once; the next gets 503
    before its body is read (bounds the memory that bodies in flight take)."""


def check_options(o: ServeOptions) -> None:
    """One ``NeorecError`` line for the first flag out of range."""
    checks = [
        ("--port", o.port, 0 <= o.port <= 65535, "0..65535 (0: any free port)"),
        ("--max-batch", o.max_batch, o.max_batch >= 1, ">= 1 rows (1: no batching)"),
        ("--max-wait-ms", o.max_wait_ms, 0 <= o.max_wait_ms <= 10_000, "0..10000"),
        ("--queue", o.queue, o.queue >= 1, ">= 1 requests"),
        ("--threads", o.threads, o.threads >= 1, ">= 1"),
        ("--max-body-bytes", o.max_body, o.max_body >= 1024, ">= 1024"),
        ("--read-timeout-s", o.read_timeout_s, o.read_timeout_s > 0, "> 0"),
        ("--drain-timeout-s", o.drain_timeout_s, o.drain_timeout_s > 0, "> 0"),
        ("--max-inflight", o.max_inflight, o.max_inflight >= 1, ">= 1"),
    ]
    for flag, value, ok, want in checks:
        if not ok:
            raise NeorecError(f"neorec serve {flag} {value}: want {want}")


class ServeState:
    """What the handlers share: the model, its input checks, the batcher, the metrics."""

    def __init__(self, predictor: Any, opts: ServeOptions) -> None:
        self.predictor, self.opts = predictor, opts
        self.inputs = ModelInputs.of(predictor)
        self.batcher = Batcher(
            predictor,
            list(self.inputs.features),
            max_batch=opts.max_batch,
            max_wait_s=opts.max_wait_ms / 1000,
            capacity=opts.queue,
            threads=opts.threads,
        )
        self.metrics = ServeMetrics(opts.max_batch, self.batcher.depth, opts.queue)
        self.inflight = 0
        """``POST /predict`` requests under way (the event loop's own count: no lock)."""
        self.batcher.on_batch = self.metrics.batch


def _error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 (``BadRequest``) past ``limit`` bytes (read and dropped up to
    ``DRAIN_CAP`` times the limit first, so the client reads the answer)."""
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise BadRequest(f"Content-Length: {declared[:20]!r} is not a byte count")
    too_large = f"body: over {limit} bytes (neorec serve --max-body-bytes)"
    if declared is not None and int(declared) > limit:
        if "100-continue" in request.headers.get("expect", "").lower() or (
            int(declared) > DRAIN_CAP * limit
        ):
            raise BadRequest(too_large, 413)  # the body was not sent yet / is not worth reading
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DRAIN_CAP * limit:
            break
    if size > limit:
        raise BadRequest(too_large, 413)
    return b"".join(chunks)


async def predict(request: Request) -> Response:
    """``POST /predict``."""
    st: ServeState = request.app.state.neorec
    if st.inflight >= st.opts.max_inflight:
        msg = f"{st.inflight} requests under way (--max-inflight); retry after 1 s"
        return _error(503, msg, **{"Retry-After": "1", "Connection": "close"})
    st.inflight += 1
    try:
        return await _predict(request, st)
    finally:
        st.inflight -= 1


async def _predict(request: Request, st: ServeState) -> Response:
    try:
        body = await asyncio.wait_for(_read_body(request, st.opts.max_body), st.opts.read_timeout_s)
        job, want_info = parse_body(body, st.inputs, st.predictor)
    except BadRequest as e:
        close = {"Connection": "close"} if e.status == 413 else {}
        return _error(e.status, str(e), **close)
    except ClientDisconnect:
        return Response(status_code=CLIENT_GONE)
    except asyncio.TimeoutError:
        s = st.opts.read_timeout_s
        return _error(
            408, f"body: not received within {s:g} s (--read-timeout-s)", Connection="close"
        )
    if job.rows == 0:
        return JSONResponse({"predictions": []})
    try:
        future = st.batcher.submit(job)
    except QueueFull:
        msg = f"queue full ({st.opts.queue} requests waiting, --queue); retry after 1 s"
        return _error(503, msg, **{"Retry-After": "1"})
    except Draining:
        return _error(503, "the server is stopping", **{"Retry-After": "1"})
    try:
        probs, where = await asyncio.wrap_future(future)
    except Exception as e:  # noqa: BLE001 - a validated request the model refused: a defect
        return _error(500, f"inference failed ({type(e).__name__}: {str(e)[:200]})")
    if not np.isfinite(probs).all():
        return _error(500, "the model gave non-finite predictions (its weights hold NaN or inf?)")
    out: dict[str, Any] = {"predictions": probs.tolist()}
    if want_info:
        out["batch"] = asdict(where)
    return JSONResponse(out)


async def healthz(request: Request) -> Response:
    """``GET /healthz``: 200 and what a request must hold while requests are taken, else 503."""
    st: ServeState = request.app.state.neorec
    ok = st.batcher.alive()
    inputs = st.inputs
    body = {
        "status": "ok" if ok else "stopping",
        "num_dense": inputs.num_dense,
        "features": {
            f: {"table": inputs.tables[f], "rows": inputs.rows[f]} for f in inputs.features
        },
        "raw": isinstance(st.predictor.manifest.get("transforms"), dict)
        and st.predictor.manifest["transforms"].get("kind") == "criteo",
        "max_batch": st.opts.max_batch,
        "max_wait_ms": st.opts.max_wait_ms,
        "queue": {"depth": st.batcher.depth(), "capacity": st.opts.queue},
    }
    return JSONResponse(body, status_code=200 if ok else 503)


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text."""
    st: ServeState = request.app.state.neorec
    return Response(st.metrics.render(), media_type=CONTENT_TYPE)


class _Counted:
    """ASGI wrapper: every HTTP answer counted by path and code; /predict's latency (200s)."""

    def __init__(self, app: Any, metrics: ServeMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.monotonic(), [0]

        async def send_counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            code = status[0] or CLIENT_GONE
            took = time.monotonic() - t0 if path == "/predict" and code == 200 else None
            self.metrics.response(path, code, took)


async def _http_error(request: Request, exc: Exception) -> Response:
    """404 / 405 as one JSON line like every other error."""
    code = int(getattr(exc, "status_code", 500))
    what = "unknown path" if code == 404 else "method not allowed"
    msg = f"{request.method} {request.url.path}: {what} (POST /predict, GET /healthz, GET /metrics)"
    return _error(code, msg, **dict(getattr(exc, "headers", None) or {}))


def build_app(state: ServeState) -> Any:
    """The ASGI app of ``state``."""
    app = Starlette(
        routes=[
            Route("/predict", predict, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        exception_handlers={404: _http_error, 405: _http_error},
    )
    app.state.neorec = state
    return _Counted(app, state.metrics)


class _Server(uvicorn.Server):
    """uvicorn's server, but a SIGTERM / SIGINT that shut it down gracefully is not raised again
    afterwards (uvicorn re-raises it: the process would die by the signal instead of exit 0)."""

    signalled: int | None = None
    on_signal: Any = None
    """Called (on a thread of its own: the handler may interrupt a lock's holder) at the first
    signal: the batcher's flush."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._on_signal) for s in sigs}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        first = not self.should_exit
        self.signalled = sig
        self.should_exit = True
        if first and self.on_signal is not None:
            threading.Thread(target=self.on_signal, name="neorec-serve-flush", daemon=True).start()


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound here: a taken port is one clear line, not a log record)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)  # connections wait from now on, before uvicorn accepts them
    except OSError as e:
        raise NeorecError(
            f"neorec serve: cannot listen on {host}:{port} ({e.strerror or e})"
        ) from None
    sock.set_inheritable(True)
    return sock


_HTTP = "httptools" if importlib.util.find_spec("httptools") else "h11"
"""uvicorn's HTTP parser: httptools (C, the [serve] extra) where installed, else h11 (pure
Python, about twice the server CPU per request)."""
_LOOP = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
"""The event loop: uvloop (C, the [serve] extra on Linux / macOS) where installed."""


def make_server(state: ServeState) -> tuple[_Server, socket.socket]:
    """The uvicorn server of ``state`` and its listening socket (``server.run(sockets=[sock])``
    serves; the batcher is started by the caller)."""
    opts = state.opts
    sock = _bind(opts.host, opts.port)
    config = uvicorn.Config(
        build_app(state), log_level="warning", access_log=False, lifespan="off", http=_HTTP,
        loop=_LOOP,
        ws="none", timeout_graceful_shutdown=math.ceil(opts.drain_timeout_s), server_header=False,
        backlog=BACKLOG,
    )  # fmt: skip
    server = _Server(config)
    server.on_signal = state.batcher.flush
    return server, sock


def serve(directory: str, opts: ServeOptions, out: TextIO | None = None) -> int:
    """Load the export in ``directory`` (every file checked: a damaged folder is one
    ``NeorecError`` line before the port is bound), serve it until SIGTERM / Ctrl-C, drain,
    return 0."""
    out = out or sys.stdout
    check_options(opts)
    try:
        predictor = standalone.load(directory)
    except ValueError as e:  # ArtifactError names the file
        raise NeorecError(f"neorec serve {directory}: {str(e).splitlines()[0]}") from None
    state = ServeState(predictor, opts)
    server, sock = make_server(state)
    host, port = sock.getsockname()[:2]
    state.batcher.start()
    batching = f"batches of <= {opts.max_batch} rows, wait <= {opts.max_wait_ms:g} ms"
    if opts.max_batch == 1:
        batching = "no batching"
    print(
        f"neorec serve: {directory} on http://{host}:{port} ({batching}, queue {opts.queue}, "
        f"{opts.threads} inference thread(s)); POST /predict, GET /healthz, GET /metrics",
        file=out,
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        drained = state.batcher.stop(opts.drain_timeout_s)
    names = {int(signal.SIGTERM): "SIGTERM", int(signal.SIGINT): "interrupted"}
    why = names.get(server.signalled or 0, "stopped")
    n = state.metrics.count("/predict", 200)
    print(f"neorec serve: {why}: answered {n} predict requests; stopped", file=out, flush=True)
    return 0 if drained else 1
