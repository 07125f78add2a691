"""``neorec bench soak --minutes M``: train for M minutes and watch for leaks, interval by interval.

Two jobs run side by side, each a ``neorec train`` subprocess with checkpoints and periodic evals:

- ``dist``: ``--nproc 2`` (two gloo ranks, ``comm.transport`` as ``--transport`` says: ``auto``
  uses the shared-memory transport between the ranks);
- ``cached``: one process whose dynamic table lives on ``--store`` (ssd or dram) behind a row cache
  (the distributed runtime runs no cached table, so the row cache soaks in its own process).

Every ``--interval`` seconds it samples each training process (the two ranks, found by their
``RANK`` among the launcher's descendants, and the cached job): RSS (``/proc/<pid>/status``), open
file descriptors (``/proc/<pid>/fd``) and the memfds among them (the shared-memory transport's
segments); the bytes of the files in ``/dev/shm`` that were not there when the soak began; and
each job's throughput in the interval: samples per wall second (from the steps and ``elapsed_s``
of its ``events.jsonl``) and samples per CPU second (the same steps over the CPU time its processes
used in the interval, from ``/proc/<pid>/stat``: unlike the wall rate, it does not fall because
other programs share the cores). The M minutes count from the moment both jobs have logged their
first step.

Verdict per metric (after warm-up: the first third of the intervals is dropped): the median of the
last third against the median of the first third of the rest. Resources ``grows`` when the rise
exceeds the tolerance (RSS: 3% and 8 MiB; fds and memfds: 2; /dev/shm: 1 MiB), else ``flat``;
throughput ``falls`` when it drops by more than 10%, else ``flat``; ``short`` with fewer than 3
intervals after warm-up. Prints a table, then one JSON line (the last line of stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from neorec.errors import NeorecError

COMMON = [
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=64",
    "data.train_samples=6400",
    "data.eval_samples=256",
    f"train.steps={10**9}",
    "train.eval_every=50",
    "train.log_every=10",
    "train.threads=1",
    "train.progress=false",
    "train.save_model=false",
    "checkpoint.every_steps=25",
    "checkpoint.keep_last=2",
    "checkpoint.fsync=false",
]
DIST = ["embedding.num_tables=3", "embedding.rows=2000", "embedding.dim=8"]
CACHED = (
    "embedding.tables=[{{name='u', rows=20000, dim=8, kind='dynamic', capacity=4000, "
    "storage='{store}', cache_rows=1000}}, {{name='i', rows=2000, dim=8}}]"
)
TOL = {"rss_mb": (0.03, 8.0), "fds": (0.0, 2.0), "memfds": (0.0, 2.0), "shm_mb": (0.0, 1.0)}
THROUGHPUT_DROP = 0.10


class SoakError(NeorecError):
    """A soak job failed to start or ended early."""


def _job(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "neorec", "train", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped as one at the end
        )


def _sets(overrides: list[str]) -> list[str]:
    return [x for s in overrides for x in ("--set", s)]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(d))
    return out


def rank_pids(root: int) -> dict[int, int]:
    """Descendants of ``root`` that are ranks of a job: RANK -> pid."""
    kids, found, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        for c in kids.get(pid, []):
            todo.append(c)
            try:
                env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            vals = dict(e.split(b"=", 1) for e in env if b"=" in e)
            if b"RANK" in vals and b"LOCAL_RANK" in vals:
                found[int(vals[b"RANK"])] = c
    return found


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and memfds of ``pid`` (empty if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    rss = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS:"))
    memfds = 0
    for fd in fds:
        try:
            memfds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:")
        except OSError:
            pass
    return {"rss_mb": rss / 1024, "fds": float(len(fds)), "memfds": float(memfds)}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its threads so far (None if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def shm_bytes(before: set[str]) -> int:
    """Bytes of the files in /dev/shm that were not there when the soak began."""
    total = 0
    for name in set(os.listdir("/dev/shm")) - before if os.path.isdir("/dev/shm") else ():
        try:
            total += os.stat(f"/dev/shm/{name}").st_size
        except OSError:
            pass
    return total


class Events:
    """A run's ``events.jsonl``, read as it grows: samples/s between two reads (from the steps and
    ``elapsed_s`` of its lines; ``samples_per_step``: batch x world)."""

    def __init__(self, path: Path, samples_per_step: int) -> None:
        self.path, self.pos, self.per = path, 0, samples_per_step
        self.last: tuple[int, float] | None = None

    def rate(self) -> tuple[float, float] | None:
        """Samples since the previous call and samples/s over them (None: no new line)."""
        got = self.take()
        if not got:
            return None
        prev, self.last = self.last, got[-1]
        if prev is None or self.last[1] <= prev[1]:
            return None
        samples = (self.last[0] - prev[0]) * self.per
        return samples, samples / (self.last[1] - prev[1])

    def take(self) -> list[tuple[int, float]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.pos += end
        out = []
        for ln in data[:end].splitlines():
            try:
                e = json.loads(ln)
            except ValueError:
                continue
            if "elapsed_s" in e and "step" in e:
                out.append((int(e["step"]), float(e["elapsed_s"])))
        return out


def verdict(series: list[float | None], metric: str) -> str:
    """``flat`` / ``grows`` (resources) or ``flat`` / ``falls`` (throughput), or ``short``."""
    vals = [v for v in series if v is not None]
    rest = vals[len(vals) // 3 :]
    if len(rest) < 3:
        return "short"
    k = max(1, len(rest) // 3)
    first, last = statistics.median(rest[:k]), statistics.median(rest[-k:])
    if metric in ("samples_per_s", "samples_per_cpu_s"):
        return "falls" if last < first * (1 - THROUGHPUT_DROP) else "flat"
    rel, slack = TOL[metric]
    return "grows" if last - first > max(rel * first, slack) else "flat"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="neorec bench soak", description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="soak length (after start-up)")
    ap.add_argument("--interval", type=float, default=0.0, help="seconds (default: minutes/12)")
    ap.add_argument("--transport", default="auto", choices=("auto", "gloo", "shm"))
    ap.add_argument("--store", default="ssd", choices=("ssd", "dram"))
    ap.add_argument("--dir", default="", help="work folder (default: a temporary one)")
    ap.add_argument("--startup-s", type=float, default=600.0, help="start-up limit")
    a = ap.parse_args(argv)
    if a.minutes <= 0:
        raise SoakError(f"--minutes must be positive, got {a.minutes}")
    interval = a.interval or max(1.0, a.minutes * 60 / 12)
    tmp = None if a.dir else tempfile.TemporaryDirectory(prefix="neorec-soak-")
    work = Path(a.dir or (tmp.name if tmp else "."))
    work.mkdir(parents=True, exist_ok=True)
    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    runs = {"dist": work / "dist", "cached": work / "cached"}
    jobs = {
        "dist": _job(
            ["--nproc", "2"]
            + _sets([*DIST, *COMMON, f"comm.transport='{a.transport}'",
                     f"train.run_dir='{runs['dist']}'"]),
            work / "dist.log",
        ),
        "cached": _job(
            _sets([CACHED.format(store=a.store), *COMMON, f"train.run_dir='{runs['cached']}'",
                   f"storage.dir='{work / 'store'}'"]),
            work / "cached.log",
        ),
    }  # fmt: skip
    events = {
        k: Events(p / "events.jsonl", 64 * (2 if k == "dist" else 1)) for k, p in runs.items()
    }
    rows: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        while not all(e.path.exists() and e.path.stat().st_size for e in events.values()):
            _alive(jobs, work)
            if time.monotonic() - t0 > a.startup_s:
                raise SoakError(f"the soak's jobs did not start within {a.startup_s:.0f} s")
            time.sleep(0.2)
        for e in events.values():
            e.rate()
        cpu_before: dict[str, float | None] = {k: None for k in jobs}
        start = time.monotonic()
        while time.monotonic() - start < a.minutes * 60:
            time.sleep(max(0.0, min(interval, start + a.minutes * 60 - time.monotonic())))
            _alive(jobs, work)
            procs = {f"rank{r}": p for r, p in rank_pids(jobs["dist"].pid).items()}
            procs["cached"] = jobs["cached"].pid
            row: dict[str, Any] = {"t_s": round(time.monotonic() - start, 1)}
            row.update({n: proc_sample(p) for n, p in sorted(procs.items())})
            row["shm_mb"] = shm_bytes(shm_before) / 2**20
            row["load"] = os.getloadavg()[0]  # the machine's 1-minute load: context for the rates
            job_pids = {"dist": [p for n, p in procs.items() if n != "cached"],
                        "cached": [procs["cached"]]}  # fmt: skip
            for k, ev in events.items():
                cpu = _job_cpu(job_pids[k])
                got, prev = ev.rate(), cpu_before[k]
                cpu_before[k] = cpu
                row[f"{k}_samples_per_s"] = None if got is None else got[1]
                row[f"{k}_samples_per_cpu_s"] = (
                    None if got is None or cpu is None or prev is None or cpu <= prev
                    else got[0] / (cpu - prev)
                )  # fmt: skip
            rows.append(row)
    finally:
        for j in jobs.values():
            _stop(j)
        if tmp is not None:
            tmp.cleanup()
    return _report(rows, a, interval)


def _job_cpu(pids: list[int]) -> float | None:
    """CPU seconds of a job's training processes (None while one of them cannot be read)."""
    got = [cpu_seconds(p) for p in pids]
    return None if not got or any(c is None for c in got) else sum(c for c in got if c is not None)


def _alive(jobs: dict[str, subprocess.Popen[bytes]], work: Path) -> None:
    for k, j in jobs.items():
        if j.poll() is not None:
            tail = (work / f"{k}.log").read_text(errors="replace").strip().splitlines()[-1:]
            raise SoakError(f"soak job {k} ended early (exit {j.returncode}): {' '.join(tail)}")


def _stop(j: subprocess.Popen[bytes]) -> None:
    """Ctrl-C to the job's process group (it was started as its own session), then SIGKILL."""
    if j.poll() is None:
        try:
            os.killpg(j.pid, signal.SIGINT)
            j.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(j.pid, signal.SIGKILL)
            j.wait()
        except ProcessLookupError:
            pass


def _report(rows: list[dict[str, Any]], a: argparse.Namespace, interval: float) -> int:
    procs = sorted({k for r in rows for k, v in r.items() if isinstance(v, dict)})
    series: dict[str, list[float | None]] = {}
    for p in procs:
        for m in ("rss_mb", "fds", "memfds"):
            series[f"{p}.{m}"] = [r.get(p, {}).get(m) for r in rows]
    series["shm_mb"] = [r["shm_mb"] for r in rows]
    for k in ("dist", "cached"):
        for m in ("samples_per_s", "samples_per_cpu_s"):
            series[f"{k}.{m}"] = [r.get(f"{k}_{m}") for r in rows]
    verdicts = {k: verdict(v, k.split(".")[-1]) for k, v in series.items()}
    cols = list(series)
    print(f"soak: {a.minutes} min, {len(rows)} intervals of {interval:.1f} s")
    print("t_s".rjust(7) + "".join(c.rjust(max(12, len(c) + 1)) for c in cols))
    for i, r in enumerate(rows):
        cells = [series[c][i] for c in cols]
        print(
            f"{r['t_s']:7.1f}"
            + "".join(
                ("-" if v is None else f"{v:.1f}").rjust(max(12, len(c) + 1))
                for c, v in zip(cols, cells, strict=True)
            )
        )
    print("verdict".rjust(7) + "".join(verdicts[c].rjust(max(12, len(c) + 1)) for c in cols))
    out = {
        "bench": "soak",
        "minutes": a.minutes,
        "interval_s": interval,
        "transport": a.transport,
        "store": a.store,
        "t_s": [r["t_s"] for r in rows],
        "load": [round(r["load"], 2) for r in rows],
        "series": {k: [None if x is None else round(x, 3) for x in v] for k, v in series.items()},
        "verdict": verdicts,
        "tolerance": {**{k: {"rel": r, "abs": s} for k, (r, s) in TOL.items()},
                      "samples_per_s": {"drop": THROUGHPUT_DROP},
                      "samples_per_cpu_s": {"drop": THROUGHPUT_DROP}},
        "ok": not any(v in ("grows", "falls") for v in verdicts.values()),
    }  # fmt: skip
    print(json.dumps(out))
    return 0
