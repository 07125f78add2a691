"""``neorec bench movielens``: eval AUC and log loss on real MovieLens data of neorec's DLRM
(``configs/movielens.toml``) and of a logistic regression on one-hot features of the same columns.

The task is the recipe's (:mod:`neorec.data.movielens`): a rating >= 4 is a click, the last 10% of
each user's ratings by time are held out (eval). Both models read the same preprocessed shards:
the DLRM through ``neorec.train.Trainer``; the logistic regression (scikit-learn, the
``neorec[bench]`` extra) on a sparse matrix of the same inputs, one column per id of each id or
multi-hot feature (user, movie, genres, gender, occupation, out-of-vocabulary rows included) and the
two standardized dense columns (the movie's year, the user's age).

Settings are chosen on a validation split carved from the train part by the same rule (the last
10% of each user's train ratings; the eval part is never seen): the DLRM's learning rates (both
scaled together), embedding dim and epochs, and the regression's C, by mean validation AUC over
``--select-seeds``. They are reported on ``--seeds``: each model's mean eval AUC / log loss with
95% intervals and the paired difference DLRM - LR. The seeds vary the DLRM's initialization and
shuffle; the regression (L-BFGS to convergence) is deterministic. The intervals reported cover the
data as well: a bootstrap over the eval users (``neorec.bench.bootstrap``: each replicate redraws
the users, every eval rating of a drawn user with it, and the seeds; ``--boot`` replicates), so
they say how much the figures would move on other users of the same kind, not only under another
initialization; the t intervals over seeds alone are kept next to them (``*_seeds``). ``--quick``
skips the search and uses the settings the full run chose on ML-100K (:data:`QUICK`), on 3 seeds.

Without ``--input``, ML-100K comes from RecBole 1.2.1's wheel (``pip download``, once, into a cache
folder: it ships ML-100K as atomic files); the record then names the dataset and the SHA-256 of its
ratings, not the cache folder (``input`` is the ``--input`` given, or null).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from neorec.bench.movielens_report import per_seed_metrics, print_table, summarize, user_intervals
from neorec.bench.stats import parse_seeds
from neorec.config import Config
from neorec.config.load import config_from_data, load_config, read_toml
from neorec.data.movielens import (
    _write,
    movielens_schema,
    movielens_tables,
    read_movielens,
    split_by_time,
)
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular
from neorec.errors import ConfigError, DataError, NeorecError
from neorec.metrics import binary_metrics

__all__ = [
    "main",
    "carve",
    "write_task",
    "read_split",
    "onehot",
    "OneHot",
    "fit_lr",
    "summarize",
    "report_dlrm",
    "eval_users",
    "fetch_ml100k",
    "QUICK",
]

RECBOLE = "recbole==1.2.1"
WHEEL_DIR = "recbole/dataset_example/ml-100k/"
LR_SCALES = (0.5, 1.0, 2.0)
"""DLRM grid: factors on the config's embedding.lr and train.dense_lr (together)."""
DIMS = (8, 16, 32)
"""DLRM grid: the embedding dim of every table (and the bottom MLP's last layer)."""
MAX_EPOCHS = 4
"""DLRM grid: epochs 1..MAX_EPOCHS (one run per setting, evaluated after each epoch)."""
CS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)
"""Logistic regression grid: the inverse L2 strength C."""
QUICK = {"lr_scale": 1.0, "dim": 32, "epochs": 2, "C": 1.0}
"""``--quick``'s settings: those the full run chose on ML-100K (RecBole 1.2.1's), seeds 0-1."""


# --- data -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where a fetched ML-100K is kept ($XDG_CACHE_HOME or ~/.cache, then neorec/movielens)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "neorec" / "movielens"


def fetch_ml100k(cache: Path, say: Callable[[str], None]) -> Path:
    """ML-100K from RecBole's wheel (``pip download``, then its atomic files), kept in ``cache``."""
    d = cache / "ml-100k"
    if (d / "ml-100k.inter").is_file():
        say(f"ML-100K: {d} (fetched before)")
        return d
    cache.mkdir(parents=True, exist_ok=True)
    say(f"no --input: fetching ML-100K with `pip download {RECBOLE} --no-deps` into {cache}")
    cmd = [sys.executable, "-m", "pip", "download", RECBOLE, "--no-deps", "-q", "-d", str(cache)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(cache.glob("recbole-1.2.1-*.whl"))
    if r.returncode != 0 or not wheels:
        last = (r.stderr.strip().splitlines() or ["no wheel written"])[-1]
        raise DataError(
            f"pip download {RECBOLE} failed ({last}); pass --input DIR, an unpacked ML-100K folder"
        )
    tmp = Path(tempfile.mkdtemp(prefix="ml-100k.", dir=cache))
    with zipfile.ZipFile(wheels[0]) as z:
        for name in z.namelist():
            if name.startswith(WHEEL_DIR) and name.endswith((".inter", ".user", ".item")):
                (tmp / Path(name).name).write_bytes(z.read(name))
    if not (tmp / "ml-100k.inter").is_file():
        raise DataError(f"{wheels[0]}: no {WHEEL_DIR}ml-100k.inter in the wheel")
    os.replace(tmp, d)
    return d


def carve(ratings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(eval, val) masks over ``ratings``: eval is the recipe's held-out split (the last 10% of
    each user's ratings by time), val the same rule on the rest (never on eval)."""
    held = split_by_time(ratings)
    rest = np.flatnonzero(~held)
    val = np.zeros(len(ratings), bool)
    val[rest[split_by_time(ratings[rest])]] = True
    return held, val


def write_task(
    out: Path,
    ratings: np.ndarray,
    users: dict[int, Any],
    movies: dict[int, Any],
    train: np.ndarray,
    held: np.ndarray,
) -> dict[str, Any]:
    """The click task of the ratings ``train`` / ``held`` select, preprocessed into ``out`` as
    ``neorec data movielens`` writes it (rows by time within each split); the manifest."""
    order = np.lexsort((ratings[:, 1], ratings[:, 3]))
    r, tr, ho = ratings[order], train[order], held[order]
    with tempfile.TemporaryDirectory(prefix="neorec-bench-movielens-") as tmp:
        t = Path(tmp)
        _write(t / "part-0-train.csv", r[tr], users, movies)
        _write(t / "part-1-eval.csv", r[ho], users, movies)
        return preprocess_tabular(
            [t], out, movielens_schema(), movielens_tables(), TabularOptions(workers=1)
        )


def read_split(pre: Path, split: str) -> dict[str, np.ndarray]:
    """One split of a jagged preprocessed folder: labels, dense, lengths, values (concatenated)."""
    m = json.loads((pre / "manifest.json").read_text())
    names = [s["name"] for s in m["shards"] if s["split"] == split]
    if not names:
        raise DataError(f"{pre}: no {split} shards")
    cols = ("labels", "dense", "lengths", "values")
    return {
        c: np.concatenate([np.load(pre / "shards" / f"{n}.{c}.npy") for n in names]) for c in cols
    }


@dataclass
class OneHot:
    """A CSR matrix as plain arrays (scipy's ``csr_matrix((data, indices, indptr), shape)``)."""

    data: np.ndarray  # [nnz] float64
    indices: np.ndarray  # [nnz] int64 columns
    indptr: np.ndarray  # [n + 1]
    shape: tuple[int, int]


def onehot(manifest: dict[str, Any], split: dict[str, np.ndarray]) -> OneHot:
    """The regression's features of a split: the dense columns as they are, then one column per
    row of each sparse feature (a bag's ids each 1, repeated ids summed by scipy)."""
    dense, lengths, values = split["dense"], split["lengths"], split["values"]
    if not np.isfinite(dense).all():
        raise DataError("the preprocessed dense columns hold non-finite values")
    n, nd = dense.shape
    widths = [
        int(v if v is not None else r) for v, r in zip(manifest["vocab_rows"], manifest["rows"])
    ]
    if lengths.shape[1] != len(widths):
        raise DataError(
            f"{lengths.shape[1]} sparse features in the shards, manifest has {len(widths)}"
        )
    starts = nd + np.concatenate(([0], np.cumsum(widths)[:-1])).astype(np.int64)
    # values are sample-major: sample 0's ids of feature 0, 1, ..., then sample 1's
    feat = np.repeat(np.tile(np.arange(len(widths)), n), lengths.ravel())
    if len(values) and (values.min() < 0 or (values >= np.asarray(widths)[feat]).any()):
        raise DataError("an id in the shards lies outside its feature's rows")
    nnz_row = nd + lengths.sum(1).astype(np.int64)
    indptr = np.concatenate(([0], np.cumsum(nnz_row)))
    is_dense = np.zeros(int(indptr[-1]), bool)
    is_dense[(indptr[:-1, None] + np.arange(nd)).ravel()] = True
    indices = np.empty(len(is_dense), np.int64)
    data = np.ones(len(is_dense), np.float64)
    indices[is_dense] = np.tile(np.arange(nd), n)
    data[is_dense] = dense.ravel()
    indices[~is_dense] = starts[feat] + values.astype(np.int64)
    return OneHot(data, indices, indptr, (n, nd + sum(widths)))


def need_sklearn() -> Any:
    """``sklearn.linear_model``, or a one-line error naming the extra."""
    try:
        import scipy.sparse  # noqa: F401  (scikit-learn's own dependency)
        import sklearn.linear_model as lm
    except ImportError:
        raise NeorecError(
            "neorec bench movielens needs scikit-learn: pip install 'neorec[bench]'"
        ) from None
    return lm


def _csr(x: OneHot) -> Any:
    import scipy.sparse as sp

    return sp.csr_matrix((x.data, x.indices, x.indptr), shape=x.shape)


def fit_lr(x: OneHot, y: np.ndarray, c: float) -> Any:
    """A logistic regression (L2, inverse strength ``c``, L-BFGS to convergence) on ``x``."""
    lm = need_sklearn()
    model = lm.LogisticRegression(C=c, max_iter=2000, tol=1e-6)
    return model.fit(_csr(x), y)


def lr_metrics(model: Any, x: OneHot, y: np.ndarray) -> dict[str, float]:
    """Eval metrics of a fitted regression (neorec.metrics, as for the DLRM)."""
    xs = _csr(x)
    if xs.shape[1] != model.coef_.shape[1]:  # eval built from the same manifest: never
        raise DataError(f"eval has {xs.shape[1]} feature columns, train {model.coef_.shape[1]}")
    return binary_metrics(model.predict_proba(xs)[:, 1], y)


@dataclass
class Task:
    """A preprocessed split pair and the one-hot features of both."""

    pre: Path
    manifest: dict[str, Any]
    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]

    @classmethod
    def load(cls, pre: Path) -> Task:
        """Read a preprocessed folder written by :func:`write_task`."""
        m = json.loads((pre / "manifest.json").read_text())
        return cls(pre, m, read_split(pre, "train"), read_split(pre, "eval"))

    def lr(self, c: float) -> dict[str, float]:
        """Eval metrics of the regression with ``c``, fitted on train."""
        model = fit_lr(onehot(self.manifest, self.train), self.train["labels"], c)
        return lr_metrics(model, onehot(self.manifest, self.eval), self.eval["labels"])

    def lr_probs(self, c: float) -> np.ndarray:
        """The regression's (``c``, fitted on train) predicted probabilities on eval."""
        model = fit_lr(onehot(self.manifest, self.train), self.train["labels"], c)
        xs = _csr(onehot(self.manifest, self.eval))
        if xs.shape[1] != model.coef_.shape[1]:  # eval built from the same manifest: never
            raise DataError(f"eval has {xs.shape[1]} feature columns, train {model.coef_.shape[1]}")
        return np.asarray(model.predict_proba(xs)[:, 1], np.float64)


# --- the DLRM ---------------------------------------------------------------------------------


def dlrm_config(
    a: argparse.Namespace, task: Task, seed: int, setting: dict[str, Any], run_dir: Path,
    epochs: int, eval_every: int = 0,
) -> Config:  # fmt: skip
    """The config's DLRM with ``setting``'s lr factor and dim, on ``task``, for ``epochs``."""
    base = load_config(a.config, list(a.set))
    data = read_toml(a.config)
    dim = int(setting["dim"])
    for t in data.get("embedding", {}).get("tables", []):
        t["dim"] = dim
    scale = float(setting["lr_scale"])
    over = [
        *a.set,
        f"model.bottom_mlp={[*base.model.bottom_mlp[:-1], dim]}",
        f"embedding.dim={dim}",
        f"embedding.lr={base.embedding.lr * scale!r}",
        f"train.dense_lr={base.train.dense_lr * scale!r}",
        f"data.path='{task.pre}'",
        f"train.run_dir='{run_dir}'",
        f"train.seed={seed}",
        f"data.seed={seed}",
        f"train.epochs={epochs}",
        f"train.eval_every={eval_every}",
        "train.eval_fraction=0",
        "train.eval_batches=0",
        "train.progress=false",
        "train.save_model=false",
        "train.tensorboard='off'",
    ]
    return config_from_data(data, over, a.config)


def train_dlrm(cfg: Config) -> dict[str, Any]:
    """The metrics of one run (its folder removed after)."""
    from neorec.train.trainer import Trainer

    try:
        return Trainer(cfg, out=io.StringIO()).fit()
    finally:
        shutil.rmtree(cfg.train.run_dir, ignore_errors=True)


def per_epoch(m: dict[str, Any], spe: int, epochs: int) -> list[float]:
    """Eval AUC after each epoch of a run evaluated every ``spe`` steps."""
    aucs = {int(e["step"]): float(e["auc"]) for e in m["evals"]}
    if int(m["train"]["steps"]) != spe * epochs or any(
        spe * k not in aucs for k in range(1, epochs + 1)
    ):
        raise RuntimeError(
            f"expected evals every {spe} steps for {epochs} epochs, got {sorted(aucs)}"
        )
    return [aucs[spe * k] for k in range(1, epochs + 1)]


# --- selection and report ---------------------------------------------------------------------


def select(
    a: argparse.Namespace, task: Task, work: Path, say: Callable[[str], None]
) -> tuple[dict[str, Any], dict[str, float]]:
    """The DLRM setting and C with the best mean validation AUC (``task`` = train' / val)."""
    tried: dict[str, float] = {}
    best: tuple[float, dict[str, Any]] = (-1.0, {})
    seeds = parse_seeds(a.select_seeds, "--select-seeds")
    bs = load_config(a.config, list(a.set)).data.batch_size
    spe = math.ceil(len(task.train["labels"]) / bs)
    for scale in LR_SCALES:
        for dim in DIMS:
            setting = {"lr_scale": scale, "dim": dim}
            runs = []
            for s in seeds:
                cfg = dlrm_config(
                    a, task, s, setting, work / f"sel-{scale}-{dim}-{s}", MAX_EPOCHS, spe
                )
                runs.append(per_epoch(train_dlrm(cfg), spe, MAX_EPOCHS))
            for k in range(MAX_EPOCHS):
                v = statistics.fmean(r[k] for r in runs)
                tried[f"dlrm lr x{scale:g} dim {dim} epochs {k + 1}"] = v
                if v > best[0]:
                    best = (v, {**setting, "epochs": k + 1})
            say(f"  select DLRM lr x{scale:g} dim {dim}: val AUC by epoch "
                + " ".join(f"{statistics.fmean(r[k] for r in runs):.4f}" for k in range(MAX_EPOCHS)))  # fmt: skip
    best_c = (-1.0, 0.0)
    for c in CS:
        v = task.lr(c)["auc"]
        tried[f"lr C {c:g}"] = v
        best_c = max(best_c, (v, c))
        say(f"  select LR C {c:g}: val AUC {v:.4f}")
    return {**best[1], "C": best_c[1]}, tried


def report(
    a: argparse.Namespace, task: Task, chosen: dict[str, Any], seeds: Sequence[int], work: Path,
    say: Callable[[str], None],
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Eval predictions of the DLRM per seed ([seeds, n]) and of the regression ([n]), in the
    eval split's file order (``task`` = train / eval)."""
    lr = task.lr_probs(float(chosen["C"]))
    y = task.eval["labels"].astype(np.float64)
    ref = binary_metrics(lr, y)
    dlrm = []
    for s in seeds:
        cfg = dlrm_config(a, task, s, chosen, work / f"rep-{s}", int(chosen["epochs"]))
        probs, labels = report_dlrm(cfg)
        if not np.array_equal(labels, y):
            raise DataError(
                f"{task.pre}: the DLRM's eval labels are not the eval split's, in order"
            )
        dlrm.append(probs)
        ev = binary_metrics(probs, y)
        say(f"  seed {s}: DLRM AUC {ev['auc']:.4f} log loss {ev['logloss']:.4f}; "
            f"LR AUC {ref['auc']:.4f} log loss {ref['logloss']:.4f}")  # fmt: skip
    return np.stack(dlrm), lr


def report_dlrm(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """One reported run: its eval split's predicted probabilities and labels, in the split's
    order (its folder removed after)."""
    from neorec.train.steps import predict
    from neorec.train.trainer import Trainer

    try:
        trainer = Trainer(cfg, out=io.StringIO())
        trainer.fit()
        got = predict(trainer.model, iter(trainer.source.eval_batches()), cfg.train.bf16_dense)
        d = got.state_dict()
        return d["probs"].double().numpy(), d["labels"].double().numpy()
    finally:
        shutil.rmtree(cfg.train.run_dir, ignore_errors=True)


def eval_users(ratings: np.ndarray, held: np.ndarray) -> np.ndarray:
    """The user of each eval row, in the order :func:`write_task` writes the eval split."""
    order = np.lexsort((ratings[:, 1], ratings[:, 3]))
    return ratings[order][held[order], 0]


# --- command line -----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    """Flags."""
    p = argparse.ArgumentParser(prog="neorec bench movielens", description=__doc__.split("\n")[0])
    p.add_argument("--input", default="", help="a MovieLens folder (default: fetch ML-100K)")
    p.add_argument("--cache", default="", help="where a fetched ML-100K is kept")
    p.add_argument("--config", default="configs/movielens.toml", help="the DLRM")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    p.add_argument("--seeds", default="100-104", help="reported seeds (a-b or a,b,c)")
    p.add_argument("--select-seeds", default="0-1", help="seeds the settings are chosen on")
    p.add_argument("--quick", action="store_true", help="no search (QUICK settings), 3 seeds")
    p.add_argument(
        "--boot", type=int, default=2000, help="bootstrap replicates over eval users and seeds"
    )
    a = p.parse_args(argv)
    if a.boot < 2:
        raise ConfigError(f"--boot must be >= 2, got {a.boot}")
    if a.quick and a.seeds == "100-104":
        a.seeds = "100-102"
    return a


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table and a JSON line."""
    from neorec.machine import cpu_model_and_flags

    a = parse(argv)
    seeds = parse_seeds(a.seeds, "--seeds")
    parse_seeds(a.select_seeds, "--select-seeds")
    load_config(a.config, list(a.set))  # flags checked before any work
    need_sklearn()

    def say(s: str) -> None:
        print(s, flush=True)

    t0 = time.perf_counter()
    src = Path(a.input) if a.input else fetch_ml100k(Path(a.cache) if a.cache else cache_dir(), say)
    ratings, users, movies, layout = read_movielens(src)
    held, val = carve(ratings)
    work = Path(tempfile.mkdtemp(prefix="neorec-bench-movielens-"))
    try:
        extra: dict[str, Any] = {"quick": a.quick}
        tried: dict[str, float] = {}
        if a.quick:
            chosen = dict(QUICK)
        else:
            sel = Task.load(_pre(work / "select", ratings, users, movies, ~held & ~val, val))
            say(f"selection on seeds {a.select_seeds}: {len(sel.train['labels']):,} train, "
                f"{len(sel.eval['labels']):,} validation ratings")  # fmt: skip
            chosen, tried = select(a, sel, work, say)
        task = Task.load(_pre(work / "report", ratings, users, movies, ~held, held))
        dlrm, lr = report(a, task, chosen, seeds, work, say)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    y, who = task.eval["labels"].astype(np.float64), eval_users(ratings, held)
    if len(who) != len(y):
        raise DataError(f"{len(y)} eval rows in the shards, {len(who)} held-out ratings")
    say(
        f"bootstrap over {len(np.unique(who))} eval users and {len(seeds)} seeds: {a.boot} replicates"
    )
    boot = user_intervals(dlrm, lr, y, who, a.boot)
    extra.update(
        layout=layout,
        input=a.input or None,
        dataset=f"ML-100K from {RECBOLE}'s wheel" if not a.input else None,
        ratings_sha256=hashlib.sha256(np.ascontiguousarray(ratings).tobytes()).hexdigest(),
        bootstrap={"over": "eval users and seeds", "reps": a.boot, "users": len(np.unique(who))},
        cpu=cpu_model_and_flags()[0],
        select_seeds=[] if a.quick else parse_seeds(a.select_seeds, "--select-seeds"),
        settings=chosen,
        selection=tried,
        split={"train": int((~held).sum()), "val": int(val.sum()), "eval": int(held.sum())},
    )
    result = summarize(per_seed_metrics(dlrm, lr, y), seeds, extra, boot)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    print(json.dumps(result, sort_keys=True))
    return 0


def _pre(
    out: Path, ratings: np.ndarray, users: dict[int, Any], movies: dict[int, Any],
    train: np.ndarray, held: np.ndarray,
) -> Path:  # fmt: skip
    write_task(out, ratings, users, movies, train, held)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
