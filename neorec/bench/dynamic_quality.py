"""The runs of ``neorec bench dynamic``: streams, table sizes at equal memory, one model trained
window by window and evaluated, and the choice of admission thresholds on development seeds.

Table kinds (``kind``), each at a memory budget of M rows x (dim + 1) x 4 bytes a table:

- ``full``: a row for every id (the id space),
- ``hashed``: M rows indexed by ``mix64(id) % M`` (``--hash mod``: ``id % M``),
- ``hashed_adm``: the same hashed table behind the dynamic table's threshold admission
  (``neorec.storage.admission``: unadmitted ids are left out of their bags, so they read zero and
  train nothing), with as many rows as fit beside its sketches (``hashed_adm_rows``),
- ``dynamic``: a dynamic table (LRU, unadmitted zeros) with as many slots as fit beside its id map
  and sketch (``dynamic_slots``, the map's bytes as ``map_bytes_per_slot`` counts them).

Threshold 0 means no admission filter (``dynamic``: every id admitted; ``hashed_adm``: the plain
hashed table of M rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from copy import deepcopy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from neorec.config import Config, load_config
from neorec.ops.id_map_size import map_bytes_per_slot, sketch_width
from neorec.sparse import SparseFeatures
from neorec.storage.admission import AdmissionFilter, sketch_bytes

__all__ = ["STREAMS", "dynamic_slots", "hashed_adm_rows", "stream_cfg", "train_eval", "select"]

STREAMS = {"default": (4000.0, 1.0), "tuned": (100.0, 3.0)}
"""Stream name -> (``data.id_shrink_visits``, ``data.id_weight``). ``default``: the stream's own
defaults; ``tuned``: the knobs under which a row per id is worth 3-4% NE (docs/dynamic.md)."""


def dynamic_slots(
    memory: int, row_bytes: int, admission: str = "always", eviction: str = "lru"
) -> int:
    """Slots of a dynamic table that fit in ``memory`` bytes with their rows and map (the map's
    bytes a slot as ``map_bytes_per_slot`` counts them for this admission and eviction)."""
    cap = max(1, memory // row_bytes)
    for _ in range(6):  # the map's bytes a slot depend (a little) on the capacity
        cap = max(1, int(memory // (row_bytes + map_bytes_per_slot(cap, admission, eviction))))
    return cap


def hashed_adm_rows(memory: int, row_bytes: int) -> int:
    """Rows of a hashed table that fit in ``memory`` bytes beside its admission sketch, sized
    by the id map's rule for a capacity (``sketch_width(rows)``: 2-4 counters a row a sketch
    row); the largest such count."""
    rows = max(1, memory // row_bytes)
    while rows > 1 and rows * row_bytes + sketch_bytes(sketch_width(rows)) > memory:
        rows -= 1
    return rows


def stream_cfg(a: argparse.Namespace, stream: str, seed: int) -> Config:
    """The run's config: the drifting stream ``stream`` for ``seed`` (data seed 100 + seed)."""
    shrink, weight = STREAMS[stream]
    return load_config(
        None,
        [
            "data.source='stream'",
            f"data.windows={a.windows}",
            f"data.window_samples={a.window_samples}",
            f"data.eval_samples={a.eval_samples}",
            f"data.id_churn={a.churn}",
            f"data.drift={a.drift}",
            f"data.id_distribution='{a.ids}'",
            f"data.id_shrink_visits={shrink}",
            f"data.id_weight={weight}",
            f"data.batch_size={a.batch}",
            f"data.seed={100 + seed}",
            f"embedding.num_tables={a.tables}",
            f"embedding.rows={a.rows}",
            f"embedding.dim={a.dim}",
            f"model.bottom_mlp=[64, {a.dim}]",
            f"train.seed={seed}",
        ],
    )


def sizes(a: argparse.Namespace, frac: float, threshold: int, kind: str) -> int:
    """Rows (or slots) of ``kind`` at budget ``frac`` with admission ``threshold``."""
    row_bytes = 4 * a.dim + 4  # weights + row-wise Adagrad state
    m = max(1, int(a.rows * frac))
    if kind == "dynamic":
        adm = "threshold" if threshold > 0 else "always"
        return dynamic_slots(m * row_bytes, row_bytes, adm, a.eviction)
    if kind == "hashed_adm" and threshold > 0:
        return hashed_adm_rows(m * row_bytes, row_bytes)
    return a.rows if kind == "full" else m


class Table:
    """One model and what its batches go through: ``prep(sparse, training)`` -> its ids."""

    def __init__(self, cfg: Config, a: argparse.Namespace, kind: str, m: int, thr: int) -> None:
        from neorec.builder import build_dlrm

        c = deepcopy(cfg)
        for t in c.embedding.tables:
            if kind in ("hashed", "hashed_adm"):
                t.rows = m
            elif kind == "dynamic":
                t.kind, t.capacity, t.eviction = "dynamic", m, a.eviction
                t.unadmitted = "zeros"
                t.admission = "threshold" if thr > 0 else "always"
                t.admit_threshold = max(1, thr)
        self.kind, self.m, self.how = kind, m, a.hash
        self.model = build_dlrm(c)
        self.opt = torch.optim.Adagrad(list(self.model.dense_parameters()), lr=c.train.dense_lr)
        keys = [t.name for t in c.embedding.tables]
        self.filter = (
            AdmissionFilter(keys, thr, sketch_width(m), seed=c.train.seed)
            if kind == "hashed_adm" and thr > 0
            else None
        )
        self.lookups = self.kept = 0

    def prep(self, sp: SparseFeatures, training: bool) -> SparseFeatures:
        if self.filter is not None:
            n = sp.values.numel()
            sp = self.filter(sp, count=training)
            if training:
                self.lookups, self.kept = self.lookups + n, self.kept + sp.values.numel()
        if self.kind in ("hashed", "hashed_adm"):
            sp = hash_ids(sp, self.m, self.how)
        return sp

    def step(self, b: Any) -> None:
        """One training step (its ids through the filter, the hash or the id map)."""
        loss = F.binary_cross_entropy_with_logits(
            self.model(b.dense, self.prep(b.sparse, True)), b.labels
        )
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def unadmitted_share(self) -> float:
        """Unadmitted share of the training lookups so far."""
        if self.kind == "dynamic":
            s = self.model.ebc.stats().values()
            look = sum(t["total"]["lookups"] for t in s)
            return sum(t["total"]["unadmitted"] for t in s) / max(1, look)
        return 1 - self.kept / self.lookups if self.lookups else 0.0


def hash_ids(sp: SparseFeatures, m: int, how: str) -> SparseFeatures:
    """Ids to rows of an M-row table: ``mix64(id) % M`` (a hash, as production tables hash raw
    ids) or ``id % M`` (kinder on this stream: ids sharing ``id % M`` have popularity ranks M
    apart)."""
    if how == "mod":
        return SparseFeatures(sp.keys, sp.values % m, sp.lengths, sp.weights)
    from neorec.ops.id_map import _mix64_np

    h = _mix64_np(sp.values.numpy().astype(np.uint64)) % np.uint64(m)
    return SparseFeatures(sp.keys, torch.from_numpy(h.astype(np.int64)), sp.lengths, sp.weights)


def train_eval(cfg: Config, a: argparse.Namespace, kind: str, m: int, thr: int) -> dict[str, Any]:
    """Train window by window; the eval NE per window and their mean, the mean AUC; unadmitted
    share."""
    from neorec.data.stream import DriftingClickData
    from neorec.metrics import binary_metrics

    tab = Table(cfg, a, kind, m, thr)
    bs = cfg.data.batch_size
    nes, aucs = [], []
    for w in range(cfg.data.windows):
        data = DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=w)
        for i in range(cfg.data.window_samples // bs):
            tab.step(data.batch("train", i, bs))
        ps, ys = [], []
        with torch.no_grad():
            for i in range(cfg.data.eval_samples // bs):
                b = data.batch("eval", i, bs)
                ps.append(torch.sigmoid(tab.model(b.dense, tab.prep(b.sparse, False))).double())
                ys.append(b.labels.double())
        got = binary_metrics(torch.cat(ps), torch.cat(ys))
        nes.append(got["ne"])
        aucs.append(got["auc"])
    return {
        "ne": statistics.mean(nes),
        "auc": statistics.mean(aucs),
        "ne_by_window": nes,
        "unadmitted": tab.unadmitted_share(),
    }


def teacher_ne(cfg: Config) -> float:
    """The teacher's eval NE (the best any model can do), mean over windows."""
    from neorec.data.stream import teacher_metrics_by_window

    return statistics.mean(
        m["ne"]
        for m in teacher_metrics_by_window(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    )


def select(
    a: argparse.Namespace, stream: str, frac: float, grid: list[int], dev: list[int]
) -> dict[str, Any]:
    """Per kind (``dynamic``, ``hashed_adm``): the threshold of ``grid`` with the lowest mean NE
    on the development seeds ``dev`` (one value: taken as is, nothing trained)."""
    out: dict[str, Any] = {}
    for kind in ("dynamic", "hashed_adm"):
        if len(grid) == 1:
            out[kind] = {"threshold": grid[0], "dev_ne": {}}
            continue
        ne = {
            thr: statistics.mean(
                train_eval(stream_cfg(a, stream, s), a, kind, sizes(a, frac, thr, kind), thr)["ne"]
                for s in dev
            )
            for thr in grid
        }
        out[kind] = {"threshold": min(ne, key=lambda t: (ne[t], t)), "dev_ne": ne}
    return out


def speed_round(tables: dict[str, Table], batches: list[Any]) -> dict[str, float]:
    """Steps a second of each table over ``batches`` (in the dict's order)."""
    out = {}
    for name, tab in tables.items():
        t0 = time.perf_counter()
        for b in batches:
            tab.step(b)
        out[name] = len(batches) / (time.perf_counter() - t0)
    return out
