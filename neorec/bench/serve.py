"""``neorec bench serve``: the request rate ``neorec serve`` holds at a p99 bound, batching on and
off, per table format and model; and the model's latency against the batch size.

    neorec bench serve --configs default,dlrm_benchmark --quantize none,int8,int4

Each model is trained (``neorec train --config C``, or ``--model RUN``), exported per table format,
and served by ``neorec serve`` in a subprocess on a free port, once with dynamic batching
(``--batched`` flags) and once without (``--unbatched``). A load generator in ``--workers``
separate processes (``neorec.bench.serve_load``) sends the model's own eval rows, ``R`` rows per
request, over keep-alive connections: open-loop levels at fixed rates with Poisson arrivals
(latency counted from each request's scheduled send time), searched for the highest rate whose
p99 stays within ``--bound-ms`` with no error (``neorec.bench.serve_search``), one level at
``--overload-factor`` times the first failing rate (the server must refuse the excess with 503s,
not time out or fall over), then closed-loop levels at fixed concurrencies.

The server and the load generator share this machine's cores (2 on a development machine): every
level reports the CPU each side used (``server_cores``, ``client_cores``), and the held rate is
that of the server beside its own load. ``--characterize`` times the model alone
(``neorec.bench.serve_models.characterize``: embedding / dense / overhead per batch size).

The JSON line's ``max_rps_p99_20ms`` {``batched``, ``unbatched``} and ``batching_gain`` are the
first model's (``default``) fp32 tables at the first ``--rows-per-request``; every variant is under
``variants``. Docs: docs/serving.md "Measuring a server", "Sizing a deployment".
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from neorec.bench.serve_load import Level, LoadGen, request_body
from neorec.bench.serve_search import HOST, SearchSettings, ServerProcess, held_rate, overload
from neorec.errors import ConfigError

__all__ = ["main", "parse_args", "QUICK_MODEL"]

QUANTIZE = ("none", "int8", "int4", "int2", "fp16")
"""``--quantize`` values the bench passes to ``neorec export`` (what the exporter accepts)."""
LABEL = {"none": "fp32"}
QUICK_MODEL = (
    "embedding.num_tables=3",
    "embedding.rows=200",
    "embedding.dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=64",
    "data.train_samples=1280",
    "data.eval_samples=640",
)
"""``--quick``'s tiny model (trained from the default config with these settings)."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``neorec bench serve``."""
    p = argparse.ArgumentParser(prog="neorec bench serve", description=__doc__.splitlines()[0])
    a = p.add_argument
    a(
        "--configs",
        default="default,dlrm_benchmark",
        help="models to train (files or configs/ names)",
    )
    a("--model", default=None, help="a trained run to serve instead of training --configs")
    a("--set", action="append", default=[], help="training override KEY=VALUE (every config)")
    a("--quantize", default="none,int8,int4", help="table formats (neorec export --quantize)")
    a("--rows-per-request", default="1,4", help="rows per request (comma-separated)")
    a("--bound-ms", type=float, default=20.0, help="the p99 latency bound")
    a("--start-rate", type=float, default=100.0, help="the ladder's first rate (requests/s)")
    a("--factor", type=float, default=2.0, help="the ladder's step")
    a("--bisect", type=int, default=3, help="bisection steps after the ladder")
    a("--max-rate", type=float, default=20000.0, help="the ladder's last rate")
    a("--level-seconds", type=float, default=3.0, help="an open-loop level's minimum length")
    a("--level-requests", type=int, default=1000, help="an open-loop level's minimum requests")
    a("--overload-factor", type=float, default=3.0, help="the overload level / first failing")
    a("--closed", default="1,8,32", help="closed-loop concurrencies (empty: none)")
    a("--workers", type=int, default=2, help="load generator processes")
    a("--connections", type=int, default=64, help="keep-alive connections per worker")
    a("--timeout", type=float, default=2.0, help="seconds a request may take before a timeout")
    a("--batched", default="--max-batch 64 --max-wait-ms 2", help="neorec serve's batching flags")
    a("--unbatched", default="--no-batching", help="neorec serve's flags without batching")
    a("--server-args", default="--queue 64",
      help="further neorec serve flags (both runs); the queue must be shorter than the load "
      "generator's connections, or the excess waits in the client, never refused")  # fmt: skip
    a("--characterize", default="1,2,4,8,16,32,64,128,256,512,1024",
      help="batch sizes of the model-alone timing ('' = skip)")  # fmt: skip
    a("--repeats", type=int, default=20, help="characterization repeats per batch size")
    a("--threads", type=int, default=1, help="intra-op threads of the characterization")
    a("--eval-rows", type=int, default=1024, help="eval rows the requests cycle through")
    a("--workdir", default=None, help="keep models, exports and server logs here")
    a("--only", choices=("all", "load", "characterize"), default="all", help="parts to run")
    a("--quick", action="store_true", help="a tiny model, short levels (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        _quick(args, argv or [])
    _check(args)
    return args


def _quick(a: argparse.Namespace, argv: list[str]) -> None:
    """``--quick``'s settings for every flag not given."""
    given = {x.split("=")[0] for x in argv if x.startswith("--")}
    quick = {
        "configs": "default", "quantize": "none", "rows_per_request": "1", "start_rate": 50.0,
        "factor": 4.0, "bisect": 1, "max_rate": 200.0, "level_seconds": 0.4,
        "level_requests": 20, "overload_factor": 2.0, "closed": "2", "workers": 1,
        "connections": 8, "server_args": "--queue 2", "timeout": 10.0, "characterize": "1,4", "repeats": 3, "eval_rows": 64,
    }  # fmt: skip
    for k, v in quick.items():
        if "--" + k.replace("_", "-") not in given:
            setattr(a, k, v)
    a.set = [*QUICK_MODEL, *a.set]


def _check(a: argparse.Namespace) -> None:
    """Every flag checked before anything is trained or started (one line each)."""
    for q in a.quantize.split(","):
        if q not in QUANTIZE:
            raise ConfigError(f"bench serve: --quantize {q!r}: one of {', '.join(QUANTIZE)}")
    try:
        a.rows_list = _ints(a.rows_per_request)
        a.closed_list = _ints(a.closed)
        a.batch_list = _ints(a.characterize)
    except ValueError as e:
        raise ConfigError(
            f"bench serve: a comma-separated list of integers is wrong ({e})"
        ) from None
    if not a.rows_list or min(a.rows_list) < 1 or max(a.rows_list) > a.eval_rows:
        raise ConfigError(f"bench serve: --rows-per-request {a.rows_per_request}: 1..--eval-rows")
    if min(a.batch_list, default=1) < 1:
        raise ConfigError(f"bench serve: --characterize {a.characterize}: batch sizes >= 1")
    cap = a.workers * a.connections
    if min(a.closed_list, default=1) < 1 or max(a.closed_list, default=1) > cap:
        raise ConfigError(f"bench serve: --closed {a.closed}: 1..workers x connections ({cap})")
    for name in ("bound_ms", "start_rate", "level_seconds", "timeout", "max_rate"):
        if not getattr(a, name) > 0:
            raise ConfigError(f"bench serve: --{name.replace('_', '-')} must be > 0")
    if a.factor <= 1 or a.overload_factor <= 1:
        raise ConfigError("bench serve: --factor and --overload-factor must be > 1")
    for name in ("workers", "connections", "repeats", "eval_rows", "level_requests"):
        if getattr(a, name) < 1:
            raise ConfigError(f"bench serve: --{name.replace('_', '-')} must be >= 1")
    if a.model is not None and not Path(a.model).exists():
        raise ConfigError(f"bench serve: --model {a.model}: no such run folder")


# ---- one server -------------------------------------------------------------------------------
def _timed(server: ServerProcess, lg: LoadGen, level: Level) -> dict[str, Any]:
    """``level`` run, with the server's CPU share over it."""
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    out = lg.run(level)
    wall = max(time.monotonic() - t0, 1e-9)
    out["server_cores"] = round((server.cpu_seconds() - cpu0) / wall, 3)
    return out


def serve_variant(a: argparse.Namespace, artifact: Path, bodies: list[bytes], batching: bool,
                  log: Path) -> dict[str, Any]:  # fmt: skip
    """One server (batching on or off) under the whole sequence of levels."""
    flags = shlex.split(a.batched if batching else a.unbatched) + shlex.split(a.server_args)
    search = SearchSettings(
        a.bound_ms, a.start_rate, a.factor, a.bisect, a.max_rate, min(a.start_rate, 1.0)
    )
    with ServerProcess(artifact, flags, log) as server:
        with LoadGen(HOST, server.port, bodies, a.workers, a.connections, a.timeout) as lg:
            lg.run(Level.closed(1, min(1.0, a.level_seconds)))  # warm-up: connections, caches
            seed = iter(range(1, 1_000_000))

            def level(rate: float) -> dict[str, Any]:
                lv = Level.open(rate, a.level_seconds, a.level_requests, next(seed))
                return _timed(server, lg, lv)

            found = held_rate(level, search)
            top = found["first_failing_rps"] or found["max_rps"] or a.start_rate
            over = level(top * a.overload_factor)
            verdict = overload(over, server.alive())
            closed = [_timed(server, lg, Level.closed(c, a.level_seconds)) for c in a.closed_list]
        exit_code = server.stop()
    return {
        "batching": batching,
        "server_flags": flags,
        **found,
        "overload": verdict,
        "closed": closed,
        "server_exit": exit_code,
    }


def _held_level(v: dict[str, Any]) -> dict[str, Any] | None:
    held = [lv for lv in v["levels"] if lv["held"] and lv["offered_rps"] == v["max_rps"]]
    return held[-1] if held else None


def _summary(v: dict[str, Any], rows: int) -> dict[str, Any]:
    """A variant's headline: held rate, rows/s, and the server's rows/s per core there."""
    lv = _held_level(v)
    out: dict[str, Any] = {"max_rps": v["max_rps"], "rows_per_s": round(v["max_rps"] * rows, 1)}
    if lv is not None:
        cores = lv["server_cores"]
        out["p99_ms"] = lv["p99_ms"]
        out["server_cores"] = cores
        out["client_cores"] = lv["client_cores"]
        out["rows_per_s_per_server_core"] = round(lv["achieved_rps"] * rows / cores, 1) if cores > 0 else None  # fmt: skip
    return out


# ---- the whole run ------------------------------------------------------------------------------
def _models(a: argparse.Namespace, work: Path) -> list[tuple[str, Path]]:
    """(name, trained run folder) per model."""
    from neorec.bench.serve_models import resolve_config, train_model

    if a.model is not None:
        return [(Path(a.model).name, Path(a.model))]
    out = []
    for name in a.configs.split(","):
        cfg = resolve_config(name)
        run = work / f"run-{cfg.stem}"
        if not (run / "model").exists():
            print(f"training {cfg} -> {run}", flush=True)
            train_model(cfg, run, a.set, work / f"train-{cfg.stem}.log")
        out.append((cfg.stem, run))
    return out


def run_all(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every model x table format: the characterization, then every server variant."""
    import torch

    from neorec.bench.serve_models import characterize, eval_inputs, export, request_rows

    torch.set_num_threads(a.threads)
    variants: list[dict[str, Any]] = []
    chars: dict[str, Any] = {}
    for model, run in _models(a, work):
        dense, sparse = eval_inputs(run, a.eval_rows)
        rows = request_rows(dense, sparse)
        for q in a.quantize.split(","):
            art = export(run, work / f"export-{model}-{q}", q)
            key = f"{model}/{LABEL.get(q, q)}"
            if a.only in ("all", "characterize") and a.batch_list:
                print(f"characterizing {key}", flush=True)
                chars[key] = characterize(art, dense, sparse, a.batch_list, a.repeats)
            if a.only == "characterize":
                continue
            for r in a.rows_list:
                bodies = [request_body(rows[i : i + r]) for i in range(0, len(rows) - r + 1, r)]
                for batching in (True, False):
                    name = f"{key}/r{r}/{'batched' if batching else 'unbatched'}"
                    print(f"serving {name}", flush=True)
                    log = work / f"serve-{name.replace('/', '-')}.log"
                    v = serve_variant(a, art, bodies, batching, log)
                    variants.append({"model": model, "tables": LABEL.get(q, q),
                                     "rows_per_request": r, **v, **_summary(v, r)})  # fmt: skip
    return {"variants": variants, "characterize": chars}


def headline(a: argparse.Namespace, variants: list[dict[str, Any]]) -> dict[str, Any]:
    """The check keys: the first model's first table format at the first rows per request; and
    the same pair per variant."""
    key = f"max_rps_p99_{a.bound_ms:g}ms"
    pairs: dict[str, dict[str, Any]] = {}
    for v in variants:
        name = f"{v['model']}/{v['tables']}/r{v['rows_per_request']}"
        pairs.setdefault(name, {})["batched" if v["batching"] else "unbatched"] = v["max_rps"]
    for p in pairs.values():
        b, u = p.get("batched"), p.get("unbatched")
        p["batching_gain"] = round(b / u, 3) if b is not None and u else None
    out: dict[str, Any] = {"by_variant": pairs}
    if pairs:
        first = next(iter(pairs.values()))
        out[key] = {k: first.get(k) for k in ("batched", "unbatched")}
        out["batching_gain"] = first["batching_gain"]
        out["headline"] = next(iter(pairs))
        out["overload_only_503"] = all(
            v["overload"]["only_503"] for v in variants
            if f"{v['model']}/{v['tables']}/r{v['rows_per_request']}" == out["headline"]
        )  # fmt: skip
    return out


def _table(res: dict[str, Any], a: argparse.Namespace) -> str:
    from neorec.bench.provenance import usable_cpus

    lines = [
        f"server and load generator share this machine's {usable_cpus()} cores; "
        f"bound p99 <= {a.bound_ms:g} ms, 0 errors",
        f"{'variant':34}{'held/s':>9}{'rows/s':>9}{'p99':>7}{'srv':>6}{'cli':>6}"
        f"{'rows/s/core':>12}  above: 503 / timeout / conn",
    ]
    for v in res["variants"]:
        name = f"{v['model']}/{v['tables']}/r{v['rows_per_request']}/" + (
            "batched" if v["batching"] else "unbatched"
        )
        o = v["overload"]
        e = o["errors"]
        per_core = v.get("rows_per_s_per_server_core")
        lines.append(
            f"{name:34}{v['max_rps']:9.0f}{v['rows_per_s']:9.0f}{v.get('p99_ms') or 0:7.1f}"
            f"{v.get('server_cores', 0):6.2f}{v.get('client_cores', 0):6.2f}"
            f"{per_core or 0:12.0f}  {e['http_503']} / {e['timeout']} / {e['connection']}"
            f"{'' if o['only_503'] else '  (NOT only 503)'}"
        )
    for key, rows in res["characterize"].items():
        lines.append(f"model alone, {key}: batch, ms total = embedding + dense + overhead, µs/row")
        for r in rows:
            lines.append(
                f"  {r['batch']:6d}{r['total_ms']:9.3f} = {r['embedding_ms']:.3f} + "
                f"{r['dense_ms']:.3f} + {r['overhead_ms']:.3f}{r['us_per_row']:10.1f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print its table and JSON line."""
    from neorec.bench.provenance import usable_cpus

    a = parse_args(argv)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="neorec-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = run_all(a, work)
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(_table(res, a))
    cores = usable_cpus()
    line = {
        "bench": "serve",
        **headline(a, res["variants"]),
        "bound_ms": a.bound_ms,
        "cores": cores,
        "colocated": f"the server and the load generator share the same {cores} cores",
        "client": {"workers": a.workers, "connections": a.connections},
        "variants": res["variants"],
        "characterize": res["characterize"],
    }
    print(json.dumps(line))
    return 0
