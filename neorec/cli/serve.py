"""``neorec serve DIR``: an HTTP server of an exported model with dynamic batching (the
``[serve]`` extra: starlette, uvicorn). docs/serving.md, "The server"."""

from __future__ import annotations

import argparse
import importlib.util

from neorec.errors import NeorecError

HELP = "serve an exported model over HTTP: POST /predict with dynamic batching, /healthz, /metrics"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``neorec serve``."""
    p.add_argument("dir", metavar="DIR", help="a directory `neorec export` wrote")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port, printed)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument(
        "--max-batch", type=int, default=128,
        help="rows per model call at most (whole requests; a larger request runs alone); "
        "1: no batching",
    )  # fmt: skip
    p.add_argument(
        "--max-wait-ms", type=float, default=2.0,
        help="how long the oldest queued request waits for others to join its batch",
    )  # fmt: skip
    p.add_argument(
        "--no-batching", action="store_true",
        help="one request per model call (= --max-batch 1 --max-wait-ms 0): for comparison",
    )  # fmt: skip
    p.add_argument(
        "--queue", type=int, default=512,
        help="requests waiting at most; the next one gets 503 with Retry-After",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the model")
    p.add_argument(
        "--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)"
    )
    p.add_argument(
        "--read-timeout-s", type=float, default=30.0,
        help="a body not received within this gets 408 (slow clients)",
    )  # fmt: skip
    p.add_argument(
        "--drain-timeout-s", type=float, default=30.0,
        help="on SIGTERM, how long requests in flight may take to be answered",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / Ctrl-C."""
    missing = [m for m in ("starlette", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise NeorecError(
            f"neorec serve needs {' and '.join(missing)}: pip install 'neorec[serve]'"
        )
    from neorec.serve.server import ServeOptions, serve

    opts = ServeOptions(
        host=args.host,
        port=args.port,
        max_batch=1 if args.no_batching else args.max_batch,
        max_wait_ms=0.0 if args.no_batching else args.max_wait_ms,
        queue=args.queue,
        threads=args.threads,
        max_body=args.max_body_bytes,
        read_timeout_s=args.read_timeout_s,
        drain_timeout_s=args.drain_timeout_s,
    )
    return serve(args.dir, opts)
