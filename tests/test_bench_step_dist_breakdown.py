"""``neorec bench step --breakdown --nproc N``: the distributed phase model's bytes, the marks
leaving the sharded step bitwise unchanged (2 gloo ranks), the JSON's phases. No timing is
asserted."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from neorec.bench import step
from neorec.bench.floors import Floors
from neorec.bench.step_phases import (
    DIST_PHASES,
    Gemm,
    LocalLookup,
    StepShape,
    dist_phase_work,
    phase_floor_ms,
    phase_work,
)
from tests.dist_util import run_ranks

SETS = ["model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]"]
TINY = ["--tables", "4", "--rows", "200", "--dim", "8", "--batch", "32", "--pooling", "3"]
FAST = ["--iters", "2", "--warmup", "1", "--gemm-n", "64", "--floor-mb", "1"]
TYPES = "sharding.types={t0='table_wise', t1='row_wise', t2='column_wise', t3='data_parallel'}"


def test_dist_phase_model_places_each_collective_and_the_shards() -> None:
    """One rank: 2 units (16 ids of dim 4, 6 ids of dim 2) over 8 bags, 2 tables (5 and 3 rows
    touched), rowwise Adagrad state; each collective's bytes in its phase at the copy rate."""
    g = Gemm("top.0", m=4, k=5, n=2)
    local = StepShape(batch=4, features=2, dim=4, ids=10, unique_rows=9, num_dense=5,
                      gemms=(g,), dense_params=12)  # fmt: skip
    lk = LocalLookup(bags=8, unit_ids=(16, 6), unit_dims=(4, 2), table_rows=(5, 3),
                     table_dims=(4, 2))  # fmt: skip
    sent = {"lengths": 8.0, "ids": 40.0, "fwd_pooled": 64.0, "bwd_grads": 64.0,
            "dp_allgather": 10.0, "allreduce_dense": 48.0, "unknown": 1e9}  # fmt: skip
    w = dist_phase_work(local, lk, sent, {4: 4, 2: 4})
    assert list(w) == list(DIST_PHASES)
    assert w["input_dist"].copy == 48 and w["output_dist"].copy == 64
    assert w["grad_dist"].copy == 74 and w["allreduce"].copy == 48
    assert w["tbe_forward"].copy == 0 and w["dense_forward"].copy == 0
    # per unit: ids and offsets (8 B each), rows read (4 B per element), the pooled block written
    fwd = 8 * (16 + 8) + 4 * 4 * 16 + 4 * 8 * 4 + 8 * (6 + 8) + 4 * 2 * 6 + 4 * 8 * 2
    assert w["tbe_forward"].bytes == fwd
    bwd = (4 * 8 * 4 + 8 * 16) + (4 * 8 * 2 + 8 * 6) + 2 * 5 * (16 + 4) + 2 * 3 * (8 + 4)
    assert w["tbe_backward_update"].bytes == bwd
    one = phase_work(local)  # the dense side: one process with the rank's batch
    for p in ("batch_prep", "dense_forward", "loss", "dense_backward", "dense_optimizer"):
        assert w[p].bytes == one[p].bytes and w[p].flops == one[p].flops
    floors = Floors(triad_gbs=1.0, copy_gbs=2.0, gemm_gflops={"fp32": 1.0, "bf16": 1.0})
    floor, bound = phase_floor_ms(w["allreduce"], floors)
    assert bound == "copy" and floor == pytest.approx(floors.copy_ms(48))


def _train(rank: int, world: int, cfg: Any, marked: bool) -> tuple[list, list]:
    """Three pipeline steps of a fresh model on the rank's slices; with ``marked`` the bench's
    marks on (the timer active, the staging wrapped, the collection's and the step's marks)."""
    from neorec.bench.step_dist_breakdown import _wrap_staging, attach_dist_timer
    from neorec.bench.step_timing import PhaseTimer, fresh_batches
    from neorec.builder import dense_optimizer, distributed_model, resolve_plan
    from neorec.train.pipeline import make_pipeline
    from neorec.train.steps import LossGuard, Step

    model = distributed_model(cfg, resolve_plan(cfg, world))
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    timer = PhaseTimer()
    timer.active = marked
    guard, hooks = LossGuard(), []
    if marked:
        _wrap_staging(model, timer)
        guard, around = attach_dist_timer(model, opt, timer)
        hooks.append(around)
    seen: list[set[str]] = []

    class Seen:
        def before_step(self, step: int) -> None:
            pass

        def after_step(self, step: int, loss: torch.Tensor) -> None:
            seen.append(set(timer.cur))

    b = cfg.data.batch_size // world
    batches = [x.slice(rank * b, (rank + 1) * b) for x in step.make_batches(cfg, 3, 1.05)]
    pipe = make_pipeline(
        "overlapped", model, opt, fresh_batches(batches), Step(guard=guard), hooks=[Seen(), *hooks]
    )
    losses = []
    for i in range(3):
        timer.begin()
        out = pipe.progress(i + 1)
        assert out is not None
        losses.append(out.loss)
    pipe.close()
    if marked:  # every phase of a distributed step marked, in every step
        assert all(s == set(DIST_PHASES) for s in seen), seen
    state = [p.detach().clone() for p in model.parameters()]
    return losses, state + [x.clone() for x in model.buffers()]


def _same_with_and_without_marks(rank: int, world: int, cfg: Any) -> None:
    l0, s0 = _train(rank, world, cfg, marked=False)
    l1, s1 = _train(rank, world, cfg, marked=True)
    assert all(torch.equal(x, y) for x, y in zip(l0, l1, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(s0, s1, strict=True))


@pytest.mark.bitwise
def test_marks_leave_the_distributed_step_bitwise_unchanged() -> None:
    """Two gloo ranks, a plan of four sharding types: the same losses, weights and optimizer
    state with the breakdown's marks as without."""
    from neorec.config import load_config

    sets = ["embedding.num_tables=4", "embedding.rows=200", "embedding.dim=8", "data.batch_size=32"]
    cfg = load_config(None, [*sets, *SETS, TYPES])
    run_ranks(_same_with_and_without_marks, 2, cfg)


def test_dist_breakdown_json_has_every_phase(capsys: pytest.CaptureFixture[str]) -> None:
    sets = [x for s in SETS for x in ("--set", s)]
    argv = [*TINY, "--breakdown", "--nproc", "2", *FAST, *sets, "--set", "comm.transport=gloo"]
    assert step.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "step_breakdown" and out["nproc"] == 2
    assert out["transport"] == "gloo" and out["local_batch"] == 16
    assert [p["name"] for p in out["phases"]] == list(DIST_PHASES)
    for p in out["phases"]:
        assert p["ms"] >= 0 and p["ms_max_over_ranks"] >= p["ms"] * (1 - 1e-4)  # (rounding)
        assert p["floor_ms"] > 0 and len(p["ms_by_rank"]) == 2
    by = {p["name"]: p for p in out["phases"]}
    assert by["output_dist"]["bound"] == "copy" and by["allreduce"]["bound"] == "copy"
    assert out["phase_sum_over_step"] == pytest.approx(out["phase_sum_ms"] / out["step_ms"], 1e-3)
    assert len(out["phase_sum_over_step_by_rank"]) == 2
    assert out["collectives_not_modelled"] == []


@pytest.mark.parametrize(
    ("extra", "match"),
    [(["--nproc", "3"], "divisible"), (["--nproc", "0"], ">= 2"),
     (["--nproc", "2", "--set", "lowp.mode=auto"], "lowp.mode")],
)  # fmt: skip
def test_dist_breakdown_refuses_in_one_line(extra: list[str], match: str) -> None:
    from neorec.errors import ConfigError

    with pytest.raises(ConfigError, match=match) as e:
        step.main([*TINY, "--breakdown", *extra])
    assert "\n" not in str(e.value)


def test_nproc_without_breakdown_is_refused_in_one_line() -> None:
    from neorec.errors import ConfigError

    with pytest.raises(ConfigError, match="--nproc 2: only the breakdown") as e:
        step.main([*TINY, "--nproc", "2"])
    assert "\n" not in str(e.value)
