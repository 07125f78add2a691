"""``neorec bench threads``: the default thread count on a loaded machine. The Parquet example
(``configs/parquet_example.toml`` on ``neorec data example-parquet``'s data) trains with ``--busy``
busy loops running beside it, once with PyTorch's own default (``train.threads`` = the count a
fresh ``import torch`` picks: the physical cores) and once with neorec's (``train.threads = 0``:
``neorec.machine.CpuShare``), in alternating order per round (paired); then once per round with
neorec's default and no busy loop (the quiet reference), and with one thread and no busy loop:
the fair-share floor. Beside ``--busy`` loops on C CPUs the kernel's fair scheduler gives a
one-thread run min(1, C / (busy + 1)) of a CPU (2/3 beside two loops on 2 CPUs), so no thread
choice trains faster than its quiet one-thread time / that share (``floor_s``); the loaded run
is reported against the quiet default run and against that floor. Each figure is the run's own training
seconds (``metrics.json``'s ``train.seconds``: start-up and the final eval excluded). Reports the
paired ratio PyTorch default / neorec default and loaded / quiet with 95% intervals
(``neorec.bench.stats.paired_ratio``). A speed row: measure it on a machine where nothing else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from neorec.bench.stats import paired_ratio

__all__ = ["main", "torch_default_threads", "train_seconds"]

BUSY = "while True: pass"


def torch_default_threads() -> int:
    """The intra-op threads PyTorch picks in a fresh process without ``OMP_NUM_THREADS``."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    return int(out.stdout.strip())


def train_seconds(config: str, data: Path, runs: Path, name: str, threads: int | None) -> float:
    """Train the example in a fresh process (``threads`` None: neorec's default); its seconds."""
    sets = [
        f"data.path={data}",
        f"train.runs_dir={runs}",
        f"train.name={name}",
        "train.progress=false",
        "train.save_model=false",
        "train.tensorboard=off",
    ]
    if threads is not None:
        sets.append(f"train.threads={threads}")
    argv = [sys.executable, "-m", "neorec", "train", "--config", config]
    for s in sets:
        argv += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    metrics = json.loads((runs / name / "metrics.json").read_text())
    return float(metrics["train"]["seconds"])


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    p = argparse.ArgumentParser(prog="neorec bench threads", description=__doc__)
    p.add_argument("--config", default="configs/parquet_example.toml")
    p.add_argument("--busy", type=int, default=2, help="busy loops beside the loaded runs")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds")
    p.add_argument("--train-rows", type=int, default=20_000, help="the example's train rows")
    p.add_argument("--eval-rows", type=int, default=4_000, help="the example's eval rows")
    a = p.parse_args(argv)
    from neorec.data.example import write_example
    from neorec.machine import cpu_share

    old = torch_default_threads()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fair = min(1.0, (cpus or 1) / (a.busy + 1))  # of a CPU, for one thread beside the loops
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="neorec-bench-threads-") as tmp:
        data, runs = Path(tmp) / "data", Path(tmp) / "runs"
        write_example(data, train=a.train_rows, eval=a.eval_rows)
        for r in range(a.rounds):
            quiet = train_seconds(a.config, data, runs, f"quiet-{r}", None)
            one = train_seconds(a.config, data, runs, f"quiet1-{r}", 1)
            busy = _busy(a.busy)
            try:
                share = cpu_share()
                order = [("torch", old), ("neorec", None)]
                if r % 2:
                    order.reverse()
                got = {k: train_seconds(a.config, data, runs, f"{k}-{r}", n) for k, n in order}
            finally:
                _stop(busy)
            rows.append(
                {
                    "round": r,
                    "quiet_s": quiet,
                    "quiet_1_thread_s": one,
                    "floor_s": one / fair,
                    **{f"{k}_s": v for k, v in got.items()},
                    "neorec_threads": share.threads(),
                    "why": share.why(),
                }
            )
    ratio = paired_ratio([x["torch_s"] for x in rows], [x["neorec_s"] for x in rows])
    loaded = paired_ratio([x["neorec_s"] for x in rows], [x["quiet_s"] for x in rows])
    floor = paired_ratio([x["floor_s"] for x in rows], [x["quiet_s"] for x in rows])
    over_floor = paired_ratio([x["neorec_s"] for x in rows], [x["floor_s"] for x in rows])
    print(
        f"{'round':>5} {'quiet s':>8} {'1 thr s':>8} {'floor s':>8} {'torch s':>8} {'neorec s':>9}"
        "  neorec's choice beside busy"
    )
    for x in rows:
        print(
            f"{x['round']:>5} {x['quiet_s']:8.2f} {x['quiet_1_thread_s']:8.2f} {x['floor_s']:8.2f} "
            f"{x['torch_s']:8.2f} {x['neorec_s']:9.2f}  "
            f"{x['neorec_threads']} ({x['why']})"
        )
    print(f"PyTorch default ({old} threads) / neorec default, beside {a.busy} busy loops: {ratio}")
    print(f"neorec default beside {a.busy} busy loops / quiet: {loaded}")
    print(
        f"the fair-share floor ({fair:.3g} of a CPU for one thread on {cpus} CPUs) / quiet: {floor}; "
        f"neorec default / the floor: {over_floor}"
    )
    result = {
        "bench": "threads",
        "busy": a.busy,
        "torch_threads": old,
        "rounds": rows,
        "torch_over_neorec": ratio.to_dict(),
        "loaded_over_quiet": loaded.to_dict(),
        "cpus": cpus,
        "fair_share": fair,
        "floor_over_quiet": floor.to_dict(),
        "loaded_over_floor": over_floor.to_dict(),
    }
    print(json.dumps(result))
    return 0
