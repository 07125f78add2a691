"""Quantization-aware training (``train.qat``, Naumov et al. 2018's periodic regularizer in the
fused row update): the formula against autograd of the penalty, the C kernel against the
reference, determinism, rows pulled onto their grid (untouched rows unchanged), the schedule's
switch and the config section."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from neorec.config import ConfigError, QatConfig, load_config
from neorec.modules.qat import QatSchedule
from neorec.ops.qat import Periodic, grid_error, periodic_grad
from neorec.ops.row_optim import RowOptimizer, zeros_state
from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, get_backend

LAYOUT = TBELayout(rows=(40, 24), dims=(16, 5), feature_table=(0, 1, 0))
"""Two tiny tables (one blockable dim, one not); features 0 and 2 share table 0."""
B = 6


def lookup(seed: int, hi: int = 30) -> tuple[Lookup, Tensor]:
    """A batch of bags over ids below ``hi`` (table 0's rows from ``hi`` on are never touched),
    with per-sample weights, and an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (LAYOUT.num_features * B,), generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    n = int(offsets[-1])
    ids = torch.randint(0, min(hi, 20), (n,), generator=gen)
    psw = torch.rand(n, generator=gen) + 0.5
    grad = torch.randn(B, LAYOUT.total_dim, generator=gen) * 0.01
    return Lookup(ids, offsets, psw, PoolingMode.SUM), grad


def weights(seed: int = 0) -> Tensor:
    return torch.randn(LAYOUT.total_elems, generator=torch.Generator().manual_seed(seed))


def run(backend: str, opt: RowOptimizer, steps: int, w: Tensor, scale: float = 1.0) -> Tensor:
    """``steps`` fused updates of ``w`` (a copy) with the output gradient times ``scale``."""
    w = w.clone()
    st = zeros_state(opt.kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu"))
    for s in range(1, steps + 1):
        lk, grad = lookup(100 + s)
        get_backend(backend).backward_update(LAYOUT, w, st, lk, grad * scale, opt, s)
    return w


@pytest.mark.parametrize("shape", ["sin", "hat"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_gradient_is_the_penalty_derivative(shape: str, bits: int) -> None:
    """periodic_grad equals float64 autograd of the documented penalty (grid held constant)."""
    w = torch.randn(7, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(bits))
    w[3] = 0.25  # one row of equal values: no grid, no penalty
    lam = 0.7
    x = w.clone().requires_grad_()
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    s = (hi - lo) / ((1 << bits) - 1)
    u = (x - lo) / torch.where(s > 0, s, 1.0)
    if shape == "sin":
        pen = lam * s**2 / (2 * math.pi**2) * torch.sin(math.pi * u) ** 2
    else:
        pen = lam * s**2 / math.pi**2 * (u - torch.round(u)).abs()
    pen.sum().backward()
    assert x.grad is not None
    got = periodic_grad(Periodic(bits, lam, shape), w)
    torch.testing.assert_close(got, x.grad, rtol=1e-9, atol=1e-12)
    assert float(got[3].abs().max()) == 0.0
    assert float(got.abs().max()) > 0


@pytest.mark.parametrize("shape", ["sin", "hat"])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_cpu_equals_reference(kind: str, shape: str) -> None:
    """The C kernel's qat_row against the reference over several steps (weight decay on: the
    penalty follows the L2 term); SGD's update is the same operations, bitwise."""
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01, qat=Periodic(4, 2.0, shape))
    ref = run("reference", opt, 4, weights())
    cpu = run("cpu", opt, 4, weights())
    if kind == "sgd":
        assert torch.equal(cpu, ref)
    torch.testing.assert_close(cpu, ref, rtol=1e-5, atol=1e-6)
    plain = run("cpu", RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01), 4, weights())
    assert not torch.allclose(plain, cpu), "the regularizer must change the update"


def test_cpu_bitwise_across_threads() -> None:
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05, qat=Periodic(2, 3.0, "sin"))
    before = torch.get_num_threads()
    out = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out.append(run("cpu", opt, 3, weights()))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1])


def _grid_err(w: Tensor, t: int, rows: slice, bits: int) -> float:
    table = LAYOUT.table(w, t).view(LAYOUT.rows[t], -1)[rows]
    return float(grid_error(table, bits).mean())


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("shape", ["sin", "hat"])
def test_pulls_touched_rows_onto_the_grid(backend: str, shape: str) -> None:
    """With a small data gradient, the quantization error of the touched rows falls well below
    both its start and a run without the regularizer; rows no batch touches stay bitwise."""
    bits = 4
    w0 = weights(3)
    on = RowOptimizer(kind="sgd", lr=0.1, qat=Periodic(bits, 5.0, shape))
    off = RowOptimizer(kind="sgd", lr=0.1)
    w_on = run(backend, on, 40, w0, scale=0.1)
    w_off = run(backend, off, 40, w0, scale=0.1)
    touched = slice(0, 20)  # lookup() draws ids below 20
    start = _grid_err(w0, 0, touched, bits)
    got, plain = _grid_err(w_on, 0, touched, bits), _grid_err(w_off, 0, touched, bits)
    assert got < 0.3 * start and got < 0.3 * plain, (start, got, plain)
    assert _grid_err(w_on, 1, touched, bits) < 0.3 * _grid_err(w0, 1, touched, bits)
    untouched = LAYOUT.table(w_on, 0).view(40, -1)[20:]
    assert torch.equal(untouched, LAYOUT.table(w0, 0).view(40, -1)[20:])


def test_schedule_switches_on_for_the_last_part() -> None:
    cfg = QatConfig(bits=4, strength=0.5, start_fraction=0.25)
    sched = QatSchedule.of(cfg, 10)
    assert sched.start_step == 7
    assert [sched.at(s) is not None for s in range(1, 11)] == [False] * 7 + [True] * 3
    assert sched.at(10) == Periodic(4, 0.5, "sin")
    with pytest.raises(ConfigError, match="set train.steps"):
        QatSchedule.of(cfg, None)


def test_trainer_runs_the_regularizer_from_its_start_step(tmp_path: Path) -> None:
    from neorec.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "train.steps=4",
            "embedding.num_tables=2",
            "embedding.rows=50",
            "data.batch_size=32",
            "data.eval_samples=64",
            "train.progress=false",
            "train.save_model=false",
            f"train.run_dir='{tmp_path}'",
            "train.qat.bits=2",
            "train.qat.start_fraction=0.5",
            "train.qat.strength=3.0",
        ],
    )
    seen: list[Periodic | None] = []
    t = Trainer(cfg)
    assert t.qat is not None and t.qat.start_step == 2
    hook = t.qat.hook(t.model.ebc)
    for s in range(1, 5):
        hook.before_step(s)
        seen.append(t.model.ebc.optimizer.qat)
    assert seen == [None, None, Periodic(2, 3.0, "sin"), Periodic(2, 3.0, "sin")]
    t.model.ebc.set_qat(None)
    t.fit()  # the run's pipeline carries the hook: the regularizer is on after the last step
    assert t.model.ebc.optimizer.qat == Periodic(2, 3.0, "sin")


def test_config_section() -> None:
    cfg = load_config(None, ["train.qat.bits=4", "train.qat.shape='hat'"])
    assert cfg.train.qat.active and cfg.train.qat.shape == "hat"
    assert not load_config(None, []).train.qat.active
    bad = {
        "train.qat.bits=3": "train.qat.bits",
        "train.qat.strength=0": "train.qat.strength",
        "train.qat.start_fraction=1.5": "train.qat.start_fraction",
        "train.qat.shape='cos'": "train.qat.shape",
    }
    for text, key in bad.items():
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, ["train.qat.bits=4", text] if "bits" not in text else [text])
    with pytest.raises(ConfigError, match="train.qat.bits is 0"):
        load_config(None, ["train.qat.strength=2"])
    with pytest.raises(ConfigError, match="CPU backends"):
        load_config(None, ["train.qat.bits=4", "embedding.backend='triton'"])
    with pytest.raises(ConfigError, match="QAT bits"):
        Periodic(3, 1.0)
    with pytest.raises(ConfigError, match="strength"):
        Periodic(4, float("nan"))
