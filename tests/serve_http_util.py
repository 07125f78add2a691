"""Helpers of the ``neorec serve`` tests: a tiny Criteo-trained model exported, a real server
process on an ephemeral port of 127.0.0.1, and plain HTTP (http.client, raw sockets) to it."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_serve_raw import _lines, _tables
from test_trainer import tiny_cfg

from neorec.cli import main
from neorec.serve import save_model, standalone
from neorec.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 120.0
"""A failure guard only (start-up imports torch on a loaded machine); never a measured window."""

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


def trained_export(tmp: Path) -> SimpleNamespace:
    """A model trained on 96 Criteo lines (26 tables, C3 dynamic), saved, exported fp32."""
    train, held = tmp / "train.tsv", tmp / "held.tsv"
    train.write_text("".join(_lines(96, 0)))
    held_lines = _lines(24, 1)
    held.write_text("".join(held_lines))
    cfg = tiny_cfg(
        tmp, _tables(), "model.bottom_mlp=[8, 4]", "data.batch_size=16", "data.source='criteo'",
        f"data.path='{train}'", f"data.eval_path='{held}'",
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    if not (tmp / "model" / "model.json").exists():
        save_model(trainer.model, trainer.cfg, tmp / "model")
    art = tmp / "art"
    assert main(["export", "--model", str(tmp), "--out", str(art)]) == 0
    predictor = standalone.load(str(art))
    return SimpleNamespace(tmp=tmp, held=held, lines=held_lines, art=art, predictor=predictor)


def json_rows(dense: np.ndarray, sparse: dict[str, Any], weights: bool = False) -> list[dict]:
    """``{"dense", "sparse"}`` rows of Predictor inputs (``weights``: per-id weights 0.5, 1.5,
    ... added)."""
    rows: list[dict] = [{"dense": [float(v) for v in d], "sparse": {}} for d in dense]
    for f, (lengths, ids, *_) in sparse.items():
        off = 0
        for i, n in enumerate(lengths):
            bag = [int(x) for x in ids[off : off + n]]
            off += int(n)
            if weights:
                rows[i]["sparse"][f] = {"ids": bag, "weights": [0.5 + k for k in range(len(bag))]}
            else:
                rows[i]["sparse"][f] = bag
    return rows


def predictor_inputs(rows: list[dict], features: list[str]) -> tuple[np.ndarray, dict]:
    """What the Predictor takes for JSON ``rows`` (the reference the server is compared with)."""
    dense = np.asarray([r["dense"] for r in rows], dtype=np.float32)
    sparse = {}
    for f in features:
        bags = [r["sparse"][f] for r in rows]
        ids = [b["ids"] if isinstance(b, dict) else b for b in bags]
        lengths = np.asarray([len(b) for b in ids], dtype=np.int64)
        flat = np.asarray([x for b in ids for x in b], dtype=np.int64)
        if any(isinstance(b, dict) for b in bags):
            w = [x for b in bags for x in (b["weights"] if isinstance(b, dict) else [1.0] * len(b))]
            sparse[f] = (lengths, flat, np.asarray(w, dtype=np.float32))
        else:
            sparse[f] = (lengths, flat)
    return dense, sparse


class Client:
    """Plain HTTP to a server at ``host:port``."""

    host: str
    port: int

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, JSON or text) of one request on a new connection."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=GUARD_S)
        try:
            data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
            conn.request(method, path, body=data, headers=headers or {})
            resp = conn.getresponse()
            raw = resp.read()
            hdrs = {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()
        text = raw.decode()
        is_json = hdrs.get("content-type", "").startswith("application/json")
        return resp.status, hdrs, json.loads(text) if is_json else text

    def predict(self, body: Any) -> tuple[int, Any]:
        status, _, out = self.request("POST", "/predict", body)
        return status, out

    def connect(self) -> socket.socket:
        """A raw TCP connection (slow and vanishing clients)."""
        return socket.create_connection((self.host, self.port), timeout=GUARD_S)

    def metric(self, name: str) -> float:
        """The value of one series (``name`` with its labels) of GET /metrics, 0 if absent."""
        _, _, text = self.request("GET", "/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0


class Server(Client):
    """``python -m neorec serve ART --port 0 FLAGS`` as a process; its port read from stdout."""

    def __init__(self, art: Path, *flags: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, "-m", "neorec", "serve", str(art), "--port", "0", *flags]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []  # read as it comes: a full pipe would block the server
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        while True:
            line = self.lines.get(timeout=GUARD_S)
            m = re.search(r"on http://([0-9.]+):(\d+)", line)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return
            if not line:
                self.proc.wait(GUARD_S)
                raise AssertionError(f"the server ended: {''.join(self.err)[-2000:]}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line)
            self.lines.put(line)
        self.lines.put("")

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Signal the server; its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=GUARD_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=GUARD_S)


class ThreadServer(Client):
    """The server in this process (uvicorn on a thread; real HTTP on 127.0.0.1): start-up without
    importing torch again, for cases that need their own options."""

    def __init__(self, predictor: Any, **opts: Any) -> None:
        from neorec.serve.server import ServeOptions, ServeState, make_server

        self.state = ServeState(predictor, ServeOptions(port=0, **opts))
        self.server, sock = make_server(self.state)
        self.host, self.port = sock.getsockname()[:2]
        self.state.batcher.start()
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(GUARD_S)
        assert self.state.batcher.stop(GUARD_S)


def read_response(sock: socket.socket) -> tuple[int, Any]:
    """(status, JSON body) of one HTTP/1.1 response read from a raw socket."""
    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return resp.status, json.loads(resp.read())
