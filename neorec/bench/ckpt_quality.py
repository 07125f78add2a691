"""The quality half of ``neorec bench ckpt``: NE after restoring quantized checkpoints, on a model
that learns, paired by seed.

Per seed, the default model (``neorec train``'s: 8 tables x 10,000 rows x 16, dot interaction,
row-wise Adagrad, the synthetic teacher) trains ``steps`` uninterrupted: the reference, whose eval
NE and AUC are reported. During it, one ``CheckpointManager`` per stored form (bits, adaptive
range, optimizer-state bits; policy ``adaptive``: baselines and increments) checkpoints every
``interval`` steps. A setting adds the number of restores ``k``: the run is "killed" at ``k``
checkpoint steps spread evenly over the run; each time a fresh model, optimizer and manager
restore the checkpoint of that step and training continues on the same batches (the first
restore reads the reference's chain; later ones the continued run's own, which extends it as
after a real restore). A setting's cost is its eval NE at the end over the reference's, per seed:
``ne_change`` (mean over seeds) with its 95% t interval over the seeds (``neorec.bench.stats``).

The default setting (``CheckpointConfig``'s defaults) was chosen on ``DEV_SEEDS``; the reported
seeds must not include them, or the JSON says ``held_out: false``.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neorec.bench.stats import mean_interval
from neorec.builder import build_dlrm, dense_optimizer
from neorec.builder.schedule import lr_schedule
from neorec.checkpoint.manager import CheckpointManager, list_checkpoints
from neorec.checkpoint.storage import open_storage
from neorec.config import CheckpointConfig, Config, load_config
from neorec.data.synthetic import SyntheticClickData
from neorec.train.trainer import evaluate, train_step

__all__ = [
    "QSetting",
    "QSETTINGS",
    "DEFAULT_Q",
    "DEV_SEEDS",
    "quality_config",
    "run_seed",
    "summarize",
]

DEV_SEEDS = (0, 1, 2, 3, 4)
"""The seeds the default setting was chosen on (docs/checkpoints.md): never reported."""


@dataclass(frozen=True)
class QSetting:
    """A stored form of the checkpoint and how many times the run restores from it."""

    bits: int
    adaptive_range: bool
    opt_bits: int
    restores: int

    @property
    def form(self) -> str:
        """The stored form (one checkpoint directory per form in the reference run)."""
        ar = "+ar" if self.adaptive_range and self.bits <= 4 else ""
        return f"{self.bits}{ar}/opt{self.opt_bits}"

    @property
    def name(self) -> str:
        """The setting's name in the table and JSON: form and restores."""
        return f"{self.form}/x{self.restores}"

    def config(self) -> CheckpointConfig:
        """The manager's settings (policy ``adaptive``, everything else the defaults)."""
        return CheckpointConfig(
            bits=self.bits,
            adaptive_range=self.adaptive_range,
            opt_bits=self.opt_bits,
            keep_last=1000,
            async_write=False,
            fsync=False,
        )


_D = CheckpointConfig()
DEFAULT_Q = QSetting(_D.bits, _D.adaptive_range, _D.opt_bits, 1)
"""The default checkpoint settings (``CheckpointConfig()``), one restore."""

QSETTINGS: list[QSetting] = [
    DEFAULT_Q,
    QSetting(8, True, 32, 4),
    QSetting(8, True, 16, 1),
    QSetting(8, True, 0, 1),
    QSetting(4, True, 32, 1),
    QSetting(4, False, 32, 1),
    QSetting(2, True, 32, 1),
]
"""Every setting the benchmark measures, the default first."""


def quality_config(
    seed: int, steps: int, batch: int, eval_samples: int, extra: list[str] | None = None
) -> Config:
    """The default model and teacher data (``neorec train``'s config), seeded, ``steps`` long."""
    return load_config(
        None,
        [
            f"data.batch_size={batch}",
            f"data.train_samples={batch * steps}",
            f"data.eval_samples={eval_samples}",
            f"data.seed={seed}",
            f"train.seed={seed}",
            "train.progress=false",
            "train.schedule.decay=cosine",
            *(extra or []),
        ],
    )


def restore_steps(steps: int, interval: int, k: int) -> list[int]:
    """``k`` checkpoint steps (multiples of ``interval``) spread evenly over ``steps``."""
    out = [max(interval, round(i * steps / (k + 1) / interval) * interval) for i in range(1, k + 1)]
    if len(set(out)) != k or out[-1] >= steps:
        raise ValueError(f"{k} restores do not fit {steps} steps at interval {interval}")
    return out


class _Run:
    """One seed's data, eval batches and the model's training loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.bs = cfg.data.batch_size
        self.data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
        self.eval = list(self.data.batches("eval", min(4096, cfg.data.eval_samples)))
        steps = cfg.data.train_samples // self.bs
        self.schedule = lr_schedule(cfg, steps) if cfg.train.schedule.active else None

    def fresh(self) -> tuple[Any, Any]:
        """A newly built model and its dense optimizer."""
        model = build_dlrm(self.cfg)
        return model, dense_optimizer(self.cfg.train, model.dense_parameters())

    def train(self, model: Any, opt: Any, start: int, end: int, every: int, mgrs: list) -> None:
        """Steps ``start`` .. ``end`` - 1; every manager saves at multiples of ``every``."""
        for s in range(start, end):
            if self.schedule is not None:
                self.schedule.apply(s + 1, opt, model.ebc)
            train_step(model, opt, self.data.batch("train", s, self.bs), s + 1)
            if (s + 1) % every == 0:
                for m in mgrs:
                    m.save(s + 1)

    def metrics(self, model: Any) -> dict[str, float]:
        """Eval metrics of ``model``."""
        return evaluate(model, iter(self.eval))


def _restore_at(run: _Run, q: QSetting, root: Path, step: int) -> tuple[Any, Any, Any]:
    """A fresh model, optimizer and manager on ``root``, restored from its checkpoint at ``step``."""
    model, opt = run.fresh()
    mgr = CheckpointManager(q.config(), model, opt, str(root))
    name = next(m["name"] for m in list_checkpoints(open_storage(str(root))) if m["step"] == step)
    mgr.restore(name)
    return model, opt, mgr


def _continue(run: _Run, q: QSetting, ref_root: Path, root: Path, steps: int, every: int) -> Any:
    """The model after a run of ``steps`` restored ``q.restores`` times; ``root`` starts as a copy
    of the reference's chain up to the first restore."""
    points = restore_steps(steps, every, q.restores)
    shutil.copytree(ref_root, root)
    storage = open_storage(str(root))
    for m in list_checkpoints(storage):
        if m["step"] > points[0]:
            storage.remove(m["name"])
    for i, p in enumerate(points):
        model, opt, mgr = _restore_at(run, q, root, p)
        end = points[i + 1] if i + 1 < len(points) else steps
        run.train(model, opt, p, end, every, [mgr] if i + 1 < len(points) else [])
        mgr.close()
    return model


def run_seed(
    seed: int,
    settings: list[QSetting],
    steps: int,
    batch: int,
    every: int,
    evals: int,
    tmp: Path,
    extra: list[str] | None = None,
) -> dict[str, Any]:
    """One seed: the reference's metrics and each setting's eval NE."""
    run = _Run(quality_config(seed, steps, batch, evals, extra))
    forms = {q.form: q for q in settings}
    roots = {f: tmp / f"s{seed}" / f.replace("/", "_") for f in forms}
    model, opt = run.fresh()
    mgrs = [CheckpointManager(q.config(), model, opt, str(roots[f])) for f, q in forms.items()]
    run.train(model, opt, 0, steps, every, mgrs)
    for m in mgrs:
        m.close()
    ref = run.metrics(model)
    out: dict[str, Any] = {"seed": seed, "reference": ref, "ne": {}}
    for q in settings:
        root = tmp / f"s{seed}" / f"run_{q.name.replace('/', '_')}"
        out["ne"][q.name] = run.metrics(_continue(run, q, roots[q.form], root, steps, every))["ne"]
    shutil.rmtree(tmp / f"s{seed}", ignore_errors=True)
    return out


def summarize(per_seed: list[dict[str, Any]], settings: list[QSetting]) -> dict[str, Any]:
    """Reference NE/AUC (mean, interval) and per setting the paired NE change with its interval."""
    ref_ne = [r["reference"]["ne"] for r in per_seed]
    ref_auc = [r["reference"]["auc"] for r in per_seed]
    rows: dict[str, Any] = {}
    for q in settings:
        changes = [r["ne"][q.name] / r["reference"]["ne"] - 1.0 for r in per_seed]
        iv = mean_interval(changes)
        rows[q.name] = {
            "bits": q.bits,
            "adaptive_range": q.adaptive_range and q.bits <= 4,
            "opt_bits": q.opt_bits,
            "restores": q.restores,
            "ne_change": iv.value,
            "ne_change_interval": iv.to_dict(),
            "ne_change_per_seed": changes,
        }
    return {
        "reference_ne": statistics.fmean(ref_ne),
        "reference_ne_interval": mean_interval(ref_ne).to_dict(),
        "reference_auc": statistics.fmean(ref_auc),
        "reference_auc_interval": mean_interval(ref_auc).to_dict(),
        "reference_ne_per_seed": ref_ne,
        "settings": rows,
    }
