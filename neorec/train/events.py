"""A run's event lines (``events.jsonl`` and TensorBoard, rank 0): each logged step's values since
the previous line (loss and rates from the progress, lrs, communication, row cache, dynamic
tables) and the evals' metrics."""

from __future__ import annotations

from typing import Any

import torch

from neorec.train.metrics import dynamic_counters, dynamic_fields
from neorec.train.runs import RunLog, utc_now
from neorec.train.state import TrainState
from neorec.train.steps import RecModel
from neorec.train.tb import TBWriter

__all__ = ["EventLog"]

_WINDOW_KEYS = ("bytes", "wait_s", "hits", "misses")


class EventLog:
    """The event lines of a run (written when ``runlog`` is open: rank 0) and the running
    counters whose differences they report."""

    def __init__(
        self,
        state: TrainState,
        model: RecModel,
        opt: torch.optim.Optimizer,
        world: int,
        runlog: RunLog | None = None,
        tb: TBWriter | None = None,
        eval_batches: int = 0,
    ) -> None:
        self.state, self.model, self.opt, self.world = state, model, opt, world
        self.runlog, self.tb, self.eval_batches = runlog, tb, eval_batches
        self.window: dict[str, float] = {}
        """The counters at the previous logged line."""

    def counters(self) -> dict[str, float]:
        """Running totals this rank can read without a collective: bytes it sent and seconds it
        waited on communication (distributed), row cache hits and misses (a cached model)."""
        out: dict[str, float] = {"step": float(self.state.step)}
        stats = self.model.comm_stats
        if stats is not None and self.world > 1:
            out["bytes"] = float(sum(stats.bytes_sent.values()))
            out["wait_s"] = float(sum(stats.wait_s.values()))
        s = self.model.ebc.stats()
        if s:  # a row cache's hits and misses; dynamic tables' counters
            out["hits"], out["misses"] = float(s.get("hits", 0)), float(s.get("misses", 0))
            out.update(dynamic_counters(self.model.ebc))
        return out

    def start_window(self) -> None:
        """The next logged line counts from now."""
        self.window = self.counters()

    def exclude_since(self, before: dict[str, float]) -> None:
        """Leave what happened since ``before`` (``counters()``: an eval's traffic and cache use)
        out of the current window: it is not training's."""
        now = self.counters()
        for k in _WINDOW_KEYS:
            if k in now:
                self.window[k] = self.window.get(k, 0.0) + now[k] - before[k]

    def event(
        self, logged: dict[str, Any] | None, ev: dict[str, Any] | None, final: bool = False
    ) -> None:
        """One line: the logged step's values since the previous line, and the eval's metrics
        when there was one at this step."""
        if self.runlog is None:
            return
        rec: dict[str, Any] = {"step": self.state.step, "time_utc": utc_now()}
        if logged is not None:
            rec.update(logged)
            rec.update(self._rates())
        if ev is not None:
            rec.update({f"eval_{k}": v for k, v in ev.items() if k != "step"})
            if final:
                rec["final"] = True
            elif self.eval_batches:
                rec["eval_batches"] = self.eval_batches
        self.runlog.event(rec)
        if self.tb is not None:
            self.tb.event(rec)

    def _rates(self) -> dict[str, Any]:
        """The lrs, and per step since the previous line: bytes, waits, cache hit rate, dynamic
        tables' counters (the window moves on)."""
        rec: dict[str, Any] = {
            "lr": float(self.opt.param_groups[0]["lr"]),
            "embedding_lr": float(self.model.ebc.optimizer.lr),
        }
        now, before = self.counters(), self.window
        steps = max(1.0, now["step"] - before.get("step", 0.0))
        if "bytes" in now:
            rec["comm_bytes_per_step"] = (now["bytes"] - before.get("bytes", 0.0)) / steps
            waited = now["wait_s"] - before.get("wait_s", 0.0)
            rec["comm_wait_ms_per_step"] = 1000 * waited / steps
        if "hits" in now:
            hits = now["hits"] - before.get("hits", 0.0)
            misses = now["misses"] - before.get("misses", 0.0)
            rec["cache_hit_rate"] = hits / (hits + misses) if hits + misses else None
        rec.update(dynamic_fields(now, before, steps))
        self.window = now
        return rec
