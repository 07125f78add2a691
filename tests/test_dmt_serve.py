"""DMT loose ends on 2 gloo ranks (2 hosts x 1): a towered run's saved model predicts, exports and
serves as the unsharded ``TowerDLRM`` does; the overlapped pipeline stages SPTT's ids exchange and
trains bitwise as the sequential one and as no staging; DDP does not warn about unused parameters;
``save_model`` of ``tower_sync="host"`` gathers every host's tower module. One launch."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_util import run_ranks
from test_serve import _inputs, _serving
from test_trainer import tiny_cfg

from neorec.cli import main
from neorec.serve import load_model, save_model
from neorec.serve.evaluate import eval_data, evaluate_model

GROUPS = "[['t0', 't2'], ['t1']]"
STEPS = 5


def _cfg(root: Path, *extra: str) -> Any:
    return tiny_cfg(root, f"towers.groups={GROUPS}", "towers.module='dot'", *extra)


def _batches(cfg: Any, rank: int, world: int) -> list[Any]:
    """This rank's slices of the first ``STEPS`` global train batches."""
    from neorec.builder import data_source

    b = cfg.data.batch_size // world
    batches = data_source(cfg).train_batches(0)
    return [g.slice(rank * b, (rank + 1) * b) for _, g in zip(range(STEPS), batches)]


def _pipelined(cfg: Any, kind: str, rank: int, world: int) -> tuple[Any, ...]:
    """Train ``STEPS`` steps of the SPTT model through pipeline ``kind`` (``none``: no staging,
    each forward exchanges its ids itself)."""
    from neorec.builder import dense_optimizer, towered_model
    from neorec.distributed.comm import Chain
    from neorec.train.pipeline import make_pipeline
    from neorec.train.trainer import train_step

    model = towered_model(cfg, cfg.towers.groups)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    batches = _batches(cfg, rank, world)
    losses = []
    if kind == "none":
        losses = [train_step(model, opt, b, i + 1) for i, b in enumerate(batches)]
    else:
        pipe = make_pipeline(kind, model, opt, batches, train_step)
        while (out := pipe.progress(len(losses) + 1)) is not None:
            losses.append(out.loss)
            if kind == "overlapped" and len(losses) < STEPS:
                # the next batch was staged, and its ids arrived during this step's forward
                assert len(model._staged) == 1, model._staged
                assert not isinstance(model._staged[0][1], Chain)
        pipe.close()
    assert not model._staged
    test = batches[0]
    with torch.no_grad():
        preds = model(test.dense, test.sparse)
    return torch.stack(losses), model.state_dict(), preds


def _stderr_of(fn: Any) -> str:
    """What ``fn()`` wrote to this process's fd 2 (C++ warnings bypass Python's sys.stderr)."""
    with tempfile.TemporaryFile(mode="w+b") as cap:
        saved = os.dup(2)
        os.dup2(cap.fileno(), 2)
        try:
            fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        cap.seek(0)
        return cap.read().decode(errors="replace")


def _rank(rank: int, world: int, root: str) -> None:
    from neorec.builder import dense_optimizer, towered_model
    from neorec.train.trainer import Trainer, train_step

    base = Path(root)
    # DDP's warning, first in the process (c10 warns once): identity towers have no parameters
    for module in ("identity", "dot"):
        cfg = _cfg(base / "w", f"towers.module='{module}'")

        def steps(cfg: Any = cfg) -> None:
            model = towered_model(cfg, cfg.towers.groups)
            opt = dense_optimizer(cfg.train, model.dense_parameters())
            for i, b in enumerate(_batches(cfg, rank, world)[:2]):
                train_step(model, opt, b, i + 1)

        err = _stderr_of(steps)
        assert "find_unused_parameters" not in err and "unused param" not in err, err[-2000:]

    # the pipelines: bitwise the same training with or without staging
    cfg = _cfg(base / "p")
    runs = {k: _pipelined(cfg, k, rank, world) for k in ("sequential", "overlapped", "none")}
    seq = runs["sequential"]
    for kind in ("overlapped", "none"):
        got = runs[kind]
        assert torch.equal(got[0], seq[0]), f"{kind}: losses differ"
        assert got[1].keys() == seq[1].keys()
        for k in seq[1]:
            assert torch.equal(got[1][k], seq[1][k]), f"{kind}: {k} differs"
        assert torch.equal(got[2], seq[2]), f"{kind}: predictions differ"

    # a towered training run saves its model (the trainer's own save_model)
    trainer = Trainer(_cfg(base / "run", "train.steps=6"))
    result = trainer.fit()
    if rank == 0:
        torch.save(result["eval"], base / "run" / "eval.pt")

    # tower_sync = "host": each rank holds a stale copy of the other host's tower module
    cfg = _cfg(base / "h")
    model = towered_model(cfg, cfg.towers.groups, tower_sync="host")
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    for i, b in enumerate(_batches(cfg, rank, world)[:3]):
        train_step(model, opt, b, i + 1)
    mine = model.dense_part.towers[model.host].state_dict()  # type: ignore[index]
    torch.save(mine, base / f"tower{model.host}.pt")
    save_model(model, cfg, base / "host_model")


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dmt")
    run_ranks(_rank, 2, str(root))
    return root


@pytest.mark.bitwise
def test_sptt_pipelines_and_no_ddp_warning(launched: Path) -> None:
    """(checked in the ranks: the overlapped pipeline's staged ids exchange trains bitwise as
    the sequential pipeline and as unstaged steps; no DDP warning with or without tower
    parameters)"""
    assert (launched / "run" / "model" / "model.json").exists()


def test_towered_model_predicts_exports_and_serves(launched: Path, tmp_path: Path) -> None:
    from neorec.modules.towers import TowerDLRM

    run = launched / "run"
    model, cfg = load_model(run, dense_blocks=False)
    assert isinstance(model, TowerDLRM)
    info = json.loads((run / "model" / "model.json").read_text())
    assert info["world_size"] == 2
    data = eval_data(cfg)
    want = torch.load(run / "eval.pt")  # the 2-rank SPTT model's own eval
    got = evaluate_model(model, cfg, data)
    for k in ("auc", "ne", "calibration"):
        assert got[k] == pytest.approx(want[k], rel=1e-5), k

    # neorec predict = the TowerDLRM's forward on the same batches
    out = tmp_path / "preds.npy"
    assert main(["predict", "--model", str(run), "--out", str(out)]) == 0
    preds = np.load(out)
    with torch.no_grad():
        spec = torch.cat([torch.sigmoid(model(b.dense, b.sparse)) for b in data.batches()])
    assert preds.shape == (cfg.data.eval_samples,)
    np.testing.assert_allclose(preds, spec.numpy(), rtol=0, atol=1e-6)

    # neorec export: the standalone loader serves what neorec predict predicts
    art = tmp_path / "art"
    assert main(["export", "--model", str(run), "--out", str(art)]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["dense"]["format"] == "torch.export", manifest["dense"]
    serve = _serving(art).load(str(art))
    served = np.concatenate([serve(*_inputs(b)) for b in data.batches()])
    np.testing.assert_allclose(served, preds, rtol=0, atol=1e-6)


def test_host_synced_towers_are_saved_from_their_host(launched: Path) -> None:
    model, _ = load_model(launched / "host_model")
    for t in range(2):
        want = torch.load(launched / f"tower{t}.pt")
        got = model.towers[t].state_dict()
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), f"tower {t} {k}"
