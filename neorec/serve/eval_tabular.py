"""``--data PATH`` of ``neorec eval | predict`` for a model trained on tabular data (Parquet / CSV
files, their preprocessed directory, or the MovieLens recipe's): read in the format it was
trained on.

- Files (Parquet / CSV / TSV, or a directory of them): every row, in file order, encoded by the
  model's ``data.schema`` with the statistics and vocabularies of its training data (the files
  it trained on are fitted again the same way; a preprocessed training directory's are read).
- A directory from ``neorec data preprocess`` / ``neorec data movielens``: its held-out split when
  it has one, else all of it; its vocabularies and statistics must be the model's (a directory
  preprocessed separately maps ids to other rows: refused, naming the fix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from neorec.config import Config
from neorec.data.batch import Batch
from neorec.errors import DataError, NeorecError

__all__ = ["expected_format", "fitted_of_dir", "model_fitted", "tabular_batches"]


def expected_format(cfg: Config) -> str:
    """The data a model's ``--data`` must be, in words (its errors name it)."""
    d = cfg.data
    if d.source == "tabular":
        cols = [f.column for f in d.schema.features]
        return (
            f"tabular data as the model was trained on (Parquet / CSV files with columns "
            f"{d.schema.label}, {', '.join(cols)}; or a directory preprocessed from them)"
        )
    how = "as the model was trained on" if d.source == "criteo" else "(what --data reads for "
    how += "" if d.source == "criteo" else f"a model trained on {d.source} data)"
    return (
        f"Criteo data {how} (TSV files: label, 13 integer and 26 categorical fields; or a "
        "directory from `neorec data preprocess`)"
    )


def fitted_of_dir(path: str | Path) -> Any:
    """The statistics and vocabularies a preprocessed tabular directory was encoded with."""
    from neorec.data.encode import Fitted
    from neorec.data.loader import read_manifest

    p = Path(path)
    f = read_manifest(p).get("fitted", {})
    vocab = {t: np.load(p / "vocab" / f"{t}.npy") for t in f.get("vocab_rows", {})}
    return Fitted(dict(f.get("mean", {})), dict(f.get("std", {})), vocab)


def model_fitted(cfg: Config) -> Any | None:
    """What the model's training data was encoded with: its preprocessed directory's, or the
    files' fitted again as ``TabularSource`` fits them; None when its data is not found here."""
    from neorec.data.encode import Fitted, Fitter
    from neorec.data.loader import is_preprocessed

    d, tables = cfg.data, cfg.embedding.tables
    if not Fitter(d.schema, tables).needed:
        return Fitted()
    if not d.path or not Path(d.path).exists():
        return None
    if is_preprocessed(d.path):
        return fitted_of_dir(d.path)
    from neorec.data.tabular import tabular_files
    from neorec.data.tabular_pre import fit

    files = tabular_files(d.path)
    train = files if d.eval_path or len(files) == 1 else files[:-1]
    return fit(train, d.schema, tables, None)


def _differs(a: Any, b: Any) -> str:
    """What differs between two ``Fitted`` ("" when nothing)."""
    for name in ("mean", "std"):
        x, y = getattr(a, name), getattr(b, name)
        if set(x) != set(y) or any(not np.isclose(x[k], y[k], rtol=1e-6) for k in x):
            return f"the {name} of its standardized columns"
    if set(a.vocab) != set(b.vocab):
        return "the tables with vocabularies"
    for t in a.vocab:
        if not np.array_equal(a.vocab[t], b.vocab[t]):
            return f"table '{t}''s vocabulary"
    return ""


def tabular_batches(cfg: Config, p: Path) -> Callable[[], Iterator[Batch]]:
    """The eval batches of ``--data p`` for a model trained on tabular data (checked now)."""
    from neorec.data.loader import is_preprocessed

    if is_preprocessed(p):
        return _preprocessed(cfg, p)
    from neorec.data.tabular import tabular_files
    from neorec.data.tabular_source import TabularSource

    try:
        files = tabular_files(p)
    except NeorecError as e:
        raise DataError(f"{e}; --data must be {expected_format(cfg)}") from None
    fitted = model_fitted(cfg)
    if fitted is None:
        raise DataError(
            f"--data {p}: the model's vocabularies and statistics come from its training data "
            f"{cfg.data.path!r}, not found from here; run this where that path exists, or give "
            "--set data.path=WHERE_IT_IS"
        )
    try:
        source = TabularSource.reading(files, cfg.data, cfg.embedding.tables, fitted)
    except NeorecError as e:
        raise DataError(f"{e} (--data must be {expected_format(cfg)})") from None
    return source.eval_batches


def _preprocessed(cfg: Config, p: Path) -> Callable[[], Iterator[Batch]]:
    from neorec.data.jagged import check_jagged_tables
    from neorec.data.loader import SampleOrder, ShardedReader, open_shards, read_manifest

    if read_manifest(p).get("layout") != "jagged":
        raise DataError(
            f"--data {p} was preprocessed from Criteo data; the model was trained on "
            f"{expected_format(cfg)}"
        )
    every = read_manifest(p)["shards"]
    held = [s for s in every if s.get("split") == "eval"]
    shards = open_shards(p, held or None)
    check_jagged_tables(shards, cfg.embedding.tables, cfg.data.schema, cfg.model.num_dense)
    mine, theirs = model_fitted(cfg), fitted_of_dir(p)
    if mine is None:
        raise DataError(
            f"--data {p}: cannot tell whether its vocabularies are the model's: its training "
            f"data {cfg.data.path!r} is not found from here; give --set data.path=WHERE_IT_IS"
        )
    if what := _differs(mine, theirs):
        raise DataError(
            f"--data {p} was preprocessed with other statistics than the model's training data "
            f"({what} differs): its ids would reach other rows; give the raw files (Parquet / "
            "CSV) as --data, encoded with the model's own"
        )
    shards.check_files()
    keys = list(shards.manifest["features"])
    reader = ShardedReader(
        shards, cfg.data.batch_size, keys=keys, order=SampleOrder(shuffle=False), workers=0
    )
    return lambda: iter(reader)
