"""``neorec bench step --breakdown`` and ``--compare torchrec``: the phase model's bytes and
flops, the summary's sums, the timing hooks leaving the step's numbers alone, the JSON's fields.
No timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from neorec.bench import step
from neorec.bench.floors import Floors, measure_floors
from neorec.bench.step_phases import PHASES, Gemm, StepShape, gemm_sites, phase_work, summarize
from neorec.config import ModelConfig
from neorec.modules.dlrm import DenseArch

TINY = ["--tables", "2", "--rows", "200", "--dim", "8", "--batch", "32", "--pooling", "3"]
FAST = ["--iters", "2", "--warmup", "1", "--gemm-n", "64", "--floor-mb", "1"]


def test_phase_model_counts_bytes_and_flops_of_a_toy_step() -> None:
    """B=2 samples, F=3 features of dim 4, 12 ids over 10 distinct rows, one [2,5]x[5,4] GEMM."""
    g = Gemm("top.0", m=2, k=5, n=4)
    s = StepShape(batch=2, features=3, dim=4, ids=12, unique_rows=10, num_dense=5, gemms=(g,),
                  dense_params=24, emb_bytes=4, row_state_bytes=4, dense_states=1)  # fmt: skip
    w = phase_work(s)
    assert list(w) == list(PHASES)
    assert g.flops == 2 * 2 * 5 * 4 and g.operand_bytes == 4 * (10 + 8 + 20)
    assert w["batch_prep"].bytes == 8 * (12 + 6) + 4 * 2 * 6
    # ids + offsets, 12 rows of 4 floats, the [2, 12] pooled output
    assert w["tbe_forward"].bytes == 8 * 18 + 12 * 16 + 2 * 12 * 4
    assert w["dense_forward"].flops == {"fp32": 80.0}
    assert w["dense_backward"].flops == {"fp32": 160.0}
    assert w["dense_backward"].bytes == 2 * w["dense_forward"].bytes
    # pooled gradient, ids, 10 rows and their state words read and written
    assert w["tbe_backward_update"].bytes == 2 * 12 * 4 + 8 * 12 + 2 * 10 * (16 + 4)
    assert w["dense_optimizer"].bytes == 4 * 24 * (3 + 2)


def test_gemm_sites_of_a_dense_arch_follow_its_modules_and_plan() -> None:
    m = ModelConfig(bottom_mlp=[16, 8], top_mlp=[32, 1], interaction="dot")
    arch = DenseArch(m, num_features=3, emb_dim=8)
    sites = {g.name: g for g in gemm_sites(arch, batch=10, precisions={"top.0": "bf16"})}
    assert set(sites) == {"bottom.0", "bottom.2", "interaction", "top.0", "top.2"}
    assert (sites["bottom.0"].m, sites["bottom.0"].k, sites["bottom.0"].n) == (10, 13, 16)
    gram = sites["interaction"]  # one [F+1, D] x [D, F+1] product per sample
    assert (gram.m, gram.k, gram.n, gram.count) == (4, 8, 4, 10)
    assert sites["top.0"].dtype == "bf16" and sites["top.2"].dtype == "fp32"
    assert sites["top.0"].k == arch.interaction.out_dim


def test_summary_sums_phases_and_floors() -> None:
    floors = Floors(triad_gbs=1.0, copy_gbs=1.0, gemm_gflops={"fp32": 1.0, "bf16": 4.0})
    g = Gemm("top.0", m=100, k=100, n=100, dtype="bf16")  # 2e6 flops: 0.5 ms at 4 GFLOP/s
    s = StepShape(batch=100, features=1, dim=1, ids=100, unique_rows=50, num_dense=1,
                  gemms=(g,), dense_params=0)  # fmt: skip
    work = phase_work(s)
    ms = {p: 1.0 for p in PHASES} | {"lowp_dispatch": 0.5}
    out = summarize(work, ms, floors, step_ms=8.0)
    by = {p["name"]: p for p in out["phases"]}
    assert by["dense_forward"]["bound"] == "flops"
    assert by["dense_forward"]["floor_ms"] == pytest.approx(max(0.5, g.operand_bytes / 1e6))
    assert by["lowp_dispatch"]["floor_ms"] == 0.0 and by["lowp_dispatch"]["over_floor"] is None
    assert out["phase_sum_ms"] == pytest.approx(7.5)
    assert out["phase_sum_over_step"] == pytest.approx(7.5 / 8.0)
    floor = sum(p["floor_ms"] for p in out["phases"])
    assert out["step_over_floor"] == pytest.approx(8.0 / floor, rel=1e-3)


def test_floors_are_positive_rates() -> None:
    f = measure_floors(array_mb=1, gemm_n=64, reps=1)
    assert f.triad_gbs > 0 and f.copy_gbs > 0 and set(f.gemm_gflops) == {"fp32", "bf16"}
    assert f.bytes_ms(f.triad_gbs * 1e9) == pytest.approx(1000.0)


@pytest.mark.bitwise
def test_timing_hooks_leave_the_step_bitwise_unchanged() -> None:
    """The same step with and without the timer attached: the same loss and weights, bitwise."""
    from neorec.bench.step_timing import PhaseTimer, attach_timer, hook_collection
    from neorec.builder import build_dlrm, dense_optimizer
    from neorec.config import load_config
    from neorec.train.steps import LossGuard, train_step

    sets = ["embedding.num_tables=2", "embedding.rows=200", "data.batch_size=32"]
    cfg = load_config(None, sets)
    batch = step.make_batches(cfg, 1, 0.0)[0]
    outs = []
    for timed in (False, True):
        model = build_dlrm(cfg, torch.device("cpu"))
        opt = dense_optimizer(cfg.train, model.dense_parameters())
        timer = PhaseTimer()
        guard = LossGuard()
        if timed:
            hook_collection(model, timer)
            guard = attach_timer(model, opt, timer)
        timer.active = timed
        timer.begin()
        loss = train_step(model, opt, batch, 1, guard=guard)
        outs.append((loss, [p.detach().clone() for p in model.parameters()],
                     [b.clone() for b in model.buffers()]))  # fmt: skip
    assert set(timer.cur) == set(PHASES) - {"batch_prep"}  # (batch_prep: the pipeline's)
    (l0, p0, b0), (l1, p1, b1) = outs
    assert torch.equal(l0, l1)
    assert all(torch.equal(x, y) for x, y in zip(p0 + b0, p1 + b1))


def test_breakdown_runs_and_its_json_has_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert step.main([*TINY, "--breakdown", *FAST]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["bench"] == "step_breakdown"
    names = [p["name"] for p in out["phases"]]
    assert names == list(PHASES)
    for p in out["phases"]:
        assert {"name", "ms", "floor_ms", "over_floor", "mb", "gflop"} <= set(p)
        assert p["floor_ms"] > 0
    phase_sum = sum(p["ms"] for p in out["phases"])
    assert out["phase_sum_ms"] == pytest.approx(phase_sum, rel=1e-3)
    assert out["phase_sum_over_step"] == pytest.approx(phase_sum / out["step_ms"], rel=1e-3)
    ratio = out["step_ms"] / out["floor_ms"]
    assert out["step_over_floor"] == pytest.approx(ratio, rel=1e-3, abs=1e-3)
    assert out["furthest"] in names and out["floors"]["triad_gbs"] > 0


def test_breakdown_refuses_a_peer_in_one_line() -> None:
    from neorec.errors import ConfigError

    with pytest.raises(ConfigError, match="--breakdown"):
        step.main([*TINY, "--breakdown", "--compare", "fbgemm"])
