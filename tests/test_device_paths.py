"""The GPU backends' device path on CPU tensors (``tbe_checks.device_checks_on_cpu``; triton under
its interpreter): equal to the reference and the host path (the TBE kernels, the padded row
gradients of data-parallel tables and their masked updates, the low-precision rows' working set),
device asserts that refuse bad input, the codecs' device-side checks; with no host read
(``no_host_sync`` of test_device_generic)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from test_device_generic import CPU_GPU_BACKENDS, gpu_backend, gpu_path, no_host_sync

from neorec.ops.tbe_checks import device_checks_on_cpu


def _padded(c: Any) -> Any:
    """``c`` with ids outside every bag before and after them (never read, never checked)."""
    from test_tbe import Case

    junk = torch.tensor([-5, 10**9, 3], dtype=c.indices.dtype)
    return Case(
        c.layout,
        c.weights,
        torch.cat([junk, c.indices, junk]),
        c.offsets + 3,
        torch.cat([torch.ones(3), c.psw, torch.full((3,), float("nan"))]),
        c.grad,
    )


@pytest.mark.parametrize("backend", CPU_GPU_BACKENDS)
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_gpu_backends_device_path_equals_reference(backend, kind):
    from test_tbe import make_case

    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode, get_backend

    be, ref = gpu_backend(backend), get_backend("reference")
    c, p = make_case(5, batch=10, id_range=4), None  # long runs of duplicates
    p = _padded(c)
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    lay = c.layout
    res = []
    for b_, case in ((ref, c), (be, p), (be, p)):
        w = case.weights.clone()
        st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
        with gpu_path(b_.name if b_ is be else None):
            lookup = Lookup(case.indices, case.offsets, case.psw, PoolingMode.MEAN)
            out = b_.forward(lay, w, lookup)
            for step in (1, 2):
                b_.backward_update(lay, w, st, lookup, case.grad, opt, step)
        res.append((out, w, st))
    (o_ref, w_ref, st_ref), (o, w, st), (o2, w2, st2) = res
    assert torch.equal(o, o2) and torch.equal(w, w2), "two runs differ"
    assert all(torch.equal(st[k], st2[k]) for k in st)
    torch.testing.assert_close(o, o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-6)
    for k in st:
        torch.testing.assert_close(st[k], st_ref[k], rtol=1e-6, atol=1e-7)
    if backend == "triton":  # the device path keeps the interpreter's bitwise claims
        assert torch.equal(o, o_ref)
        if kind == "sgd":
            assert torch.equal(w, w_ref)
    assert not torch.equal(w, c.weights)
    assert torch.equal(lay.table(w, 3), lay.table(c.weights, 3))  # table 3: no feature


@pytest.mark.parametrize("backend", CPU_GPU_BACKENDS)
def test_padded_row_grads_equal_row_grads(backend):
    """``row_grads_padded`` is ``row_grads`` in blocks of host-known sizes (its rows first, then
    zeros), and ``apply_padded_row_grads`` of padded blocks is ``apply_row_grads`` of their valid
    pairs, bitwise (the same backend), without a host read."""
    from test_tbe import make_case

    from neorec.ops.padded_rows import apply_padded_row_grads
    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode, apply_row_grads

    be, c = gpu_backend(backend), make_case(5, batch=10, id_range=4)
    lay, b = c.layout, c.grad.shape[0]
    args = (lay, Lookup(c.indices, c.offsets, c.psw, PoolingMode.MEAN), c.grad)
    with gpu_path(backend):
        plain = {t: (ids, g) for t, ids, g in be.row_grads(*args)}
    n_ids = [0] * lay.num_tables
    for f, t in enumerate(lay.feature_table):
        n_ids[t] += int(c.offsets[(f + 1) * b] - c.offsets[f * b])
    bounds = [n + 2 for n in n_ids]
    sites: set[str] = set()
    with gpu_path(backend), no_host_sync(sites):
        padded = be.row_grads_padded(*args, bounds)
    assert not sites and [p[0] for p in padded] == list(range(lay.num_tables))
    for t, ids, g, count in padded:
        k = int(count)
        want_ids, want_g = plain.get(t, (ids[:0], g[:0]))
        assert ids.numel() == bounds[t] and k == want_ids.numel()
        assert torch.equal(ids[:k], want_ids) and torch.equal(g[:k], want_g)
        assert not ids[k:].any() and not g[k:].any()
    # Two "ranks'" blocks in a row (the second's rows scaled), junk pairs after each.
    blocks, pairs = [], []
    for t, ids, g, count in padded:
        k, n = int(count), ids.numel()
        valid = torch.cat([torch.arange(n) < k, torch.zeros(3, dtype=torch.bool)] * 2)
        junk_ids, junk_g = torch.ones(3, dtype=ids.dtype), torch.full((3, g.shape[1]), 7.0)
        blocks.append((t, torch.cat([ids, junk_ids, ids, junk_ids]),
                       torch.cat([g, junk_g, 3 * g, junk_g]), valid))  # fmt: skip
        pairs.append((t, torch.cat([ids[:k], ids[:k]]), torch.cat([g[:k], 3 * g[:k]])))
    opt = RowOptimizer(kind="adam", lr=0.05, weight_decay=0.01)
    res = []
    for padded_path in (False, True):
        w = c.weights.clone()
        st = zeros_state("adam", lay.total_rows, lay.total_elems, torch.device("cpu"))
        with gpu_path(backend), no_host_sync(sites):
            if padded_path:
                apply_padded_row_grads(be, lay, w, st, blocks, opt, 3)
            else:
                apply_row_grads(be, lay, w, st, pairs, opt, 3)
        res.append((w, st))
    (w0, st0), (w1, st1) = res
    assert not torch.equal(w0, c.weights)
    assert torch.equal(w0, w1) and all(torch.equal(st0[k], st1[k]) for k in st0)
    assert not sites, sites


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_update_table_rows_padded_writes_only_valid_rows(kind):
    """``update_table_rows_padded`` of a block is ``update_table_rows`` of its valid entries,
    bitwise, without a host read: padding naming a valid row (row 0) or any row, junk gradients
    there, and a block with no valid entry (nothing written)."""
    from neorec.ops.padded_rows import update_table_rows_padded
    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import TBELayout, update_table_rows

    lay = TBELayout(rows=(6, 5), dims=(3, 2), feature_table=(0, 1))
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(lay.total_elems, generator=g)
    ids = torch.tensor([0, 2, 5, 0, 4, 0])  # valid: the first three
    grads = torch.randn(6, 3, generator=g)
    valid = torch.arange(6) < 3
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    res = []
    for padded in (False, True):
        w = w0.clone()
        st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
        for k in st:
            st[k].uniform_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
        sites: set[str] = set()
        with no_host_sync(sites):
            if padded:
                update_table_rows_padded(lay, w, st, 0, ids, grads, valid, opt, 2)
                none = torch.zeros(4, dtype=torch.bool)  # table 1: no valid entry
                update_table_rows_padded(lay, w, st, 1, ids[2:] % 5, grads[2:, :2], none, opt, 2)
            else:
                update_table_rows(lay, w, st, 0, ids[:3], grads[:3], opt, 2)
        assert not sites, sites
        res.append((w, st))
    (w_a, st_a), (w_b, st_b) = res
    assert not torch.equal(w_a, w0)
    assert torch.equal(w_a, w_b) and all(torch.equal(st_a[k], st_b[k]) for k in st_a)
    assert torch.equal(lay.table(w_b, 1), lay.table(w0, 1))  # (and its state: as unpadded)


@pytest.mark.parametrize("backend", CPU_GPU_BACKENDS)
@pytest.mark.parametrize(
    "precision,rounding,kind",
    [("fp16", "nearest", "adam"), ("bf16", "stochastic", "rowwise_adagrad"),
     ("fp8", "stochastic", "sgd"), ("fp8", "nearest", "adam")],
)  # fmt: skip
def test_lowp_rows_device_path_equals_host_path(backend, precision, rounding, kind):
    """Low-precision tables over a GPU backend: the device path's working set (one compact table
    per dim, sizes from shapes, masked write-back: no host read) stores the host path's bits
    (exactly each table's distinct rows), outputs and optimizer state included. Tables 0, 1
    and 3 share a dim; table 3 is never looked up; shards' stochastic-rounding keys."""
    from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat
    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode, TBELayout

    lay = TBELayout(rows=(50, 7, 100, 5), dims=(8, 8, 4, 8), feature_table=(0, 2, 0, 1))
    g, b = torch.Generator().manual_seed(3), 10
    lengths = torch.randint(0, 6, (lay.num_features * b,), generator=g)
    lengths[::5] = 0
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    ids = torch.cat([
        torch.randint(0, min(6, lay.rows[t]), (int(lengths[f * b : (f + 1) * b].sum()),),
                      generator=g)
        for f, t in enumerate(lay.feature_table)
    ])  # fmt: skip
    psw = torch.rand(ids.numel(), generator=g) + 0.5
    grad = torch.randn(b, lay.total_dim, generator=g)
    fmt = RowFormat(precision)
    w0 = fmt.empty(lay)
    for t in range(lay.num_tables):
        fmt.encode(w0, lay, t, None, torch.randn(lay.rows[t], lay.dims[t], generator=g))
    keys = [(11 * t + 1, 3 * t, t, lay.dims[t] + t) for t in range(lay.num_tables)]
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    res, sites = [], set()
    for device_path in (False, True):
        be = LowpRowsBackend(gpu_backend(backend), fmt, rounding, seed=5, keys=keys)
        w = w0.clone()
        st = zeros_state(kind, lay.total_rows, lay.total_elems, torch.device("cpu"))
        outs = []
        with (
            gpu_path(backend, device_checks=device_path),
            no_host_sync(sites) if device_path else contextlib.nullcontext(),
        ):
            lookup = Lookup(ids, offsets, psw, PoolingMode.MEAN)
            for step in (1, 2):
                outs.append(be.forward(lay, w, lookup))
                be.backward_update(lay, w, st, lookup, grad, opt, step)
        res.append((outs, w, st))
    assert not sites, f"host reads on the device path: {sorted(sites)}"
    (o0, w_0, st0), (o1, w_1, st1) = res
    assert not torch.equal(w_0, w0)
    assert all(torch.equal(a, c) for a, c in zip(o0, o1))
    assert torch.equal(w_0, w_1), "the stored rows differ"
    assert all(torch.equal(st0[k], st1[k]) for k in st0)


def test_lowp_rows_device_path_empty_batch():
    """An empty batch (no ids; no bags) on the device path: zeros out, nothing written."""
    from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat
    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode, TBELayout

    lay, fmt = TBELayout(rows=(5, 7), dims=(4, 4), feature_table=(0, 1)), RowFormat("fp8")
    w0 = fmt.empty(lay)
    for t in range(2):
        fmt.encode(w0, lay, t, None, torch.randn(lay.rows[t], 4))
    for b in (3, 0):
        be = LowpRowsBackend(gpu_backend("cuda"), fmt, "stochastic")
        w, offsets, ids = w0.clone(), torch.zeros(2 * b + 1, dtype=torch.int64), torch.zeros(0)
        st = zeros_state("adam", lay.total_rows, lay.total_elems, torch.device("cpu"))
        with gpu_path("cuda"):
            lookup = Lookup(ids.long(), offsets, None, PoolingMode.SUM)
            out = be.forward(lay, w, lookup)
            be.backward_update(lay, w, st, lookup, torch.ones(b, 8), RowOptimizer(kind="adam"), 1)
        assert out.shape == (b, 8) and not out.any()
        assert torch.equal(w, w0) and not any(v.any() for v in st.values())


@pytest.mark.parametrize("backend", CPU_GPU_BACKENDS)
def test_gpu_backends_device_asserts_refuse_bad_input(backend):
    """Bad ids, offsets, gradients and per-id weights still raise on the device path (here at
    once, ``_assert_async`` on CPU tensors), before anything is written."""
    from test_tbe import make_case

    from neorec.ops.row_optim import RowOptimizer, zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode
    from neorec.ops.tbe_checks import check_finite_weights, check_grad_output

    be, c = gpu_backend(backend), make_case(9)
    lay, b = c.layout, c.grad.shape[0]
    pos = int(c.offsets[3 * b]) + 1  # feature 3 reads table 1 (7 rows)
    bad_ids = c.indices.clone()
    bad_ids[pos] = 7
    bad_off = c.offsets.clone()
    bad_off[b] = bad_off[b + 1] + 1
    w = c.weights.clone()
    st = zeros_state("adam", lay.total_rows, lay.total_elems, torch.device("cpu"))
    with gpu_path(backend):
        for ids, off, match in [
            (bad_ids, c.offsets, "an id is out of range of its table"),
            (c.indices, bad_off, "offsets are not F.B.1 non-decreasing"),
            (c.indices, c.offsets + 1, "offsets are not"),
        ]:
            with pytest.raises(RuntimeError, match=match):
                be.forward(lay, w, Lookup(ids, off, None, PoolingMode.SUM))
            with pytest.raises(RuntimeError, match=match):
                be.backward_update(lay, w, st, Lookup(ids, off, None, PoolingMode.SUM), c.grad,
                                   RowOptimizer(kind="adam"), 1)  # fmt: skip
        g = c.grad.clone()
        g[2, 5] = float("inf")
        with pytest.raises(RuntimeError, match="gradient of the pooled embeddings"):
            check_grad_output(g, lay)
        psw = c.psw.clone()
        psw[4] = float("nan")
        with pytest.raises(RuntimeError, match="per-id weight is not finite"):
            check_finite_weights(psw)
    assert torch.equal(w, c.weights) and all(not bool(v.ne(0).any()) for v in st.values())
    # outside the device path (CPU tensors): the host checks, which name the culprit
    with pytest.raises(IndexError, match=r"feature 3 \(table 1"):
        be.forward(lay, w, Lookup(bad_ids, c.offsets, None, PoolingMode.SUM))


def test_codecs_refuse_non_finite_on_the_device_path():
    """On the device path the codecs' checks are device asserts (no host read), still
    refusing inf/NaN and a static scale's overflow; on the host path a ``CodecError``."""
    from neorec.distributed.codecs import CodecError, FloatCodec, Int8RowCodec

    x = torch.randn(6, 4)
    x[2, 1] = float("nan")
    big = torch.full((2, 3), 1e6)
    for codec in (FloatCodec("fp16", "tensor"), FloatCodec("fp8_e4m3", "row"), Int8RowCodec()):
        ops_reads: set[str] = set()  # (int8 quantizes in neorec/ops: its reads are recorded)
        with device_checks_on_cpu(), no_host_sync(ops_reads):
            with pytest.raises(RuntimeError, match="non-finite value.*in the fwd"):
                codec.encode(x, "fwd")
            ok = codec.decode(codec.encode(x.nan_to_num(), "fwd"), 6, 4)
        assert not ops_reads, (codec, ops_reads)
        assert torch.all((ok - x.nan_to_num()).abs() <= codec.bound(x.nan_to_num()))
        with pytest.raises(CodecError, match="1 non-finite"):
            codec.encode(x, "fwd")
    static = FloatCodec("fp16", "static", 1024.0)
    with device_checks_on_cpu(), pytest.raises(RuntimeError, match="overflows fp16"):
        static.encode(big, "bwd")
    with pytest.raises(CodecError, match="overflows fp16"):
        static.encode(big, "bwd")
