"""``neorec eval | predict`` of runs trained on tabular data read their own source and schema by
default, and ``--data`` in the format the run was trained on: a Parquet-trained run, a
tabular-preprocessed run and a MovieLens-trained run (tiny data made here); a directory
preprocessed with other vocabularies, and data of the other format, are refused naming the
format expected."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from neorec.cli import main
from neorec.config import load_config
from neorec.data.example import write_example
from neorec.data.movielens import movielens
from neorec.data.tabular_pre import TabularOptions, preprocess_tabular

pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
PARQUET = ROOT / "configs" / "parquet_example.toml"
SMALL = ["data.batch_size=64", "train.progress=false", "train.tensorboard=off", "data.workers=0"]


def _sets(items: list[str]) -> list[str]:
    return [a for kv in items for a in ("--set", kv)]


def _train(config: Path, run: Path, data: Path, *more: str) -> None:
    sets = [f"data.path={data}", f"train.run_dir={run}", *SMALL, *more]
    assert main(["train", "--config", str(config), *_sets(sets)]) == 0


def _eval(capsys: pytest.CaptureFixture[str], run: Path, *args: str) -> tuple[str, str]:
    """(the data the eval line names, the metrics row)."""
    capsys.readouterr()
    assert main(["eval", "--model", str(run), *args]) == 0
    text = capsys.readouterr().out
    row = [x for x in text.splitlines() if x.startswith("eval ")]
    return re.search(r"data: (.*)", text).group(1), row[0]  # type: ignore[union-attr]


def _predict(run: Path, out: Path, *args: str) -> np.ndarray:
    assert main(["predict", "--model", str(run), "--out", str(out), *args]) == 0
    return np.load(out)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_parquet_trained_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, run = tmp_path / "pq", tmp_path / "run"
    write_example(data, train=512, eval=192, seed=1)
    _train(PARQUET, run, data, "train.epochs=1")
    own, row = _eval(capsys, run)
    given, same = _eval(capsys, run, "--data", str(data / "part-1.parquet"))
    assert (own, given) == (
        "the config's eval data, 192 samples",
        f"{data}/part-1.parquet, 192 samples",
    )
    assert same == row  # the held-out file read as the trainer reads it
    p_own = _predict(run, tmp_path / "a.npy")
    p_data = _predict(run, tmp_path / "b.npy", "--data", str(data / "part-1.parquet"))
    assert p_own.shape == (192,) and np.array_equal(p_own, p_data)
    # CSV of the same columns is the same data (the schema reads either)
    csv = tmp_path / "csv"
    write_example(csv, fmt="csv", train=512, eval=192, seed=1)
    assert np.allclose(_predict(run, tmp_path / "c.npy", "--data", str(csv / "part-1.csv")), p_own)
    # Criteo-shaped text is refused, naming what the model expects
    tsv = tmp_path / "criteo.tsv"
    tsv.write_text("1\t" + "\t".join(["3"] * 13 + ["a1"] * 26) + "\n")
    err = _error(capsys, ["eval", "--model", str(run), "--data", str(tsv)])
    assert "tabular data as the model was trained on" in err and "click" in err


def test_a_tabular_preprocessed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, pre, run = tmp_path / "raw", tmp_path / "pre", tmp_path / "run"
    files = write_example(raw, train=512, eval=192, seed=2)
    cfg = load_config(PARQUET)
    preprocess_tabular(
        files, pre, cfg.data.schema, cfg.embedding.tables, TabularOptions(workers=1), out=None
    )
    _train(PARQUET, run, pre, "train.epochs=1")
    _, row = _eval(capsys, run)
    assert _eval(capsys, run, "--data", str(pre))[1] == row  # its held-out split
    # the raw held-out file, encoded with the preprocessed directory's vocabularies
    assert _eval(capsys, run, "--data", str(files[1]))[1] == row
    assert np.array_equal(
        _predict(run, tmp_path / "a.npy"),
        _predict(run, tmp_path / "b.npy", "--data", str(files[1])),
    )
    # a directory preprocessed from other data maps ids to other rows: refused
    other_raw, other = tmp_path / "other_raw", tmp_path / "other"
    more = write_example(other_raw, train=300, eval=100, seed=7)
    preprocess_tabular(
        more, other, cfg.data.schema, cfg.embedding.tables, TabularOptions(workers=1)
    )
    err = _error(capsys, ["eval", "--model", str(run), "--data", str(other)])
    assert "preprocessed with other statistics" in err and "give the raw files" in err


def _movielens_config(tmp_path: Path) -> Path:
    """configs/movielens.toml with tables small enough to save in a test."""
    text = (ROOT / "configs" / "movielens.toml").read_text()
    text = re.sub(r"rows = \d+", "rows = 64", text)
    path = tmp_path / "movielens.toml"
    path.write_text(text)
    return path


def test_a_movielens_trained_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.test_movielens import ratings, write_layouts

    layouts = write_layouts(tmp_path, ratings(3))
    pre, run = tmp_path / "ml_pre", tmp_path / "run"
    movielens(layouts["ml-100k"], pre, workers=1)
    _train(_movielens_config(tmp_path), run, pre, "train.steps=3", "data.batch_size=8")
    _, row = _eval(capsys, run)
    assert _eval(capsys, run, "--data", str(pre))[1] == row
    n = len(_predict(run, tmp_path / "a.npy", "--data", str(pre)))
    assert n == len(_predict(run, tmp_path / "b.npy")) > 0
    # the other format: a Criteo-trained model's data is not this
    err = _error(capsys, ["eval", "--model", str(run), "--data", str(layouts["ml-100k"])])
    assert "tabular data as the model was trained on" in err


def test_a_criteo_model_refuses_a_tabular_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw, pre, run = tmp_path / "raw", tmp_path / "pre", tmp_path / "run"
    files = write_example(raw, train=256, eval=64)
    cfg = load_config(PARQUET)
    preprocess_tabular(files, pre, cfg.data.schema, cfg.embedding.tables, TabularOptions(workers=1))
    sets = ["data.train_samples=256", "data.eval_samples=128", f"train.run_dir={run}", *SMALL]
    assert main(["train", *_sets(sets)]) == 0
    err = _error(capsys, ["eval", "--model", str(run), "--data", str(pre)])
    assert "was preprocessed from tabular data" in err
    assert "Criteo data (what --data reads for a model trained on synthetic data)" in err
    err = _error(capsys, ["predict", "--model", str(run), "--data", str(files[1]), "--out", "x"])
    assert "is parquet data; the model was trained on 'synthetic' data" in err
