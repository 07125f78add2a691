"""The TBE contract against the triton backend, run by triton's interpreter on CPU tensors.

``TRITON_INTERPRET=1`` must be in the environment when ``@triton.jit`` decorates the kernels
(the first import of ``neorec.ops.triton_tbe``) and again while they are launched (triton reads
it then too): it is set around that import and, by an autouse fixture, during each test of this
module only. Skips when triton is not installed (the optional ``neorec[gpu]`` extra).

What is bitwise against the reference backend, and why: the forward (each bag summed from zero in
position order, then one IEEE division for mean), the summed row gradients (each row's
occurrences in (feature, position) order from zero, ``g / len * psw`` per occurrence), SGD
updates, and Adam's ``exp_avg`` / ``exp_avg_sq``. To tolerance (1e-6, the cpu backend's): Adam's
weights and everything of row-wise Adagrad, because torch's CPU ``sqrt`` of float32 is not
correctly rounded (the kernels use ``sqrt_rn``) and ``mean(g*g)`` sums in another order.
Two runs of the triton backend are always bitwise equal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch import Tensor

_old = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    from neorec.ops import triton_tbe
finally:
    if _old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _old

from test_tbe import (  # noqa: E402 - after the interpreter is switched on
    OPTIMIZERS,
    POOLINGS,
    make_case,
    oracle_state,
    oracle_step,
    run_steps,
)

from neorec.errors import ConfigError  # noqa: E402
from neorec.ops import tbe  # noqa: E402
from neorec.ops.row_optim import RowOptimizer, zeros_state  # noqa: E402
from neorec.ops.tbe import (  # noqa: E402
    Lookup,
    PoolingMode,
    TBEInputError,
    TBELayout,
    apply_row_grads,
    get_backend,
    tbe_lookup,
)

if not triton_tbe.INTERPRET:
    pytest.skip(
        "neorec.ops.triton_tbe was imported without TRITON_INTERPRET=1 earlier in this session",
        allow_module_level=True,
    )

pytestmark = pytest.mark.bitwise


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET=1 for this module's tests (triton reads it at launch), nowhere else."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def both(case_seed: int, kind: str, pooling: PoolingMode, use_psw: bool, wd: float = 0.01):
    """(triton, reference) weights and state after steps 1 and 2 of the same batch."""
    case = make_case(case_seed)
    return (
        run_steps("triton", case, kind, pooling, use_psw, wd=wd),
        run_steps("reference", case, kind, pooling, use_psw, wd=wd),
    )


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_forward_equals_reference_bitwise(
    pooling: PoolingMode, use_psw: bool, fast_paths: Any
) -> None:
    c = make_case(1)
    psw = c.psw if use_psw else None
    got = get_backend("triton").forward(
        c.layout, c.weights, Lookup(c.indices, c.offsets, psw, pooling)
    )
    want = get_backend("reference").forward(
        c.layout, c.weights, Lookup(c.indices, c.offsets, psw, pooling)
    )
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert fast_paths()["triton.forward"] == 1, "the Triton kernel ran (in the interpreter)"
    b = c.grad.shape[0]
    empty = (c.offsets[1:] - c.offsets[:-1]).view(-1, b) == 0  # [F, B]
    f, s = (int(x) for x in empty.nonzero()[0])
    lo, hi = c.layout.out_offsets[f], c.layout.out_offsets[f + 1]
    assert torch.all(got[s, lo:hi] == 0), "an empty bag pools to zeros"


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
def test_row_grads_equal_reference_bitwise(pooling: PoolingMode, use_psw: bool) -> None:
    c = make_case(3)
    psw = c.psw if use_psw else None
    got = get_backend("triton").row_grads(
        c.layout, Lookup(c.indices, c.offsets, psw, pooling), c.grad
    )
    want = get_backend("reference").row_grads(
        c.layout, Lookup(c.indices, c.offsets, psw, pooling), c.grad
    )
    assert [t for t, _, _ in got] == [t for t, _, _ in want] == [0, 1, 2]
    for (_, ids_g, g_g), (_, ids_w, g_w) in zip(got, want, strict=True):
        assert torch.equal(ids_g, ids_w) and torch.equal(g_g, g_w)


@pytest.mark.parametrize("use_psw", [False, True])
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_update_equals_reference_and_oracle(kind: str, pooling: PoolingMode, use_psw: bool) -> None:
    (w, st), (w_ref, st_ref) = both(2, kind, pooling, use_psw)
    case = make_case(2)
    assert not torch.equal(w, case.weights), "the step changed nothing"
    if kind == "sgd":
        assert torch.equal(w, w_ref)
    else:
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    for k in st_ref:
        if kind == "adam":
            assert torch.equal(st[k], st_ref[k]), k
        else:
            torch.testing.assert_close(st[k], st_ref[k], rtol=1e-6, atol=1e-7)
    # and the float64 oracle (dense autograd + textbook optimizers), as the other backends
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    w64, st64 = case.weights.double(), oracle_state(kind, case.layout)
    for s in (1, 2):
        oracle_step(case, w64, st64, case.psw if use_psw else None, pooling, opt, s)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=2e-6)


def test_adam_bias_correction_uses_step_count() -> None:
    case = make_case(3)
    opt = RowOptimizer(kind="adam", lr=0.05)
    w64, st64 = case.weights.double(), oracle_state("adam", case.layout)
    for s in (1, 2, 7):
        oracle_step(case, w64, st64, None, PoolingMode.SUM, opt, s)
    w, _ = run_steps("triton", case, "adam", PoolingMode.SUM, False, steps=(1, 2, 7), wd=0.0)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=2e-6)
    w3, _ = run_steps("triton", case, "adam", PoolingMode.SUM, False, steps=(1, 2, 3), wd=0.0)
    assert not torch.allclose(w3, w), "step 7 and step 3 must differ in bias correction"


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_two_runs_bitwise_equal(kind: str) -> None:
    case = make_case(5, batch=16, id_range=4)  # long runs of duplicates
    runs = [run_steps("triton", case, kind, PoolingMode.MEAN, True) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for k in runs[0][1]:
        assert torch.equal(runs[0][1][k], runs[1][1][k])
    be = get_backend("triton")
    outs = [
        be.forward(
            case.layout, case.weights, Lookup(case.indices, case.offsets, case.psw, PoolingMode.SUM)
        )
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])


def test_tbe_lookup_autograd_updates_weights_without_grad() -> None:
    c = make_case(4)
    be = get_backend("triton")
    w = c.weights.clone()
    w0 = w.clone()
    st = zeros_state("rowwise_adagrad", c.layout.total_rows, c.layout.total_elems, w.device)
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.1)
    anchor = torch.empty(0, requires_grad=True)

    def update(g: Tensor) -> None:
        be.backward_update(
            c.layout, w, st, Lookup(c.indices, c.offsets, None, PoolingMode.SUM), g, opt, 1
        )

    out = tbe_lookup(
        anchor, be, c.layout, w, Lookup(c.indices, c.offsets, None, PoolingMode.SUM), update
    )
    (out * c.grad).sum().backward()
    assert w.grad is None and not torch.equal(w, w0)
    assert torch.equal(c.layout.table(w, 3), c.layout.table(w0, 3))  # table 3: no feature


def test_untouched_tables_and_rows_do_not_move() -> None:
    case = make_case(7)
    w, st = run_steps("triton", case, "adam", PoolingMode.SUM, True)
    lay = case.layout
    assert torch.equal(lay.table(w, 3), lay.table(case.weights, 3))
    assert torch.all(lay.table(st["exp_avg"], 3) == 0)
    assert torch.equal(lay.table(w, 2)[9:], lay.table(case.weights, 2)[9:])  # lazy


def test_int32_inputs() -> None:
    c = make_case(8)
    be = get_backend("triton")
    outs, ws = [], []
    for dt in (torch.int64, torch.int32):
        w = c.weights.clone()
        idx, off = c.indices.to(dt), c.offsets.to(dt)
        outs.append(be.forward(c.layout, w, Lookup(idx, off, c.psw, PoolingMode.MEAN)))
        be.backward_update(
            c.layout,
            w,
            {},
            Lookup(idx, off, c.psw, PoolingMode.MEAN),
            c.grad,
            RowOptimizer(kind="sgd"),
            1,
        )
        ws.append(w)
    assert torch.equal(outs[0], outs[1]) and torch.equal(ws[0], ws[1])


@pytest.mark.parametrize("bad_id", [7, -1, 2**62])
def test_out_of_range_id_is_refused_before_any_write(bad_id: int) -> None:
    c = make_case(9)
    b = c.grad.shape[0]
    pos = int(c.offsets[3 * b]) + 1  # feature 3 reads table 1 (7 rows)
    c.indices[pos] = bad_id
    be = get_backend("triton")
    with pytest.raises(IndexError, match=rf"feature 3 \(table 1.*id {bad_id}\b"):
        be.forward(c.layout, c.weights, Lookup(c.indices, c.offsets, None, PoolingMode.SUM))
    w = c.weights.clone()
    st = zeros_state("rowwise_adagrad", c.layout.total_rows, c.layout.total_elems, w.device)
    with pytest.raises(IndexError, match=rf"feature 3 .*id {bad_id}\b"):
        be.backward_update(
            c.layout,
            w,
            st,
            Lookup(c.indices, c.offsets, None, PoolingMode.SUM),
            c.grad,
            RowOptimizer(),
            1,
        )
    assert torch.equal(w, c.weights)


def test_malformed_inputs_are_refused_before_any_write() -> None:
    c = make_case(11)
    be = get_backend("triton")
    b = c.grad.shape[0]
    bad_offsets = c.offsets.clone()
    bad_offsets[b] = bad_offsets[b + 1] + 1
    st = zeros_state("adam", c.layout.total_rows, c.layout.total_elems, torch.device("cpu"))
    for w, off, psw, match in [
        (c.weights, bad_offsets, c.psw, "decrease"),
        (c.weights, c.offsets + 1, c.psw, "offsets span"),
        (c.weights, c.offsets, c.psw[:-1], "per_sample_weights"),
        (c.weights.double(), c.offsets, c.psw, "float32"),
    ]:
        w = w.clone()
        with pytest.raises(TBEInputError, match=match):
            be.forward(c.layout, w, Lookup(c.indices, off, psw, PoolingMode.SUM))
        with pytest.raises(TBEInputError, match=match):
            be.backward_update(
                c.layout, w, st, Lookup(c.indices, off, psw, PoolingMode.SUM), c.grad,
                RowOptimizer(kind="adam"), 1,
            )  # fmt: skip
        assert torch.equal(w, c.weights.to(w.dtype))
    with pytest.raises(TBEInputError, match="exp_avg_sq"):
        be.backward_update(
            c.layout, c.weights.clone(), {"exp_avg": st["exp_avg"]},
            Lookup(c.indices, c.offsets, None, PoolingMode.SUM), c.grad, RowOptimizer(kind="adam"), 1,
        )  # fmt: skip
    assert all(not bool(v.ne(0).any()) for v in st.values())


def test_all_bags_empty() -> None:
    lay = TBELayout(rows=(4,), dims=(2,), feature_table=(0,))
    w = torch.randn(lay.total_elems)
    idx = torch.zeros(0, dtype=torch.int64)
    off = torch.zeros(4, dtype=torch.int64)
    be = get_backend("triton")
    out = be.forward(lay, w, Lookup(idx, off, None, PoolingMode.MEAN))
    assert out.shape == (3, 2) and torch.all(out == 0)
    w0 = w.clone()
    be.backward_update(
        lay,
        w,
        {},
        Lookup(idx, off, None, PoolingMode.MEAN),
        torch.ones(3, 2),
        RowOptimizer(kind="sgd"),
        1,
    )
    assert torch.equal(w, w0)


def test_apply_row_grads_equals_reference_bitwise_for_sgd() -> None:
    gen = torch.Generator().manual_seed(3)
    layout = TBELayout(rows=(50, 40, 30), dims=(8, 16, 12), feature_table=(0, 1, 2))
    grads = [
        (t, torch.randint(0, layout.rows[t], (n,), generator=gen), torch.randn(n, layout.dims[t]))
        for t, n in enumerate((3, 30, 12))
    ]
    w0 = torch.randn(layout.total_elems, generator=gen)
    res = []
    for name in ("triton", "reference"):
        w = w0.clone()
        apply_row_grads(get_backend(name), layout, w, {}, grads, RowOptimizer(kind="sgd"), 1)
        res.append(w)
    assert torch.equal(res[0], res[1]) and not torch.equal(res[0], w0)


def test_get_backend_triton_needs_cuda_or_the_interpreter(monkeypatch) -> None:
    assert get_backend("triton", "cpu").name == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="needs weights on a CUDA device, or TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")
    with pytest.raises(ConfigError, match="needs weights on a CUDA device.*not meta"):
        get_backend("triton", "meta")


def test_auto_prefers_triton_on_cuda(monkeypatch) -> None:
    # torch.device("cuda") needs no GPU; the backends are only looked up, never run here.
    assert get_backend("auto", "cuda").name == "triton"
    monkeypatch.setattr(tbe, "_triton_importable", lambda: False)
    assert get_backend("auto", "cuda").name == "cuda"
    assert get_backend("auto", "cpu").name in ("cpu", "reference")


def test_missing_triton_is_one_line_config_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    tbe._make.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"pip install 'neorec\[gpu\]'") as info:
            get_backend("triton", "cuda")
        assert "\n" not in str(info.value)
    finally:
        tbe._make.cache_clear()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_low_precision_tables_through_the_lowp_wrapper(precision: str) -> None:
    """fp16 / bf16 / fp8 tables: ``LowpRowsBackend`` over triton equals the triton kernels on the
    decoded fp32 rows, the updated rows rounded to the format (nearest), state bitwise."""
    from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat

    c = make_case(12)
    lay, fmt, inner = c.layout, RowFormat(precision), get_backend("triton")
    lp = LowpRowsBackend(inner, fmt, "nearest")
    packed = fmt.empty(lay)
    for t in range(lay.num_tables):
        fmt.encode(packed, lay, t, None, lay.table(c.weights, t) * 0.1)
    ref_w = torch.cat([fmt.decode(packed, lay, t).reshape(-1) for t in range(lay.num_tables)])
    opt = RowOptimizer(kind="adam", lr=0.05)
    st_lp = zeros_state(opt.kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
    st_ref = {k: v.clone() for k, v in st_lp.items()}
    for step in (1, 2):
        got = lp.forward(lay, packed, Lookup(c.indices, c.offsets, c.psw, PoolingMode.MEAN))
        assert torch.equal(
            got, inner.forward(lay, ref_w, Lookup(c.indices, c.offsets, c.psw, PoolingMode.MEAN))
        )
        args = (Lookup(c.indices, c.offsets, c.psw, PoolingMode.MEAN), c.grad, opt, step)
        lp.backward_update(lay, packed, st_lp, *args)
        inner.backward_update(lay, ref_w, st_ref, *args)
        for k in st_ref:
            assert torch.equal(st_lp[k], st_ref[k]), k
        for t in range(lay.num_tables):
            spec = fmt.empty(lay)
            fmt.encode(spec, lay, t, None, lay.table(ref_w, t))
            assert torch.equal(fmt.decode(packed, lay, t), fmt.decode(spec, lay, t)), t
            lay.table(ref_w, t).copy_(fmt.decode(spec, lay, t))


def test_rows_wider_than_one_column_block() -> None:
    """A dim over the kernels' 128-column block (two blocks, the second partly masked) next to a
    narrow one: forward, row gradients and SGD bitwise the reference's, Adam to tolerance."""
    lay = TBELayout(rows=(6, 5), dims=(130, 3), feature_table=(0, 1, 0))
    gen = torch.Generator().manual_seed(13)
    b = 4
    lengths = torch.randint(0, 4, (lay.num_features * b,), generator=gen)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    idx = torch.cat(
        [
            torch.randint(0, lay.rows[t], (int(lengths[f * b : (f + 1) * b].sum()),), generator=gen)
            for f, t in enumerate(lay.feature_table)
        ]
    )
    psw = torch.rand(idx.numel(), generator=gen)
    grad = torch.randn(b, lay.total_dim, generator=gen)
    w0 = torch.randn(lay.total_elems, generator=gen)
    tri, ref = get_backend("triton"), get_backend("reference")
    for pooling in POOLINGS:
        assert torch.equal(
            tri.forward(lay, w0, Lookup(idx, offsets, psw, pooling)),
            ref.forward(lay, w0, Lookup(idx, offsets, psw, pooling)),
        )
        got = tri.row_grads(lay, Lookup(idx, offsets, psw, pooling), grad)
        want = ref.row_grads(lay, Lookup(idx, offsets, psw, pooling), grad)
        for (t_g, i_g, g_g), (t_w, i_w, g_w) in zip(got, want, strict=True):
            assert t_g == t_w and torch.equal(i_g, i_w) and torch.equal(g_g, g_w)
    for kind in ("sgd", "adam"):
        res = []
        for be in (tri, ref):
            w = w0.clone()
            st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
            opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
            be.backward_update(
                lay, w, st, Lookup(idx, offsets, psw, PoolingMode.MEAN), grad, opt, 1
            )
            res.append(w)
        if kind == "sgd":
            assert torch.equal(res[0], res[1]) and not torch.equal(res[0], w0)
        else:
            torch.testing.assert_close(res[0], res[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_low_precision_tables_through_the_triton_backend(kind: str, precision: str) -> None:
    """LoKA's fp16 / bf16 tables on the triton backend (``LowpRowsBackend`` over it): the forward
    is the triton kernel on the decoded rows, and after an update each stored row is the triton
    kernel's fp32 update of the decoded rows, rounded to the format; the fp32 state equal."""
    from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat

    layout = TBELayout((40, 25), (8, 4), (0, 1, 1))
    fmt, inner = RowFormat(precision), get_backend("triton")
    lp = LowpRowsBackend(inner, fmt, "nearest")
    opt = RowOptimizer(kind=kind, lr=0.05)
    g = torch.Generator().manual_seed(11)
    packed = fmt.empty(layout)
    for t, (r, d) in enumerate(zip(layout.rows, layout.dims)):
        fmt.encode(packed, layout, t, None, torch.randn(r, d, generator=g) * 0.1)
    ref_w = torch.cat([fmt.decode(packed, layout, t).reshape(-1) for t in range(2)])
    st_lp = zeros_state(kind, layout.total_rows, layout.total_elems, torch.device("cpu"))
    st_ref = {k: v.clone() for k, v in st_lp.items()}
    b = 6
    for step in (1, 2):
        lengths = torch.randint(0, 4, (layout.num_features * b,), generator=g)
        ids = []
        for f, t in enumerate(layout.feature_table):
            n = int(lengths[f * b : (f + 1) * b].sum())
            ids.append(torch.randint(0, layout.rows[t], (n,), generator=g))
        idx = torch.cat(ids)
        off = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=off[1:])
        grad = torch.randn(b, layout.total_dim, generator=g)
        got = lp.forward(layout, packed, Lookup(idx, off, None, PoolingMode.SUM))
        assert torch.equal(
            got, inner.forward(layout, ref_w, Lookup(idx, off, None, PoolingMode.SUM))
        )
        lp.backward_update(
            layout, packed, st_lp, Lookup(idx, off, None, PoolingMode.SUM), grad, opt, step
        )
        inner.backward_update(
            layout, ref_w, st_ref, Lookup(idx, off, None, PoolingMode.SUM), grad, opt, step
        )
        for k in st_ref:
            assert torch.equal(st_lp[k], st_ref[k]), (k, step)
        spec = fmt.empty(layout)
        for t in range(2):
            fmt.encode(spec, layout, t, None, layout.table(ref_w, t))
            assert torch.equal(fmt.decode(packed, layout, t), fmt.decode(spec, layout, t))
            layout.table(ref_w, t).copy_(fmt.decode(spec, layout, t))
