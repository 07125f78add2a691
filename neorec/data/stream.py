"""Streaming synthetic data (windows of a drifting teacher) and DAS: FM logits attached to it.

The stream is ``neorec.data.synthetic``'s generator, made non-stationary over windows ("days")
w = 0, 1, ... (``data.window`` of ``data.windows``):

- **Id churn.** Each table's *active* ids are a contiguous range of ``A = ceil(rows / 2)`` ids on a
  ring of ``rows`` ids, starting at ``s_w = round(w * data.id_churn * A)``. A lookup draws a slot
  r in [0, A) from the usual distribution (uniform / zipf / locality, over A), and the id is the
  one id v of [s_w, s_w + A) with v = r (mod A), taken mod rows. So per window the
  ``id_churn`` share of the range's oldest ids retire and as many new ids appear; a new id
  inherits the popularity of the slot it takes over, and the teacher's vector of an id is keyed
  by v (a new entity, even where v mod rows reuses a row retired long ago).
- **Teacher drift.** The teacher's dense, per-feature and dense x sparse weights (and the
  within-group pair weights) move per window: ``w_t = sqrt(1 - r^2) w_(t-1) + r fresh_t`` with
  r = ``data.drift`` and ``fresh_t`` drawn like the initial weights (seeded by (seed, t)), so
  their scale stays put. Per-row vectors do not drift (entities change through churn). The bias
  is solved per window for a CTR of about 0.25 on a window-independent calibration batch.
- **Id effects.** ``data.id_shrink_visits`` (H) replaces the synthetic teacher's 4000 in the
  shrink sqrt(v / (v + H)) of each id's teacher vector (v: the id's expected visits in 200,000
  samples): lower H = rarer ids carry their own effect, so exact per-id rows matter (a hashed
  table's collisions cost more). ``data.id_weight`` multiplies every id's vector after the shrink
  (the per-id terms of the logit grow against the dense ones). H = 4000 and weight 1 are the
  stream as before, bitwise (same fingerprints).
- **Splits.** Each window has its own train split (``data.window_samples``) and eval split
  (``data.eval_samples``), from seeds of (seed, window, split, batch index, batch size). With
  drift 0 and churn 0 every window has bitwise the same teacher (only the samples differ).

DAS (data augmentation system, ExFM): ``neorec.serve.das.write_fm_logits`` runs a saved FM over a window's split, in
data order, and writes its float32 logits as a side file ``fm_w{window}_{split}.npy`` with a JSON
sidecar (window, split, samples, batch size, the FM's window and step, a fingerprint of the
stream's config and the array's SHA-256). ``read_fm_logits`` is the reader the stream source uses
for ``data.fm_logits`` / ``data.fm_staleness``: the logits of window w must come from the FM of
window w - k, and anything else is refused with a one-line ``DataError``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from neorec.config import ConfigError, DataConfig, TableConfig
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
from neorec.data.synthetic import (
    _REF_SAMPLES,
    _SCALE_CACHE_ROWS,
    _SPLITS,
    _VISITS_HALF,
    TEACHER_DIM,
    SyntheticClickData,
    _mix_int,
)
from neorec.errors import DataError
from neorec.metrics import binary_metrics

__all__ = [
    "DriftingClickData",
    "active_rows",
    "teacher_metrics_by_window",
    "stream_fingerprint",
    "fm_paths",
    "read_fm_logits",
    "split_samples",
    "check_split",
    "logits_sha256",
    "FM_FORMAT",
    "FM_FORMAT_VERSION",
]

FM_FORMAT = "neorec.fm_logits"
FM_FORMAT_VERSION = 1
_STREAM_SALT = 0x57AE4D
_DRIFT_SALT = 0xD21F7
_VERTICAL_SALT = 0x7E47C
_MASK63 = (1 << 63) - 1
_SPLIT_NAMES = ("train", "eval")


def active_rows(rows: int) -> int:
    """Ids of a table active in one window: ceil(rows / 2) (the rest hold retired / future ids)."""
    return max(1, (rows + 1) // 2)


class DriftingClickData(SyntheticClickData):
    """Window ``window`` (default ``data.window``) of the drifting stream: random access by
    (split, batch index, batch size), like ``SyntheticClickData``."""

    def __init__(
        self,
        data: DataConfig,
        tables: list[TableConfig],
        num_dense: int,
        window: int | None = None,
        locality_ref_batch: int = LOCALITY_REF_BATCH,
        teacher_groups: int | None = None,
    ) -> None:
        w = data.window if window is None else window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ConfigError(f"data.window must be an integer >= 0, got {w!r}")
        self.window = w
        self._ready = False  # the base class solves the bias before the weights drifted: skip it
        self._active = [active_rows(t.rows) for t in tables]
        self._starts = [int(round(w * data.id_churn * a)) for a in self._active]
        super().__init__(data, tables, num_dense, locality_ref_batch, teacher_groups)
        self._drift(w)
        self._vertical()
        self._ready = True
        self.bias = 0.0
        self.bias = self._solve_bias() + float(data.vertical_bias)

    # ---- sizes ------------------------------------------------------------------------------
    def num_samples(self, split: str) -> int:
        """Samples in a split of this window (data.window_samples / data.eval_samples)."""
        self._split_code(split)
        return self.data.window_samples if split == "train" else self.data.eval_samples

    def active_range(self, table: int) -> tuple[int, int]:
        """``(first, count)``: table ``table``'s active ids are ``(first + i) % rows``, i < count."""
        return self._starts[table] % self.tables[table].rows, self._active[table]

    # ---- the drifting teacher -----------------------------------------------------------------
    def _drift(self, window: int) -> None:
        r = float(self.data.drift)
        keep = math.sqrt(max(0.0, 1.0 - r * r))
        nf, nd, k = len(self.keys), self.num_dense, TEACHER_DIM
        for t in range(1, window + 1):
            seed = _mix_int(_mix_int(self.data.seed ^ _DRIFT_SALT) ^ t) & _MASK63
            g = torch.Generator().manual_seed(seed)
            dense = torch.randn(nd, generator=g) / math.sqrt(nd)
            feat = torch.randn(nf, k, generator=g) / math.sqrt(nf * k)
            cross = torch.randn(nf, nd, k, generator=g) / math.sqrt(nd * nf * k)
            self._dense_w = keep * self._dense_w + r * dense
            self._feat_w = keep * self._feat_w + r * feat
            self._cross = keep * self._cross + r * cross
            if self._pairs:
                p = len(self._pairs)
                sign = torch.randint(0, 2, (p,), generator=g).double() * 2 - 1
                mag = 0.5 + torch.rand(p, generator=g, dtype=torch.float64)
                fresh = sign * mag / math.sqrt(p * k)
                self._pair_w = keep * self._pair_w + r * fresh

    def _vertical(self) -> None:
        """This run's vertical: the dense weights moved by ``data.vertical_shift`` along a fixed
        seeded direction (the same in every window); the click offset is added to the bias."""
        s = float(self.data.vertical_shift)
        if s == 0.0:
            return
        g = torch.Generator().manual_seed(_mix_int(self.data.seed ^ _VERTICAL_SALT) & _MASK63)
        u = torch.randn(self.num_dense, generator=g) / math.sqrt(self.num_dense)
        self._dense_w = math.sqrt(1.0 - s * s) * self._dense_w + s * u

    def _solve_bias(self) -> float:
        return super()._solve_bias() if self._ready else 0.0

    def teacher_metrics_under(
        self, teacher: DriftingClickData, split: str = "eval", batch_size: int = 512
    ) -> dict[str, float]:
        """Metrics of ``teacher``'s probabilities (another window's teacher, same stream config)
        on this window's samples and labels: how stale a teacher of another window is."""
        code = self._split_code(split)
        twin = copy.copy(self)
        for name in ("_dense_w", "_feat_w", "_cross", "_pair_w", "bias"):
            setattr(twin, name, getattr(teacher, name))
        probs, labels = [], []
        for i in range(self.num_batches(split, batch_size)):
            _, logits, g = self._features(code, i, batch_size)
            labels.append(torch.bernoulli(torch.sigmoid(logits), generator=g))
            probs.append(torch.sigmoid(twin._features(code, i, batch_size)[1]))
        if not probs:
            raise ValueError(f"split '{split}' has fewer samples than one batch of {batch_size}")
        return binary_metrics(torch.cat(probs).double(), torch.cat(labels).double())

    # ---- generation ---------------------------------------------------------------------------
    def _generator(self, code: int, index: int, batch_size: int) -> torch.Generator:
        h = _mix_int(self.data.seed ^ _STREAM_SALT)
        # the bias's calibration batch is the same in every window (no drift: the same teacher)
        parts: tuple[int, ...] = (code, index, batch_size)
        if code != _SPLITS["calib"]:
            parts = (code, index, batch_size, self.window)
        for x in parts:
            h = _mix_int(h ^ x)
        return torch.Generator().manual_seed(h & _MASK63)

    def _ids(self, f: int, n: int, g: torch.Generator) -> Tensor:
        t = self._feature_table[f]
        table, salt, a = self.tables[t], self._salts[t], self._active[t]
        dist = self.data.id_distribution
        if dist == "uniform":
            slots = uniform_ids(a, n, g)
        elif dist == "zipf":
            slots = zipf_ids(a, n, self.data.zipf_alpha, g, salt)
        else:
            ref = max(table.pooling_factor, 1e-3) * self.locality_ref_batch
            slots = locality_ids(a, n, ref, g, salt)
        s = self._starts[t]
        return torch.remainder(s + torch.remainder(slots - s, a), table.rows)

    def _virtual(self, t: int, ids: Tensor) -> Tensor:
        """The entity (unbounded id) of active ids ``ids`` of table ``t`` in this window."""
        s = self._starts[t]
        return s + torch.remainder(ids - s, self.tables[t].rows)

    def _raw_logit(self, z: Tensor, lengths: Tensor, values: list[Tensor]) -> Tensor:
        virt = [self._virtual(self._feature_table[f], ids) for f, ids in enumerate(values)]
        return super()._raw_logit(z, lengths, virt)

    def _row_scale(self, t: int, ids: Tensor) -> Tensor:
        """Scales of entities ``ids`` (virtual): the popularity of their slot (ids mod A)."""
        a = self._active[t]
        slots = torch.remainder(ids, a)
        if a <= _SCALE_CACHE_ROWS:
            if t not in self._scale_cache:
                self._scale_cache[t] = self._row_scale_uncached(t, torch.arange(a))
            return self._scale_cache[t][slots]
        return self._row_scale_uncached(t, slots)

    def _row_scale_uncached(self, t: int, ids: Tensor) -> Tensor:
        """The shrink of slots ``ids`` (below) times ``data.id_weight``."""
        w = float(self.data.id_weight)
        s = self._shrink(t, ids)
        return s if w == 1.0 else s * w

    def _shrink(self, t: int, ids: Tensor) -> Tensor:
        """The teacher's shrink sqrt(v / (v + H)) of slots ``ids``, H = data.id_shrink_visits."""
        half = float(self.data.id_shrink_visits)
        if half == _VISITS_HALF:
            return super()._row_scale_uncached(t, ids)  # the stream as before, bitwise
        if half == 0.0:
            return torch.ones(ids.shape, dtype=torch.float32)
        visits = self._row_prob(t, ids) * (_REF_SAMPLES * self.tables[t].pooling_factor)
        return (visits / (visits + half)).sqrt().float()

    def _row_prob(self, t: int, ids: Tensor) -> Tensor:
        """Probability that a lookup of table ``t`` is each of slots ``ids`` (float64)."""
        table, dist, a = self.tables[t], self.data.id_distribution, self._active[t]
        if dist == "uniform":
            return uniform_rank_prob(ids, a)
        ranks = unscatter_ranks(ids, a, self._salts[t])
        if dist == "zipf":
            return zipf_rank_prob(ranks, a, self.data.zipf_alpha)
        ref = max(table.pooling_factor, 1e-3) * self.locality_ref_batch
        return locality_rank_prob(ranks, a, ref)


def teacher_metrics_by_window(
    d: DataConfig,
    tables: Sequence[TableConfig],
    num_dense: int,
    windows: int | None = None,
    split: str = "eval",
) -> list[dict[str, float]]:
    """The Bayes-optimal (teacher) metrics of ``split`` of windows 0 .. ``windows`` - 1
    (default ``data.windows``), at ``data.batch_size``."""
    n = d.windows if windows is None else windows
    out = []
    for w in range(n):
        data = DriftingClickData(d, list(tables), num_dense, window=w)
        out.append({"window": w, **data.teacher_metrics(split, d.batch_size)})
    return out


# ---- DAS: FM logits as side files -------------------------------------------------------------
def stream_fingerprint(d: DataConfig, tables: Sequence[TableConfig], num_dense: int) -> str:
    """16 hex digits naming what defines the stream's samples (seed, ids, teacher, drift, churn,
    id shrink, batch size, tables, dense features): side files of another stream are refused."""
    desc = {
        "seed": d.seed,
        "id_distribution": d.id_distribution,
        "zipf_alpha": d.zipf_alpha,
        "fixed_pooling": d.fixed_pooling,
        "teacher_scale": d.teacher_scale,
        "teacher_groups": d.teacher_groups,
        "drift": d.drift,
        "id_churn": d.id_churn,
        "batch_size": d.batch_size,
        "num_dense": num_dense,
        "tables": [[t.name, t.rows, float(t.pooling_factor), list(t.features)] for t in tables],
    }
    if d.vertical_bias or d.vertical_shift:  # a vertical's labels (absent: fingerprints as before)
        desc["vertical"] = [d.vertical_bias, d.vertical_shift]
    if d.id_shrink_visits != _VISITS_HALF or d.id_weight != 1.0:  # likewise (defaults: absent)
        desc["id_effects"] = [d.id_shrink_visits, d.id_weight]
    text = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fm_paths(out_dir: str | Path, window: int, split: str) -> tuple[Path, Path]:
    """(``fm_w{window}_{split}.npy``, its ``.json`` sidecar) in ``out_dir``."""
    base = Path(out_dir) / f"fm_w{window}_{split}"
    return base.with_suffix(".npy"), base.with_suffix(".json")


def check_split(split: str) -> None:
    """``split`` is 'train' or 'eval' (else a ``ConfigError``)."""
    if split not in _SPLIT_NAMES:
        raise ConfigError(f"split must be 'train' or 'eval', got {split!r}")


def split_samples(d: DataConfig, split: str) -> int:
    """Samples of a window's split that full batches cover (the source's data order)."""
    n = d.window_samples if split == "train" else d.eval_samples
    return (n // d.batch_size) * d.batch_size


def logits_sha256(arr: np.ndarray) -> str:
    """SHA-256 of float32 logits as stored (little-endian), hex."""
    return hashlib.sha256(np.ascontiguousarray(arr, dtype="<f4").tobytes()).hexdigest()


def read_fm_logits(
    d: DataConfig,
    tables: Sequence[TableConfig],
    num_dense: int,
    split: str,
    required: bool = True,
) -> np.ndarray | None:
    """The FM logits ``data.fm_logits`` holds for window ``data.window``'s ``split``, checked:
    produced by the FM of window ``data.window - data.fm_staleness``, for this stream, one per
    sample of the split (in data order), and intact. Missing files are a ``DataError`` when
    ``required``, else None (but one of the pair without the other is always refused)."""
    check_split(split)
    w, k = d.window, d.fm_staleness
    if k > w:
        raise ConfigError(
            f"data.fm_staleness {k} is more than data.window {w}: there is no FM of window "
            f"{w - k}; lower data.fm_staleness or train a later window"
        )
    root = Path(d.fm_logits)
    if not root.is_dir():
        raise DataError(f"{root}: no such directory (data.fm_logits); check the path")
    npy, side = fm_paths(root, w, split)
    have = (npy.is_file(), side.is_file())
    if not all(have):
        if not required and not any(have):
            return None  # (optional split: neither file, nothing attached)
        missing = npy if not have[0] else side
        raise DataError(
            f"{missing}: missing (data.fm_logits, window {w} {split}); write it with "
            f"neorec.serve.das.write_fm_logits(<FM of window {w - k}>, cfg, {w}, '{split}', '{root}', {w - k})"
        )
    try:
        meta = json.loads(side.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise DataError(
            f"{side}: unreadable DAS sidecar ({e}); write the FM logits again"
        ) from None
    if meta.get("format") != FM_FORMAT or meta.get("version") != FM_FORMAT_VERSION:
        raise DataError(
            f"{side}: not a {FM_FORMAT} v{FM_FORMAT_VERSION} sidecar (format "
            f"{meta.get('format')!r}, version {meta.get('version')!r}); write the FM logits again"
        )
    if meta.get("window") != w or meta.get("split") != split:
        raise DataError(
            f"{side}: holds window {meta.get('window')!r} {meta.get('split')!r}, not window {w} "
            f"{split}; the file was renamed or copied: write it again"
        )
    if meta.get("fm_window") != w - k:
        raise DataError(
            f"{side}: logits of the FM of window {meta.get('fm_window')!r}, but data.window {w} "
            f"with data.fm_staleness {k} wants the FM of window {w - k}; write that FM's logits "
            "or set data.fm_staleness to match"
        )
    mine = stream_fingerprint(d, tables, num_dense)
    if meta.get("stream") != mine:
        raise DataError(
            f"{side}: written for another stream (seed, drift, churn, batch size or tables "
            f"differ: fingerprint {meta.get('stream')!r} vs {mine!r}); write "
            "the FM logits for this config"
        )
    want = split_samples(d, split)
    if meta.get("samples") != want:
        raise DataError(
            f"{side}: {meta.get('samples')!r} samples, but window {w}'s {split} split has {want:,} "
            f"(data.{'window_samples' if split == 'train' else 'eval_samples'}); write it again"
        )
    try:
        arr = np.load(npy, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{npy}: corrupt FM logits ({e}); write them again") from None
    if arr.dtype != np.float32 or arr.shape != (want,):
        raise DataError(
            f"{npy}: {arr.dtype} {tuple(arr.shape)}, expected float32 ({want},); write it again"
        )
    if logits_sha256(arr) != meta.get("sha256"):
        raise DataError(
            f"{npy}: checksum mismatch (the array does not match {side.name}'s sha256): the "
            "file is corrupt; write the FM logits again"
        )
    return arr
