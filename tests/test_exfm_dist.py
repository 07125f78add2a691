"""ExFM students with the aux head and the Student Adapter distributed and towered, against the
one-process student (the specification) trained on the same global batches: 2 gloo ranks flat
(DDP over the dense arch, aux head and adapter), towered (SPTT) under ``tower_sync`` "world"
(parametrised tower modules: DDP with unused parameters) and "host", and a towered model in one
process; each with the C loss kernel and with the torch path. Per-step losses (serving, aux,
adapter; the mean of the ranks') and final weights (dense arch with aux head and adapter, tower
modules, tables) equal to rtol 1e-5, atol 1e-6 (float rounding: N ranks sum the batch in another
order)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_util import run_ranks

import neorec.train.distill as distill
import neorec.train.losses as losses
import neorec.train.steps as steps
from neorec.builder import build_dlrm, dense_optimizer
from neorec.config import (
    Config,
    DataConfig,
    DistillConfig,
    EmbeddingConfig,
    ModelConfig,
    TableConfig,
    TowersConfig,
    TrainConfig,
)
from neorec.data.batch import Batch
from neorec.ops.exfm_losses import native_lib
from neorec.ops.fastpath import RAN
from neorec.sparse import SparseFeatures

pytestmark = pytest.mark.skipif(native_lib() is None, reason="no C compiler")

TABLES = [
    TableConfig(name="a", rows=37, dim=8),
    TableConfig(name="b", rows=5, dim=8, features=["b", "b2"]),
    TableConfig(name="c", rows=50, dim=8),
    TableConfig(name="d", rows=10, dim=8),
]
# in table order: with identity tower modules the towered model is the flat one
GROUPS = [["a", "b"], ["c", "d"]]
B, STEPS, TOL = 16, 3, dict(rtol=1e-5, atol=1e-6)


def _cfg(towers: str = "", adapter: bool = True) -> Config:
    """The student: aux head (T = 2) and, ``adapter``, the Student Adapter reading the dense
    features; ``towers``: "" (flat) or the tower module kind of ``GROUPS``."""
    tw = TowersConfig(count=2, groups=GROUPS, module=towers, out_vectors=2) if towers else None
    return Config(
        model=ModelConfig(num_dense=5, bottom_mlp=[8, 8], top_mlp=[8, 4, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in TABLES], optimizer="rowwise_adagrad", lr=0.1
        ),
        data=DataConfig(batch_size=B),
        train=TrainConfig(dense_optimizer="sgd", dense_lr=0.1, seed=7),
        distill=DistillConfig(
            enabled=True,
            aux_head=True,
            aux_weight=0.7,
            adapter=adapter,
            adapter_size=4,
            temperature=2.0,
        ),  # fmt: skip
        towers=tw if tw is not None else TowersConfig(),
    )


def _batch(step: int) -> Batch:
    """Global batch ``step`` with FM logits."""
    g = torch.Generator().manual_seed(100 + step)
    values, lengths = [], []
    for t in TABLES:
        for _ in t.features:
            lens = torch.randint(0, 4, (B,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.rows, (int(lens.sum()),), generator=g))
    feats = [f for t in TABLES for f in t.features]
    sparse = SparseFeatures(feats, torch.cat(values), torch.cat(lengths))
    labels = (torch.rand(B, generator=g) < 0.4).float()
    return Batch(torch.randn(B, 5, generator=g), sparse, labels, torch.randn(B, generator=g) * 2)


def _train(
    model, cfg: Config, fast: bool, lo: int = 0, hi: int = B, ranks: bool = False
) -> list[list[float]]:
    """Train ``STEPS`` steps on samples [lo, hi) of each global batch; per step the (serving,
    aux, adapter) losses, with ``ranks`` the mean of the ranks'. Asserts the C kernel ran every
    step exactly when ``fast``."""
    seen: list = []

    def record(*args, **kw):
        out = distill.distill_loss(*args, **kw)
        seen.append(out)
        return out

    opt = dense_optimizer(cfg.train, model.dense_parameters())
    ran = RAN["exfm_losses.forward"]
    real, losses.distill_loss = losses.distill_loss, record
    was, distill.FAST_LOSSES = distill.FAST_LOSSES, fast
    try:
        for step in range(1, STEPS + 1):
            steps.train_step(
                model, opt, _batch(step).slice(lo, hi), step, loss_fn=losses.make_loss(cfg.distill)
            )
    finally:
        losses.distill_loss, distill.FAST_LOSSES = real, was
    assert RAN["exfm_losses.forward"] - ran == (STEPS if fast else 0), "kernel / torch path"
    none = torch.zeros(())
    rows = torch.stack(
        [torch.stack([d.serving, d.aux, none if d.adapter is None else d.adapter]) for d in seen]
    )
    if ranks:
        dist.all_reduce(rows)
        rows /= dist.get_world_size()
    return rows.tolist()


def _dense(model) -> dict[str, torch.Tensor]:
    """The dense state (dense arch with aux head / adapter, tower modules) under the keys of
    the flat model's dense arch (``dense_arch.`` dropped)."""
    part = model.dense_part
    state = part.state_dict()
    return {k.removeprefix("dense_arch."): v for k, v in state.items()}


def _same(where: str, losses, ref_losses, dense, ref_dense, tables, ref_tables) -> None:
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), **TOL, msg=lambda m: f"{where} loss: {m}"
    )
    assert dense.keys() == ref_dense.keys(), (where, sorted(dense), sorted(ref_dense))
    assert any(k.startswith("aux_head.") for k in dense), where
    for k in ref_dense:
        torch.testing.assert_close(
            dense[k], ref_dense[k], **TOL, msg=lambda m, k=k: f"{where} dense {k}: {m}"
        )
    for n, w in tables.items():
        torch.testing.assert_close(w, ref_tables[n], **TOL, msg=lambda m, n=n: f"{where} {n}: {m}")


def _reference(cfg: Config, fast: bool):
    """The one-process model of ``cfg`` trained on the global batches: (losses, dense, tables)."""
    ref = build_dlrm(cfg)
    init = {k: v.clone() for k, v in _dense(ref).items() if k.startswith(("aux_head.", "adapter."))}
    losses = _train(ref, cfg, fast)
    trained = _dense(ref)
    assert all(not torch.equal(v, trained[k]) for k, v in init.items()), "aux head / adapter"
    return losses, _dense(ref), {t.name: ref.ebc.table_weight(t.name).clone() for t in TABLES}


def _ranks(rank: int, world: int) -> None:
    from neorec.builder import distributed_model, towered_model
    from neorec.sharding.fixed_plan import plan_by_type

    b = B // world
    lo, hi = rank * b, (rank + 1) * b
    plan = plan_by_type(TABLES, world, world, "row_wise")
    for fast in (True, False):
        flat = _cfg()
        ref = _reference(flat, fast)
        dm = distributed_model(flat, plan)
        got = _train(dm, flat, fast, lo, hi, ranks=True)
        tables = {t.name: dm.ebc.gather_table(t.name) for t in TABLES}
        _same(f"flat fast={fast}", got, ref[0], _dense(dm), ref[1], tables, ref[2])
        # identity towers (the flat model) under "host"; mlp towers under "world": the other
        # host's tower module is unused on this rank
        for kind, sync in (("identity", "host"), ("mlp", "world")):
            cfg = _cfg(kind)
            spec = ref if kind == "identity" else _reference(cfg, fast)
            tm = towered_model(cfg, GROUPS, tower_sync=sync)
            got = _train(tm, cfg, fast, lo, hi, ranks=True)
            tm.sync_replicas()
            mine = {n: tm.ebc.gather_table(n) for n in GROUPS[tm.host]}
            where = f"towers {kind} {sync} fast={fast} rank {rank}"
            _same(where, got, spec[0], _dense(tm), spec[1], mine, spec[2])


def test_distributed_and_towered_students_equal_one_process():
    run_ranks(_ranks, 2)


def test_towered_student_in_one_process_equals_flat():
    """``TowerDLRM`` with identity tower modules (one process) trains as the flat student, with
    the aux head alone and with the adapter."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: tiny ops, no thread pool to wait for
    try:
        for adapter in (True, False):
            towered = _cfg("identity", adapter=adapter)
            assert type(build_dlrm(towered)).__name__ == "TowerDLRM"
            for fast in (True, False):
                ref, got = _reference(_cfg(adapter=adapter), fast), _reference(towered, fast)
                where = f"one process adapter={adapter} fast={fast}"
                _same(where, got[0], ref[0], got[1], ref[1], got[2], ref[2])
    finally:
        torch.set_num_threads(threads)
