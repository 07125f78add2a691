"""The trainer's LoKA hooks: dispatch around each step, the probe's table at the end.

With ``lowp.mode`` other than ``off`` the trainer probes the first ``lowp.probe_steps`` steps (in
fp32), chooses per site, and re-probes every ``lowp.reprobe_every`` steps; at the end rank 0
prints the probe's table and writes it with the plan and the timings to ``<run_dir>/lowp.json``.
Several ranks run rank 0's plan (broadcast), so every replica computes alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import Tensor

from neorec.config import Config
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.lowp.dispatch import Dispatcher
from neorec.lowp.report import format_table, report_json
from neorec.train.progress import lowp_decision

__all__ = ["TrainerLowp"]


def _broadcast_plan(plan: dict[str, str]) -> dict[str, str]:
    box: list[Any] = [plan]
    dist.broadcast_object_list(box, src=0)
    return dict(box[0])


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class TrainerLowp:
    """The Dispatcher of a run's ``model`` (``rank`` of ``world``; rank 0 prints to ``out``): a
    pipeline's step hook (``neorec.train.pipeline.StepHook``)."""

    def __init__(self, cfg: Config, model: Any, out: TextIO, rank: int = 0, world: int = 1) -> None:
        lp = cfg.lowp
        ebc = model.ebc
        weights = None
        if world == 1:  # (sharded: table_weight would be a collective)
            names = [t.name for t in cfg.embedding.tables]

            def weights() -> dict[str, Any]:
                return {n: ebc.table_weight(n) for n in names}

        several = world > 1
        wire = None
        sharded = ebc
        if (
            several
            and lp.mode == "auto"
            and cfg.comm.forward == "fp32"
            and cfg.comm.backward == "fp32"
            and isinstance(sharded, ShardedEmbeddingBagCollection)
        ):
            from neorec.distributed.codecs import make_codec

            def wire(direction: str, codec: str, sharded: Any = sharded) -> None:
                fwd, bwd = sharded.codecs
                made = make_codec(codec, cfg.comm.fp8_scaling, cfg.comm.loss_scale)
                sharded.codecs = (made, bwd) if direction == "forward" else (fwd, made)

        self.disp = Dispatcher(
            model.dense_arch,
            max(1, cfg.data.batch_size // world),
            lp,
            weights=weights,
            sync=_broadcast_plan if several else None,
            any_rank=_any_rank if several else None,
            wire=wire,
        )
        self.rank, self.out = rank, out
        self.run_dir = Path(cfg.train.run_dir)
        self._index = 0

    @classmethod
    def create(
        cls, cfg: Config, model: Any, out: TextIO, rank: int = 0, world: int = 1
    ) -> TrainerLowp | None:
        """The hooks when ``lowp.mode`` is not ``off``."""
        return cls(cfg, model, out, rank, world) if cfg.lowp.mode != "off" else None

    def before_step(self, step: int) -> None:
        """Before a step's forward (the dispatcher counts this process's steps)."""
        self.disp.before_step(self._index)

    def after_step(self, step: int, loss: Tensor) -> None:
        """After a step's backward and optimizer step."""
        first = not self.disp.decisions
        self.disp.after_step(self._index)
        if first and self.disp.decisions and self.rank == 0:  # the first decision, and why
            print(lowp_decision(self.disp, self._index + 1), file=self.out, flush=True)
        self._index += 1

    def summary(self) -> dict[str, Any]:
        """The plan and how many sites run in low precision (for metrics.json)."""
        plan = self.disp.plan
        return {
            "wire": {k: v for k, v in plan.items() if k.startswith("pooled.")},
            "mode": self.disp.mode,
            "tolerance": self.disp.tolerance,
            "plan": dict(plan),
            "low_precision_sites": sum(
                p != "fp32" for k, p in plan.items() if not k.startswith("pooled.")
            ),
            "decisions": len(self.disp.decisions),
            "fallbacks": sum(len(d.fallbacks) for d in self.disp.decisions),
        }

    def close(self) -> None:
        """Print the table and write ``lowp.json`` (rank 0); detach the hooks."""
        disp = self.disp
        if self.rank == 0 and disp.decisions:
            times = next((d.times for d in reversed(disp.decisions) if d.times), {})
            probe = disp.probe.to_json()
            print(format_table(probe, disp.plan, times, disp.tolerance), file=self.out, flush=True)
            rep = report_json(
                probe, disp.plan, times, disp.tolerance, disp.mode, disp.timings.machine
            )
            rep["summary"] = self.summary()
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "lowp.json").write_text(json.dumps(rep, indent=1))
        disp.close()
