"""The MovieLens click recipe: GroupLens rating files -> a click task, through the schema path.

Layouts read (GroupLens publishes them at https://grouplens.org/datasets/movielens/; neorec
downloads nothing): ML-100K (``u.data``, ``u.user``, ``u.item``), ML-1M (``ratings.dat``,
``users.dat``, ``movies.dat``), ML-20M / ML-25M (``ratings.csv``, ``movies.csv``: no user
attributes) and RecBole's atomic files (``*.inter``, ``*.user``, ``*.item``; its wheel ships
ML-100K so).

The task: a rating >= 4 is a click. Features: ``user`` and ``movie`` ids (vocabularies),
``genres`` (a multi-hot bag), ``gender`` and ``occupation`` (ids, empty where the layout has no
users file), dense ``year`` (the movie's, standardized) and ``age`` (the user's, standardized;
0 where unknown). Split by time: the last ``round(0.1 * n)`` of each user's n ratings (by
timestamp, then movie id) are held out. The two splits are written as CSV (train, then eval: the
last file) and preprocessed with :func:`movielens_schema` for the tables of
``configs/movielens.toml``.
"""

from __future__ import annotations

import csv
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from neorec.config.model import TableConfig
from neorec.config.schema import FeatureSpec, SchemaConfig
from neorec.errors import DataError

__all__ = ["movielens", "movielens_schema", "movielens_tables", "read_movielens", "EVAL_SHARE"]

EVAL_SHARE = 0.1
_YEAR = re.compile(r"\((\d{4})\)\s*$")
_100K_GENRES = (
    "unknown Action Adventure Animation Children's Comedy Crime Documentary Drama Fantasy "
    "Film-Noir Horror Musical Mystery Romance Sci-Fi Thriller War Western"
).split()


def movielens_schema() -> SchemaConfig:
    """The columns the recipe writes and what each becomes (configs/movielens.toml's)."""
    f = FeatureSpec
    return SchemaConfig(
        label="click",
        features=[
            f(column="year", type="dense", transform="standardize"),
            f(column="age", type="dense", transform="standardize"),
            f(column="user", type="id", ids="vocab", table="user"),
            f(column="movie", type="id", ids="vocab", table="movie"),
            f(column="genres", type="list", dtype="str", ids="vocab", table="genre"),
            f(column="gender", type="id", dtype="str", ids="vocab", table="gender"),
            f(column="occupation", type="id", dtype="str", ids="vocab", table="occupation"),
        ],
    )


def movielens_tables(dim: int = 16) -> list[TableConfig]:
    """Tables large enough for ML-25M's vocabularies (162,541 users, 59,047 rated movies)."""
    rows = {"user": 200_000, "movie": 100_000, "genre": 32, "gender": 4, "occupation": 32}
    feats = {"genre": ["genres"]}
    return [
        TableConfig(
            name=n,
            rows=r,
            dim=dim,
            features=feats.get(n, [n]),
            pooling_factor=1.7 if n == "genre" else 1.0,
        )
        for n, r in rows.items()
    ]


def _lines(path: Path, sep: str, header: bool = False) -> list[list[str]]:
    text = path.read_bytes().decode("latin-1")  # GroupLens' .dat / u.* files are latin-1
    rows = [ln.split(sep) for ln in text.splitlines() if ln.strip()]
    return rows[1:] if header else rows


def _csv(path: Path) -> list[list[str]]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.reader(f))[1:]


def _year(title: str) -> float | None:
    m = _YEAR.search(title.strip())
    return float(m[1]) if m else None


def _layout(d: Path) -> str:
    for name, files in (
        ("ml-100k", ("u.data", "u.item")),
        ("ml-1m", ("ratings.dat", "movies.dat")),
        ("ml-20m", ("ratings.csv", "movies.csv")),
    ):
        if all((d / f).is_file() for f in files):
            return name
    if list(d.glob("*.inter")):
        return "recbole"
    raise DataError(
        f"{d}: not a MovieLens directory (want u.data + u.item, ratings.dat + movies.dat, "
        "ratings.csv + movies.csv, or RecBole's *.inter)"
    )


def read_movielens(d: str | Path) -> tuple[np.ndarray, dict[int, Any], dict[int, Any], str]:
    """(ratings [n, 4] int64: user, movie, rating x 2, timestamp; users {id: (gender, age,
    occupation)}; movies {id: (genres, year)}; the layout)."""
    d = Path(d)
    if not d.is_dir():
        raise DataError(f"{d}: no such directory (the MovieLens input)")
    layout = _layout(d)
    users: dict[int, Any] = {}
    movies: dict[int, Any] = {}
    try:
        if layout == "ml-100k":
            r = _lines(d / "u.data", "\t")
            for u in _lines(d / "u.user", "|") if (d / "u.user").is_file() else []:
                users[int(u[0])] = (u[2], float(u[1]), u[3])
            for m in _lines(d / "u.item", "|"):
                g = [n for n, flag in zip(_100K_GENRES, m[5:24]) if flag == "1"]
                y = m[2][-4:]
                movies[int(m[0])] = (g, float(y) if y.isdigit() else None)
        elif layout == "ml-1m":
            r = _lines(d / "ratings.dat", "::")
            for u in _lines(d / "users.dat", "::") if (d / "users.dat").is_file() else []:
                users[int(u[0])] = (u[1], float(u[2]), u[3])
            for m in _lines(d / "movies.dat", "::"):
                movies[int(m[0])] = (m[2].split("|"), _year(m[1]))
        elif layout == "ml-20m":
            r = _csv(d / "ratings.csv")
            for m in _csv(d / "movies.csv"):
                g = [] if m[2] == "(no genres listed)" else m[2].split("|")
                movies[int(m[0])] = (g, _year(m[1]))
        else:
            r, users, movies = _recbole(d)
        ratings = np.array(
            [(int(x[0]), int(x[1]), round(float(x[2]) * 2), int(float(x[3]))) for x in r], np.int64
        )
    except (ValueError, IndexError) as e:
        raise DataError(f"{d}: a {layout} file does not read as that layout ({e})") from None
    if not len(ratings):
        raise DataError(f"{d}: no ratings")
    return ratings, users, movies, layout


def _recbole(d: Path) -> tuple[list[list[str]], dict[int, Any], dict[int, Any]]:
    def table(suffix: str) -> list[dict[str, str]]:
        files = list(d.glob(f"*.{suffix}"))
        if not files:
            return []
        rows = _lines(files[0], "\t")
        head = [h.split(":")[0] for h in rows[0]]
        return [dict(zip(head, x)) for x in rows[1:]]

    inter = [[x["user_id"], x["item_id"], x["rating"], x["timestamp"]] for x in table("inter")]
    users = {
        int(u["user_id"]): (u["gender"], float(u["age"]), u["occupation"]) for u in table("user")
    }
    movies = {
        int(m["item_id"]): (
            m["class"].split(),
            float(m["release_year"]) if m["release_year"].isdigit() else None,
        )
        for m in table("item")
    }
    return inter, users, movies


def split_by_time(ratings: np.ndarray, share: float = EVAL_SHARE) -> np.ndarray:
    """Per rating: held out (the last ``round(share * n)`` of its user's n, by time)."""
    order = np.lexsort((ratings[:, 1], ratings[:, 3], ratings[:, 0]))
    users = ratings[order, 0]
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
    counts = np.diff(np.r_[starts, len(users)])
    rank = np.arange(len(users)) - np.repeat(starts, counts)
    n_eval = np.floor(share * counts + 0.5).astype(np.int64)
    held = np.empty(len(users), bool)
    held[order] = rank >= np.repeat(counts - n_eval, counts)
    return held


def _write(path: Path, ratings: np.ndarray, users: dict[int, Any], movies: dict[int, Any]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["click", "year", "age", "user", "movie", "genres", "gender", "occupation"])
        for u, m, r2, _ in ratings.tolist():
            gender, age, occ = users.get(u, ("", None, ""))
            genres, year = movies.get(m, ([], None))
            w.writerow([int(r2 >= 8), "" if year is None else year, "" if age is None else age,
                        u, m, "|".join(genres), gender, occ])  # fmt: skip


def movielens(
    inp: str | Path, out: str | Path, workers: int = 0, stdout: Any = None
) -> dict[str, Any]:
    """Read a MovieLens directory, write the click task's CSV and preprocess it into ``out``."""
    from neorec.data.tabular_pre import TabularOptions, preprocess_tabular

    ratings, users, movies, layout = read_movielens(inp)
    held = split_by_time(ratings)
    with tempfile.TemporaryDirectory(prefix="neorec-movielens-") as tmp:
        t = Path(tmp)
        order = np.lexsort((ratings[:, 1], ratings[:, 3]))  # by time within each split
        _write(t / "part-0-train.csv", ratings[order][~held[order]], users, movies)
        _write(t / "part-1-eval.csv", ratings[order][held[order]], users, movies)
        note = f"eval = the last {EVAL_SHARE:.0%} of each user's ratings by time"
        opts = TabularOptions(workers=workers, split_note=note)
        m = preprocess_tabular([t], out, movielens_schema(), movielens_tables(), opts, out=stdout)
    if stdout is not None:
        print(f"MovieLens layout {layout}: {len(ratings):,} ratings, {len(users):,} users with "
              f"attributes, {len(movies):,} movies", file=stdout, flush=True)  # fmt: skip
    return m
