"""The pieces of ``neorec bench movielens`` on tiny MovieLens files written here: the carving of
the validation split, the regression's one-hot features, the JSON record (and, with
scikit-learn, the whole --quick command)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import neorec.bench.movielens as bench
from neorec.bench.movielens import Task, carve, main, onehot, summarize, write_task
from neorec.data.encode import str_keys
from neorec.data.movielens import _100K_GENRES, read_movielens, split_by_time

GENRES = _100K_GENRES


def write_ml100k(d: Path, users: int = 24, movies: int = 30, per_user: int = 16) -> Path:
    """A tiny ML-100K folder (u.data, u.user, u.item) from a seeded generator."""
    rng = np.random.default_rng(7)
    d.mkdir(parents=True, exist_ok=True)
    lines = []
    for u in range(1, users + 1):
        for m in rng.choice(np.arange(1, movies + 1), per_user, replace=False):
            rating = int(rng.integers(1, 6)) if u % 3 else 5 - int(m) % 2  # some signal
            lines.append(f"{u}\t{m}\t{rating}\t{880000000 + int(rng.integers(0, 10**6))}")
    (d / "u.data").write_text("\n".join(lines) + "\n")
    occ = ["student", "writer", "other"]
    (d / "u.user").write_text(
        "".join(f"{u}|{18 + u}|{'MF'[u % 2]}|{occ[u % 3]}|0000{u}\n" for u in range(1, users + 1))
    )
    items = []
    for m in range(1, movies + 1):
        flags = ["1" if (m + g) % 7 == 0 or g == m % 19 else "0" for g in range(19)]
        items.append(f"{m}|Movie {m} (199{m % 10})|01-Jan-199{m % 10}||http://x|" + "|".join(flags))
    (d / "u.item").write_text("\n".join(items) + "\n")
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ml100k(tmp_path_factory.mktemp("ml") / "ml-100k")


def test_carve_takes_validation_from_train_only(tiny: Path) -> None:
    ratings, *_ = read_movielens(tiny)
    held, val = carve(ratings)
    assert (held == split_by_time(ratings)).all()  # eval is the recipe's split
    assert not (held & val).any() and val.any()
    for u in np.unique(ratings[:, 0]):
        mine = ratings[:, 0] == u
        rest, v, e = mine & ~held & ~val, mine & val, mine & held
        # validation: the last 10% of the user's train ratings, between the rest and eval in time
        assert v.sum() == round(0.1 * (mine & ~held).sum())
        assert ratings[rest, 3].max() <= ratings[v, 3].min()
        assert ratings[v, 3].max() <= ratings[e, 3].min()


def test_onehot_features_are_the_columns_of_the_shards(tiny: Path, tmp_path: Path) -> None:
    ratings, users, movies, _ = read_movielens(tiny)
    held, _ = carve(ratings)
    write_task(tmp_path / "pre", ratings, users, movies, ~held, held)
    task = Task.load(tmp_path / "pre")
    x = onehot(task.manifest, task.train)
    rows = task.manifest["vocab_rows"]  # user, movie, genres, gender, occupation
    assert x.shape == (int((~held).sum()), 2 + sum(rows))
    # the rows in file order: by time (then movie) within the train split
    tr = ratings[~held]
    tr = tr[np.lexsort((tr[:, 1], tr[:, 3]))]
    vocab = {
        t: np.load(tmp_path / "pre" / "vocab" / f"{t}.npy") for t in ("user", "movie", "genre")
    }
    starts = 2 + np.concatenate(([0], np.cumsum(rows)[:-1]))
    for i in range(0, len(tr), 7):
        cols = x.indices[x.indptr[i] : x.indptr[i + 1]]
        vals = x.data[x.indptr[i] : x.indptr[i + 1]]
        assert list(cols[:2]) == [0, 1] and np.allclose(vals[:2], task.train["dense"][i])
        assert (vals[2:] == 1).all()
        user = cols[(cols >= starts[0]) & (cols < starts[1])] - starts[0]
        movie = cols[(cols >= starts[1]) & (cols < starts[2])] - starts[1]
        genre = cols[(cols >= starts[2]) & (cols < starts[3])] - starts[2]
        assert vocab["user"][user - 1].tolist() == [tr[i, 0]]
        assert vocab["movie"][movie - 1].tolist() == [tr[i, 1]]
        assert sorted(vocab["genre"][genre - 1].tolist()) == sorted(str_keys(movies[tr[i, 1]][0]))
        assert len(cols) == 2 + 1 + 1 + len(movies[tr[i, 1]][0]) + 1 + 1
    assert (x.indices < x.shape[1]).all()


def test_eval_users_follow_the_eval_rows_of_the_shards(tiny: Path, tmp_path: Path) -> None:
    ratings, users, movies, _ = read_movielens(tiny)
    held, _ = carve(ratings)
    write_task(tmp_path / "pre", ratings, users, movies, ~held, held)
    task = Task.load(tmp_path / "pre")
    who = bench.eval_users(ratings, held)
    vocab = np.load(tmp_path / "pre" / "vocab" / "user.npy")
    lengths = task.eval["lengths"]
    assert len(who) == len(lengths) == int(held.sum())
    # the user feature (the first sparse one, one id a row) decoded through its vocabulary
    first = np.concatenate(([0], np.cumsum(lengths.sum(1))[:-1]))
    assert (lengths[:, 0] == 1).all()
    assert vocab[task.eval["values"][first] - 1].tolist() == who.tolist()


def test_summary_json_fields() -> None:
    per_seed = {
        "dlrm": {"auc": [0.80, 0.82, 0.81], "logloss": [0.54, 0.53, 0.55]},
        "lr": {"auc": [0.79, 0.79, 0.79], "logloss": [0.55, 0.55, 0.55]},
    }
    r = summarize(per_seed, [100, 101, 102], {"cpu": "x"})
    assert r["bench"] == "movielens" and r["seeds"] == [100, 101, 102] and r["cpu"] == "x"
    assert r["dlrm"]["auc"] == pytest.approx(0.81) and r["lr"]["logloss"] == pytest.approx(0.55)
    assert r["auc_diff"]["value"] == pytest.approx(0.02) and r["auc_diff"]["n"] == 3
    assert r["auc_diff"]["lo"] < 0.02 < r["auc_diff"]["hi"]
    assert r["lr"]["auc_ci"]["lo"] == r["lr"]["auc_ci"]["hi"]  # one value on every seed
    one = summarize({k: {m: v[:1] for m, v in d.items()} for k, d in per_seed.items()}, [1], {})
    assert one["auc_diff"]["lo"] is None  # one seed: no interval, and valid JSON
    json.loads(json.dumps(one, allow_nan=False))


def fake_dlrm(cfg: Any) -> dict[str, Any]:
    """What train_dlrm returns, from the config it was handed: a planted best setting (lr x0.5,
    dim 32, 3 epochs), evals every train.eval_every steps, a final eval that varies by seed."""
    t, e = cfg.train, cfg.embedding
    assert {x.dim for x in e.tables} == {cfg.model.bottom_mlp[-1]}  # the dim reaches every table
    assert e.lr / 0.05 == pytest.approx(t.dense_lr / 0.01)  # both lrs scaled together
    assert t.eval_batches == 0 and not t.save_model and cfg.data.path.endswith(("select", "report"))
    good = 0.02 * (e.lr == pytest.approx(0.025)) + 0.01 * (e.tables[0].dim == 32)

    def auc(epoch: int) -> float:
        return 0.7 + good - 0.005 * abs(epoch - 3) + 0.001 * t.seed

    spe = t.eval_every or 1
    evals = [{"step": spe * k, "auc": auc(k)} for k in range(1, t.epochs + 1)]
    final = {"auc": auc(t.epochs), "logloss": 0.6 - 0.001 * t.seed}
    return {
        "train": {"steps": spe * t.epochs},
        "evals": evals if t.eval_every else [],
        "eval": final,
    }


def fake_report(cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """What report_dlrm returns: eval probabilities that rank clicks above the rest, less well
    on odd seeds, and the eval labels in the shards' order."""
    y = bench.read_split(Path(cfg.data.path), "eval")["labels"].astype(np.float64)
    rng = np.random.default_rng(cfg.train.seed)
    probs = 0.3 + 0.2 * y + (0.3 if cfg.train.seed % 2 else 0.1) * rng.random(len(y))
    return probs, y


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    config = str(Path(__file__).parents[1] / "configs/movielens.toml")
    assert main([*argv, "--config", config, "--set", "data.batch_size=64"]) == 0
    return dict(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def test_quick_command_prints_both_models(
    tiny: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sklearn")
    monkeypatch.setattr(bench, "report_dlrm", fake_report)
    r = run_bench(["--input", str(tiny), "--quick", "--seeds", "100-101", "--boot", "200"], capsys)
    assert r["bench"] == "movielens" and r["seeds"] == [100, 101] and r["quick"]
    assert r["settings"] == bench.QUICK and r["select_seeds"] == []
    ratings = read_movielens(tiny)[0]
    held = carve(ratings)[0]
    assert r["layout"] == "ml-100k" and r["split"]["eval"] == int(held.sum())
    # the record names the --input given (no cache folder of a bare run) and the ratings' digest
    assert r["input"] == str(tiny) and r["dataset"] is None and len(r["ratings_sha256"]) == 64
    users = len(np.unique(ratings[held, 0]))
    assert r["bootstrap"] == {"over": "eval users and seeds", "reps": 200, "users": users}
    assert r["dlrm"]["auc_per_seed"][0] > r["dlrm"]["auc_per_seed"][1]  # odd seed: noisier
    assert 0 <= r["lr"]["auc"] <= 1 and r["lr"]["logloss"] > 0 and len(r["lr"]["auc_per_seed"]) == 2
    assert r["auc_diff"]["value"] == pytest.approx(r["dlrm"]["auc"] - r["lr"]["auc"])
    assert r["auc_diff"]["lo"] < r["auc_diff"]["value"] < r["auc_diff"]["hi"]
    boot = r["auc_diff_users"]
    assert boot["value"] == pytest.approx(r["auc_diff"]["value"]) and boot["n"] == users
    assert boot["lo"] < boot["value"] < boot["hi"]
    assert r["dlrm"]["auc_ci_users"]["value"] == pytest.approx(r["dlrm"]["auc"])


def test_selection_takes_the_best_validation_setting(
    tiny: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("sklearn")
    monkeypatch.setattr(bench, "train_dlrm", fake_dlrm)
    monkeypatch.setattr(bench, "report_dlrm", fake_report)
    monkeypatch.setattr(bench, "CS", (0.1, 1.0))  # fewer fits: a quicker test
    argv = ["--input", str(tiny), "--seeds", "100,101", "--select-seeds", "0,1", "--boot", "20"]
    r = run_bench(argv, capsys)
    assert {k: r["settings"][k] for k in ("lr_scale", "dim", "epochs")} == {
        "lr_scale": 0.5, "dim": 32, "epochs": 3
    }  # fmt: skip
    lr_val = {float(k.split()[-1]): v for k, v in r["selection"].items() if k.startswith("lr C")}
    assert set(lr_val) == set(bench.CS) and r["settings"]["C"] == max(lr_val, key=lr_val.get)
    assert len(r["selection"]) == len(bench.LR_SCALES) * len(bench.DIMS) * bench.MAX_EPOCHS + 2
    assert r["select_seeds"] == [0, 1] and not r["quick"]


def test_bench_data_measures_the_tabular_path(tmp_path: Path) -> None:
    from neorec.bench.data import tabular_rates

    config = str(Path(__file__).parents[1] / "configs/parquet_example.toml")
    r = tabular_rates(tmp_path, 600, config, 1, 0.05)
    fmts = ["csv"] + (["parquet"] if importlib.util.find_spec("pyarrow") else [])
    for fmt in fmts:
        assert r[f"preprocess_{fmt}_rows_s"] > 0 and r[f"direct_{fmt}_rows_s"] > 0
        assert r[f"preprocess_{fmt}_mb_s"] > 0 and r[f"direct_{fmt}_mb_s"] > 0
        pre = json.loads((tmp_path / f"tab_{fmt}_pre" / "manifest.json").read_text())
        assert pre["split"]["train"] == 600  # every generated row preprocessed
    assert r["reader_tabular_samples_s_per_core"] > 0 and r["tabular_rows"] == 600
