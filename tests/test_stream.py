"""Streaming synthetic data (drifting windows) and DAS side files of FM logits (issue 20 items 1, 3).

Fault campaign "stream das": a missing, mismatched (window, FM window / staleness, stream, sample
count) or corrupt (bytes, truncation, sidecar) side file, and bad stream settings, must each be a
one-line ``NeorecError``; one CLI run proves the exit-2 path.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from faults import campaign
from test_trainer import tiny_cfg

from neorec.builder import data_source
from neorec.config import Config, ConfigError, load_config
from neorec.data.batch import Batch
from neorec.data.sources import StreamSource
from neorec.data.stream import (
    DriftingClickData,
    active_rows,
    fm_paths,
    read_fm_logits,
)
from neorec.errors import DataError
from neorec.serve import load_model, save_model
from neorec.serve.das import write_fm_logits
from neorec.train.trainer import Trainer

C = campaign("stream das")
STREAM = [
    "data.source='stream'",
    "data.window_samples=640",
    "data.eval_samples=320",
    "data.windows=4",
    "data.drift=0.5",
    "data.id_churn=0.2",
]


def stream_cfg(tmp: Path, *extra: str) -> Config:
    """The tiny trainer config of test_trainer on the stream."""
    return tiny_cfg(tmp, *STREAM, *extra)


def _gen(cfg: Config, window: int) -> DriftingClickData:
    return DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=window)


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.sparse.values, b.sparse.values)
        and torch.equal(a.sparse.lengths, b.sparse.lengths)
    )


# ---- the drifting generator ---------------------------------------------------------------------
def test_stream_is_deterministic_and_random_access(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path)
    a, b = _gen(cfg, 2), _gen(cfg, 2)
    assert a.bias == b.bias
    for split, i in (("train", 3), ("eval", 1), ("train", 0)):
        assert _same(a.batch(split, i, 64), b.batch(split, i, 64))
    in_order = list(a.batches("train", 64))
    assert len(in_order) == 10 and _same(in_order[7], b.batch("train", 7, 64))
    other = _gen(stream_cfg(tmp_path, "data.seed=7"), 2)
    assert not _same(a.batch("train", 0, 64), other.batch("train", 0, 64))


def test_windows_and_splits_are_disjoint(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path)

    def rows(data: DriftingClickData, split: str) -> set[bytes]:
        return {r.numpy().tobytes() for b in data.batches(split, 64) for r in b.dense}

    w1, w2 = _gen(cfg, 1), _gen(cfg, 2)
    tr1, ev1, tr2 = rows(w1, "train"), rows(w1, "eval"), rows(w2, "train")
    assert len(tr1) == 640 and len(ev1) == 320 and len(tr2) == 640
    assert not tr1 & ev1 and not tr1 & tr2 and not ev1 & tr2
    assert w1.num_samples("train") == 640 and w1.num_samples("eval") == 320


def test_ids_churn(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path, "data.id_distribution='uniform'")
    rows = cfg.embedding.tables[0].rows
    a = active_rows(rows)
    w0, w3 = _gen(cfg, 0), _gen(cfg, 3)
    ids0 = torch.cat([b.sparse.values for b in w0.batches("train", 64)]).unique()
    ids3 = torch.cat([b.sparse.values for b in w3.batches("train", 64)]).unique()
    first, count = w3.active_range(0)
    assert (first, count) == (round(3 * 0.2 * a), a) == (60, 100)
    assert int(ids0.max()) < a  # window 0: ids [0, A)
    new = set(ids3.tolist()) - set(ids0.tolist())
    assert new and min(new) >= a  # new ids appeared after the old range
    assert int(ids3.min()) >= first  # the oldest ids [0, 60) retired
    assert all(0 <= i < rows for i in ids3.tolist())


def test_teacher_drifts(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path, "data.eval_samples=2048")
    w0, w3 = _gen(cfg, 0), _gen(cfg, 3)
    own, stale = w3.teacher_metrics("eval", 64), w3.teacher_metrics_under(w0, "eval", 64)
    assert stale["ne"] > own["ne"] + 0.02, (own, stale)
    # control: no drift, no churn -> every window has bitwise the same teacher
    still = stream_cfg(tmp_path, "data.eval_samples=2048", "data.drift=0", "data.id_churn=0")
    s0, s3 = _gen(still, 0), _gen(still, 3)
    assert s0.bias == s3.bias and torch.equal(s0._cross, s3._cross)
    assert s3.teacher_metrics_under(s0, "eval", 64) == s3.teacher_metrics("eval", 64)


def test_id_shrink_visits_and_weight(tmp_path: Path) -> None:
    """data.id_shrink_visits H: per-id teacher vectors shrunk by sqrt(v / (v + H)), then
    multiplied by data.id_weight; the defaults (4000, 1) are the stream as before (same
    fingerprint as before the knobs existed)."""
    from neorec.data.stream import stream_fingerprint

    base, low = stream_cfg(tmp_path), stream_cfg(tmp_path, "data.id_shrink_visits=100")
    assert (
        stream_fingerprint(base.data, base.embedding.tables, base.model.num_dense)
        == "c23818eb0865996b"
    )  # recorded before the knob
    same = stream_cfg(tmp_path, "data.id_shrink_visits=4000", "data.id_weight=1")
    heavy = stream_cfg(tmp_path, "data.id_weight=3")
    assert (
        stream_fingerprint(same.data, same.embedding.tables, same.model.num_dense)
        == stream_fingerprint(base.data, base.embedding.tables, base.model.num_dense)
        != stream_fingerprint(low.data, low.embedding.tables, low.model.num_dense)
    )
    assert stream_fingerprint(heavy.data, heavy.embedding.tables, heavy.model.num_dense) not in (
        stream_fingerprint(base.data, base.embedding.tables, base.model.num_dense),
        stream_fingerprint(low.data, low.embedding.tables, low.model.num_dense),
    )
    a, b, c = _gen(base, 2), _gen(same, 2), _gen(low, 2)
    (ba, pa), (bb, pb), (bc, pc) = (g.batch_with_probs("train", 1, 64) for g in (a, b, c))
    assert torch.equal(pa, pb) and _same(ba, bb)
    # same samples (dense, ids), other labels' probabilities: only the teacher changed
    assert torch.equal(ba.sparse.values, bc.sparse.values) and torch.equal(ba.dense, bc.dense)
    assert not torch.equal(pa, pc)
    ids = torch.arange(active_rows(base.embedding.tables[0].rows))
    v = c._row_prob(0, ids) * (200_000 * base.embedding.tables[0].pooling_factor)
    torch.testing.assert_close(c._row_scale(0, ids), (v / (v + 100)).sqrt().float())
    torch.testing.assert_close(a._row_scale(0, ids), (v / (v + 4000)).sqrt().float())
    torch.testing.assert_close(_gen(heavy, 2)._row_scale(0, ids), 3 * a._row_scale(0, ids))
    none = _gen(stream_cfg(tmp_path, "data.id_shrink_visits=0"), 2)
    assert torch.equal(none._row_scale(0, ids), torch.ones(ids.numel()))
    # weight 0: no per-id signal at all, the teacher's logit is its dense part alone
    flat = _gen(stream_cfg(tmp_path, "data.id_weight=0", "data.drift=0", "data.id_churn=0"), 2)
    z = torch.randn(8, flat.num_dense, generator=torch.Generator().manual_seed(0))
    ids0 = torch.zeros(int(b.tables[0].pooling_factor) * 8, dtype=torch.int64)
    want = 1.2 * (z @ flat._dense_w)  # _DENSE_WEIGHT x the dense term
    lengths = torch.full((len(flat.keys), 8), int(b.tables[0].pooling_factor))
    got = flat._raw_logit(z, lengths, [ids0 for _ in flat.keys])
    torch.testing.assert_close(got, want.float())
    for bad in ("data.id_shrink_visits=-1", "data.id_weight=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            stream_cfg(tmp_path, bad)


def test_trainer_trains_a_window(tmp_path: Path) -> None:
    cfg = stream_cfg(tmp_path, "data.window=3", "train.steps=3")
    trainer = Trainer(cfg)
    assert isinstance(trainer.source, StreamSource)
    want = _gen(cfg, 3)
    assert _same(next(iter(trainer.source.train_batches())), want.batch("train", 0, 64))
    assert trainer.source.reference_metrics() == want.teacher_metrics("eval", 64)
    trainer.fit()
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["teacher"]["ne"] == pytest.approx(want.teacher_metrics("eval", 64)["ne"])


def test_batch_carries_fm_logits() -> None:
    from neorec.sparse import SparseFeatures

    sp = SparseFeatures(["a"], torch.arange(4), torch.ones(4, dtype=torch.int64))
    fm = torch.arange(4, dtype=torch.float32)
    b = Batch(torch.zeros(4, 2), sp, torch.zeros(4), fm)
    assert torch.equal(b.slice(1, 3).fm_logits, fm[1:3])  # type: ignore[arg-type]
    assert torch.equal(b.to("cpu").fm_logits, fm)  # type: ignore[arg-type]
    assert Batch(torch.zeros(4, 2), sp, torch.zeros(4)).slice(0, 2).fm_logits is None
    with pytest.raises(ValueError, match="fm_logits"):
        Batch(torch.zeros(4, 2), sp, torch.zeros(4), torch.zeros(3))


# ---- DAS ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fms(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two tiny FMs trained on stream windows 0 and 1 (saved models)."""
    out = {}
    for w in (0, 1):
        run = tmp_path_factory.mktemp(f"fm{w}")
        trainer = Trainer(stream_cfg(run, f"data.window={w}", "train.steps=5"))
        trainer.fit()
        if not (run / "model" / "model.json").exists():
            save_model(trainer.model, trainer.cfg, run / "model")
        out[w] = run
    return SimpleNamespace(run=out, tmp=tmp_path_factory.mktemp("das"))


def _student(tmp: Path, fm_dir: Path, window: int, k: int, *extra: str) -> Config:
    return stream_cfg(
        tmp, f"data.window={window}", f"data.fm_logits='{fm_dir}'", f"data.fm_staleness={k}", *extra
    )


@torch.no_grad()
def _direct_logits(run: Path, cfg: Config, window: int, split: str) -> torch.Tensor:
    model, _ = load_model(run)
    data = _gen(cfg, window)
    return torch.cat([model(b.dense, b.sparse) for b in data.batches(split, 64)]).float()


def test_das_written_and_read_back_bitwise_with_staleness(fms: SimpleNamespace) -> None:
    cfg = stream_cfg(fms.tmp)
    k2, k1 = fms.tmp / "k2", fms.tmp / "k1"
    for split in ("train", "eval"):
        npy = write_fm_logits(fms.run[0], cfg, 2, split, k2, fm_window=0)  # FM 0 -> window 2
        assert npy == fm_paths(k2, 2, split)[0]
        write_fm_logits(fms.run[1], cfg, 2, split, k1, fm_window=1)
    meta = json.loads(fm_paths(k2, 2, "train")[1].read_text())
    assert (meta["window"], meta["split"], meta["fm_window"], meta["samples"]) == (
        2,
        "train",
        0,
        640,
    )
    assert meta["fm_step"] == 5
    arr = np.load(fm_paths(k2, 2, "train")[0])
    assert arr.dtype == np.float32 and torch.equal(
        torch.from_numpy(arr), _direct_logits(fms.run[0], cfg, 2, "train")
    )
    assert not np.array_equal(arr, np.load(fm_paths(k1, 2, "train")[0]))  # another FM
    # through a trainer's data source: k = 2 reads FM 0's logits, joined by sample index
    src = Trainer(_student(fms.tmp, k2, 2, 2)).source
    got = [b.fm_logits for b in src.train_batches()]
    assert all(g is not None and g.dtype == torch.float32 for g in got)
    assert np.array_equal(torch.cat(got).numpy(), arr)  # type: ignore[arg-type]
    ev = torch.cat([b.fm_logits for b in src.eval_batches()])  # type: ignore[misc]
    assert torch.equal(ev, _direct_logits(fms.run[0], cfg, 2, "eval"))
    assert next(iter(src.train_batches(4))).fm_logits.tolist() == arr[256:320].tolist()  # type: ignore[union-attr]
    # k = 1 reads FM 1's file; each directory holds one FM's logits: the other k is refused
    src1 = data_source(_student(fms.tmp, k1, 2, 1))
    assert np.array_equal(
        torch.cat([b.fm_logits for b in src1.train_batches()]).numpy(),  # type: ignore[misc]
        np.load(fm_paths(k1, 2, "train")[0]),
    )
    C.expect_error(
        "staleness: k=1 on FM 0's file",
        lambda: data_source(_student(fms.tmp, k2, 2, 1)),
        ("FM of window 0", "wants the FM of window 1"),
    )
    C.expect_error(
        "staleness: k=2 on FM 1's file",
        lambda: data_source(_student(fms.tmp, k1, 2, 2)),
        ("FM of window 1", "wants the FM of window 0"),
    )
    C.check()


def _corrupt_cases(fms: SimpleNamespace) -> None:
    cfg = stream_cfg(fms.tmp)
    good = fms.tmp / "good"
    write_fm_logits(fms.run[0], cfg, 1, "train", good, fm_window=0)
    npy, side = fm_paths(good, 1, "train")

    def variant(name: str, edit: object) -> Path:
        d = fms.tmp / name
        shutil.copytree(good, d)
        edit(*fm_paths(d, 1, "train"))  # type: ignore[operator]
        return d

    def flip(n: Path, s: Path) -> None:
        raw = bytearray(n.read_bytes())
        raw[-5] ^= 0x40
        n.write_bytes(bytes(raw))

    def meta_set(key: str, value: object):  # noqa: ANN202
        def edit(n: Path, s: Path) -> None:
            m = json.loads(s.read_text())
            m[key] = value
            s.write_text(json.dumps(m))

        return edit

    src = lambda d, *x: lambda: data_source(_student(fms.tmp, d, 1, 1, *x))  # noqa: E731
    C.expect_error("missing dir", src(fms.tmp / "nope"), ("nope", "no such directory"))
    C.expect_error(
        "missing file",
        src(variant("miss", lambda n, s: n.unlink())),
        ("fm_w1_train.npy", "missing"),
    )
    C.expect_error(
        "missing sidecar",
        src(variant("miss_side", lambda n, s: s.unlink())),
        ("fm_w1_train.json", "missing"),
    )

    def eval_half(n: Path, s: Path) -> None:
        shutil.copy(s, s.with_name("fm_w1_eval.json"))

    C.expect_error(
        "eval sidecar without its array", src(variant("ehalf", eval_half)), "fm_w1_eval.npy"
    )
    C.expect_error("flipped byte", src(variant("flip", flip)), ("fm_w1_train.npy", "checksum"))
    C.expect_error(
        "truncated npy",
        src(variant("trunc", lambda n, s: n.write_bytes(n.read_bytes()[:200]))),
        ("fm_w1_train.npy", "corrupt"),
    )
    C.expect_error(
        "garbage npy",
        src(variant("garb", lambda n, s: n.write_bytes(b"x" * 64))),
        ("fm_w1_train.npy", "corrupt"),
    )
    C.expect_error(
        "garbage sidecar",
        src(variant("gside", lambda n, s: s.write_text("{oops"))),
        ("fm_w1_train.json", "unreadable"),
    )
    C.expect_error(
        "sidecar not a dict",
        src(variant("lside", lambda n, s: s.write_text("[1]"))),
        ("fm_w1_train.json", "unreadable"),
    )
    C.expect_error("other format", src(variant("fmt", meta_set("format", "x"))), "not a")
    C.expect_error("sample count", src(variant("cnt", meta_set("samples", 64))), "samples")
    C.expect_error("renamed window", src(variant("win", meta_set("window", 0))), "window 0")
    C.expect_error(
        "fm window", src(variant("fmw", meta_set("fm_window", 1))), "wants the FM of window 0"
    )
    C.expect_error(
        "bad checksum field", src(variant("sha", meta_set("sha256", "0" * 64))), "checksum"
    )
    C.expect_error("window_samples differ", src(good, "data.window_samples=1280"), "samples")
    C.expect_error("batch size differs", src(good, "data.batch_size=32"), "another stream")
    C.expect_error("seed differs", src(good, "data.seed=9"), "another stream")
    C.expect_error("drift differs", src(good, "data.drift=0.1"), "another stream")
    C.expect_error(
        "float64 array",
        src(variant("f64", lambda n, s: np.save(n, np.load(n).astype(np.float64)))),
        "float64",
    )
    C.expect_error(
        "staleness > window",
        lambda: data_source(_student(fms.tmp, good, 1, 2)),
        "data.fm_staleness 2",
    )
    C.expect_error(
        "fm_logits on synthetic",
        lambda: data_source(_student(fms.tmp, good, 1, 1, "data.source='synthetic'")),
        "data.fm_logits",
    )
    C.expect_error(
        "window >= windows", lambda: stream_cfg(fms.tmp, "data.window=4"), "data.window 4"
    )
    C.expect_error(
        "window_samples < batch",
        lambda: data_source(stream_cfg(fms.tmp, "data.window_samples=10")),
        "data.window_samples 10",
    )
    # writer refusals
    w = lambda *a, **kw: lambda: write_fm_logits(*a, **kw)  # noqa: E731
    C.expect_error(
        "writer: fm after window", w(fms.run[1], cfg, 0, "train", good, fm_window=1), "fm_window 1"
    )
    C.expect_error(
        "writer: wrong fm window",
        w(fms.run[1], cfg, 2, "train", good, fm_window=0),
        "trained on window 1",
    )
    C.expect_error("writer: bad split", w(fms.run[0], cfg, 1, "test", good, fm_window=0), "split")
    C.expect_error(
        "writer: out is a file", w(fms.run[0], cfg, 1, "train", npy, fm_window=0), "not a directory"
    )
    other = dataclasses.replace(
        cfg,
        embedding=dataclasses.replace(
            cfg.embedding, tables=[dataclasses.replace(t, rows=300) for t in cfg.embedding.tables]
        ),
    )
    C.expect_error(
        "writer: other tables", w(fms.run[0], other, 1, "train", good, fm_window=0), "tables"
    )
    # a refused rewrite left the good file as it was
    assert _read(_student(fms.tmp, good, 1, 1), "train") is not None
    C.record("good file still reads", "handled", "after the refusals")


def test_das_refusals(fms: SimpleNamespace) -> None:
    _corrupt_cases(fms)
    C.check()


def test_das_cli_one_line(fms: SimpleNamespace) -> None:
    C.expect_cli_error(
        "cli: train with a missing side file",
        [
            "train",
            "--set",
            "data.source='stream'",
            "--set",
            "data.window=1",
            "--set",
            f"data.fm_logits='{fms.tmp}'",
            "--set",
            "data.fm_staleness=1",
            "--set",
            "embedding.rows=200",
            "--set",
            "train.progress=false",
        ],
        ("fm_w1_train", "missing"),
    )
    C.check()


def test_teacher_metrics_by_window(tmp_path: Path) -> None:
    from neorec.data.stream import teacher_metrics_by_window

    cfg = stream_cfg(tmp_path)
    table = teacher_metrics_by_window(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    assert [m["window"] for m in table] == [0, 1, 2, 3]
    assert table[3]["ne"] == _gen(cfg, 3).teacher_metrics("eval", 64)["ne"]
    assert len({m["ne"] for m in table}) == 4


def test_config_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.window 5"):
        load_config(None, ["data.source='stream'", "data.window=5", "data.windows=5"])
    with pytest.raises(DataError):
        _read(stream_cfg(tmp_path, f"data.fm_logits='{tmp_path}'"), "train")


def test_predict_cli_window_split_and_das(
    fms: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    from neorec.cli import main

    cfg = stream_cfg(fms.tmp)
    ref = fms.tmp / "ref"
    write_fm_logits(fms.run[0], cfg, 3, "train", ref, fm_window=0)
    cli = fms.tmp / "cli"
    argv = ["predict", "--model", str(fms.run[0]), "--window", "3", "--split", "train"]
    assert main([*argv, "--das", str(cli)]) == 0
    assert "FM of window 0" in capsys.readouterr().out
    a, b = (np.load(fm_paths(d, 3, "train")[0]) for d in (ref, cli))
    assert np.array_equal(a, b)
    meta = [json.loads(fm_paths(d, 3, "train")[1].read_text()) for d in (ref, cli)]
    assert meta[0]["sha256"] == meta[1]["sha256"] and meta[1]["fm_window"] == 0
    probs = fms.tmp / "p.npy"
    assert main([*argv, "--out", str(probs)]) == 0
    assert np.array_equal(np.load(probs), torch.sigmoid(torch.from_numpy(a)).numpy())
    capsys.readouterr()
    bad = ["predict", "--model", str(fms.run[0]), "--window", "-1", "--out", str(probs)]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("neorec: error: ") and "data.window" in err[0]


def _read(cfg: Any, split: str) -> Any:
    """``read_fm_logits`` of a config's stream."""
    return read_fm_logits(cfg.data, cfg.embedding.tables, cfg.model.num_dense, split)
