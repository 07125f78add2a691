"""The measurements ``neorec plan`` asks for, each run in a fresh Python process (torch stays out
of the planner's process): ``calibrate`` (``neorec.measure.calibrate``) and ``tune``
(``neorec.measure.plan_tune``). Their progress goes to stderr; their one-line error becomes
ours.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from neorec.errors import ConfigError
from neorec.sharding.learned_cost import LearnedModelError, specs_dicts
from neorec.sharding.planner import Planner, PlanResult
from neorec.sharding.planner_shortlist import shortlist, with_plan

__all__ = ["calibrate", "tune"]


def calibrate(
    out: str, world_size: int, ranks_per_host: int = 0, budget_s: float | None = None
) -> None:
    """Measure this machine (``neorec.measure.calibrate``) and write the topology to ``out``;
    ``budget_s``: its wall-clock budget (None: the calibration's default)."""
    cmd = [sys.executable, "-m", "neorec.measure.calibrate", "--out", out]
    cmd += ["--world-size", str(world_size)]
    if ranks_per_host:
        cmd += ["--ranks-per-host", str(ranks_per_host)]
    if budget_s is not None:
        if budget_s < 0:
            raise LearnedModelError(f"--budget-s must be >= 0 seconds, got {budget_s}")
        cmd += ["--budget-s", str(budget_s)]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    errs = [x for x in proc.stderr.splitlines() if x.startswith("neorec: error: ")]
    if proc.returncode and errs:
        raise LearnedModelError(errs[-1].removeprefix("neorec: error: "))
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise LearnedModelError(
            f"--calibrate: the calibration crashed (exit {proc.returncode}); its output is above"
        )


def tune(
    planner: Planner, result: PlanResult, batch: int, optimizer: str, k: int, rounds: int
) -> PlanResult:
    """Measure ``result``'s shortlist of ``k`` plans (``neorec.measure.plan_tune``, ``rounds``
    rounds) and return the result with the fastest plan and the tuning record."""
    cands = shortlist(planner, result, k)
    req = {
        "tables": specs_dicts(result.tables),
        "batch": batch,
        "optimizer": optimizer,
        "rounds": rounds,
        "plans": [
            {"label": c.label, "plan": c.plan.to_dict(), "predicted_ms": c.predicted_ms}
            for c in cands
        ],
    }
    with tempfile.TemporaryDirectory(prefix="neorec-tune-") as tmp:
        rq, out = Path(tmp) / "request.json", Path(tmp) / "tuning.json"
        rq.write_text(json.dumps(req))
        cmd = [sys.executable, "-m", "neorec.measure.plan_tune", "--request", str(rq)]
        try:  # progress straight to our stderr; captured and copied there when it has no fd
            sink: Any = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            sink = subprocess.PIPE
        proc = subprocess.run(
            [*cmd, "--out", str(out)], stdout=sink, stderr=subprocess.PIPE, text=True
        )
        if proc.stdout:
            sys.stderr.write(proc.stdout)
        errs = [x for x in proc.stderr.splitlines() if x.startswith("neorec: error: ")]
        if proc.returncode:
            if errs:
                raise ConfigError(errs[-1].removeprefix("neorec: error: "))
            sys.stderr.write(proc.stderr)
            raise ConfigError(f"--tune: the measurement crashed (exit {proc.returncode})")
        rec = json.loads(out.read_text())
    picked = next(c for c in cands if c.label == rec["picked"])
    tuned = with_plan(planner, result, picked.plan)
    tuned.tuning = rec
    tuned.plan.meta["tuning"] = {
        "picked": rec["picked"],
        "measured_ms": {m["label"]: round(m["ms_per_step"], 3) for m in rec["measured"]},
        "rounds": rec["rounds"],
        "world": rec["world"],
        "note": "measured here with neorec plan --tune (neorec.measure.plan_tune)",
    }
    return tuned
