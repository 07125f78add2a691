"""TBE backends against a float64 oracle (nn.EmbeddingBag + dense autograd + textbook optimizers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from neorec.ops import cpu as cpu_mod
from neorec.ops.cpu import CpuBackend
from neorec.ops.cuda import CudaBackend
from neorec.ops.row_optim import RowOptimizer, zeros_state
from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, get_backend, tbe_lookup

# Bitwise equalities: make test-isa reruns them under every other vector ISA of the CPU.
pytestmark = pytest.mark.bitwise

HAS_CUDA = torch.cuda.is_available()
BACKENDS = [
    "reference",
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")),
]
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]
POOLINGS = [PoolingMode.SUM, PoolingMode.MEAN]


@dataclass
class Case:
    """One random batch on a layout with a shared table and an unused one."""

    layout: TBELayout
    weights: Tensor  # [total_elems] float32
    indices: Tensor  # [N] int64
    offsets: Tensor  # [F*B + 1] int64
    psw: Tensor  # [N] float32
    grad: Tensor  # [B, total_dim] float32

    def to(self, device: str) -> Case:
        """Copy of the case on ``device``."""
        return Case(
            self.layout,
            *(
                x.to(device)
                for x in (self.weights, self.indices, self.offsets, self.psw, self.grad)
            ),
        )


def make_case(seed: int = 0, batch: int = 12, max_len: int = 6, id_range: int = 9) -> Case:
    """Tables of different dims; features 0 and 2 share table 0; table 3 is never looked up."""
    layout = TBELayout(rows=(50, 7, 100, 5), dims=(8, 4, 16, 3), feature_table=(0, 2, 0, 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (layout.num_features * batch,), generator=gen)
    lengths[::5] = 0  # plenty of empty bags
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = []
    for f, t in enumerate(layout.feature_table):
        n = int(lengths[f * batch : (f + 1) * batch].sum())
        # a small id range: many duplicates within and across bags and features
        ids.append(torch.randint(0, min(id_range, layout.rows[t]), (n,), generator=gen))
    indices = torch.cat(ids)
    return Case(
        layout,
        torch.randn(layout.total_elems, generator=gen),
        indices,
        offsets,
        torch.rand(indices.numel(), generator=gen) + 0.5,
        torch.randn(batch, layout.total_dim, generator=gen),
    )


def device_of(backend: str) -> str:
    """Device the backend's tensors live on."""
    return "cuda" if backend == "cuda" else "cpu"


# ---- float64 oracle -----------------------------------------------------------------------------


def oracle_bags(lay: TBELayout, weights: Tensor) -> list[torch.nn.EmbeddingBag]:
    """One float64 nn.EmbeddingBag per table, initialized from the flat weights."""
    return [
        torch.nn.EmbeddingBag.from_pretrained(
            lay.table(weights, t).double().clone(),
            freeze=False,
            mode="sum",
            include_last_offset=True,
        )
        for t in range(lay.num_tables)
    ]


def oracle_forward(
    case: Case, bags: list[torch.nn.EmbeddingBag], psw: Tensor | None, pooling: PoolingMode
) -> Tensor:
    """Pooled output [B, total_dim] in float64: each feature through its table's EmbeddingBag."""
    lay, b = case.layout, case.grad.shape[0]
    cols = []
    for f, t in enumerate(lay.feature_table):
        seg = case.offsets[f * b : (f + 1) * b + 1]
        lo, hi = int(seg[0]), int(seg[-1])
        w = psw[lo:hi].double() if psw is not None else None
        pooled = bags[t](case.indices[lo:hi], seg - lo, per_sample_weights=w)
        if pooling == PoolingMode.MEAN:
            pooled = pooled / (seg[1:] - seg[:-1]).clamp(min=1).double().unsqueeze(1)
        cols.append(pooled)
    return torch.cat(cols, dim=1)


def oracle_step(
    case: Case,
    weights: Tensor,
    state: dict[str, Tensor],
    psw: Tensor | None,
    pooling: PoolingMode,
    opt: RowOptimizer,
    step: int,
) -> None:
    """One training step in float64: dense autograd gradient, then the optimizer on touched rows."""
    lay, b = case.layout, case.grad.shape[0]
    bags = oracle_bags(lay, weights)
    (oracle_forward(case, bags, psw, pooling) * case.grad.double()).sum().backward()
    for t in range(lay.num_tables):
        feats = [f for f, tt in enumerate(lay.feature_table) if tt == t]
        ids = [
            case.indices[int(case.offsets[f * b]) : int(case.offsets[(f + 1) * b])] for f in feats
        ]
        if not ids or not torch.cat(ids).numel():
            continue
        rows = torch.unique(torch.cat(ids))  # touched rows (even if their gradient is zero)
        grad = bags[t].weight.grad
        assert grad is not None
        g = grad[rows]  # the dense gradient, summed over every occurrence of the row
        w = lay.table(weights, t)[rows]
        if opt.weight_decay:
            g = g + opt.weight_decay * w
        if opt.kind == "sgd":
            w = w - opt.lr * g
        elif opt.kind == "rowwise_adagrad":
            s = state["momentum1"][lay.row_offsets[t] + rows] + (g * g).mean(1)
            state["momentum1"][lay.row_offsets[t] + rows] = s
            w = w - opt.lr * g / (s.sqrt() + opt.eps).unsqueeze(1)
        else:
            m = lay.table(state["exp_avg"], t)[rows] * opt.beta1 + (1 - opt.beta1) * g
            v = lay.table(state["exp_avg_sq"], t)[rows] * opt.beta2 + (1 - opt.beta2) * g * g
            lay.table(state["exp_avg"], t)[rows] = m
            lay.table(state["exp_avg_sq"], t)[rows] = v
            mh, vh = m / (1 - opt.beta1**step), v / (1 - opt.beta2**step)
            w = w - opt.lr * mh / (vh.sqrt() + opt.eps)
        lay.table(weights, t)[rows] = w


def oracle_state(kind: str, lay: TBELayout) -> dict[str, Tensor]:
    """Zero optimizer state in float64."""
    st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
    return {k: v.double() for k, v in st.items()}


def run_steps(
    backend: str,
    case: Case,
    kind: str,
    pooling: PoolingMode,
    use_psw: bool,
    steps: tuple[int, ...] = (1, 2),
    wd: float = 0.01,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weights and state after backward_update at each step count in ``steps`` (same batch)."""
    dev = device_of(backend)
    c = case.to(dev)
    be = get_backend(backend, dev)
    w = c.weights.clone()
    st = zeros_state(kind, c.layout.total_rows, c.layout.total_elems, torch.device(dev))
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=wd)
    for s in steps:
        be.backward_update(
            c.layout,
            w,
            st,
            Lookup(c.indices, c.offsets, c.psw if use_psw else None, pooling),
            c.grad,
            opt,
            s,
        )
    return w.cpu(), {k: v.cpu() for k, v in st.items()}


# ---- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_embedding_bag(
    backend: str, pooling: PoolingMode, use_psw: bool, fast_paths: Any
) -> None:
    case = make_case(1)
    dev = device_of(backend)
    c = case.to(dev)
    out = get_backend(backend, dev).forward(
        c.layout, c.weights, Lookup(c.indices, c.offsets, c.psw if use_psw else None, pooling)
    )
    bags = oracle_bags(case.layout, case.weights)
    want = oracle_forward(case, bags, case.psw if use_psw else None, pooling).detach()
    assert out.dtype == torch.float32 and out.shape == want.shape
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
    b = case.grad.shape[0]
    empty = (case.offsets[1:] - case.offsets[:-1]).view(-1, b) == 0  # [F, B]
    f, s = (int(x) for x in empty.nonzero()[0])
    lo, hi = case.layout.out_offsets[f], case.layout.out_offsets[f + 1]
    assert torch.all(out[s, lo:hi] == 0), "an empty bag pools to zeros"
    assert (fast_paths()["cpu.forward"] > 0) == (backend == "cpu"), "the C kernel ran (or not)"


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_update_matches_dense_autograd(
    backend: str, kind: str, pooling: PoolingMode, use_psw: bool, fast_paths: Any
) -> None:
    case = make_case(2)
    w, st = run_steps(backend, case, kind, pooling, use_psw)
    assert (fast_paths()["cpu.backward"] > 0) == (backend == "cpu"), "the C kernel ran (or not)"
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    w64 = case.weights.double()
    st64 = oracle_state(kind, case.layout)
    for s in (1, 2):
        oracle_step(case, w64, st64, case.psw if use_psw else None, pooling, opt, s)
    assert not torch.equal(w, case.weights), "the step changed nothing"
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=2e-6)
    for k in st:
        torch.testing.assert_close(st[k].double(), st64[k], rtol=1e-5, atol=1e-6)


def test_adam_bias_correction_uses_step_count() -> None:
    case = make_case(3)
    opt = RowOptimizer(kind="adam", lr=0.05)
    w64 = case.weights.double()
    st64 = oracle_state("adam", case.layout)
    for s in (1, 2, 7):
        oracle_step(case, w64, st64, None, PoolingMode.SUM, opt, s)
    w, _ = run_steps("cpu", case, "adam", PoolingMode.SUM, False, steps=(1, 2, 7), wd=0.0)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=2e-6)
    w_wrong, _ = run_steps("cpu", case, "adam", PoolingMode.SUM, False, steps=(1, 2, 3), wd=0.0)
    assert not torch.allclose(w_wrong, w), "step 7 and step 3 must differ in bias correction"


def big_case(seed: int = 5) -> tuple[TBELayout, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A larger skewed batch: (layout, weights, indices, offsets, psw, grad)."""
    layout = TBELayout(rows=(3000, 500, 2000), dims=(32, 16, 8), feature_table=(0, 1, 0, 2, 2))
    gen = torch.Generator().manual_seed(seed)
    b = 256
    lengths = torch.randint(0, 30, (layout.num_features * b,), generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = []
    for f, t in enumerate(layout.feature_table):
        n = int(lengths[f * b : (f + 1) * b].sum())
        # squaring a uniform skews ids towards 0: hot rows with long runs of duplicates
        ids.append((torch.rand(n, generator=gen) ** 3 * layout.rows[t]).long())
    indices = torch.cat(ids)
    return (
        layout,
        torch.randn(layout.total_elems, generator=gen),
        indices,
        offsets,
        torch.rand(indices.numel(), generator=gen),
        torch.randn(b, layout.total_dim, generator=gen),
    )


def cpu_steps(
    be: CpuBackend, kind: str, threads: int, use_psw: bool = True, weight_decay: float = 0.001
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Two steps of a big case on the cpu backend with ``threads`` threads: weights, state, output."""
    layout, w, idx, off, psw, grad = big_case()
    st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    opt = RowOptimizer(kind=kind, lr=0.03, weight_decay=weight_decay)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = be.forward(layout, w, Lookup(idx, off, psw if use_psw else None, PoolingMode.MEAN))
        for s in (1, 2):
            be.backward_update(
                layout,
                w,
                st,
                Lookup(idx, off, psw if use_psw else None, PoolingMode.MEAN),
                grad,
                opt,
                s,
            )
    finally:
        torch.set_num_threads(old)
    return w, st, out


@pytest.mark.parametrize("weight_decay", [0.0, 0.001])  # 0: SGD / row-wise Adagrad go blocked
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_bitwise_deterministic_across_threads(kind: str, weight_decay: float) -> None:
    be = CpuBackend()
    runs = [cpu_steps(be, kind, n, weight_decay=weight_decay) for n in (2, 2, 1, 3)]
    for w, st, out in runs[1:]:
        assert torch.equal(w, runs[0][0])
        assert torch.equal(out, runs[0][2])
        for k in st:
            assert torch.equal(st[k], runs[0][1][k])


@pytest.mark.parametrize("weight_decay", [0.0, 0.001])
@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_equals_reference(kind: str, use_psw: bool, weight_decay: float) -> None:
    layout, w0, idx, off, psw, grad = big_case(6)
    p = psw if use_psw else None
    res = []
    for be in (get_backend("reference"), get_backend("cpu")):
        w = w0.clone()
        st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
        opt = RowOptimizer(kind=kind, lr=0.03, weight_decay=weight_decay)
        out = be.forward(layout, w, Lookup(idx, off, p, PoolingMode.SUM))
        for s in (1, 2):
            be.backward_update(layout, w, st, Lookup(idx, off, p, PoolingMode.SUM), grad, opt, s)
        res.append((out, w, st))
    (o_ref, w_ref, st_ref), (o_cpu, w_cpu, st_cpu) = res
    torch.testing.assert_close(o_cpu, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w_cpu, w_ref, rtol=1e-6, atol=1e-6)
    for k in st_ref:
        torch.testing.assert_close(st_cpu[k], st_ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("use_psw", [False, True])
def test_cpu_row_grads_and_emitted_tables(use_psw: bool, pooling: PoolingMode) -> None:
    # The kernel's summed row gradients equal the reference's bitwise (same order of sums), for
    # any thread count; emitting some tables leaves them untouched and updates the rest exactly
    # as the full fused update does.
    layout, w0, idx, off, psw, grad = big_case(7)
    p = psw if use_psw else None
    want = get_backend("reference").row_grads(layout, Lookup(idx, off, p, pooling), grad)
    be = CpuBackend()
    old = torch.get_num_threads()
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            got = be.row_grads(layout, Lookup(idx, off, p, pooling), grad)
        finally:
            torch.set_num_threads(old)
        assert [t for t, _, _ in got] == [t for t, _, _ in want]
        for (_, ids_g, g_g), (_, ids_w, g_w) in zip(got, want, strict=True):
            assert torch.equal(ids_g, ids_w)
            assert torch.equal(g_g, g_w)
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.03, weight_decay=0.001)
    full_w = w0.clone()
    full_st = zeros_state(opt.kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    be.backward_update(layout, full_w, full_st, Lookup(idx, off, p, pooling), grad, opt, 1)
    part_w = w0.clone()
    part_st = zeros_state(opt.kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    emitted = be.backward_update(
        layout, part_w, part_st, Lookup(idx, off, p, pooling), grad, opt, 1, emit_tables=[1]
    )
    assert [t for t, _, _ in emitted] == [1]
    assert torch.equal(emitted[0][1], want[1][1]) and torch.equal(emitted[0][2], want[1][2])
    for t in range(layout.num_tables):
        lo, hi = layout.row_offsets[t], layout.row_offsets[t + 1]
        if t == 1:
            assert torch.equal(layout.table(part_w, t), layout.table(w0, t))
            assert not part_st["momentum1"][lo:hi].any()
        else:
            assert torch.equal(layout.table(part_w, t), layout.table(full_w, t))
            assert torch.equal(part_st["momentum1"][lo:hi], full_st["momentum1"][lo:hi])


def test_cpu_payload_pairs_path_matches_packed() -> None:
    """The (key, payload) sort used for enormous tables gives the same bits as the packed one."""
    for kind in OPTIMIZERS:
        for use_psw in (False, True):
            a = cpu_steps(CpuBackend(), kind, 2, use_psw)
            b = cpu_steps(CpuBackend(force_pairs=True), kind, 2, use_psw)
            assert torch.equal(a[0], b[0])
            for k in a[1]:
                assert torch.equal(a[1][k], b[1][k])


@pytest.mark.parametrize("backend", BACKENDS)
def test_tbe_lookup_autograd_updates_weights_without_grad(backend: str) -> None:
    dev = device_of(backend)
    c = make_case(4).to(dev)
    be = get_backend(backend, dev)
    w = c.weights.clone()
    w0 = w.clone()
    st = zeros_state(
        "rowwise_adagrad", c.layout.total_rows, c.layout.total_elems, torch.device(dev)
    )
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.1)
    anchor = torch.empty(0, requires_grad=True, device=dev)
    grads: list[Tensor] = []

    def update(g: Tensor) -> None:
        grads.append(g)
        be.backward_update(
            c.layout, w, st, Lookup(c.indices, c.offsets, None, PoolingMode.SUM), g, opt, 1
        )

    out = tbe_lookup(
        anchor, be, c.layout, w, Lookup(c.indices, c.offsets, None, PoolingMode.SUM), update
    )
    assert out.requires_grad
    (out * c.grad).sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], c.grad)
    assert w.grad is None
    assert not torch.equal(w, w0)
    # a touched row moved, an untouched one did not
    t0 = c.layout.table(w, 0)
    assert not torch.equal(t0[int(c.indices[0])], c.layout.table(w0, 0)[int(c.indices[0])])
    assert torch.equal(c.layout.table(w, 3), c.layout.table(w0, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_without_ids_is_untouched(backend: str) -> None:
    case = make_case(7)
    w, st = run_steps(backend, case, "adam", PoolingMode.SUM, True)
    lay = case.layout
    assert torch.equal(lay.table(w, 3), lay.table(case.weights, 3))  # table 3: no feature
    assert torch.all(lay.table(st["exp_avg"], 3) == 0)
    # table 2 rows beyond the id range were not touched either (lazy update)
    assert torch.equal(lay.table(w, 2)[9:], lay.table(case.weights, 2)[9:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_inputs(backend: str) -> None:
    dev = device_of(backend)
    c = make_case(8).to(dev)
    be = get_backend(backend, dev)
    outs, ws = [], []
    for dt in (torch.int64, torch.int32):
        w = c.weights.clone()
        st = zeros_state("sgd", c.layout.total_rows, c.layout.total_elems, torch.device(dev))
        idx, off = c.indices.to(dt), c.offsets.to(dt)
        outs.append(be.forward(c.layout, w, Lookup(idx, off, c.psw, PoolingMode.MEAN)))
        be.backward_update(
            c.layout,
            w,
            st,
            Lookup(idx, off, c.psw, PoolingMode.MEAN),
            c.grad,
            RowOptimizer(kind="sgd"),
            1,
        )
        ws.append(w)
    assert torch.equal(outs[0], outs[1]) and torch.equal(ws[0], ws[1])


# (cuda: CUDA tensors are checked by device asserts, see test_device_generic)
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("bad_id", [7, -1, 2**62])
def test_out_of_range_id_is_refused(backend: str, bad_id: int) -> None:
    dev = device_of(backend)
    c = make_case(9).to(dev)
    lay, b = c.layout, c.grad.shape[0]
    f = 3  # feature 3 reads table 1, which has 7 rows
    pos = int(c.offsets[f * b]) + 1
    assert int(c.offsets[(f + 1) * b]) > pos
    c.indices[pos] = bad_id
    be = get_backend(backend, dev)
    with pytest.raises(IndexError, match=rf"feature 3 \(table 1.*id {bad_id}\b"):
        be.forward(lay, c.weights, Lookup(c.indices, c.offsets, None, PoolingMode.SUM))
    w = c.weights.clone()
    st = zeros_state("rowwise_adagrad", lay.total_rows, lay.total_elems, torch.device(dev))
    with pytest.raises(IndexError, match=rf"feature 3 .*id {bad_id}\b"):
        be.backward_update(
            lay,
            w,
            st,
            Lookup(c.indices, c.offsets, None, PoolingMode.SUM),
            c.grad,
            RowOptimizer(),
            1,
        )
    assert torch.equal(w, c.weights), "nothing may be written when the batch is refused"


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_reports_the_first_bad_id_across_chunks(threads: int) -> None:
    # Ids are checked chunk by chunk (a feature is cut into several); the error must still name
    # the first bad position of the whole batch, whichever thread saw which.
    layout, w0, idx, off, _, grad = big_case(7)
    b = grad.shape[0]
    early = int(off[2 * b]) + (int(off[3 * b]) - int(off[2 * b])) * 3 // 4  # feature 2, late
    late = int(off[4 * b]) + 5  # feature 4 (table 2)
    idx = idx.clone()
    idx[late] = -5
    idx[early] = 10**6
    be = CpuBackend()
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        w = w0.clone()
        st = zeros_state(
            "rowwise_adagrad", layout.total_rows, layout.total_elems, torch.device("cpu")
        )
        with pytest.raises(IndexError, match=r"feature 2 .*id 1000000\b"):
            be.backward_update(
                layout, w, st, Lookup(idx, off, None, PoolingMode.SUM), grad, RowOptimizer(), 1
            )
        assert torch.equal(w, w0)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_one_row_tables(kind: str) -> None:
    # A table of one row has no row bits to sort on; next to a wide one it must still come out
    # as the reference does.
    layout = TBELayout(rows=(1, 300, 1), dims=(8, 16, 4), feature_table=(0, 1, 2, 0))
    gen = torch.Generator().manual_seed(3)
    b = 64
    lengths = torch.randint(0, 5, (layout.num_features * b,), generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = [
        torch.randint(0, layout.rows[t], (int(lengths[f * b : (f + 1) * b].sum()),), generator=gen)
        for f, t in enumerate(layout.feature_table)
    ]
    idx = torch.cat(ids)
    w0 = torch.randn(layout.total_elems, generator=gen)
    grad = torch.randn(b, layout.total_dim, generator=gen)
    res = []
    for be in (get_backend("reference"), CpuBackend()):
        w = w0.clone()
        st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
        be.backward_update(
            layout,
            w,
            st,
            Lookup(idx, offsets, None, PoolingMode.SUM),
            grad,
            RowOptimizer(kind=kind),
            1,
        )
        res.append((w, st))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=1e-6)
    for k in res[0][1]:
        torch.testing.assert_close(res[1][1][k], res[0][1][k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_malformed_offsets_and_weights_are_refused_before_any_write(backend: str) -> None:
    from neorec.ops.tbe import TBEInputError

    c = make_case(11)
    be = get_backend(backend)
    b = c.grad.shape[0]
    st = zeros_state("adam", c.layout.total_rows, c.layout.total_elems, torch.device("cpu"))
    bad_offsets = c.offsets.clone()
    bad_offsets[b] = bad_offsets[b + 1] + 1
    for off, psw, match in [
        (bad_offsets, c.psw, "decrease"),
        (c.offsets + 1, c.psw, "offsets span"),
        (c.offsets, c.psw.double(), "float32"),
        (c.offsets, c.psw[:-1], "per_sample_weights"),
    ]:
        w = c.weights.clone()
        with pytest.raises(TBEInputError, match=match):
            be.forward(c.layout, w, Lookup(c.indices, off, psw, PoolingMode.SUM))
        with pytest.raises(TBEInputError, match=match):
            be.backward_update(
                c.layout, w, st, Lookup(c.indices, off, psw, PoolingMode.SUM), c.grad,
                RowOptimizer(kind="adam"), 1,
            )  # fmt: skip
        assert torch.equal(w, c.weights) and all(not bool(v.ne(0).any()) for v in st.values())


def test_cpu_rejects_malformed_inputs() -> None:
    c = make_case(10)
    be = get_backend("cpu")
    with pytest.raises(ValueError, match="float32"):
        be.forward(
            c.layout, c.weights.double(), Lookup(c.indices, c.offsets, None, PoolingMode.SUM)
        )
    with pytest.raises(ValueError, match="offsets"):
        be.forward(c.layout, c.weights, Lookup(c.indices, c.offsets[:-1], None, PoolingMode.SUM))
    bad = c.offsets.clone()
    bad[5] = bad[6] + 1
    with pytest.raises(ValueError, match="decrease"):
        be.forward(c.layout, c.weights, Lookup(c.indices, bad, None, PoolingMode.SUM))
    st = zeros_state("adam", c.layout.total_rows, c.layout.total_elems, torch.device("cpu"))
    del st["exp_avg_sq"]
    with pytest.raises(ValueError, match="exp_avg_sq"):
        be.backward_update(
            c.layout,
            c.weights,
            st,
            Lookup(c.indices, c.offsets, None, PoolingMode.SUM),
            c.grad,
            RowOptimizer(kind="adam"),
            1,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_bags_empty(backend: str) -> None:
    dev = device_of(backend)
    lay = TBELayout(rows=(4,), dims=(2,), feature_table=(0,))
    w = torch.randn(lay.total_elems, device=dev)
    idx = torch.zeros(0, dtype=torch.int64, device=dev)
    off = torch.zeros(4, dtype=torch.int64, device=dev)
    be = get_backend(backend, dev)
    out = be.forward(lay, w, Lookup(idx, off, None, PoolingMode.MEAN))
    assert out.shape == (3, 2) and torch.all(out == 0)
    w0 = w.clone()
    st = zeros_state("sgd", lay.total_rows, lay.total_elems, torch.device(dev))
    be.backward_update(
        lay,
        w,
        st,
        Lookup(idx, off, None, PoolingMode.MEAN),
        torch.ones(3, 2, device=dev),
        RowOptimizer(kind="sgd"),
        1,
    )
    assert torch.equal(w, w0)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cuda_backend_logic_on_cpu_tensors(kind: str) -> None:
    """The CUDA backend's ops are device-generic: check its logic here even without a GPU."""
    layout, w0, idx, off, psw, grad = big_case(11)
    res = []
    for be in (get_backend("reference"), CudaBackend()):
        w = w0.clone()
        st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
        out = be.forward(layout, w, Lookup(idx, off, psw, PoolingMode.MEAN))
        be.backward_update(
            layout, w, st, Lookup(idx, off, psw, PoolingMode.MEAN), grad, RowOptimizer(kind=kind), 1
        )
        res.append((out, w, st))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_bitwise_deterministic() -> None:
    layout, w0, idx, off, psw, grad = big_case(12)
    be = get_backend("cuda", "cuda")
    results = []
    for _ in range(2):
        w = w0.cuda()
        st = zeros_state("adam", layout.total_rows, layout.total_elems, torch.device("cuda"))
        be.backward_update(
            layout,
            w,
            st,
            Lookup(idx.cuda(), off.cuda(), psw.cuda(), PoolingMode.SUM),
            grad.cuda(),
            RowOptimizer(kind="adam"),
            1,
        )
        results.append((w.cpu(), {k: v.cpu() for k, v in st.items()}))
    assert torch.equal(results[0][0], results[1][0])
    for k in results[0][1]:
        assert torch.equal(results[0][1][k], results[1][1][k])


def test_kernel_cache_dir_and_missing_compiler(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("NEOREC_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_mod.cache_dir() == tmp_path / "cache"
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    with pytest.raises(RuntimeError, match="no-such-compiler-xyz"):
        cpu_mod._compiler()


def test_kernel_compile_error_includes_stderr(tmp_path) -> None:
    cc, _ = cpu_mod._compiler()
    with pytest.raises(RuntimeError, match="error"):
        cpu_mod._build(tmp_path / "broken.so", "this is not C;", cc)
    assert not list(tmp_path.glob("*.tmp")), "a failed build leaves no temp files behind"


def test_cpu_tiny_batches_many_threads_update_each_row_once() -> None:
    # Fewer occurrences than work chunks: empty chunks must not reach back before the first key
    # (that once let two chunks own row 0: a double update, or an emitted row past its buffer).
    layout = TBELayout(rows=(10, 7), dims=(4, 8), feature_table=(0, 1))
    be, ref = CpuBackend(), get_backend("reference")
    old = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        for seed in range(30):
            g = torch.Generator().manual_seed(seed)
            idx = torch.tensor([int(torch.randint(0, 10, (1,), generator=g)), 3])
            off = torch.tensor([0, 1, 2])
            grad = torch.randn(1, 12, generator=g)
            got = be.row_grads(layout, Lookup(idx, off, None, PoolingMode.SUM), grad)
            want = ref.row_grads(layout, Lookup(idx, off, None, PoolingMode.SUM), grad)
            assert [(t, i.tolist(), x.tolist()) for t, i, x in got] == [
                (t, i.tolist(), x.tolist()) for t, i, x in want
            ]
            opt = RowOptimizer(kind="sgd", lr=1.0)
            w = torch.zeros(layout.total_elems)
            be.backward_update(layout, w, {}, Lookup(idx, off, None, PoolingMode.SUM), grad, opt, 1)
            w_ref = torch.zeros(layout.total_elems)
            ref.backward_update(
                layout, w_ref, {}, Lookup(idx, off, None, PoolingMode.SUM), grad, opt, 1
            )
            assert torch.equal(w, w_ref)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("odd_at", [0, 1, 2])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad"])
def test_cpu_blocked_and_per_row_updates_agree_bitwise(
    kind: str, use_psw: bool, pooling: PoolingMode, odd_at: int
) -> None:
    # With SGD / row-wise Adagrad the kernel updates the rows of tables whose dim is a multiple
    # of 8 up to 64 in blocks, and the others one row at a time; a call of both kinds cuts its
    # sorted rows at each run of tables of one kind (update_rows_mixed). A table's result must
    # not depend on which tables share its call (sharding plans regroup them), so the two shared
    # tables come out bitwise the same alone (all blocked) and with a dim-12 table before,
    # between or after them (mixed).
    gen = torch.Generator().manual_seed(11)
    rows, dims, b = [700, 300], [16, 64], 64
    both = TBELayout(rows=tuple(rows), dims=tuple(dims), feature_table=(0, 1, 0))
    at = [0, 1]  # the shared tables' indices in `plus`
    at = [i + (i >= odd_at) for i in at]
    prow, pdim = list(rows), list(dims)
    prow.insert(odd_at, 40)
    pdim.insert(odd_at, 12)
    plus = TBELayout(
        rows=tuple(prow), dims=tuple(pdim), feature_table=(at[0], at[1], at[0], odd_at)
    )
    lengths = torch.randint(0, 12, (4 * b,), generator=gen)
    ids = [
        (
            torch.rand(int(lengths[f * b : (f + 1) * b].sum()), generator=gen) ** 2 * plus.rows[t]
        ).long()
        for f, t in enumerate(plus.feature_table)
    ]
    psw_all = [torch.rand(x.numel(), generator=gen) for x in ids]
    grad_all = torch.randn(b, plus.total_dim, generator=gen)
    w_init = {i: torch.randn(rows[i] * dims[i], generator=gen) for i in (0, 1)}
    opt = RowOptimizer(kind=kind, lr=0.05)
    got = []
    for lay, where in ((both, [0, 1]), (plus, at)):
        nf = lay.num_features
        ln = lengths[: nf * b]
        off = torch.zeros(nf * b + 1, dtype=torch.int64)
        torch.cumsum(ln, 0, out=off[1:])
        w = torch.randn(lay.total_elems, generator=gen)
        for i, t in enumerate(where):
            w[lay.elem_offsets[t] : lay.elem_offsets[t + 1]] = w_init[i]
        st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
        psw = torch.cat(psw_all[:nf]) if use_psw else None
        grad = grad_all[:, : lay.total_dim].contiguous()
        for step in (1, 2):
            CpuBackend().backward_update(
                lay, w, st, Lookup(torch.cat(ids[:nf]), off, psw, pooling), grad, opt, step
            )
        got.append(
            [
                (
                    w[lay.elem_offsets[t] : lay.elem_offsets[t + 1]],
                    {k: v[lay.row_offsets[t] : lay.row_offsets[t + 1]] for k, v in st.items()},
                )
                for t in where
            ]
        )
    for (wa, sa), (wb, sb) in zip(got[0], got[1]):
        assert torch.equal(wa, wb)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_apply_row_grads_adds_repeats_in_order_then_updates_once(backend: str, kind: str) -> None:
    # (id, gradient) pairs with repeated ids, tables of very different pair counts (several
    # calls): each row's pairs are added to zero in the order given, then one optimizer step.
    from neorec.ops.tbe import apply_row_grads, update_table_rows

    gen = torch.Generator().manual_seed(3)
    layout = TBELayout(rows=(50, 400, 30), dims=(8, 16, 12), feature_table=(0, 1, 2))
    counts = (3, 300, 40)  # two calls: tables 1 and 2 padded to 300 bags, table 0 alone
    grads = [
        (t, torch.randint(0, layout.rows[t], (n,), generator=gen), torch.randn(n, layout.dims[t]))
        for t, n in enumerate(counts)
    ]
    w0 = torch.randn(layout.total_elems, generator=gen)
    opt = RowOptimizer(kind=kind, lr=0.05)
    got_w = w0.clone()
    got_st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    for step in (1, 2):
        apply_row_grads(get_backend(backend), layout, got_w, got_st, grads, opt, step)
    want_w = w0.clone()
    want_st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    for step in (1, 2):
        for t, ids, g in grads:
            uniq, inv = torch.unique(ids, sorted=True, return_inverse=True)
            summed = torch.zeros(uniq.numel(), g.shape[1]).index_add_(0, inv, g)
            update_table_rows(layout, want_w, want_st, t, uniq, summed, opt, step)
    if backend == "reference":  # the same torch code: bitwise
        assert torch.equal(got_w, want_w)
    else:
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
    for k in want_st:
        torch.testing.assert_close(got_st[k], want_st[k], rtol=1e-6, atol=1e-7)
    # Grouping does not change a table's result: one call per table gives the same bits.
    solo_w = w0.clone()
    solo_st = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    for step in (1, 2):
        for item in grads:
            apply_row_grads(get_backend(backend), layout, solo_w, solo_st, [item], opt, step)
    assert torch.equal(solo_w, got_w)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("use_psw", [False, True])
def test_cpu_wide_bags_sum_in_id_order_bitwise(pooling: PoolingMode, use_psw: bool) -> None:
    """Bags wider than 64 columns are summed 64 columns at a time in registers: every output
    element is still 0 + r0 (* s0) + r1 (* s1) + ... in id order (then / n for a mean), exactly,
    whatever the output row's alignment (a dim-4 table first shifts every row by 16 bytes)."""
    layout = TBELayout(rows=(30, 40, 25, 20), dims=(4, 128, 72, 200), feature_table=(0, 1, 2, 3, 1))
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(layout.total_elems, generator=gen)
    b = 9
    lens = torch.randint(0, 6, (len(layout.feature_table) * b,), generator=gen)
    offsets = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lens, 0)
    ids = torch.cat(
        [torch.randint(0, layout.rows[t], (int(lens[f * b : (f + 1) * b].sum()),), generator=gen)
         for f, t in enumerate(layout.feature_table)]
    )  # fmt: skip
    psw = torch.rand(ids.numel(), generator=gen) if use_psw else None
    out = get_backend("cpu").forward(layout, w, Lookup(ids, offsets, psw, pooling))
    for f, t in enumerate(layout.feature_table):
        table = layout.table(w, t)
        lo_col = layout.out_offsets[f]
        for s in range(b):
            lo, hi = int(offsets[f * b + s]), int(offsets[f * b + s + 1])
            acc = torch.zeros(layout.dims[t])
            for p in range(lo, hi):
                row = table[int(ids[p])]
                acc = acc + (row * psw[p] if psw is not None else row)
            if pooling == PoolingMode.MEAN and hi > lo:
                acc = acc / float(hi - lo)
            assert torch.equal(out[s, lo_col : lo_col + layout.dims[t]], acc), (f, s)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_cpu_adam_row_update_is_the_float32_formula_bitwise(weight_decay: float) -> None:
    # The kernel's Adam update runs 16 / 8 values at a time with a scalar tail; every value must
    # be the scalar float32 formula's, operation for operation (vector multiply, add, divide and
    # square root round as the scalar ones). Dims cover the 16-wide, 8-wide and scalar parts.
    import numpy as np

    from neorec.ops.tbe import apply_row_grads

    gen = torch.Generator().manual_seed(11)
    dims = (3, 8, 16, 27, 64, 40)
    layout = TBELayout(rows=(20,) * len(dims), dims=dims, feature_table=tuple(range(len(dims))))
    grads = []
    for t in range(len(dims)):
        ids = torch.randperm(20, generator=gen)[:12]  # distinct: each row's sum is its one grad
        grads.append((t, ids, torch.randn(12, dims[t], generator=gen) * 3.0))
    w0 = torch.randn(layout.total_elems, generator=gen)
    opt = RowOptimizer(kind="adam", lr=0.05, weight_decay=weight_decay)
    w = w0.clone()
    st = zeros_state("adam", layout.total_rows, layout.total_elems, torch.device("cpu"))
    f = np.float32
    b1, b2, lr, eps = f(opt.beta1), f(opt.beta2), f(opt.lr), f(opt.eps)
    c1, c2, wd = f(1.0 - opt.beta1), f(1.0 - opt.beta2), f(weight_decay)
    want_w = w0.numpy().copy()
    m = np.zeros(layout.total_elems, dtype=f)
    v = np.zeros(layout.total_elems, dtype=f)
    offs = np.cumsum((0,) + tuple(r * d for r, d in zip(layout.rows, dims)))
    for step in (1, 2, 3):
        apply_row_grads(get_backend("cpu"), layout, w, st, grads, opt, step)
        bc1, bc2 = f(1.0 - opt.beta1**step), f(1.0 - opt.beta2**step)
        for t, ids, g in grads:
            for i, row in enumerate(ids.tolist()):
                sl = slice(offs[t] + row * dims[t], offs[t] + (row + 1) * dims[t])
                gd = g[i].numpy().astype(f)
                if wd:
                    gd = gd + wd * want_w[sl]
                md = m[sl] * b1 + c1 * gd
                vd = v[sl] * b2 + (c2 * gd) * gd
                m[sl], v[sl] = md, vd
                want_w[sl] = want_w[sl] - (lr * (md / bc1)) / (np.sqrt(vd / bc2) + eps)
    assert np.array_equal(w.numpy(), want_w)
    assert np.array_equal(st["exp_avg"].numpy(), m)
    assert np.array_equal(st["exp_avg_sq"].numpy(), v)
