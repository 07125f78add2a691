"""The trainer's running metrics: eval predictions kept for checkpoints (``MetricState``) and
the dynamic tables' counters in the progress line and events (the metrics themselves are
``neorec.metrics``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from neorec.metrics import binary_metrics
from neorec.modules.collection import EmbeddingCollection

__all__ = [
    "MetricState",
    "dynamic_counters",
    "dynamic_fields",
    "DynamicLine",
]


class MetricState:
    """Accumulates predictions and labels over an eval pass (state_dict for checkpoints)."""

    def __init__(self) -> None:
        self.probs: list[Tensor] = []
        self.labels: list[Tensor] = []

    def update(self, probs: Tensor, labels: Tensor) -> None:
        """Add a batch."""
        self.probs.append(probs.detach().float().cpu())
        self.labels.append(labels.detach().float().cpu())

    def compute(self) -> dict[str, float]:
        """Metrics over everything added."""
        if not self.probs:
            raise ValueError("no predictions were added")
        return binary_metrics(torch.cat(self.probs), torch.cat(self.labels))

    def state_dict(self) -> dict[str, Tensor]:
        """Concatenated predictions and labels."""
        if not self.probs:
            return {"probs": torch.empty(0), "labels": torch.empty(0)}
        return {"probs": torch.cat(self.probs), "labels": torch.cat(self.labels)}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Restore."""
        self.probs = [state["probs"]] if state["probs"].numel() else []
        self.labels = [state["labels"]] if state["labels"].numel() else []


# ---- dynamic tables: admitted / evicted / unadmitted lookups, occupancy -------------
_DYN_COUNTS = ("admitted", "evicted", "unadmitted", "lookups")


def dynamic_counters(ebc: EmbeddingCollection) -> dict[str, float]:
    """Running totals of the dynamic tables of a collection, flat: ``dyn.<table>.<count>`` for
    admitted, evicted, unadmitted (lookups that got no slot), lookups, occupancy and capacity
    (empty without dynamic tables)."""
    out: dict[str, float] = {}
    for t, v in ebc.stats().items():
        if isinstance(v, dict) and "total" in v and "occupancy" in v:
            for k in _DYN_COUNTS:
                out[f"dyn.{t}.{k}"] = float(v["total"][k])
            out[f"dyn.{t}.occupancy"] = float(v["occupancy"])
            out[f"dyn.{t}.capacity"] = float(v["capacity"])
    return out


def dynamic_fields(now: dict[str, float], before: dict[str, float], steps: float) -> dict[str, Any]:
    """The ``dynamic`` entry of an events.jsonl line: per table, admitted / evicted / unadmitted
    lookups per step over the window from ``before`` to ``now`` (``dynamic_counters`` values),
    the unadmitted fraction of its lookups, and the occupancy (live ids) and capacity now."""
    tables = sorted({k.split(".")[1] for k in now if k.startswith("dyn.") and k.count(".") >= 2})
    out: dict[str, Any] = {}
    for t in tables:

        def delta(k: str, t: str = t) -> float:
            return now[f"dyn.{t}.{k}"] - before.get(f"dyn.{t}.{k}", 0.0)

        lookups = delta("lookups")
        out[t] = {
            **{f"{k}_per_step": delta(k) / max(steps, 1.0) for k in _DYN_COUNTS[:3]},
            "unadmitted_fraction": delta("unadmitted") / lookups if lookups else None,
            "occupancy": int(now[f"dyn.{t}.occupancy"]),
            "capacity": int(now[f"dyn.{t}.capacity"]),
        }
    return {"dynamic": out} if out else {}


class DynamicLine:
    """The progress line's part for dynamic tables: per table, occupancy / capacity and the
    admitted (+), evicted (-) and unadmitted lookups per step since the previous line."""

    def __init__(self, ebc: EmbeddingCollection) -> None:
        self.ebc = ebc
        self.before = dynamic_counters(ebc)
        self.steps = float(ebc.step)

    def __call__(self) -> str:
        """The text (empty without dynamic tables)."""
        now = dynamic_counters(self.ebc)
        step = float(self.ebc.step)
        fields = dynamic_fields(now, self.before, step - self.steps).get("dynamic", {})
        self.before, self.steps = now, step
        parts = [
            f"{t} {v['occupancy']}/{v['capacity']} +{v['admitted_per_step']:.1f} "
            f"-{v['evicted_per_step']:.1f} unadm {v['unadmitted_per_step']:.1f}/step"
            for t, v in fields.items()
        ]
        return "  ".join(parts)
