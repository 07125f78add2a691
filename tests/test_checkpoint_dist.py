"""Checkpoints under gloo ranks: exact resume with 2 ranks; save under 2, restore under 4 and 1."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from dist_util import run_ranks

from neorec.builder import build_dlrm, dense_optimizer, distributed_model
from neorec.checkpoint import CheckpointManager
from neorec.config import load_config
from neorec.sharding.fixed_plan import plan_by_type
from neorec.train.trainer import Trainer

# DP, CW (row-wise Adagrad across column slices), RW with uneven rows, TW: every path of the
# sharded module writes and reads pieces.
PLAN_A = {"t0": "data_parallel", "t1": "column_wise", "t2": "row_wise", "t3": "table_wise"}
PLAN_B = {"t0": "row_wise", "t1": "table_wise", "t2": "column_wise", "t3": "data_parallel"}


def cfg_for(run_dir: Path, types: dict[str, str], *extra: str):
    over = [f"sharding.types.{k}='{v}'" for k, v in types.items()]
    return load_config(
        overrides=[
            "embedding.num_tables=4",
            "embedding.rows=101",
            "embedding.dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=32",
            "data.train_samples=640",
            "data.eval_samples=128",
            f"train.run_dir='{run_dir}'",
            "train.progress=false",
            "checkpoint.fsync=false",
            "checkpoint.bits=32",
            "checkpoint.opt_bits=32",
            "checkpoint.policy=consecutive",
            *over,
            *extra,
        ]
    )


def _tables(ebc) -> dict[str, torch.Tensor]:
    return {t.name: ebc.gather_table(t.name) for t in ebc.tables}


def _predictions(model, cfg, rank: int, world: int) -> torch.Tensor:
    from neorec.data.synthetic import SyntheticClickData

    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    batch = data.batch("eval", 0, cfg.data.batch_size)
    b = batch.size // world
    with torch.no_grad():
        mine = model(*_slice(batch, rank * b, (rank + 1) * b))
    if world == 1:
        return mine
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine)
    return torch.cat(parts)


def _slice(batch, lo, hi):
    s = batch.slice(lo, hi)
    return s.dense, s.sparse


def _train_phases(rank: int, world: int, out: str, *phases: str) -> None:
    for phase in phases:  # one spawn of the ranks for several phases
        _train_phase(rank, world, out, phase)


def _train_phase(rank: int, world: int, out: str, phase: str) -> None:
    run = Path(out) / ("straight" if phase == "straight" else "ckpt")
    extra = {
        "straight": ["train.steps=11"],
        "first": ["train.steps=6", "checkpoint.every_steps=3"],
        "resume": ["train.steps=11", "checkpoint.every_steps=3", "checkpoint.resume=latest"],
    }[phase]
    trainer = Trainer(cfg_for(run, PLAN_A, "train.eval_every=5", *extra))
    result = trainer.fit()
    model = trainer.model
    ebc = model.ebc
    state = {k: v.clone() for k, v in ebc.state_dict().items()}
    dense = {k: v.clone() for k, v in model.dense_arch.module.state_dict().items()}
    tables = _tables(ebc)
    preds = _predictions(model, trainer.cfg, rank, world)
    keys = ("eval", "evals")
    saved = {"state": state, "dense": dense, "tables": tables, "preds": preds}
    saved["metrics"] = {k: result[k] for k in keys} | {"loss": result["train"]["final_loss"]}
    torch.save(saved, Path(out) / f"{phase}-{rank}.pt")


def _restore_phase(rank: int, world: int, out: str) -> None:
    cfg = cfg_for(Path(out) / "r4", PLAN_B)
    plan = plan_by_type(cfg.embedding.tables, world, 2, "table_wise", PLAN_B)
    model = distributed_model(cfg, plan)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    root = str(Path(out) / "ckpt" / "checkpoints")
    CheckpointManager(cfg.checkpoint, model, opt, root).restore(_step6(Path(out)))
    tables = _tables(model.ebc)
    preds = _predictions(model, cfg, rank, world)
    if rank == 0:
        torch.save({"tables": tables, "preds": preds}, Path(out) / "reshard-4.pt")


def test_resume_exact_and_reshard(tmp_path):
    out = str(tmp_path)
    run_ranks(_train_phases, 2, out, "straight", "first")
    first = torch.load(tmp_path / "first-0.pt")
    run_ranks(_train_phases, 2, out, "resume")
    for rank in range(2):
        a = torch.load(tmp_path / f"straight-{rank}.pt")
        b = torch.load(tmp_path / f"resume-{rank}.pt")
        for part in ("state", "dense", "tables"):
            assert a[part].keys() == b[part].keys()
            for k in a[part]:
                assert torch.equal(a[part][k], b[part][k]), (rank, part, k)
        assert torch.equal(a["preds"], b["preds"])
        assert a["metrics"] == b["metrics"]

    # The checkpoint at step 6 (the end of "first", plan A on 2 ranks), restored under 4 ranks
    # and plan B, and in one process (the unsharded module): same tables, same predictions.
    run_ranks(_restore_phase, 4, out)
    cfg = cfg_for(tmp_path / "r1", {})
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    mgr = CheckpointManager(cfg.checkpoint, model, opt, str(tmp_path / "ckpt" / "checkpoints"))
    assert mgr.restore(_step6(tmp_path))["step"] == 6
    four = torch.load(tmp_path / "reshard-4.pt")
    for t in cfg.embedding.tables:
        w = model.ebc.table_weight(t.name)
        assert torch.equal(w, first["tables"][t.name]), t.name
        assert torch.equal(w, four["tables"][t.name]), t.name
    preds1 = _predictions(model, cfg, 0, 1)
    # sharded sums (row-wise partial sums) may reassociate: float tolerance, as test_distributed
    torch.testing.assert_close(four["preds"], first["preds"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(preds1, first["preds"], rtol=1e-6, atol=1e-6)


def _step6(tmp_path: Path) -> str:
    from neorec.checkpoint import list_checkpoints, open_storage

    hist = list_checkpoints(open_storage(str(tmp_path / "ckpt" / "checkpoints")))
    return str(tmp_path / "ckpt" / "checkpoints" / next(m["name"] for m in hist if m["step"] == 6))
