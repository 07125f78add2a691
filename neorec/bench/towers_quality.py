"""Tower partitions and model quality (DMT), in one process, paired by seed.

Synthetic data from the ungrouped teacher (``teacher_groups`` 0: sparse x sparse interactions
between any tables) or the grouped one (``SyntheticClickData(teacher_groups=N)``: interactions
only inside N planted groups of tables). For each seed: the learned partitioner (warm-up of the
flat model, then clustering), then eval NE of the flat model and of towered models (a
compressing tower module) with the learned and a random partition (grouped: also the balanced
partition, the planted groups, and the learned partition's adjusted Rand index to them). Every
setting trains on the same seeds, data and steps; the record carries the paired differences
with 95% intervals (``neorec.bench.stats``). ``neorec bench dmt`` runs it; alone:
``python -m neorec.bench.towers_quality [--seeds 5] [--seed-base 100] [--teacher-groups 2]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from neorec.builder import build_dlrm, build_flat_dlrm, tower_groups
from neorec.config import Config, load_config
from neorec.data.synthetic import SyntheticClickData
from neorec.metrics import binary_metrics
from neorec.train.towers_warmup import learned_groups

__all__ = ["grouped_config", "grouped_data", "adjusted_rand", "captured", "train_eval", "run"]


def grouped_config(
    seed: int = 0,
    tables: int = 12,
    towers: int = 3,
    dim: int = 16,
    module: str = "dot",
    out_vectors: int = 1,
    batch: int = 256,
    warmup: int = 600,
    extra: Sequence[str] = (),
) -> Config:
    """A small config for the grouped task (tables of 2,000 rows, pooling 2; ``dim`` below the
    tower's F x K teacher dims makes a tower's output a real compression)."""
    return load_config(
        None,
        [
            f"embedding.num_tables={tables}",
            "embedding.rows=2000",
            f"embedding.dim={dim}",
            f"model.bottom_mlp=[64, 32, {dim}]",
            "embedding.pooling_factor=2",
            f"data.batch_size={batch}",
            f"data.seed={1000 + seed}",
            "data.teacher_scale=1.5",
            "data.id_distribution='zipf'",
            f"train.seed={seed}",
            f"towers.count={towers}",
            f"towers.module='{module}'",
            f"towers.out_vectors={out_vectors}",
            f"towers.warmup_steps={warmup}",
            f"towers.seed={seed}",
            *extra,
        ],
    )


def grouped_data(cfg: Config, groups: int) -> SyntheticClickData:
    """The synthetic data of ``cfg`` with ``groups`` planted interaction groups."""
    return SyntheticClickData(
        cfg.data, cfg.embedding.tables, cfg.model.num_dense, teacher_groups=groups
    )


def adjusted_rand(a: Sequence[Sequence[str]], b: Sequence[Sequence[str]]) -> float:
    """Adjusted Rand index of two partitions of the same names (1 = equal, ~0 = chance)."""
    la = {n: i for i, g in enumerate(a) for n in g}
    lb = {n: i for i, g in enumerate(b) for n in g}
    names = sorted(la)
    ct = np.zeros((len(a), len(b)))
    for n in names:
        ct[la[n], lb[n]] += 1

    def c2(x: Any) -> Any:
        return x * (x - 1) / 2

    idx = c2(ct).sum()
    ra, rb, tot = c2(ct.sum(1)).sum(), c2(ct.sum(0)).sum(), c2(len(names))
    exp = ra * rb / tot
    mx = (ra + rb) / 2
    return 1.0 if mx == exp else float((idx - exp) / (mx - exp))


def captured(groups: Sequence[Sequence[str]], data: SyntheticClickData) -> float:
    """Share of the planted interaction (``data.table_interaction()``) inside the towers
    (1 = every interacting pair of tables in one tower)."""
    idx = {t.name: i for i, t in enumerate(data.tables)}
    inter = data.table_interaction()
    inside = sum(float(inter[idx[a], idx[b]]) for g in groups for a in g for b in g if a < b)
    total = float(inter.triu(1).sum())
    return inside / total if total else 1.0


def train_eval(
    cfg: Config,
    data: SyntheticClickData,
    steps: int,
    groups: Sequence[Sequence[str]] | None,
    eval_batches: int = 40,
) -> dict[str, float]:
    """Eval metrics (``binary_metrics``: NE, AUC, ...) after ``steps`` steps of the model of
    ``cfg`` (towered with ``groups``, or flat when None); dense Adagrad at ``train.dense_lr``,
    mean BCE."""
    model = build_dlrm(cfg, groups=groups) if groups is not None else build_flat_dlrm(cfg)
    opt = torch.optim.Adagrad(list(model.dense_parameters()), lr=cfg.train.dense_lr)
    bs = cfg.data.batch_size
    for i in range(steps):
        b = data.batch("train", i, bs)
        loss = F.binary_cross_entropy_with_logits(model(b.dense, b.sparse), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    ps, ys = [], []
    with torch.no_grad():
        for i in range(eval_batches):
            b = data.batch("eval", i, bs)
            ps.append(torch.sigmoid(model(b.dense, b.sparse)).double())
            ys.append(b.labels.double())
    return {k: float(v) for k, v in binary_metrics(torch.cat(ps), torch.cat(ys)).items()}


def _seed_row(
    s: int, steps: int, towers: int, teacher_groups: int, module: str, tables: int, dim: int
) -> dict[str, Any]:
    """One seed's partitions and eval NE: flat, learned, random (and balanced, planted on the
    grouped teacher); the same data and model seed for every setting."""
    t0 = time.perf_counter()
    cfg = grouped_config(s, tables, towers, dim, module)
    data = grouped_data(cfg, teacher_groups)
    bs = cfg.data.batch_size
    warm = (data.batch("train", i, bs) for i in range(cfg.towers.warmup_steps))
    learned = learned_groups(cfg, warm)
    rnd = tower_groups(grouped_config(s, tables, towers, dim, module,
                                      extra=["towers.partitioner='random'"]))  # fmt: skip
    assert rnd is not None
    row: dict[str, Any] = {"seed": s, "learned_groups": learned, "random_groups": rnd}
    flat = train_eval(cfg, data, steps, None)  # the reference: its absolute NE and AUC
    row["ne_flat"], row["auc_flat"] = flat["ne"], flat["auc"]
    row["ne_learned"] = train_eval(cfg, data, steps, learned)["ne"]
    row["ne_random"] = train_eval(cfg, data, steps, rnd)["ne"]
    if teacher_groups:
        planted = data.group_tables()
        bal = tower_groups(cfg)
        assert bal is not None
        row.update(
            ari_learned=adjusted_rand(learned, planted),
            ari_random=adjusted_rand(rnd, planted),
            captured_learned=captured(learned, data),
            captured_random=captured(rnd, data),
            ne_balanced=train_eval(cfg, data, steps, bal)["ne"],
            ne_planted=train_eval(cfg, data, steps, planted)["ne"],
        )
    row["ne_teacher"] = data.teacher_metrics("eval", bs)["ne"]
    row["s"] = time.perf_counter() - t0
    return row


PAIRS = (("learned", "flat"), ("random", "flat"), ("learned", "random"))
"""The paired differences reported: (a, b) -> NE of a minus NE of b, per seed."""


def run(
    seeds: int = 5,
    steps: int = 1500,
    towers: int = 2,
    module: str = "dot",
    tables: int = 12,
    dim: int = 16,
    seed_base: int = 100,
    teacher_groups: int = 0,
) -> dict[str, Any]:
    """Seeds ``seed_base .. seed_base + seeds - 1`` (each: model, data, random partition and
    learned warm-up seed), every setting on every seed; ``teacher_groups`` 0 = the ungrouped
    teacher, N = N planted groups. Returns the JSON record: per-seed NE, and for each pair of
    ``PAIRS`` the mean paired difference of NE (``d_ne_A_vs_B``) and of NE relative to B
    (``rel_ne_A_vs_B``), each a 95% interval ``{value, lo, hi, n}``."""
    from neorec.bench.stats import mean_interval, paired_difference

    rows = []
    for s in range(seed_base, seed_base + seeds):
        row = _seed_row(s, steps, towers, teacher_groups, module, tables, dim)
        rows.append(row)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items() if not k.endswith("_groups")),
              flush=True)  # fmt: skip
    out: dict[str, Any] = {
        "bench": "towers_quality", "module": module, "steps": steps, "tables": tables,
        "towers": towers, "teacher_groups": teacher_groups, "dim": dim,
        "warmup_steps": grouped_config().towers.warmup_steps,
        "seeds": [r["seed"] for r in rows],
    }  # fmt: skip
    keys = [k for k in rows[0] if k.startswith(("ne_", "auc_", "ari_", "captured_"))]
    for k in keys:
        out[k] = [float(r[k]) for r in rows]
        out[k + "_mean"] = mean_interval(out[k]).to_dict()
    for a, b in PAIRS:
        xa, xb = out[f"ne_{a}"], out[f"ne_{b}"]
        out[f"d_ne_{a}_vs_{b}"] = paired_difference(xa, xb).to_dict()
        out[f"rel_ne_{a}_vs_{b}"] = mean_interval([x / y - 1 for x, y in zip(xa, xb)]).to_dict()
    out["learned_groups"] = [r["learned_groups"] for r in rows]
    print(json.dumps(out, sort_keys=True))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: ``--seeds``, ``--seed-base``, ``--steps``, ``--towers``,
    ``--teacher-groups``, ``--module``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seed-base", type=int, default=100)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--towers", type=int, default=2)
    p.add_argument("--teacher-groups", type=int, default=0, help="0 = the ungrouped teacher")
    p.add_argument("--module", default="dot", choices=("mlp", "dot", "dcn", "identity"))
    p.add_argument("--tables", type=int, default=12)
    p.add_argument("--dim", type=int, default=16)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    run(a.seeds, a.steps, a.towers, a.module, a.tables, a.dim, a.seed_base, a.teacher_groups)


if __name__ == "__main__":
    main()
