"""The run's learning rates: ``train.lr_scaling`` against ``train.reference_batch``, then the
``[train.schedule]`` over the run's steps (``neorec.modules.schedule.LrSchedule``)."""

from __future__ import annotations

import math

from neorec.config import Config
from neorec.modules.schedule import LrSchedule

__all__ = ["lr_scale", "lr_schedule", "scaling_line"]


def lr_scale(cfg: Config) -> float:
    """The factor ``train.lr_scaling`` applies to both base lrs: k = data.batch_size (the global
    batch, whatever the number of ranks) / train.reference_batch; linear k, sqrt sqrt(k)."""
    t = cfg.train
    if t.lr_scaling == "none":
        return 1.0
    k = cfg.data.batch_size / t.reference_batch
    return k if t.lr_scaling == "linear" else math.sqrt(k)


def lr_schedule(cfg: Config, total_steps: int | None) -> LrSchedule:
    """The run's schedule (base lrs scaled), checked against a run of ``total_steps`` (None:
    unknown) before any heavy work."""
    k = lr_scale(cfg)
    s = LrSchedule.of(
        cfg.train.schedule, cfg.train.dense_lr * k, cfg.embedding.lr * k, total_steps or 0
    )
    s.check()
    return s


def scaling_line(cfg: Config) -> str | None:
    """One line saying how the lrs were scaled (None: not scaled)."""
    t = cfg.train
    if t.lr_scaling == "none":
        return None
    k = lr_scale(cfg)
    ratio = cfg.data.batch_size / t.reference_batch
    return (
        f"lr scaled x{k:.4g} ({t.lr_scaling}; global batch {cfg.data.batch_size:,} / reference "
        f"{t.reference_batch:,} = {ratio:.4g}): dense {t.dense_lr:g} -> {t.dense_lr * k:.6g}, "
        f"rows {cfg.embedding.lr:g} -> {cfg.embedding.lr * k:.6g}"
    )
