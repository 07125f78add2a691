"""The run's learning rates: ``train.lr_scaling`` against ``train.reference_batch``, then the
``[train.schedule]`` over the run's steps (``neorec.modules.schedule.LrSchedule``); the steps
``[train.qat]`` regularizes (``neorec.modules.qat.QatSchedule``)."""

from __future__ import annotations

import math

from neorec.config import Config
from neorec.modules.qat import QatSchedule
from neorec.modules.schedule import LrSchedule

__all__ = [
    "lr_scale",
    "rows_lr_scale",
    "row_l2_scale",
    "lr_schedule",
    "qat_schedule",
    "scaling_line",
]


def _ratio(cfg: Config) -> float:
    """k = data.batch_size (the global batch, whatever the number of ranks) /
    train.reference_batch (1 without scaling)."""
    t = cfg.train
    return 1.0 if t.lr_scaling == "none" else cfg.data.batch_size / t.reference_batch


def lr_scale(cfg: Config) -> float:
    """The factor ``train.lr_scaling`` applies to the dense lr: linear k, sqrt and cowclip
    sqrt(k)."""
    k = _ratio(cfg)
    return k if cfg.train.lr_scaling in ("linear", "none") else math.sqrt(k)


def rows_lr_scale(cfg: Config) -> float:
    """The factor applied to the row lr: the dense one's, except 1 under CowClip's rule."""
    return 1.0 if cfg.train.lr_scaling == "cowclip" else lr_scale(cfg)


def row_l2_scale(cfg: Config) -> float:
    """The factor applied to ``embedding.weight_decay``: k under CowClip's rule, else 1."""
    return _ratio(cfg) if cfg.train.lr_scaling == "cowclip" else 1.0


def lr_schedule(cfg: Config, total_steps: int | None) -> LrSchedule:
    """The run's schedule (base lrs scaled), checked against a run of ``total_steps`` (None:
    unknown) before any heavy work."""
    s = LrSchedule.of(
        cfg.train.schedule,
        cfg.train.dense_lr * lr_scale(cfg),
        cfg.embedding.lr * rows_lr_scale(cfg),
        total_steps or 0,
    )
    s.check()
    return s


def qat_schedule(cfg: Config, total_steps: int | None) -> QatSchedule | None:
    """When ``[train.qat]`` regularizes the rows over a run of ``total_steps`` (None: QAT is
    off), checked before any heavy work."""
    return QatSchedule.of(cfg.train.qat, total_steps) if cfg.train.qat.active else None


def scaling_line(cfg: Config) -> str | None:
    """One line saying how the lrs were scaled (None: not scaled)."""
    t = cfg.train
    if t.lr_scaling == "none":
        return None
    k, kr, emb = lr_scale(cfg), rows_lr_scale(cfg), cfg.embedding
    ratio = _ratio(cfg)
    line = (
        f"lr scaled x{k:.4g} ({t.lr_scaling}; global batch {cfg.data.batch_size:,} / reference "
        f"{t.reference_batch:,} = {ratio:.4g}): dense {t.dense_lr:g} -> {t.dense_lr * k:.6g}, "
        f"rows {emb.lr:g} -> {emb.lr * kr:.6g}"
    )
    if t.lr_scaling == "cowclip":
        line += f", row L2 {emb.weight_decay:g} -> {emb.weight_decay * row_l2_scale(cfg):.6g}"
    return line
