"""A small tabular click data set with every kind of column ``data.schema`` reads (what
``neorec data example-parquet`` writes and ``configs/parquet_example.toml`` trains on).

Columns: ``click`` (the label, from a hidden logistic model of the other columns), ``price``
(dense, ~5% missing; log1p), ``age`` (dense; standardize), ``user`` (an integer id; hashed),
``item`` (a string id; vocabulary), ``tags`` (0-5 integer ids; multi-hot) with ``tag_w`` (a
weight per tag), ``query_tags`` (1-3 ids of the same table as ``tags``).
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["example_columns", "write_example"]


def example_columns(n: int, seed: int) -> dict[str, list[Any]]:
    """``n`` rows of the example's columns (lists per column; None = missing)."""
    rng = np.random.default_rng(seed)
    teacher = np.random.default_rng(12345)  # the hidden model is the same in every file
    w_user = teacher.normal(0, 1.0, 300)
    w_item = teacher.normal(0, 1.0, 200)
    w_tag = teacher.normal(0, 0.8, 60)
    user = (rng.zipf(1.3, n) % 300).astype(np.int64)
    item = (rng.zipf(1.2, n) % 200).astype(np.int64)
    price = rng.lognormal(3, 1, n)
    age = rng.normal(40, 12, n)
    ntag = rng.integers(0, 6, n)
    nq = rng.integers(1, 4, n)
    tags = [rng.integers(0, 60, k).tolist() for k in ntag]
    tag_w = [np.round(rng.uniform(0.2, 2.0, k), 3).tolist() for k in ntag]
    query = [rng.integers(0, 60, k).tolist() for k in nq]
    logit = (
        w_user[user]
        + w_item[item]
        + np.array([sum(w * w_tag[t] for t, w in zip(ts, ws)) for ts, ws in zip(tags, tag_w)])
        + 0.5 * np.array([w_tag[q].mean() for q in query])
        + 0.6 * (age - 40) / 12
        - 0.3 * (np.log1p(price) - 3)
        - 0.5
    )
    click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    missing = rng.random(n) < 0.05
    return {
        "click": click.tolist(),
        "price": [None if m else round(float(p), 2) for m, p in zip(missing, price)],
        "age": np.round(age, 1).tolist(),
        "user": user.tolist(),
        "item": [f"item-{i}" for i in item],
        "tags": tags,
        "tag_w": tag_w,
        "query_tags": query,
    }


def _write_csv(path: Path, cols: dict[str, list[Any]], sep: str = "|") -> None:
    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, list):
            return sep.join(str(x) for x in v)
        return str(v)

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(list(cols))
        for row in zip(*cols.values()):
            w.writerow([cell(v) for v in row])


def _write_parquet(path: Path, cols: dict[str, list[Any]], row_group: int) -> None:
    from neorec.data.tabular import need_pyarrow

    pq = need_pyarrow()
    import pyarrow as pa

    types = {
        "click": pa.int64(),
        "price": pa.float64(),
        "age": pa.float64(),
        "user": pa.int64(),
        "item": pa.string(),
        "tags": pa.list_(pa.int64()),
        "tag_w": pa.list_(pa.float32()),
        "query_tags": pa.list_(pa.int64()),
    }
    table = pa.table({k: pa.array(v, type=types[k]) for k, v in cols.items()})
    pq.write_table(table, path, row_group_size=row_group)


def write_example(
    out_dir: str | Path,
    fmt: str = "parquet",
    train: int = 20_000,
    eval: int = 4_000,
    seed: int = 0,
    row_group: int = 4096,
) -> list[Path]:
    """Write ``part-0`` (train) and ``part-1`` (eval, the last file) as Parquet or CSV."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, n in enumerate((train, eval)):
        cols = example_columns(n, seed * 2 + i)
        p = out / f"part-{i}.{fmt}"
        if fmt == "parquet":
            _write_parquet(p, cols, row_group)
        else:
            _write_csv(p, cols)
        paths.append(p)
    return paths
