"""CowClip (adaptive column-wise clipping of the row gradients, Zheng et al. 2023): the reference and
cpu backends against a plain float64 PyTorch oracle of the formula; determinism; its config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from neorec.config import ConfigError, load_config
from neorec.ops.row_optim import RowOptimizer, zeros_state
from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, apply_row_grads, get_backend

LAYOUT = TBELayout(rows=(12, 6), dims=(8, 4), feature_table=(0, 1, 0))
"""Two tiny tables; features 0 and 2 share table 0 (an id's count spans both)."""


def batch(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(weights, indices, offsets, per-sample weights, output gradient) with many repeated ids
    and rows 0 of each table at zero (their threshold is the bound)."""
    gen = torch.Generator().manual_seed(seed)
    b = 6
    lengths = torch.randint(0, 5, (LAYOUT.num_features * b,), generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = [
        torch.randint(0, 5, (int(lengths[f * b : (f + 1) * b].sum()),), generator=gen)
        for f in range(LAYOUT.num_features)
    ]
    w = torch.randn(LAYOUT.total_elems, generator=gen)
    for t in range(LAYOUT.num_tables):
        LAYOUT.table(w, t)[0] = 0.0
    idx = torch.cat(ids)
    psw = torch.rand(idx.numel(), generator=gen) + 0.5
    return w, idx, offsets, psw, torch.randn(b, LAYOUT.total_dim, generator=gen)


def oracle(
    kind: str, w: Tensor, idx: Tensor, off: Tensor, psw: Tensor | None, grad: Tensor, **opt: float
) -> tuple[Tensor, int]:
    """One step in float64 by dense autograd and the paper's formula, row by row: (the new
    weights, how many rows were clipped)."""
    b = grad.shape[0]
    new, clipped = w.double().clone(), 0
    for t in range(LAYOUT.num_tables):
        table = LAYOUT.table(w, t).double().reshape(LAYOUT.rows[t], -1).requires_grad_()
        counts = torch.zeros(LAYOUT.rows[t], dtype=torch.float64)
        loss = table.new_zeros(())
        for f, ft in enumerate(LAYOUT.feature_table):
            if ft != t:
                continue
            lo, hi = int(off[f * b]), int(off[(f + 1) * b])
            ids = idx[lo:hi]
            counts += torch.bincount(ids, minlength=LAYOUT.rows[t]).double()
            p = None if psw is None else psw[lo:hi].double()
            pooled = F.embedding_bag(
                ids,
                table,
                off[f * b : (f + 1) * b + 1] - lo,
                mode="sum",
                per_sample_weights=p,
                include_last_offset=True,
            )
            g_out = grad[:, LAYOUT.out_offsets[f] : LAYOUT.out_offsets[f + 1]].double()
            loss = loss + (pooled * g_out).sum()
        loss.backward()
        assert table.grad is not None
        rows = LAYOUT.table(new, t).view(LAYOUT.rows[t], -1)
        for j in torch.nonzero(counts).flatten().tolist():
            wj = table.detach()[j]
            g = table.grad[j] + opt["weight_decay"] * wj
            thr = counts[j] * max(opt["clip_ratio"] * float(wj.norm()), opt["clip_bound"])
            if g.norm() > thr:
                g, clipped = g * thr / g.norm(), clipped + 1
            if kind == "sgd":
                rows[j] = wj - opt["lr"] * g
            else:  # row-wise Adagrad from a state of S0 (from 0 its first step is scale-free)
                rows[j] = wj - opt["lr"] * g / ((S0 + (g * g).mean()).sqrt() + 1e-8)
    return new, clipped


S0 = 0.5
"""Row-wise Adagrad's state before the step."""
OPT = {"lr": 0.1, "weight_decay": 0.01, "clip_ratio": 0.5, "clip_bound": 0.3}


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_backends_match_the_formula(backend: str, kind: str, use_psw: bool) -> None:
    w0, idx, off, psw, grad = batch(1)
    p = psw if use_psw else None
    want, clipped = oracle(kind, w0, idx, off, p, grad, **OPT)
    touched = int(torch.unique(idx).numel())
    assert 0 < clipped < 2 * touched, "the case must clip some rows (and leave others)"
    w = w0.clone()
    st = {
        k: v + S0
        for k, v in zeros_state(
            kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu")
        ).items()
    }
    opt = RowOptimizer(kind=kind, eps=1e-8, **OPT)
    get_backend(backend).backward_update(
        LAYOUT, w, st, Lookup(idx, off, p, PoolingMode.SUM), grad, opt, 1
    )
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)
    plain = w0.clone()
    no_clip = RowOptimizer(kind=kind, lr=OPT["lr"], weight_decay=OPT["weight_decay"])
    st = {
        k: v + S0
        for k, v in zeros_state(
            kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu")
        ).items()
    }
    get_backend(backend).backward_update(
        LAYOUT, plain, st, Lookup(idx, off, p, PoolingMode.SUM), grad, no_clip, 1
    )
    assert not torch.allclose(plain, w), "clipping must change the step"


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_cpu_equals_reference_over_steps(kind: str) -> None:
    """Several steps of every optimizer, mean pooling with per-sample weights."""
    res = []
    for name in ("reference", "cpu"):
        w = batch(2)[0]
        st = zeros_state(kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu"))
        opt = RowOptimizer(kind=kind, **OPT)
        for s in (1, 2, 3):
            _, idx, off, psw, grad = batch(10 + s)
            get_backend(name).backward_update(
                LAYOUT, w, st, Lookup(idx, off, psw, PoolingMode.MEAN), grad, opt, s
            )
        res.append((w, st))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-5, atol=1e-6)
    for k in res[0][1]:
        torch.testing.assert_close(res[1][1][k], res[0][1][k], rtol=1e-5, atol=1e-6)


def test_cpu_bitwise_across_threads() -> None:
    """Large skewed batches, several thread counts: the same bits."""
    layout = TBELayout(rows=(2000, 300), dims=(16, 8), feature_table=(0, 1, 0))
    gen = torch.Generator().manual_seed(3)
    b = 256
    lengths = torch.randint(0, 20, (layout.num_features * b,), generator=gen)
    off = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=off[1:])
    n = int(off[-1])
    idx = torch.cat(
        [
            (
                torch.rand(int(lengths[f * b : (f + 1) * b].sum()), generator=gen) ** 3
                * layout.rows[t]
            ).long()
            for f, t in enumerate(layout.feature_table)
        ]
    )
    assert idx.numel() == n
    w0 = torch.randn(layout.total_elems, generator=gen) * 0.1
    grad = torch.randn(b, layout.total_dim, generator=gen)
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05, clip_ratio=0.2, clip_bound=0.01)
    outs = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            w = w0.clone()
            st = zeros_state(opt.kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
            for s in (1, 2):
                get_backend("cpu").backward_update(
                    layout, w, st, Lookup(idx, off, None, PoolingMode.SUM), grad, opt, s
                )
            outs.append((w, st["momentum1"]))
    finally:
        torch.set_num_threads(old)
    for w, m in outs[1:]:
        assert torch.equal(w, outs[0][0]) and torch.equal(m, outs[0][1])


def test_paths_without_counts_are_refused() -> None:
    opt = RowOptimizer(kind="sgd", clip_ratio=1.0)
    w = torch.zeros(LAYOUT.total_elems)
    with pytest.raises(ConfigError, match="CowClip"):
        apply_row_grads(
            get_backend("cpu"), LAYOUT, w, {}, [(0, torch.tensor([1]), torch.ones(1, 8))], opt, 1
        )
    with pytest.raises(ConfigError, match="bound"):
        RowOptimizer(kind="sgd", clip_bound=0.1)


def test_config_and_scaling_rule() -> None:
    from neorec.builder.model import collection_spec
    from neorec.builder.schedule import lr_schedule

    over = [
        "embedding.cowclip_ratio=1.0",
        "embedding.cowclip_bound=0.001",
        "embedding.weight_decay=1e-5",
        "data.batch_size=4096",
        "train.lr_scaling='cowclip'",
        "train.reference_batch=512",
        "train.schedule.warmup_steps=10",
        "train.schedule.rows=false",
    ]
    cfg = load_config(None, over)
    spec = collection_spec(cfg)
    assert spec.optimizer.clip_ratio == 1.0 and spec.optimizer.clip_bound == 0.001
    assert spec.optimizer.weight_decay == pytest.approx(8e-5)  # L2 x k
    s = lr_schedule(cfg, 100)
    assert s.rows_lr == cfg.embedding.lr  # embedding lr unchanged
    assert s.dense_lr == pytest.approx(cfg.train.dense_lr * 8**0.5)
    assert s.lrs(1) == (pytest.approx(s.dense_lr * 0.1), s.rows_lr)  # dense warmup only
    for bad, what in (
        (["embedding.cowclip_bound=0.1"], "cowclip_ratio"),
        (["embedding.cowclip_ratio=1", "embedding.backend='triton'"], "backend"),
        (["embedding.cowclip_ratio=1", "embedding.precision='fp16'"], "fp32"),
        (["embedding.cowclip_ratio=-1"], "cowclip_ratio"),
    ):
        with pytest.raises(ConfigError, match=what):
            load_config(None, bad)
