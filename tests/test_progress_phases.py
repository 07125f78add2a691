"""Long phases are not silent: the Phase line (quiet at first, throttled, ETA with a known total),
table initialization, loading a saved model without random init, eval / predict / export, and
line-buffered stdout. Time is a fake clock or the thresholds set to 0: nothing here depends on
how fast the machine is."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_trainer import tiny_cfg

from neorec import phases
from neorec.builder import build_model, data_source
from neorec.cli import line_buffered, main
from neorec.phases import Phase, no_table_init, watch_init
from neorec.serve import load_model, save_model
from neorec.train.trainer import Trainer, predict


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_phase_is_quiet_at_first_then_throttled_with_an_eta() -> None:
    out, clock = io.StringIO(), Clock()
    p = Phase("init", 1000, "rows", out=out, clock=clock)
    p.advance(100)  # inside QUIET_S: nothing
    assert out.getvalue() == ""
    clock.t += phases.QUIET_S
    p.advance(100)
    first = out.getvalue().splitlines()
    assert len(first) == 1 and "init: 200/1,000 rows (20%)" in first[0] and "eta" in first[0]
    clock.t += phases.EVERY_S / 2
    p.advance(100)  # not a terminal: at most one line per EVERY_S
    assert len(out.getvalue().splitlines()) == 1
    clock.t += phases.EVERY_S
    p.advance(100)
    assert len(out.getvalue().splitlines()) == 2
    p.close()
    assert out.getvalue().splitlines()[-1].startswith("init: 400 rows in ")


def test_quick_phase_prints_nothing_and_unknown_total_has_no_eta() -> None:
    out, clock = io.StringIO(), Clock()
    with Phase("eval", None, "batches", out=out, clock=clock) as p:
        p.advance(3)
    assert out.getvalue() == ""  # a quick phase stays quiet, closing line included
    p = Phase("eval", None, "batches", out=out, clock=clock)
    clock.t += phases.QUIET_S + 1
    p.advance(5)
    line = out.getvalue()
    assert "eval: 5 batches" in line and "eta" not in line


def test_phase_on_a_terminal_redraws_in_place() -> None:
    out, clock = Tty(), Clock()
    p = Phase("predict", 10, "batches", out=out, clock=clock)
    clock.t += phases.QUIET_S
    p.advance(1)
    clock.t += phases.REDRAW_S
    p.advance(1)
    p.close()
    text = out.getvalue()
    assert text.count("\r\033[K") == 3 and text.count("\n") == 1  # redrawn, one final newline


@pytest.fixture
def loud(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase shows every update (no quiet start, no throttle)."""
    monkeypatch.setattr(phases, "QUIET_S", 0.0)
    monkeypatch.setattr(phases, "EVERY_S", 0.0)


def test_building_a_model_shows_the_tables_initialization(
    tmp_path: Path, loud: None, capsys: Any
) -> None:
    cfg = tiny_cfg(tmp_path, "train.progress=true")
    seen: list[int] = []
    with watch_init(seen.append):
        build_model(cfg, data_source(cfg), torch.device("cpu"))
    assert sum(seen) == 3 * 200  # every row of every table, reported as it is generated
    err = capsys.readouterr().err
    assert "initializing the tables (600 rows): 600/600 rows (100%)" in err
    assert "initializing the tables (600 rows): 600 rows in" in err
    build_model(tiny_cfg(tmp_path), data_source(cfg), torch.device("cpu"))  # progress=false
    assert capsys.readouterr().err == ""


def test_no_table_init_leaves_the_weights_alone() -> None:
    from neorec.config import TableConfig
    from neorec.modules.collection import CollectionSpec
    from neorec.modules.embedding import EmbeddingBagCollection

    t = [TableConfig(name="a", rows=50, dim=4, features=["f"])]
    seen: list[int] = []
    with watch_init(seen.append), no_table_init():
        ebc = EmbeddingBagCollection(t, CollectionSpec())
    assert seen == [] and ebc.step.item() == 0
    with watch_init(seen.append):
        EmbeddingBagCollection(t, CollectionSpec())
    assert sum(seen) == 50


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    run = tmp_path_factory.mktemp("run")
    tables = "[{name='a', rows=100, dim=8}, {name='b', rows=90, dim=8, precision='bf16'}]"
    trainer = Trainer(tiny_cfg(run, "train.steps=3", f"embedding.tables={tables}"))
    trainer.fit()
    if not (run / "model" / "model.json").exists():
        save_model(trainer.model, trainer.cfg, run / "model")
    return run, trainer


def test_load_model_runs_no_random_init_and_predicts_the_same(saved: Any) -> None:
    run, trainer = saved
    seen: list[int] = []
    rng = torch.random.get_rng_state()
    with watch_init(seen.append):
        model, _ = load_model(run)
    assert seen == []  # no row was generated: every one is read from the model
    torch.random.set_rng_state(rng)
    ref = predict(trainer.model, trainer.source.eval_batches())
    got = predict(model, trainer.source.eval_batches())
    assert torch.equal(torch.cat(got.probs), torch.cat(ref.probs))


def test_eval_predict_export_show_progress(
    saved: Any, loud: None, monkeypatch: Any, capsys: Any
) -> None:
    from neorec.serve import model as serve_model

    run, trainer = saved
    batches = trainer.cfg.data.eval_samples // trainer.cfg.data.batch_size
    capsys.readouterr()
    assert main(["eval", "--model", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"eval: {batches}/{batches} batches (100%)" in err and "eval: " in err.splitlines()[-1]
    assert main(["predict", "--model", str(run), "--out", str(run / "p.npy")]) == 0
    assert f"predict: 1/{batches} batches" in capsys.readouterr().err
    assert np.load(run / "p.npy").shape == (trainer.cfg.data.eval_samples,)
    monkeypatch.setattr(serve_model, "ANNOUNCE_ROWS", 0)
    assert main(["export", "--model", str(run), "--out", str(run / "exp")]) == 0
    err = capsys.readouterr().err
    assert "exporting " in err and ": 190 rows in " in err  # counted table by table
    assert "loading the model's tables (190 rows) ..." in err


def test_stdout_is_line_buffered_when_not_a_terminal(monkeypatch: Any, tmp_path: Path) -> None:
    pipe = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    assert not pipe.line_buffering
    monkeypatch.setattr(sys, "stdout", pipe)
    (tmp_path / "runs").mkdir()
    assert main(["runs", "--root", str(tmp_path / "runs")]) == 0
    assert pipe.line_buffering  # every command: main sets it before it runs one

    class Terminal(io.TextIOWrapper):
        def isatty(self) -> bool:
            return True

    term = Terminal(io.BytesIO(), encoding="utf-8")
    line_buffered(term)
    assert not term.line_buffering  # a terminal keeps its own buffering


def test_preprocessing_progress_has_an_eta() -> None:
    from neorec.data.preprocess import _eta

    assert _eta(10.0, 1, 4) == ", 10s, eta 30s"
    assert _eta(70.0, 4, 4) == ", 1m10s"


def test_calibration_says_each_measurement_as_it_starts(monkeypatch: Any) -> None:
    from neorec.measure import calibrate as cal

    fake = {
        "measure": {"memcpy_gbs": 10.0, "shm_copy_gbs": 8.0},
        "measure_tbe": {"tbe_gbs": 5.0},
        "measure_unfused": {"unfused_gbs": 4.0},
        "measure_dp_update": {"dp_update_gbs": 3.0},
        "measure_row_split": {"row_split_gbs": 2.0},
        "measure_overhead": {"shard_overhead_us": 10.0, "step_overhead_us": 100.0},
    }
    for name, value in fake.items():
        monkeypatch.setattr(cal, name, lambda *a, _v=value, **k: dict(_v))
    lines: list[str] = []
    topo, m = cal.calibrate(1, log=lines.append)
    assert [x.split("]")[0] for x in lines] == [f"calibrate [{i}/6" for i in range(1, 7)]
    assert "memory" in lines[0] and "overhead" in lines[-1] and topo.device_bw_gbs == 5.0
