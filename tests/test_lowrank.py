"""Low-rank tables (issue 53 item 3): ALS against the SVD optimum, the export's U / V files read by
the standalone loader, damage detection, bad ``--low-rank`` values, the benchmark's functions."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from faults import campaign, judge_cli
from test_faults_serve import _flip, _serving
from test_serve import _inputs
from test_trainer import tiny_cfg

from neorec.bench.lowrank import als_error_detail, als_error_over_svd, ne_vs_memory, summarize
from neorec.cli import main
from neorec.config import ConfigError
from neorec.serve import save_model
from neorec.serve.artifact import load_artifact
from neorec.serve.lowrank import als_factor, parse_low_rank, svd_optimum
from neorec.train.trainer import Trainer, evaluate, predict


def _matrix(rows: int, dim: int, rank: int | None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if rank is None:
        return torch.randn(rows, dim, generator=g)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, dim, generator=g)


def _sq_error(w: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> float:
    return float((w.double() - u.double() @ v.double()).square().sum())


# ---- ALS -----------------------------------------------------------------------------------------
def test_als_recovers_a_matrix_of_known_rank() -> None:
    w = _matrix(700, 12, 3)
    lr = als_factor(w, 3, iters=2, chunk_rows=256)  # chunks: 256, 256, 188 rows
    assert lr.u.shape == (700, 3) and lr.v.shape == (3, 12) and lr.u.dtype == torch.float32
    assert lr.relative_error < 1e-5
    assert _sq_error(w, lr.u, lr.v) / lr.sq_norm < 1e-10
    assert svd_optimum(w, 3) / lr.sq_norm < 1e-10
    lo = als_factor(w, 5, iters=2)  # rank above the matrix's: the extra directions are dropped
    assert lo.relative_error < 1e-5 and torch.isfinite(lo.u).all() and torch.isfinite(lo.v).all()


def test_als_error_is_above_the_svd_optimum_and_approaches_it() -> None:
    w = _matrix(1500, 16, None, seed=1) * torch.linspace(3.0, 0.5, 16)  # a decaying spectrum
    opt = svd_optimum(w, 4, chunk_rows=400)
    s = torch.linalg.svdvals(w.double())
    assert opt == pytest.approx(float(s[4:].square().sum()), rel=1e-9)
    lr = als_factor(w, 4, iters=10, chunk_rows=400)
    # the error the loop reports from its sums is the factors' own error
    assert lr.sq_errors[-1] == pytest.approx(_sq_error(w, lr.u, lr.v), rel=1e-5)
    ratios = [(e / opt) ** 0.5 for e in lr.sq_errors]
    assert all(r >= 1 - 1e-9 for r in ratios)  # never below Eckart-Young's optimum
    assert all(b <= a + 1e-9 for a, b in zip(ratios, ratios[1:]))  # monotone: each step a LS fit
    assert ratios[0] > 1.01 and ratios[-1] < 1.01  # it started away from the optimum, and got near


def test_chunked_als_equals_plain_als() -> None:
    """The chunked loop against textbook ALS on the whole matrix (lstsq each half-step): plain
    (no extra columns) the same product after each iteration; with extra columns, the product
    is the best rank-R approximation within the wider ALS's column space."""
    w = _matrix(400, 10, None, seed=3) * torch.linspace(2.0, 0.3, 10)
    w64 = w.double()
    for oversample in (0, 2):
        k = 3 + oversample
        v = torch.randn(k, 10, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        for it in range(1, 4):
            u = torch.linalg.lstsq(v.T, w64.T).solution.T  # argmin_U ||W - U V||
            v = torch.linalg.lstsq(u, w64).solution  # argmin_V ||W - U V||
            q, _ = torch.linalg.qr(u)
            a, sv, bt = torch.linalg.svd(q.T @ w64, full_matrices=False)
            want = q @ a[:, :3] @ torch.diag(sv[:3]) @ bt[:3]
            got = als_factor(w, 3, it, seed=5, chunk_rows=150, oversample=oversample)
            assert torch.allclose(got.u.double() @ got.v.double(), want, atol=1e-5)
            assert got.sq_errors[-1] == pytest.approx(float((w64 - want).square().sum()), rel=1e-6)


def test_als_is_deterministic_given_its_seed() -> None:
    w = _matrix(500, 8, None, seed=2)
    a, b = als_factor(w, 3, 3, seed=7), als_factor(w, 3, 3, seed=7)
    assert torch.equal(a.u, b.u) and torch.equal(a.v, b.v) and a.sq_errors == b.sq_errors
    c = als_factor(w, 3, 3, seed=8)
    assert not torch.equal(a.v, c.v)
    d = als_factor(w, 3, 3, seed=7, chunk_rows=64)  # chunking changes only the sums' rounding
    assert torch.allclose(a.u @ a.v, d.u @ d.v, atol=1e-5)


def test_bad_ranks_and_iterations_are_one_line_errors() -> None:
    w = _matrix(50, 8, None)
    for bad in (0, -1, 2.5, True, 8, 9):
        with pytest.raises(ConfigError, match="rank"):
            als_factor(w, bad, 2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="iters"):
        als_factor(w, 2, 0)
    for text in ("0", "-3", "2.5", "abc", ""):
        with pytest.raises(ConfigError, match="--low-rank must be a positive integer"):
            parse_low_rank(text)
    assert parse_low_rank(" 4 ") == 4 and parse_low_rank(None) is None


def test_bench_functions() -> None:
    ws = [_matrix(300, 8, None, seed=s) for s in range(3)] + [np.ones((10, 2), np.float32)]
    got = als_error_over_svd(ws, 2, iters=(1, 3, 10), seed=0)
    assert list(got) == [1, 3, 10] and all(v >= 1 - 1e-9 for v in got.values())
    assert got[10] <= got[1]
    d = als_error_detail(ws, 2, (1, 3, 10))
    assert d["tables"] == 3  # the dim-2 table is kept as it is, not factored
    assert d["worst_table_ratio"][10] >= d["ratio"][10] - 1e-12
    opt = sum(svd_optimum(torch.as_tensor(w), 2) for w in ws[:3])
    norm = sum(float(torch.as_tensor(w).double().square().sum()) for w in ws[:3])
    assert d["svd_relative_error"] == pytest.approx((opt / norm) ** 0.5)
    with pytest.raises(ConfigError, match="no table has dim > 8"):
        als_error_over_svd(ws, 8)


# ---- export, load, predict -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny trained model (3 tables x 200 rows x dim 8), saved, with its fp32 eval outputs."""
    run = tmp_path_factory.mktemp("lowrank")
    trainer = Trainer(tiny_cfg(run, "data.train_samples=6400"))
    trainer.fit()
    if not (run / "model" / "model.json").exists():
        save_model(trainer.model, trainer.cfg, run / "model")
    return SimpleNamespace(run=run, trainer=trainer, batches=list(trainer.source.eval_batches()))


def _export(t: SimpleNamespace, name: str, *flags: str) -> tuple[Path, str]:
    """``neorec export`` of the trained model with ``flags``; (the artifact, what it printed)."""
    out = t.run / name
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["export", "--model", str(t.run), "--out", str(out), *flags]) == 0
    return out, buf.getvalue()


def _served(art: Path, batches: list[Any]) -> np.ndarray:
    predict_fn = _serving(art).load(str(art))
    return np.concatenate([predict_fn(*_inputs(b)) for b in batches])


def test_export_low_rank_round_trip(trained: SimpleNamespace) -> None:
    """The artifact's rows are U[ids] @ V of the export's ALS; its predictions are the model's
    with each table replaced by that product (the specification), not the fp32 model's."""
    art, out = _export(trained, "art-r4", "--low-rank", "4", "--low-rank-iters", "3")
    assert "low rank 4 (3 ALS iterations): 3 tables factored" in out and "kept" not in out
    m = json.loads((art / "manifest.json").read_text())
    assert m["low_rank"] == {"rank": 4, "iters": 3, "seed": 0, "oversample": 2}
    model = trained.trainer.model
    ref = torch.cat(predict(model, iter(trained.batches)).probs).numpy()
    saved = {t.name: model.ebc.table_weight(t.name).detach().clone() for t in model.ebc.tables}
    try:
        for spec in m["tables"]:
            assert spec["quantization"] == "lowrank" and spec["rank"] == 4
            u, v = np.load(art / spec["files"]["u"]), np.load(art / spec["files"]["v"])
            assert u.dtype == v.dtype == np.float32 and u.shape == (200, 4) and v.shape == (4, 8)
            assert spec["bytes"] == sum((art / f).stat().st_size for f in spec["files"].values())
            lr = als_factor(saved[spec["name"]], 4, 3, seed=0)  # the export's own factors
            assert np.array_equal(u, lr.u.numpy()) and np.array_equal(v, lr.v.numpy())
            assert spec["relative_error"] == pytest.approx(lr.relative_error)
            model.ebc.set_table_weight(spec["name"], lr.u @ lr.v)
        want = torch.cat(predict(model, iter(trained.batches)).probs).numpy()
    finally:
        for name, w in saved.items():
            model.ebc.set_table_weight(name, w)
    got = _served(art, trained.batches)
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(got - ref).max() > 1e-4  # rank 4 of 8 is not the fp32 tables
    # the loader's rows are U[ids] @ V
    table = _serving(art).load(str(art)).tables[m["tables"][-1]["name"]]  # u, v: its files
    ids = np.array([0, 199, 5, 5], dtype=np.int64)
    assert torch.allclose(table.rows(ids), torch.from_numpy(u[ids] @ v), atol=1e-6)
    assert load_artifact(art)(*_inputs(trained.batches[0])).shape == (64,)


def test_tables_of_dim_at_most_the_rank_are_kept(trained: SimpleNamespace) -> None:
    art, out = _export(trained, "art-r8", "--low-rank", "8")
    assert "0 tables factored; kept as they are (dim <= 8): t0, t1, t2" in out
    fp32, _ = _export(trained, "art-fp32")
    m = json.loads((art / "manifest.json").read_text())
    assert {t["quantization"] for t in m["tables"]} == {"none"}
    assert np.array_equal(_served(art, trained.batches), _served(fp32, trained.batches))


def test_damaged_factors_are_named(trained: SimpleNamespace, tmp_path: Path) -> None:
    art, _ = _export(trained, "art-r2", "--low-rank", "2", "--low-rank-iters", "1")
    m = json.loads((art / "manifest.json").read_text())
    c = campaign("low-rank artifact")
    for key in ("u", "v"):
        for how in ("flip", "cut", "removed"):
            a = tmp_path / f"{key}-{how}"
            shutil.copytree(art, a)
            rel = m["tables"][1]["files"][key]
            if how == "flip":
                _flip(a / rel)
            elif how == "cut":
                data = (a / rel).read_bytes()
                (a / rel).write_bytes(data[:-8])
            else:
                (a / rel).unlink()
            c.expect_error(f"{key}: {how}", lambda a=a: load_artifact(a), (str(a), rel))
            try:
                _serving(a).load(str(a))
                c.record(f"serving.py: {key}: {how}", "silently accepted")
            except ValueError as e:
                ok = rel in str(e) and "\n" not in str(e).strip()
                c.record(f"serving.py: {key}: {how}", "clear error" if ok else "crash", str(e))
    c.check()


def test_bad_low_rank_flags_fail_before_any_work(tmp_path: Path, capsys: Any) -> None:
    """One ``neorec: error:`` line, exit 2, no folder written; the flags are checked before the
    model is even looked for (a missing model is named only when the flags are good)."""
    c = campaign("export --low-rank flags")
    missing, out = str(tmp_path / "no-model"), tmp_path / "out"
    for name, flags, match in (
        ("rank 0", ["--low-rank", "0"], "--low-rank must be a positive integer, got '0'"),
        ("negative rank", ["--low-rank", "-2"], "--low-rank must be a positive integer"),
        ("non-integer rank", ["--low-rank", "2.5"], "--low-rank must be a positive integer"),
        ("iters 0", ["--low-rank", "2", "--low-rank-iters", "0"], "--low-rank-iters must be"),
        ("iters alone", ["--low-rank-iters", "3"], "only with --low-rank"),
        ("with --quantize", ["--low-rank", "2", "--quantize", "int8"], "choose one"),
    ):
        capsys.readouterr()
        code = main(["export", "--model", missing, "--out", str(out), *flags])
        err = capsys.readouterr().err
        r = subprocess.CompletedProcess([], code, "", err)
        outcome, detail = judge_cli(r, match)
        if outcome == "clear error" and (code != 2 or len(err.strip().splitlines()) != 1):
            outcome, detail = "crash", f"exit {code}: {err.strip()[-300:]}"
        c.record(name, outcome, detail)
    c.record("nothing written", "data lost" if out.exists() else "handled")
    c.check()


# ---- the benchmark's NE vs memory ----------------------------------------------------------------
def test_ne_vs_memory_restores_the_tables(trained: SimpleNamespace) -> None:
    model = trained.trainer.model
    before = {t.name: model.ebc.table_weight(t.name).clone() for t in model.ebc.tables}

    def ev(m: Any) -> dict[str, float]:
        return evaluate(m, iter(trained.batches))

    got = ne_vs_memory(model, ev, [2, 8], iters=2)
    assert got["ranks"][8]["ne"] == got["reference"]["ne"]  # dim 8: kept, nothing changed
    assert got["ranks"][8]["bytes_ratio"] == 1.0
    assert got["ranks"][2]["bytes_ratio"] == pytest.approx((200 * 2 + 2 * 8) / (200 * 8))
    assert got["ranks"][2]["ne"] != got["reference"]["ne"]
    for name, w in before.items():
        assert torch.equal(model.ebc.table_weight(name), w)
    s = summarize([got, got])
    assert s["reference_ne"] == got["reference"]["ne"]
    assert s["ranks"][2]["ne_change"] == pytest.approx(
        got["ranks"][2]["ne"] / got["reference"]["ne"] - 1
    )
