"""The MovieLens recipe on tiny files written in each GroupLens layout (and RecBole's atomic
one): the same ratings read alike, clicks are ratings >= 4, the last 10% of each user's ratings
by time are held out, and configs/movielens.toml trains on the output as is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from neorec.cli import main
from neorec.config import load_config
from neorec.data.loader import read_manifest
from neorec.data.movielens import movielens, movielens_schema, movielens_tables, read_movielens
from neorec.errors import DataError

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "movielens.toml"
GENRES = ["Action", "Comedy", "Drama"]


def ratings(seed: int = 0) -> list[tuple[int, int, int, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for u in range(1, 7):
        for k in range(int(rng.integers(10, 25))):
            out.append((u, int(rng.integers(1, 9)), int(rng.integers(1, 6)), 1000 + 7 * k + u))
    return out


ML100K_GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy"]
ML100K_GENRES += [f"g{i}" for i in range(10)] + ["Drama", "War", "Western"]


def flags(m: int) -> str:
    """u.item's 19 genre flags of movie m (its one genre: GENRES[m % 3])."""
    return "|".join("1" if g == GENRES[m % 3] else "0" for g in ML100K_GENRES)


def write_layouts(d: Path, r: list[tuple[int, int, int, int]]) -> dict[str, Path]:
    paths = {k: d / k for k in ("ml-100k", "ml-1m", "ml-20m", "recbole")}
    for p in paths.values():
        p.mkdir()
    movies = range(1, 9)
    (paths["ml-100k"] / "u.data").write_text("".join(f"{u}\t{m}\t{s}\t{t}\n" for u, m, s, t in r))
    (paths["ml-100k"] / "u.user").write_text(
        "".join(f"{u}|{20 + u}|M|writer|0000{u}\n" for u in range(1, 7))
    )
    (paths["ml-100k"] / "u.item").write_text(
        "".join(f"{m}|Movie {m} (199{m})|01-Jan-199{m}||url|{flags(m)}\n" for m in movies)
    )
    (paths["ml-1m"] / "ratings.dat").write_text(
        "".join(f"{u}::{m}::{s}::{t}\n" for u, m, s, t in r)
    )
    (paths["ml-1m"] / "users.dat").write_text(
        "".join(f"{u}::M::{20 + u}::3::0000{u}\n" for u in range(1, 7))
    )
    (paths["ml-1m"] / "movies.dat").write_text(
        "".join(f"{m}::Movie {m} (199{m})::{GENRES[m % 3]}\n" for m in movies)
    )
    (paths["ml-20m"] / "ratings.csv").write_text(
        "userId,movieId,rating,timestamp\n" + "".join(f"{u},{m},{s}.0,{t}\n" for u, m, s, t in r)
    )
    (paths["ml-20m"] / "movies.csv").write_text(
        "movieId,title,genres\n"
        + "".join(f'{m},"Movie {m} (199{m})",{GENRES[m % 3]}\n' for m in movies)
    )
    (paths["recbole"] / "x.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{m}\t{s}\t{t}\n" for u, m, s, t in r)
    )
    (paths["recbole"] / "x.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        + "".join(f"{u}\t{20 + u}\tM\twriter\t0000{u}\n" for u in range(1, 7))
    )
    (paths["recbole"] / "x.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        + "".join(f"{m}\tMovie {m}\t199{m}\t{GENRES[m % 3]}\n" for m in movies)
    )
    return paths


def test_layouts_read_alike_and_split_by_time(tmp_path: Path) -> None:
    r = ratings()
    paths = write_layouts(tmp_path, r)
    for name, p in paths.items():
        got, users, movies, layout = read_movielens(p)
        assert got[:, [0, 1, 3]].tolist() == [[u, m, t] for u, m, _, t in r], name
        assert (got[:, 2] == 2 * np.array([s for _, _, s, _ in r])).all()
        assert movies[4] == ([GENRES[1]], 1994.0), name
        assert (users == {}) == (name == "ml-20m")
    from neorec.data.movielens import split_by_time

    held = split_by_time(np.array([(u, m, s, t) for u, m, s, t in r]))
    for u in range(1, 7):  # the last round(10%) of each user's ratings by time
        ts = sorted(t for (uu, _, _, t), h in zip(r, held) if uu == u)
        n_eval = int(np.floor(0.1 * len(ts) + 0.5))
        assert (
            sorted(t for (uu, _, _, t), h in zip(r, held) if uu == u and h)
            == ts[len(ts) - n_eval :]
        )
    with pytest.raises(DataError, match="not a MovieLens directory"):
        read_movielens(tmp_path)


def test_recipe_trains_with_the_config(tmp_path: Path) -> None:
    cfg = load_config(CONFIG)
    assert cfg.data.schema == movielens_schema()  # the recipe writes what the config reads
    assert [(t.name, t.rows, t.features) for t in cfg.embedding.tables] == [
        (t.name, t.rows, t.features) for t in movielens_tables()
    ]
    r = ratings(1)
    p = write_layouts(tmp_path, r)["ml-1m"]
    movielens(p, tmp_path / "pre", workers=1)
    m = read_manifest(tmp_path / "pre")
    n_clicks = sum(s >= 4 for _, _, s, _ in r)
    assert m["split"]["train"] + m["split"]["eval"] == len(r) and m["split"]["eval"] > 0
    labels = sum(
        float(np.load(tmp_path / "pre" / "shards" / f"{s['name']}.labels.npy").sum())
        for s in m["shards"]
    )
    assert labels == n_clicks
    sets = f"data.path={tmp_path / 'pre'} data.batch_size=8 train.steps=2 data.workers=0 train.progress=false train.save_model=false train.run_dir={tmp_path / 'run'}"
    assert (
        main(["train", "--config", str(CONFIG)] + [a for kv in sets.split() for a in ("--set", kv)])
        == 0
    )
    assert "auc" in json.loads((tmp_path / "run" / "metrics.json").read_text())["eval"]
