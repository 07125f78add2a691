"""TensorBoard scalars of a run (``neorec/train/tb.py``) and ``neorec report`` (its PNG / HTML).

One tiny run (module fixture) is read back both ways: the event file with tensorboard's
EventAccumulator (tags and steps equal events.jsonl's), and the report's series (equal to the
events) and PNG. Without tensorboard importable, ``auto`` writes nothing and says nothing,
``on`` is a one-line error (exit 2 through the CLI). The report's errors are a fault campaign.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
from faults import campaign

from neorec.cli import main as cli_main
from neorec.config import ConfigError, load_config
from neorec.train import report
from neorec.train.tb import TB_DIR, tensorboard_wanted
from neorec.train.trainer import train

C = campaign("report")
TINY = [
    "embedding.num_tables=2",
    "embedding.rows=100",
    "embedding.dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[8, 1]",
    "data.batch_size=32",
    "data.train_samples=640",
    "data.eval_samples=128",
    "train.steps=10",
    "train.log_every=2",
    "train.eval_every=4",
    "train.progress=false",
    "train.threads=1",
    "train.save_model=false",
]


def tiny_cfg(root: Path, *extra: str) -> Any:
    return load_config(overrides=[*TINY, f"train.runs_dir='{root}'", *extra])


def read_events(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; fails unless the file is a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    w, h = struct.unpack(">II", head[16:24])
    return int(w), int(h)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("runs")
    result = train(tiny_cfg(root, "train.tensorboard='on'"), out=io.StringIO())
    return Path(result["run"]["folder"]), result


# ---- TensorBoard -----------------------------------------------------------------------------
def test_tensorboard_scalars_equal_the_events(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, result = run
    ev = read_events(folder)
    acc = EventAccumulator(str(folder / TB_DIR))
    acc.Reload()
    got = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    def want(key: str, final: bool = False) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in ev if key in r and bool(r.get("final")) == final]

    pairs = {
        "train/loss": want("loss"),
        "train/samples_per_s": want("samples_per_s"),
        "train/lr": want("lr"),
        "eval/ne": want("eval_ne"),
        "eval/auc": want("eval_auc"),
        "eval/logloss": want("eval_logloss"),
        "eval/calibration": want("eval_calibration"),
        "final/ne": want("eval_ne", final=True),
        "final/auc": want("eval_auc", final=True),
    }
    assert [s for s, _ in pairs["train/loss"]] == [2, 4, 6, 8, 10]
    assert [s for s, _ in pairs["eval/ne"]] == [4, 8]
    assert [s for s, _ in pairs["final/ne"]] == [10]
    for tag, expected in pairs.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in expected], tag
        for (_, a), (_, b) in zip(got[tag], expected):
            assert a == pytest.approx(b, rel=1e-6), tag  # float32 in the event file
    teacher = result["teacher"]["ne"]
    assert got["eval/teacher_ne"] == [(s, pytest.approx(teacher, rel=1e-6)) for s in (4, 8, 10)]
    # one rank, no row cache: no communication or cache scalars
    assert not [t for t in got if t.startswith(("comm/", "cache/"))]


def test_tensorboard_mode_off_writes_nothing(tmp_path):
    folder = Path(
        train(tiny_cfg(tmp_path, "train.tensorboard='off'", "train.steps=2"))["run"]["folder"]
    )
    assert (folder / "events.jsonl").exists() and not (folder / TB_DIR).exists()


def test_tensorboard_closed_on_error_and_a_bad_tb_path(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "failed"
    with pytest.raises(RuntimeError, match="injected failure"):  # an error inside the loop
        train(
            tiny_cfg(tmp_path, f"train.run_dir='{run_dir}'", "system.fail_at='0:7'"),
            out=io.StringIO(),
        )
    acc = EventAccumulator(str(run_dir / TB_DIR))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("eval/ne")] == [4]
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / TB_DIR).write_text("a file where the tb folder goes")
    C.expect_error(
        "a file named tb in the run folder",
        lambda: train(tiny_cfg(tmp_path, f"train.run_dir='{blocked}'", "train.steps=2")),
        ("tb", "train.tensorboard = off"),
    )
    C.check()


def _hide_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("torch.utils.tensorboard", "tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError


def test_without_tensorboard_auto_is_silent_and_on_is_one_line(tmp_path, monkeypatch, capsys):
    _hide_tensorboard(monkeypatch)
    assert tensorboard_wanted("auto") is False and tensorboard_wanted("off") is False
    with pytest.raises(ConfigError, match=r"pip install 'neorec\[tb\]'"):
        tensorboard_wanted("on")
    out = io.StringIO()
    with _no_warnings():
        result = train(tiny_cfg(tmp_path, "train.steps=2", "train.progress=true"), out=out)
    folder = Path(result["run"]["folder"])
    assert (folder / "metrics.json").exists() and not (folder / TB_DIR).exists()
    for text in (out.getvalue(), (folder / "train.log").read_text()):
        assert "tensorboard" not in text.replace(str(tmp_path), "").lower()  # (the test's name)
    # on: refused before training, through the CLI's one-line error, exit 2, no folder left
    monkeypatch.chdir(tmp_path)
    argv = ["train", *(a for s in TINY for a in ("--set", s)), "--set", "train.tensorboard=on"]
    argv += ["--set", "train.runs_dir=cli_runs"]
    capsys.readouterr()
    code = cli_main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == (
        "neorec: error: train.tensorboard = on needs tensorboard: pip install 'neorec[tb]'"
    )
    assert not [p for p in (tmp_path / "cli_runs").iterdir() if p.name != "latest"]


class _no_warnings:
    """No warning is issued inside the block (an 'auto' that says nothing)."""

    def __enter__(self) -> None:
        import warnings

        self._cm = warnings.catch_warnings(record=True)
        self.seen = self._cm.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc: object) -> None:
        self._cm.__exit__(*exc)
        noisy = [str(w.message) for w in self.seen if "tensorboard" in str(w.message).lower()]
        assert not noisy, noisy


# ---- report: the series and the PNG -----------------------------------------------------------
def test_series_equal_the_events(run):
    folder, result = run
    ev = read_events(folder)
    s = report.series(report.read_events(folder), report.read_metrics(folder))
    assert s.loss == (
        [r["step"] for r in ev if "loss" in r],
        [r["loss"] for r in ev if "loss" in r],
    )
    assert s.samples_per_s[1] == [r["samples_per_s"] for r in ev if "samples_per_s" in r]
    periodic = [r for r in ev if "eval_ne" in r and not r.get("final")]
    assert s.eval["ne"] == ([r["step"] for r in periodic], [r["eval_ne"] for r in periodic])
    assert s.eval["auc"][1] == [r["eval_auc"] for r in periodic]
    assert s.final["step"] == 10 and s.final["ne"] == result["eval"]["ne"]
    assert (
        s.teacher["ne"] == result["teacher"]["ne"] and s.teacher["auc"] == result["teacher"]["auc"]
    )
    assert s.eval_batches == 20 and not s.has_comm and not s.has_cache


def test_report_png_and_html(run, tmp_path):
    folder, _ = run
    out = tmp_path / "r.png"
    written = report.make_report(folder, out, as_html=True)
    assert written == [out, tmp_path / "r.html"]
    w, h = png_size(out)
    assert (w, h) == (1300, 780)  # 13 x 7.8 in at 100 dpi: two rows of two panels
    assert 30_000 < out.stat().st_size < 1_000_000
    page = (tmp_path / "r.html").read_text()
    assert base64.b64encode(out.read_bytes()).decode() in page
    assert "eval ne" in page and "teacher ne" in page and "eval NE vs teacher" in page


def test_comm_and_cache_panels_when_present(tmp_path):
    events = [
        {
            "step": s,
            "loss": 0.6 - s / 100,
            "samples_per_s": 1000.0 + s,
            "lr": 0.1,
            "comm_bytes_per_step": 2.0**20 * s,
            "comm_wait_ms_per_step": 1.5,
            "cache_hit_rate": None if s == 1 else 0.5 + s / 100,
        }
        for s in range(1, 6)
    ]
    events.append(
        {
            "step": 5,
            "eval_ne": 0.95,
            "eval_auc": 0.7,
            "eval_logloss": 0.5,
            "eval_calibration": 1.0,
            "final": True,
        }
    )
    s = report.series(events, None)
    assert s.has_comm and s.has_cache
    assert s.comm_bytes == ([1, 2, 3, 4, 5], [2.0**20 * k for k in range(1, 6)])
    assert s.cache_hit_rate[0] == [2, 3, 4, 5]  # a window without lookups has no rate
    assert s.final == {"step": 5.0, "ne": 0.95, "auc": 0.7, "logloss": 0.5, "calibration": 1.0}
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    png = report.make_report(tmp_path)[0]
    assert png == tmp_path / "report.png" and png_size(png) == (1300, 1170)  # three rows


def test_cli_report_latest_and_a_cut_last_line(run, tmp_path, capsys):
    folder, _ = run
    copy = tmp_path / "runs" / "r1"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("report*", TB_DIR))
    (tmp_path / "runs" / "latest").symlink_to("r1")
    with open(copy / "events.jsonl", "a") as fh:
        fh.write('{"step": 11, "loss": 0.')  # killed while writing
    n = len(report.read_events(copy))
    assert n == len(read_events(folder))
    code = cli_main(["report", "latest", "--root", str(tmp_path / "runs"), "--html"])
    assert code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.split() == [
        "wrote",
        str(copy / "report.png"),
        "wrote",
        str(copy / "report.html"),
    ]
    png_size(copy / "report.png")
    C.record("events.jsonl with its last line cut", "handled", f"{n} events plotted")


# ---- report: errors --------------------------------------------------------------------------
def test_report_errors(run, tmp_path, monkeypatch, capsys):
    folder, _ = run
    runs = tmp_path / "runs"
    runs.mkdir()

    def case(name: str, setup: Any) -> Path:
        p = runs / name
        p.mkdir()
        setup(p)
        return p

    empty = case("empty", lambda p: (p / "events.jsonl").write_text(""))
    case("none", lambda p: None)
    bad = case(
        "bad", lambda p: (p / "events.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    )
    nostep = case("nostep", lambda p: (p / "events.jsonl").write_text('{"loss": 1}\n{"step": 2}\n'))
    badm = case("badm", lambda p: (p / "events.jsonl").write_text('{"step": 1, "loss": 0.5}\n'))
    (badm / "metrics.json").write_text("{")
    (tmp_path / "afile").write_text("x")
    R = str(runs)
    cases: list[tuple[str, list[str], tuple[str, ...]]] = [
        ("a run that does not exist", ["nope", "--root", R], ("run 'nope'", "neorec runs")),
        ("latest with no runs", ["latest", "--root", str(tmp_path / "x")], ("'latest'", "--root")),
        ("a file as RUN", [str(tmp_path / "afile")], ("is a file",)),
        ("a folder without events.jsonl", ["none", "--root", R], ("events.jsonl does not exist",)),
        ("an empty events.jsonl", [str(empty)], ("no events yet",)),
        ("a bad line in the middle", [str(bad)], ("events.jsonl line 2",)),
        ("a line without a step", [str(nostep)], ("events.jsonl line 1", "'step'")),
        ("an unreadable metrics.json", [str(badm)], ("metrics.json", "not readable")),
        ("--out not a .png", [str(folder), "--out", str(tmp_path / "r.jpg")], (".png",)),
        (
            "--out in a missing folder",
            [str(folder), "--out", str(tmp_path / "no" / "r.png")],
            ("does not exist",),
        ),
    ]
    for name, argv, match in cases:
        C.expect_error(name, lambda a=argv: report.run_report(_args(a)), match)
        code = cli_main(["report", *argv])
        err = capsys.readouterr().err.strip()
        if code != 2 or len(err.splitlines()) != 1 or not err.startswith("neorec: error: "):
            C.record(f"{name} (main)", "crash", f"exit {code}: {err!r}")
    assert not list(runs.glob("*/report.png")), "no report from a refused run"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    C.expect_error(
        "matplotlib not installed",
        lambda: report.run_report(_args([str(folder)])),
        "pip install 'neorec[plot]'",
    )
    C.check()


def _args(argv: list[str]) -> Any:
    from neorec.cli import build_parser

    return build_parser().parse_args(["report", *argv])
