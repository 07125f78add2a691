"""The end of a run: communication metrics, the summary (metrics.json, the printed table).

``RunSummary`` is the part of ``neorec.train.trainer.Trainer`` that reports what a run did; split
from trainer.py along that seam (it reads the trainer's state, changes none of it).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any, TextIO

import torch.distributed as dist

from neorec.config import Config
from neorec.train.pipeline import PipelineTimes
from neorec.train.progress import KEEP_LOSSES, Progress
from neorec.train.runs import RunFolder, RunLog, run_info, utc_now
from neorec.train.state import TrainState
from neorec.train.steps import RecModel

__all__ = ["RunSummary"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(1, len(xs))


def _memory_mb() -> dict[str, float]:
    """Peak RSS of this process, and its RSS now split into anonymous memory (what it owns) and
    file-backed pages (mapped store files: page cache the kernel can reclaim), in MiB."""
    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    out[f"{key[3:].lower()}_rss_mb"] = round(int(rest.split()[0]) / 1024, 1)
    except OSError:
        pass
    return out


class RunSummary:
    """Communication metrics and the run summary of a ``Trainer`` (a mixin: the attributes below
    are the trainer's)."""

    cfg: Config
    model: RecModel
    source: Any
    tb: Any
    world: int
    rank: int
    state: TrainState
    out: TextIO
    run: RunFolder
    runlog: RunLog | None
    tower_groups: Any
    _eval_s: float

    def comm_metrics(self) -> dict[str, Any]:
        """Pipeline and wire codecs; bytes sent per step (all ranks) and ms per step waiting on
        communication, data, codecs, and the rest (compute), over training so far (collective)."""
        c, times = self.cfg.comm, getattr(self, "pipe_times", PipelineTimes()).summary()
        out: dict[str, Any] = {
            "pipeline": self.cfg.train.pipeline,
            "codecs": {"forward": c.forward, "backward": c.backward, "allreduce": c.allreduce},
            **times,
        }
        stats = self.model.comm_stats
        if stats is None or self.world == 1:
            return out
        steps = max(1, int(times["steps"]))
        mine = (dict(stats.bytes_sent), dict(stats.wait_s), stats.codec_s)
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine)
        sent = {k: sum(p[0].get(k, 0) for p in parts) / steps for k in stats.bytes_sent}
        wait = {k: 1000 * v / steps for k, v in stats.wait_s.items()}  # this rank's
        out["bytes_per_step"] = sent
        out["bytes_per_step_total"] = sum(sent.values())
        out["wait_ms_per_step"] = wait
        out["comm_wait_ms_per_step"] = sum(wait.values())
        out["codec_ms_per_step"] = 1000 * stats.codec_s / steps
        out["compute_ms_per_step"] = (
            times["step_ms_mean"] - out["comm_wait_ms_per_step"] - times["load_wait_ms_per_step"]
        )
        return out

    def summarize(
        self,
        final: dict[str, float],
        evals: list[dict],
        progress: Progress,
        train_s: float,
        first_step: int = 0,
    ) -> dict[str, Any]:
        """Build, print and write the run summary (rates: what this process trained)."""
        teacher = self.source.reference_metrics()
        if self.tb is not None:
            self.tb.reference(teacher)
        result: dict[str, Any] = {
            **({"model": str(md)} if (md := getattr(self, "model_dir", None)) else {}),
            **({"towers": {"groups": self.tower_groups}} if self.tower_groups else {}),
            "train": {
                "steps": self.state.step,
                "resumed_at_step": first_step,
                "samples": progress.samples,
                "seconds": round(train_s, 3),
                "samples_per_s": round(progress.rate(train_s), 1),
                "final_loss": _mean(progress.losses[-KEEP_LOSSES:]),
                "periodic_eval_s": round(self._eval_s, 3),
                **_memory_mb(),
            },
            "eval": final,
            "evals": evals,
            "teacher": teacher,
            "config": self.cfg.to_dict(),
            "comm": getattr(self, "_comm", None),
        }
        bad = getattr(self.source, "bad_rows", None)  # data.bad_rows = "skip" (tabular)
        if bad is not None:
            result["bad_rows"] = bad.summary()
        storage = self.model.ebc.stats()  # row cache hit rate, bytes per tier, evictions
        if storage:
            result["storage"] = storage
        lowp = getattr(self, "lowp", None)
        if lowp is not None:
            result["lowp"] = lowp.summary()
        if teacher:
            result["eval_ne_gap_vs_teacher"] = final["ne"] / teacher["ne"] - 1.0
        start = self.runlog.start if self.runlog is not None else utc_now()
        result["run"] = {**run_info(self.run, self.world, start), "end_utc": utc_now()}
        self.write(result)
        self.print_summary(result)
        return result

    def write(self, result: dict[str, Any]) -> None:
        """metrics.json in the run directory (atomic replace; rank 0 only)."""
        if self.rank != 0:
            return
        run_dir = Path(self.cfg.train.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / "metrics.json.tmp"
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True, default=float))
        os.replace(tmp, run_dir / "metrics.json")

    def print_summary(self, r: dict[str, Any]) -> None:
        """Human-readable summary (rank 0 only)."""
        if self.rank != 0:
            return
        tr, ev, te = r["train"], r["eval"], r["teacher"]
        first = tr.get("resumed_at_step", 0)
        rate = f"in {tr['seconds']:.1f}s ({tr['samples_per_s']:,.0f} samples/s)"
        if first:
            done = f"trained steps {first + 1}-{tr['steps']} (resumed) {rate}; {tr['samples']:,}"
            done += " samples in all"
        else:
            done = f"trained {tr['steps']} steps, {tr['samples']:,} samples {rate}"
        lines = [
            "",
            done,
            f"{'':10}{'auc':>8}{'logloss':>10}{'ne':>8}{'calib':>8}",
            f"{'eval':10}{ev['auc']:8.4f}{ev['logloss']:10.4f}{ev['ne']:8.4f}{ev['calibration']:8.3f}",
        ]
        if te:
            lines.append(
                f"{'teacher':10}{te['auc']:8.4f}{te['logloss']:10.4f}{te['ne']:8.4f}"
                f"{te.get('calibration', 1.0):8.3f}"
            )
            lines.append(f"eval NE is {100 * r['eval_ne_gap_vs_teacher']:+.2f}% vs the teacher")
        if r.get("bad_rows", {}).get("skipped"):
            b = r["bad_rows"]
            lines.append(
                f"skipped {b['skipped']:,} bad rows of {b['rows']:,} read (bad_rows.jsonl)"
            )
        lines.append(f"metrics written to {Path(self.cfg.train.run_dir) / 'metrics.json'}")
        print("\n".join(lines), file=self.out, flush=True)
