"""Synthetic click data: production-like id reuse and labels from a hidden teacher (known best loss).

Every global batch is a pure function of (data.seed, split, index, batch_size), so any batch can be
produced without the ones before it (resume; ranks slicing one global batch).

Per sample:

- dense [num_dense]: latent z ~ N(0, 1); raw = exp(mu_f + sigma_f z) (log-normal counts-like);
  feature = log1p(raw), the transform the public DLRM pipeline applies to Criteo's integer features.
- sparse: for each feature (tables in order, ``[f for t in tables for f in t.features]``) a bag of
  ids of its table; bag length = round(pooling_factor) (``fixed_pooling``) or Poisson(pooling_factor)
  (some bags empty); ids ``uniform``, ``zipf`` (data.zipf_alpha) or ``locality`` (calibrated to
  Meta's published per-batch reuse, see neorec.data.locality).
- label ~ Bernoulli(sigmoid(teacher logit)).

The teacher is a tiny DLRM: each (table, row) has a K=4 vector from a hash of (seed, table, row) (no
O(rows) memory), shrunk by sqrt(v / (v + 4000)) where v is the row's expected visits in 200,000
samples (rare rows carry little signal, so the teacher's loss is reachable by training, not only a
statistical bound); a bag s_f is the sum of its rows' vectors / sqrt(pooling_factor);
``logit = bias + teacher_scale * (1.2 <z, v> + 0.6 sum_f <s_f, g_f> + 0.3 sum_f <s_f, A_f z>)``: a
linear dense term, per-row effects, and a rank-K dense x sparse interaction. Each term is what a
DLRM with sum pooling, dim >= K embeddings and the dot interaction represents (dot products of
embeddings with the bottom MLP's output). ``bias`` is solved for a CTR of about 0.25.

Default config (8 tables x 10k rows, pooling 4, locality ids): teacher NE ~0.90, AUC ~0.71.

Grouped interactions (``teacher_groups`` N > 0, for DMT towers): the tables are split into N
groups by a seeded permutation of the tables (from data.seed; not contiguous table order), sizes
differing by at most one, and the raw logit gains
``3.0 * sum_{f<g, same group} c_fg <s_f, s_g> / sqrt(P K)`` (c_fg = a random sign x U(0.5, 1.5),
P = the number of such pairs): sparse x sparse interactions only within a group, so a partition
of the tables along the groups keeps them inside towers. N = 0 is the teacher above, bitwise
(nothing extra is drawn from its generator). The count comes from ``data.teacher_groups`` (when
DataConfig has that field) or the ``teacher_groups`` argument.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from neorec.config import DataConfig, TableConfig
from neorec.data.batch import Batch
from neorec.data.ids import (
    LOCALITY_REF_BATCH,
    locality_ids,
    locality_rank_prob,
    uniform_ids,
    uniform_rank_prob,
    unscatter_ranks,
    zipf_ids,
    zipf_rank_prob,
)
from neorec.errors import ConfigError
from neorec.metrics import binary_metrics
from neorec.sparse import SparseFeatures

__all__ = ["SyntheticClickData", "TEACHER_DIM", "zipf_batches"]

TEACHER_DIM = 4
"""K: dimension of the teacher's per-row vectors (a dim-16 model represents them exactly)."""
TARGET_CTR = 0.25
_SPLITS = {"train": 1, "eval": 2, "calib": 3}
_MASK64 = (1 << 64) - 1
_DENSE_WEIGHT, _LINEAR_WEIGHT, _CROSS_WEIGHT = 1.2, 0.6, 0.3
_PAIR_WEIGHT = 3.0
"""Weight of the within-group sparse x sparse term (``teacher_groups`` > 0)."""
# A row's effect is shrunk by sqrt(v / (v + _VISITS_HALF)), v = its expected visits in
# _REF_SAMPLES samples: rows too rare to be learned from a few hundred thousand samples carry little
# signal, so the teacher's loss is reachable by a trained model rather than a statistical bound.
_REF_SAMPLES = 200_000
_VISITS_HALF = 4000.0
_SCALE_CACHE_ROWS = 1 << 20  # tables up to this size cache their rows' scales (<= 4 MiB each)


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
_GOLDEN64 = _signed(0x9E3779B97F4A7C15)


def _mix_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (seeds)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: Tensor) -> Tensor:
    """splitmix64 finalizer on int64 tensors (wrapping multiply; masks make the shifts logical)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def _row_vectors(ids: Tensor, table_key: int) -> Tensor:
    """Teacher vectors [n, K] of rows ``ids`` of one table: 4 x 16-bit slices of one hash."""
    h = _mix(ids * _GOLDEN64 + table_key)
    shifts = torch.tensor([0, 16, 32, 48], dtype=torch.int64)
    u = ((h[:, None] >> shifts) & 0xFFFF).to(torch.float32)
    # uniform on (-sqrt(3), sqrt(3)): unit variance, bounded so no single row dominates
    return (u + 0.5) * (2 * math.sqrt(3.0) / 65536) - math.sqrt(3.0)


def _check_groups(groups: object, num_tables: int) -> int:
    """``teacher_groups`` as an int in [0, num_tables], else a ``ConfigError`` naming it."""
    if isinstance(groups, bool) or not isinstance(groups, int) or not 0 <= groups <= num_tables:
        raise ConfigError(
            f"data.teacher_groups must be an integer in [0, {num_tables}] (the number of "
            f"tables), got {groups!r}"
        )
    return groups


class SyntheticClickData:
    """Random-access synthetic click data with a known Bayes-optimal loss."""

    def __init__(
        self,
        data: DataConfig,
        tables: list[TableConfig],
        num_dense: int,
        locality_ref_batch: int = LOCALITY_REF_BATCH,
        teacher_groups: int | None = None,
    ) -> None:
        if not tables:
            raise ValueError("SyntheticClickData needs at least one table")
        if num_dense <= 0:
            raise ValueError(f"num_dense must be > 0, got {num_dense}")
        self.data = data
        self.tables = list(tables)
        self.num_dense = num_dense
        self.locality_ref_batch = locality_ref_batch
        self.keys = [f for t in self.tables for f in t.features]
        # feature -> (table index); salts keep each table's hot rows in different places
        self._feature_table = [i for i, t in enumerate(self.tables) for _ in t.features]
        self._salts = [zlib.crc32(t.name.encode()) % (1 << 20) for t in self.tables]
        self._table_keys = [_signed(_mix_int(data.seed * 1_000_003 + s)) for s in self._salts]
        g = torch.Generator().manual_seed(_mix_int(data.seed ^ 0x7EAC4E2) & ((1 << 63) - 1))
        nf = len(self.keys)
        self._dense_mu = 1.0 + torch.rand(num_dense, generator=g) * 2.0
        self._dense_sigma = 0.4 + 0.5 * torch.rand(num_dense, generator=g)
        self._dense_w = torch.randn(num_dense, generator=g) / math.sqrt(num_dense)
        self._feat_w = torch.randn(nf, TEACHER_DIM, generator=g) / math.sqrt(nf * TEACHER_DIM)
        # dense x sparse interaction (what DLRM's dot(bottom(dense), embedding) computes)
        self._cross = torch.randn(nf, num_dense, TEACHER_DIM, generator=g) / math.sqrt(
            num_dense * nf * TEACHER_DIM
        )
        groups = getattr(data, "teacher_groups", 0) if teacher_groups is None else teacher_groups
        self.teacher_groups = _check_groups(groups, len(self.tables))
        self.table_group: list[int] = []
        """Teacher group of each table (``teacher_groups`` > 0), else empty."""
        self._pairs: list[tuple[int, int]] = []
        self._pair_w = torch.zeros(0, dtype=torch.float64)
        if self.teacher_groups:
            self._init_groups()
        self._scale_cache: dict[int, Tensor] = {}
        self.bias = 0.0
        self.bias = self._solve_bias()

    def _init_groups(self) -> None:
        """Seeded table -> group assignment and the within-group pair weights (own generator)."""
        n = len(self.tables)
        g = torch.Generator().manual_seed(_mix_int(self.data.seed ^ 0x6A0C5) & ((1 << 63) - 1))
        perm = torch.randperm(n, generator=g).tolist()
        group = [0] * n
        for pos, t in enumerate(perm):
            group[t] = pos * self.teacher_groups // n
        self.table_group = group
        ft = self._feature_table
        self._pairs = [
            (f, h)
            for f in range(len(ft))
            for h in range(f + 1, len(ft))
            if group[ft[f]] == group[ft[h]]
        ]
        # c_fg = random sign x U(0.5, 1.5): every planted pair interacts (none near zero), so
        # the groups are what a partitioner can find
        sign = torch.randint(0, 2, (len(self._pairs),), generator=g).double() * 2 - 1
        mag = 0.5 + torch.rand(len(self._pairs), generator=g, dtype=torch.float64)
        self._pair_w = sign * mag / math.sqrt(max(1, len(self._pairs)) * TEACHER_DIM)

    def group_tables(self) -> list[list[str]]:
        """The planted groups as lists of table names (``teacher_groups`` > 0)."""
        out: list[list[str]] = [[] for _ in range(self.teacher_groups)]
        for t, gi in zip(self.tables, self.table_group):
            out[gi].append(t.name)
        return out

    def table_interaction(self) -> Tensor:
        """[T, T] planted sparse x sparse interaction between tables: the sum of c_fg^2 over the
        pairs of their features (zero across groups; empty tensor when ``teacher_groups`` = 0)."""
        out = torch.zeros(len(self.tables), len(self.tables), dtype=torch.float64)
        for (f, h), w in zip(self._pairs, self._pair_w.tolist()):
            a, b = self._feature_table[f], self._feature_table[h]
            out[a, b] += w * w
            out[b, a] += w * w if a != b else 0.0
        return out

    # ---- sizes ----------------------------------------------------------------------------
    def num_samples(self, split: str) -> int:
        """Samples in a split (data.train_samples / data.eval_samples)."""
        self._split_code(split)
        return self.data.train_samples if split == "train" else self.data.eval_samples

    def num_batches(self, split: str, batch_size: int) -> int:
        """Full batches in a split; the remainder (< batch_size samples) is dropped."""
        return self.num_samples(split) // batch_size

    # ---- batches --------------------------------------------------------------------------
    def batch(self, split: str, index: int, batch_size: int) -> Batch:
        """Global batch ``index`` of ``split``: a function of (seed, split, index, batch_size) only."""
        return self._generate(split, index, batch_size)[0]

    def batches(self, split: str, batch_size: int, start: int = 0) -> Iterator[Batch]:
        """Batches ``start ..`` of a split, in order."""
        for i in range(start, self.num_batches(split, batch_size)):
            yield self.batch(split, i, batch_size)

    def batch_with_probs(self, split: str, index: int, batch_size: int) -> tuple[Batch, Tensor]:
        """(batch, teacher click probabilities [b]) — the probabilities the labels were drawn from."""
        b, logits = self._generate(split, index, batch_size)
        return b, torch.sigmoid(logits)

    # ---- teacher ---------------------------------------------------------------------------
    def teacher_metrics(self, split: str = "eval", batch_size: int = 512) -> dict[str, float]:
        """Metrics of the teacher's true probabilities over a split: the best any model can do."""
        probs, labels = self._collect(split, batch_size)
        return binary_metrics(probs, labels)

    def constant_metrics(self, split: str = "eval", batch_size: int = 512) -> dict[str, float]:
        """Metrics of predicting the split's empirical CTR for everyone (NE = 1, AUC = 0.5)."""
        _, labels = self._collect(split, batch_size)
        ctr = float(labels.mean())
        return binary_metrics(torch.full_like(labels, ctr, dtype=torch.float64), labels)

    def _collect(self, split: str, batch_size: int) -> tuple[Tensor, Tensor]:
        ps, ys = [], []
        for i in range(self.num_batches(split, batch_size)):
            b, p = self.batch_with_probs(split, i, batch_size)
            ps.append(p)
            ys.append(b.labels)
        if not ps:
            raise ValueError(f"split '{split}' has fewer samples than one batch of {batch_size}")
        return torch.cat(ps).double(), torch.cat(ys).double()

    # ---- generation ------------------------------------------------------------------------
    def _split_code(self, split: str) -> int:
        if split not in _SPLITS or split == "calib":
            raise ValueError(f"split must be 'train' or 'eval', got '{split}'")
        return _SPLITS[split]

    def _generator(self, code: int, index: int, batch_size: int) -> torch.Generator:
        h = _mix_int(self.data.seed)
        for x in (code, index, batch_size):
            h = _mix_int(h ^ x)
        return torch.Generator().manual_seed(h & ((1 << 63) - 1))

    def _generate(self, split: str, index: int, batch_size: int) -> tuple[Batch, Tensor]:
        if not 0 <= index:
            raise IndexError(f"batch index must be >= 0, got {index}")
        b, logits, g = self._features(self._split_code(split), index, batch_size)
        labels = torch.bernoulli(torch.sigmoid(logits), generator=g)
        return Batch(b["dense"], b["sparse"], labels.float()), logits

    def _features(
        self, code: int, index: int, batch_size: int
    ) -> tuple[dict[str, Any], Tensor, torch.Generator]:
        g = self._generator(code, index, batch_size)
        z = torch.randn(batch_size, self.num_dense, generator=g)  # [B, D]
        dense = torch.log1p(torch.exp(self._dense_mu + self._dense_sigma * z))
        lengths = self._lengths(batch_size, g)  # [F, B]
        values = [self._ids(f, int(lengths[f].sum()), g) for f in range(len(self.keys))]
        sparse = SparseFeatures(self.keys, torch.cat(values), lengths.reshape(-1))
        logits = self.bias + self.data.teacher_scale * self._raw_logit(z, lengths, values)
        return {"dense": dense, "sparse": sparse}, logits, g

    def _lengths(self, batch_size: int, g: torch.Generator) -> Tensor:
        pf = torch.tensor([float(self.tables[t].pooling_factor) for t in self._feature_table])
        if self.data.fixed_pooling:
            return pf.round().to(torch.int64)[:, None].expand(-1, batch_size).contiguous()
        rate = pf[:, None].expand(-1, batch_size).contiguous()
        return torch.poisson(rate, generator=g).to(torch.int64)

    def _ids(self, f: int, n: int, g: torch.Generator) -> Tensor:
        t = self._feature_table[f]
        table, salt = self.tables[t], self._salts[t]
        dist = self.data.id_distribution
        if dist == "uniform":
            return uniform_ids(table.rows, n, g)
        if dist == "zipf":
            return zipf_ids(table.rows, n, self.data.zipf_alpha, g, salt)
        ref = max(table.pooling_factor, 1e-3) * self.locality_ref_batch
        return locality_ids(table.rows, n, ref, g, salt)

    def _raw_logit(self, z: Tensor, lengths: Tensor, values: list[Tensor]) -> Tensor:
        nf, b = lengths.shape
        pooled = torch.zeros(nf, b, TEACHER_DIM, dtype=torch.float64)  # [F, B, K]
        for f, ids in enumerate(values):
            if ids.numel() == 0:
                continue
            t = self._feature_table[f]
            vec = _row_vectors(ids, self._table_keys[t])  # [n, K]
            vec *= self._row_scale(t, ids)[:, None]
            # bags are contiguous: a bag's sum is a difference of prefix sums (index_add_ is slow)
            csum = torch.zeros(ids.numel() + 1, TEACHER_DIM, dtype=torch.float64)
            torch.cumsum(vec, 0, dtype=torch.float64, out=csum[1:])
            ends = torch.cumsum(lengths[f], 0)
            scale = 1.0 / math.sqrt(max(self.tables[t].pooling_factor, 1.0))
            pooled[f] = (csum[ends] - csum[ends - lengths[f]]) * scale
        linear = (pooled * self._feat_w[:, None, :].double()).sum((0, 2))  # [B]
        proj = torch.einsum("bd,fdk->fbk", z.double(), self._cross.double())  # [F, B, K]
        cross = (pooled * proj).sum((0, 2))  # [B]
        dense = (z @ self._dense_w).double()
        raw = _DENSE_WEIGHT * dense + _LINEAR_WEIGHT * linear + _CROSS_WEIGHT * cross
        if self._pairs:
            f_idx = torch.tensor([p[0] for p in self._pairs])
            h_idx = torch.tensor([p[1] for p in self._pairs])
            dots = (pooled[f_idx] * pooled[h_idx]).sum(2)  # [P, B]
            raw = raw + _PAIR_WEIGHT * (self._pair_w[:, None] * dots).sum(0)
        return raw.float()

    def _row_scale(self, t: int, ids: Tensor) -> Tensor:
        """Teacher effect scale sqrt(v / (v + _VISITS_HALF)) of rows ``ids`` of table ``t``."""
        rows = self.tables[t].rows
        if rows <= _SCALE_CACHE_ROWS:  # small tables: one gather from a per-row cache
            if t not in self._scale_cache:
                self._scale_cache[t] = self._row_scale_uncached(t, torch.arange(rows))
            return self._scale_cache[t][ids]
        return self._row_scale_uncached(t, ids)

    def _row_scale_uncached(self, t: int, ids: Tensor) -> Tensor:
        visits = self._row_prob(t, ids) * (_REF_SAMPLES * self.tables[t].pooling_factor)
        return (visits / (visits + _VISITS_HALF)).sqrt().float()

    def _row_prob(self, t: int, ids: Tensor) -> Tensor:
        """Probability that a lookup of table ``t`` is each of ``ids`` (float64)."""
        table, dist = self.tables[t], self.data.id_distribution
        if dist == "uniform":
            return uniform_rank_prob(ids, table.rows)
        ranks = unscatter_ranks(ids, table.rows, self._salts[t])
        if dist == "zipf":
            return zipf_rank_prob(ranks, table.rows, self.data.zipf_alpha)
        ref = max(table.pooling_factor, 1e-3) * self.locality_ref_batch
        return locality_rank_prob(ranks, table.rows, ref)

    def _solve_bias(self) -> float:
        """Bias giving a mean click probability of TARGET_CTR on a held-aside calibration batch."""
        _, raw, _ = self._features(_SPLITS["calib"], 0, 8192)
        raw = raw.double() * self.data.teacher_scale
        lo, hi = -20.0, 20.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if float(torch.sigmoid(raw + mid).mean()) < TARGET_CTR:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


def zipf_batches(
    tables: Sequence[TableConfig],
    batch_size: int,
    num_dense: int,
    n: int,
    alpha: float,
    seed: int = 0,
) -> list[Batch]:
    """``n`` random batches for ``tables`` (benchmarks and measured placements): each feature's
    bags of ``round(pooling_factor)`` Zipf(``alpha``) ids (0 = uniform), normal dense features,
    25% positive labels."""
    g = torch.Generator().manual_seed(seed)
    b = batch_size
    names = [f for t in tables for f in t.features]
    out = []
    for _ in range(n):
        values, lengths = [], []
        for i, t in enumerate(tables):
            for _f in t.features:
                pf = int(round(t.pooling_factor))
                values.append(zipf_ids(t.rows, b * pf, alpha, g, salt=i))
                lengths.append(torch.full((b,), pf, dtype=torch.int64))
        sparse = SparseFeatures(names, torch.cat(values), torch.cat(lengths))
        dense = torch.randn(b, num_dense, generator=g)
        labels = (torch.rand(b, generator=g) < 0.25).float()
        out.append(Batch(dense, sparse, labels))
    return out
