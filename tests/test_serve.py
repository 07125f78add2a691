"""The trained model put to use: save / load, eval, predict, export (issue 18 item 5)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from faults import campaign, judge_cli
from test_trainer import tiny_cfg

from neorec.checkpoint.format import seal_manifest
from neorec.cli import main
from neorec.metrics import binary_metrics
from neorec.serve import load_model, save_model
from neorec.serve.export import export_model
from neorec.train.trainer import Trainer, predict

# Measured on the fixture's model (100 steps, 3 tables x 200 rows x dim 8; eval NE 0.9860):
# relative eval-NE change of the exported predictions vs fp32 fp16 0.0003%, int8 0.0013%, int4
# 0.0062%, int2 0.16%; max |probability| change fp16 3.7e-5, int8 1.9e-4, int4 3.5e-3, int2
# 1.6e-2. The bounds leave a margin of 6-16x.
NE_BOUND = {"fp16": 3e-5, "int8": 1e-4, "int4": 1e-3, "int2": 1e-2}
PROB_BOUND = {"fp16": 3e-4, "int8": 2e-3, "int4": 3e-2, "int2": 0.15}


def _save(trainer: Trainer, run: Path) -> None:
    """The run's model: saved by the trainer at the end of ``fit`` once that is wired in
    (then it is used as is), else saved here (every rank)."""
    if not (run / "model" / "model.json").exists():
        save_model(trainer.model, trainer.cfg, run / "model")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny trained run with its saved model, and the trainer's own eval predictions."""
    run = tmp_path_factory.mktemp("run")
    trainer = Trainer(tiny_cfg(run, "data.train_samples=6400"))
    trainer.fit()
    _save(trainer, run)
    state = predict(trainer.model, trainer.source.eval_batches())
    probs, labels = torch.cat(state.probs), torch.cat(state.labels)
    return SimpleNamespace(
        run=run, trainer=trainer, cfg=trainer.cfg, probs=probs, labels=labels, exports={}
    )


def _export(trained: SimpleNamespace, q: str) -> Path:
    if q not in trained.exports:
        out = trained.run / f"export-{q}"
        assert (
            main(["export", "--model", str(trained.run), "--out", str(out), "--quantize", q]) == 0
        )
        trained.exports[q] = out
    return trained.exports[q]


def _serving(artifact: Path) -> Any:
    """The artifact's own serving.py, imported from its file."""
    name = f"serving_{artifact.name.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(name, artifact / "serving.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _inputs(batch: Any) -> tuple[Any, dict[str, Any]]:
    sparse = {}
    for f in batch.sparse.keys:
        values, lengths, _ = batch.sparse.feature(f)
        sparse[f] = (lengths.numpy(), values.numpy())
    return batch.dense.numpy(), sparse


def _serve_eval(trained: SimpleNamespace, q: str) -> torch.Tensor:
    predict_fn = _serving(_export(trained, q)).load(str(_export(trained, q)))
    outs = [predict_fn(*_inputs(b)) for b in trained.trainer.source.eval_batches()]
    return torch.from_numpy(np.concatenate(outs))


# ---- save / load / predict / eval --------------------------------------------------------------
def test_load_model_restores_the_trained_model(trained: SimpleNamespace) -> None:
    for path in (trained.run, trained.run / "model"):  # a run folder or the model dir
        model, cfg = load_model(path)
        assert cfg.to_dict() == trained.cfg.to_dict()
        src = trained.trainer.model
        for t in src.ebc.tables:
            assert torch.equal(model.ebc.table_weight(t.name), src.ebc.table_weight(t.name))
        a, b = model.dense_arch.state_dict(), src.dense_arch.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.bitwise
def test_predict_and_eval_equal_the_trainers_eval(trained: SimpleNamespace, capsys: Any) -> None:
    out = trained.run / "preds.npy"
    assert main(["predict", "--model", str(trained.run), "--out", str(out)]) == 0
    preds = np.load(out)
    assert preds.dtype == np.float32 and preds.shape == (trained.cfg.data.eval_samples,)
    assert np.array_equal(preds, trained.probs.numpy())  # bitwise: same batches, same model
    capsys.readouterr()
    assert main(["eval", "--model", str(trained.run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["eval"]
    want = binary_metrics(trained.probs, trained.labels)
    assert got == want
    # a data override: fewer eval samples, the first ones of the same split
    half = trained.cfg.data.eval_samples // 2
    over = ["--set", f"data.eval_samples={half}"]
    assert main(["predict", "--model", str(trained.run), "--out", str(out), *over]) == 0
    assert np.array_equal(np.load(out), trained.probs.numpy()[:half])


def test_low_precision_tables_round_trip(tmp_path: Path) -> None:
    tables = "[{name='a', rows=100, dim=8, precision='fp16'}, {name='b', rows=90, dim=8}]"
    trainer = Trainer(tiny_cfg(tmp_path, "train.steps=3", f"embedding.tables={tables}"))
    trainer.fit()
    _save(trainer, tmp_path)
    model, _ = load_model(tmp_path)
    src: Any = trainer.model
    for t in src.ebc.tables:
        assert torch.equal(model.ebc.table_weight(t.name), src.ebc.table_weight(t.name))
    ref = predict(trainer.model, trainer.source.eval_batches())
    got = predict(model, trainer.source.eval_batches())
    assert torch.equal(torch.cat(got.probs), torch.cat(ref.probs))


def _dist_save(rank: int, world: int, out: str) -> None:
    types = {"t0": "row_wise", "t1": "table_wise", "t2": "data_parallel"}
    over = [f"sharding.types.{k}='{v}'" for k, v in types.items()]
    trainer = Trainer(tiny_cfg(Path(out), "train.steps=6", *over))
    result = trainer.fit()
    _save(trainer, Path(out))  # collective
    if rank == 0:
        torch.save(result["eval"], Path(out) / "eval.pt")


def test_sharded_model_saved_by_two_ranks_loads_unsharded(tmp_path: Path) -> None:
    from dist_util import run_ranks

    from neorec.serve.evaluate import eval_data, evaluate_model

    run_ranks(_dist_save, 2, str(tmp_path))
    model, cfg = load_model(tmp_path)
    info = json.loads((tmp_path / "model" / "model.json").read_text())
    assert info["world_size"] == 2 and info["step"] == 6
    want = torch.load(tmp_path / "eval.pt")
    got = evaluate_model(model, cfg, eval_data(cfg))
    for k in ("auc", "ne", "calibration"):  # row-wise partial sums: float tolerance
        assert got[k] == pytest.approx(want[k], rel=1e-5), k


def _criteo_tsv(path: Path, lines: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        dense = [str(int(x)) if x >= 0 else "" for x in rng.integers(-2, 50, 13)]
        cats = [f"{int(x):08x}" for x in rng.integers(0, 2**32, 26)]
        out.append("\t".join([str(int(rng.integers(0, 2))), *dense, *cats]) + "\n")
    path.write_text("".join(out))
    return str(path)


def test_criteo_tsv_data(tmp_path: Path) -> None:
    train = _criteo_tsv(tmp_path / "train.tsv", 64, 0)
    held = _criteo_tsv(tmp_path / "held.tsv", 40, 1)  # 2 batches of 16 and one of 8
    tables = ", ".join(f"{{name='C{i}', rows={50 + i}, dim=4}}" for i in range(1, 27))
    cfg = tiny_cfg(
        tmp_path, f"embedding.tables=[{tables}]", "model.bottom_mlp=[8, 4]", "data.batch_size=16",
        "data.source='criteo'", f"data.path='{train}'", f"data.eval_path='{held}'",
    )  # fmt: skip
    trainer = Trainer(cfg)
    trainer.fit()
    _save(trainer, tmp_path)
    ref = torch.cat(predict(trainer.model, trainer.source.eval_batches()).probs).numpy()
    out = tmp_path / "p.npy"
    from neorec.cli.data import preprocess_main as preprocess

    pre = str(tmp_path / "pre")
    rows = ",".join(str(50 + i) for i in range(1, 27))
    argv = ["--input", held, "--output", pre, "--rows", rows, "--eval-fraction", "0"]
    assert preprocess([*argv, "--workers", "1"], out=open(os.devnull, "w")) == 0
    # the config's eval data; the same file by --data; its preprocessed form (all of it)
    for extra in ([], ["--data", held], ["--data", pre]):
        assert main(["predict", "--model", str(tmp_path), "--out", str(out), *extra]) == 0
        assert np.array_equal(np.load(out), ref), extra


# ---- export ----------------------------------------------------------------------------------
def test_export_fp32_equals_the_trained_model(trained: SimpleNamespace) -> None:
    art = _export(trained, "none")
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["dense"]["format"] == "torch.export"
    assert [f["name"] for f in manifest["features"]] == ["t0", "t1", "t2"]
    got = _serve_eval(trained, "none")
    assert float((got - trained.probs).abs().max()) <= 1e-6


def test_mean_pooling_weights_empty_bags_and_torchscript(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mean pooling, per-id weights and empty bags in the loader; the TorchScript fallback."""
    from neorec.builder import build_dlrm
    from neorec.sparse import SparseFeatures

    cfg = tiny_cfg(tmp_path, "embedding.pooling='mean'", "model.interaction='dcn'")
    model = build_dlrm(cfg)
    save_model(model, cfg, tmp_path / "model")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("export is not available")

    monkeypatch.setattr(torch.export, "export", refuse)
    art = export_model(tmp_path, tmp_path / "art")
    assert json.loads((art / "manifest.json").read_text())["dense"]["format"] == "torchscript"
    g = torch.Generator().manual_seed(0)
    b, keys = 16, ["t0", "t1", "t2"]
    lengths = torch.randint(0, 4, (3 * b,), generator=g)
    lengths[:3] = 0  # empty bags: zeros, as the model pools them
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g)
    dense = torch.randn(b, 13, generator=g)
    with torch.no_grad():
        want = torch.sigmoid(model(dense, SparseFeatures(keys, values, lengths, weights)))
    sparse = {}
    for f in keys:
        v, ln, w = SparseFeatures(keys, values, lengths, weights).feature(f)
        assert w is not None
        sparse[f] = (ln.numpy(), v.numpy(), w.numpy())
    got = _serving(art).load(str(art))(dense.numpy(), sparse)
    assert np.abs(got - want.numpy()).max() <= 1e-6


@pytest.mark.parametrize("q", ["fp16", "int8", "int4", "int2"])
def test_export_quantized_within_bounds(trained: SimpleNamespace, q: str) -> None:
    got = _serve_eval(trained, q)
    ne = binary_metrics(trained.probs, trained.labels)["ne"]
    ne_q = binary_metrics(got, trained.labels)["ne"]
    change = abs(ne_q / ne - 1)
    diff = float((got - trained.probs).abs().max())
    print(f"{q}: eval NE {ne:.6f} -> {ne_q:.6f} ({100 * change:.4f}%), max prob change {diff:.2e}")
    assert 0 < change <= NE_BOUND[q]  # quantized: not the fp32 tables, and close to them
    assert float((got - trained.probs).abs().max()) <= PROB_BOUND[q]
    art = _export(trained, q)
    tables = _manifest(trained, q)["tables"] if q != "fp16" else []
    for t in tables:  # per row: dim * bits / 8 bytes of codes + float16 scale, offset
        rows = np.load(art / t["files"]["rows"])
        assert rows.dtype == np.uint8 and rows.shape == (t["rows"], t["dim"] * t["bits"] // 8 + 4)


def _manifest(trained: SimpleNamespace, q: str) -> dict[str, Any]:
    return dict(json.loads((_export(trained, q) / "manifest.json").read_text()))


def test_export_loads_without_neorec(trained: SimpleNamespace, tmp_path: Path) -> None:
    art = _export(trained, "int8")
    batch = next(iter(trained.trainer.source.eval_batches()))
    dense, sparse = _inputs(batch)
    arrays = {f"l_{k}": v[0] for k, v in sparse.items()} | {
        f"i_{k}": v[1] for k, v in sparse.items()
    }
    np.savez(tmp_path / "in.npz", dense=dense, **arrays)
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        sys.modules["neorec"] = None  # as where neorec is not installed: serving.py's own path
        sys.path.insert(0, {str(art)!r})
        import serving
        predict = serving.load({str(art)!r})
        z = np.load("in.npz")
        sparse = {{f: (z["l_" + f], z["i_" + f]) for f in predict.features}}
        np.save("out.npy", predict(z["dense"], sparse))
        bad = sorted(m for m, v in sys.modules.items() if v and m.split(".")[0] == "neorec")
        assert not bad, bad
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    inproc = _serving(art).load(str(art), fused=False)(dense, sparse)
    assert np.array_equal(np.load(tmp_path / "out.npy"), inproc)
    fused = _serving(art).load(str(art))(dense, sparse)  # neorec's kernel: the same sums
    assert np.abs(fused - inproc).max() <= 1e-6


# ---- errors ------------------------------------------------------------------------------------
def _copy(trained: SimpleNamespace, tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(trained.run / "model", dst)
    return dst


def _reseal(model_dir: Path, edit: Any) -> None:
    info = json.loads((model_dir / "model.json").read_text())
    info.pop("checksum")
    edit(info)
    (model_dir / "model.json").write_bytes(seal_manifest(info))


def _ckpt(model_dir: Path) -> Path:
    return next(p for p in model_dir.iterdir() if p.name.startswith("ckpt-"))


def test_model_dir_faults(trained: SimpleNamespace, tmp_path: Path) -> None:
    c = campaign("model dirs")
    run = str(trained.run)
    c.expect_error("missing path", lambda: load_model(tmp_path / "nope"), "no such model")
    (tmp_path / "file").write_text("x")
    c.expect_error("a file", lambda: load_model(tmp_path / "file"), "not a directory")
    (tmp_path / "emptyrun").mkdir()
    c.expect_error("run without model", lambda: load_model(tmp_path / "emptyrun"), "no saved")

    m = _copy(trained, tmp_path, "unfinished")
    (m / "model.json").unlink()
    c.expect_error("no model.json", lambda: load_model(m), "did not finish")
    m = _copy(trained, tmp_path, "edited")
    info = json.loads((m / "model.json").read_text())
    info["step"] += 1
    (m / "model.json").write_text(json.dumps(info))
    c.expect_error("edited model.json", lambda: load_model(m), "checksum mismatch")
    m = _copy(trained, tmp_path, "garbage")
    (m / "model.json").write_bytes(b"\x00\xff{")
    c.expect_error("garbage model.json", lambda: load_model(m), "unreadable")
    m = _copy(trained, tmp_path, "version")
    _reseal(m, lambda i: i.update(format_version=99))
    c.expect_error("newer format", lambda: load_model(m), "format_version 99")
    m = _copy(trained, tmp_path, "unknown-key")
    _reseal(m, lambda i: i["config"]["model"].update(layers=3))
    c.expect_error("unknown config key", lambda: load_model(m), "unknown key 'layers'")
    m = _copy(trained, tmp_path, "bad-value")
    _reseal(m, lambda i: i["config"]["model"].update(top_mlp=[16, 2]))
    c.expect_error("bad config value", lambda: load_model(m), "top_mlp must end with 1")
    m = _copy(trained, tmp_path, "other-rows")
    _reseal(m, lambda i: i["config"]["embedding"]["tables"][0].update(rows=300))
    c.expect_error("config vs checkpoint", lambda: load_model(m), "table t0 rows")
    m = _copy(trained, tmp_path, "no-ckpt")
    shutil.rmtree(_ckpt(m))
    c.expect_error("checkpoint removed", lambda: load_model(m), "no such checkpoint")
    m = _copy(trained, tmp_path, "truncated")
    piece = next((_ckpt(m) / "emb" / "t1").iterdir())
    piece.write_bytes(piece.read_bytes()[:-7])
    c.expect_error("truncated piece", lambda: load_model(m), ("t1", "truncated"))
    m = _copy(trained, tmp_path, "no-dense")
    (_ckpt(m) / "dense.pt").unlink()
    c.expect_error("dense.pt removed", lambda: load_model(m), "dense.pt: listed")

    # refusing to write over something: nothing there may be lost
    keep = tmp_path / "busy"
    keep.mkdir()
    (keep / "mine.txt").write_text("keep")
    model = trained.trainer.model
    c.expect_error(
        "save into a busy dir", lambda: save_model(model, trained.cfg, keep), "not empty"
    )
    c.expect_error("export into a busy dir", lambda: export_model(run, keep), "not an empty")
    intact = (keep / "mine.txt").read_text() == "keep" and len(list(keep.iterdir())) == 1
    c.record("busy dir kept", "handled" if intact else "data lost", str(list(keep.iterdir())))
    c.expect_error("bad quantize", lambda: export_model(run, tmp_path / "q", "int3"), "int8")

    out = str(tmp_path / "no" / "p.npy")
    argv = ["predict", "--model", run, "--out", out]
    c.expect_error("predict into a missing dir", lambda: main_raising(argv), "no such directory")
    p = str(tmp_path / "p.npy")
    for name, extra, match in (
        ("missing --data", ["--data", str(tmp_path / "nodata")], "--data"),
        ("--set of the model", ["--set", "model.top_mlp=[1]"], "is fixed"),
        ("--set unknown data key", ["--set", "data.nope=1"], "unknown key 'nope'"),
        ("--data TSV for another model", ["--data", str(tmp_path / "file")], "26 embedding"),
    ):
        argv = ["predict", "--model", run, "--out", p, *extra]
        c.expect_error(name, lambda a=argv: main_raising(a), match)  # type: ignore[misc]
    c.record("no output on error", "data lost" if Path(p).exists() else "handled", p)

    # the serving loader refuses bad input naming the feature (ValueError: it has no neorec)
    predict_fn = _serving(_export(trained, "none")).load(str(_export(trained, "none")))
    dense, sparse = _inputs(next(iter(trained.trainer.source.eval_batches())))
    lengths, ids = sparse["t1"]
    for name, d, s, match in (
        ("serving: id out of range", dense, {**sparse, "t1": (lengths, ids + 10_000)}, "t1"),
        ("serving: lengths sum", dense, {**sparse, "t1": (lengths, ids[:-1])}, "t1"),
        ("serving: missing feature", dense, {"t0": sparse["t0"]}, "missing ['t1', 't2']"),
        ("serving: dense shape", dense[:, :5], sparse, "[batch, 13]"),
    ):
        try:
            predict_fn(d, s)
            c.record(name, "silently accepted")
        except ValueError as e:
            ok = match in str(e) and "\n" not in str(e)
            c.record(name, "clear error" if ok else "crash", str(e))

    # two runs through a process: one line on stderr, exit 2
    for name, argv in (
        ("cli: eval of a missing run", ["eval", "--model", str(tmp_path / "nope")]),
        ("cli: export into a busy dir", ["export", "--model", run, "--out", str(keep)]),
    ):
        code = "import sys; from neorec.cli import main; sys.exit(main(sys.argv[1:]))"
        r = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        outcome, detail = judge_cli(r, "neorec: error:")
        if outcome == "clear error" and r.returncode != 2:
            outcome, detail = "crash", f"exit {r.returncode}: {detail}"
        c.record(name, outcome, detail)
    c.check()


def main_raising(argv: list[str]) -> None:
    """The command's handler with its ``NeorecError`` left to the caller."""
    from neorec.cli import build_parser

    args = build_parser().parse_args(argv)
    args.func(args)
