"""Triton TBE backend: the pooled forward and the fused backward + row optimizer as ``@triton.jit``
kernels. Same contract as ``reference`` and ``cpu`` (see ``ops/tbe.py``); fp32 weights.

- forward (``_pool_kernel``): one program per (bag, block of columns) walks the bag's ids in
  order, ``acc = 0 + w[id0]*psw0 + w[id1]*psw1 + ...`` in float32; mean divides by
  ``max(len, 1)`` afterwards (correctly rounded). Empty bags give zeros.
- backward: every looked-up id gets the global row key ``row_offsets[table] + id`` (ids outside
  ``offsets[0] .. offsets[-1]`` a key past every row); a *stable* ``torch.sort`` (outside the
  kernels) groups each row's occurrences in (feature, position) order, the reference's summation
  order. The first occurrence of each row (its head) carries the run's length, the others 0.
  ``_segment_grad_kernel`` (one program per (sorted occurrence, block of columns); only heads
  loop) sums each run in that order from zero, computing each occurrence's gradient on the fly as
  ``grad_output[sample, cols] / len * psw`` (the reference's order of operations);
  ``_row_update_kernel`` (one program per sorted occurrence, heads only act) applies SGD, exact
  row-wise Adagrad or Adam (per-element state, bias correction from the module's step) in place.
  Distinct rows: no two programs write the same row, no atomics, so two runs give the same bits.

No host read per step: the grids are sized by the batch's id count and bag count (shapes), not by
its distinct rows, and the inputs of CUDA tensors are checked by device asserts
(``tbe_checks.assert_inputs_async``; CPU tensors: the reference's host checks, which name the
position). Only ``row_grads`` (the host path) returns data-dependent sizes: one read of the
per-table row counts; ``row_grads_padded`` (what the device path of data-parallel tables and of
column-wise tables under row-wise Adagrad uses) none.

Rounding: divisions and square roots are ``div_rn`` / ``sqrt_rn`` (IEEE, like torch's), and the
kernels are launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA;
the one reduction whose order differs from torch's is the row-wise Adagrad ``mean(g*g)``
(``tl.sum`` vs ATen's vectorized sum).

``TRITON_INTERPRET=1`` in the environment when this module is first imported makes the kernels run
in triton's interpreter on CPU tensors (that is how the tests run them without a GPU);
``INTERPRET`` records which mode the kernels were built in. Keep it set while they run: triton
reads it again when a kernel is launched.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.fastpath import ran
from neorec.ops.padded_rows import PaddedRows, pad_heads, rows_by_table, segments
from neorec.ops.row_optim import RowOptimizer, state_shapes
from neorec.ops.tbe_checks import (
    TBEInputError,
    assert_inputs_async,
    bag_of_ids,
    check_grad_shape,
    check_shapes,
    on_device,
)
from neorec.ops.tbe_reference import ReferenceBackend
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = ["TritonBackend", "INTERPRET"]

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
"""Whether the kernels below were built for triton's interpreter (CPU tensors)."""

_MAX_BLOCK = 128  # columns per program of the forward and the segment reduce
_KINDS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}


@triton.jit
def _pool_kernel(
    w_ptr,
    idx_ptr,
    off_ptr,
    psw_ptr,
    out_ptr,
    f_elem_ptr,
    f_dim_ptr,
    f_out_ptr,
    B,
    total_dim,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (bag, column block): out[sample, out_off[f] + cols] = pooled rows of the bag."""
    bag = tl.program_id(0)
    f = bag // B
    s = bag - f * B
    dim = tl.load(f_dim_ptr + f)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < dim
    base = tl.load(f_elem_ptr + f)
    start = tl.load(off_ptr + bag).to(tl.int64)
    end = tl.load(off_ptr + bag + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(start, end):
        row = tl.load(idx_ptr + k).to(tl.int64)
        v = tl.load(w_ptr + base + row * dim + cols, mask=mask, other=0.0)
        if HAS_PSW:
            v = v * tl.load(psw_ptr + k)
        acc = acc + v
    if MEAN:
        n = tl.maximum(end - start, 1).to(tl.float32)
        acc = tl.math.div_rn(acc, tl.zeros([BLOCK_D], dtype=tl.float32) + n)
    out_col = tl.load(f_out_ptr + f)
    tl.store(out_ptr + s.to(tl.int64) * total_dim + out_col + cols, acc, mask=mask)


@triton.jit
def _segment_grad_kernel(
    grad_ptr,
    gbase_ptr,
    glen_ptr,
    psw_ptr,
    seg_count_ptr,
    u_dim_ptr,
    out_ptr,
    out_stride,
    HAS_PSW: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (sorted occurrence, column block): at a row's head, the sum of the row's occurrence
    gradients in the sorted (feature, position) order, from zero; nothing elsewhere."""
    u = tl.program_id(0)
    count = tl.load(seg_count_ptr + u)
    if count > 0:  # a head (an early exit elsewhere)
        dim = tl.load(u_dim_ptr + u)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < dim
        start = u.to(tl.int64)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in range(start, start + count):
            g = tl.load(grad_ptr + tl.load(gbase_ptr + k) + cols, mask=mask, other=0.0)
            if MEAN:
                n = tl.maximum(tl.load(glen_ptr + k), 1).to(tl.float32)
                g = tl.math.div_rn(g, tl.zeros([BLOCK_D], dtype=tl.float32) + n)
            if HAS_PSW:
                g = g * tl.load(psw_ptr + k)
            acc = acc + g
        tl.store(out_ptr + u.to(tl.int64) * out_stride + cols, acc, mask=mask)


@triton.jit
def _row_update_kernel(
    w_ptr,
    g_ptr,
    g_stride,
    m1_ptr,
    m_ptr,
    v_ptr,
    u_base_ptr,
    u_dim_ptr,
    u_key_ptr,
    seg_count_ptr,
    lr,
    eps,
    wd,
    b1,
    omb1,
    b2,
    omb2,
    bc1,
    bc2,
    KIND: tl.constexpr,
    HAS_WD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One sorted occurrence: at a row's head, the row optimizer in place on the whole row's
    weights and state; elsewhere nothing."""
    u = tl.program_id(0)
    if tl.load(seg_count_ptr + u) > 0:  # a head (an early exit elsewhere)
        dim = tl.load(u_dim_ptr + u)
        base = tl.load(u_base_ptr + u)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < dim
        zero = tl.zeros([BLOCK_D], dtype=tl.float32)
        g = tl.load(g_ptr + u.to(tl.int64) * g_stride + cols, mask=mask, other=0.0)
        w = tl.load(w_ptr + base + cols, mask=mask, other=0.0)
        if HAS_WD:
            g = g + wd * w
        if KIND == 0:
            w = w - lr * g
        elif KIND == 1:
            key = tl.load(u_key_ptr + u)
            sq = tl.sum(g * g, axis=0)
            s = tl.load(m1_ptr + key) + tl.math.div_rn(sq, dim.to(tl.float32))
            tl.store(m1_ptr + key, s)
            w = w - tl.math.div_rn(lr * g, zero + (tl.sqrt_rn(s) + eps))
        else:
            m = tl.load(m_ptr + base + cols, mask=mask, other=0.0)
            v = tl.load(v_ptr + base + cols, mask=mask, other=0.0)
            m = m * b1 + omb1 * g
            v = v * b2 + omb2 * g * g
            tl.store(m_ptr + base + cols, m, mask=mask)
            tl.store(v_ptr + base + cols, v, mask=mask)
            m_hat = tl.math.div_rn(m, zero + bc1)
            v_hat = tl.math.div_rn(v, zero + bc2)
            w = w - tl.math.div_rn(lr * m_hat, tl.sqrt_rn(v_hat) + eps)
        tl.store(w_ptr + base + cols, w, mask=mask)


def _launch_opts() -> dict[str, Any]:
    """No FMA contraction on a GPU (the interpreter never contracts)."""
    return {} if INTERPRET else {"enable_fp_fusion": False}


def _block(max_dim: int) -> int:
    return min(triton.next_power_of_2(max(max_dim, 1)), _MAX_BLOCK)


class _Sorted:
    """A batch's occurrences sorted by global row (stable), one slot per occurrence: a row's
    first occurrence (its head) holds the run's length in ``seg_count``, the others 0. Every size
    is the batch's id count, so nothing is read back to the host."""

    def __init__(self, layout: TBELayout, lookup: Lookup, bag: Tensor) -> None:
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights = lookup.per_sample_weights
        dev = indices.device
        meta = layout.meta(dev)
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        nbags = nf * b
        offsets = offsets.long()
        lengths = offsets[1:] - offsets[:-1]  # [F*B]
        inside = (bag >= 0) & (bag < nbags)
        bag_c = bag.clamp(0, max(nbags - 1, 0))
        f = bag_c // max(b, 1)
        s = bag_c - f * b
        t = meta["feature_table"][f]
        total = layout.total_rows
        key = torch.where(inside, meta["row_offsets"][t] + indices.long(), total)
        sorted_key, perm = torch.sort(key, stable=True)
        count, head, _ = segments(sorted_key, total)
        self.seg_count = torch.where(head, count, 0)
        self.head = head
        self.gbase = (s * layout.total_dim + meta["out_offsets"][f])[perm]
        self.glen = lengths[bag_c][perm]
        self.psw = per_sample_weights[perm] if per_sample_weights is not None else None
        self.key = sorted_key.clamp(0, max(total - 1, 0))  # (past-the-rows keys: never heads)
        self.u_table = torch.bucketize(self.key, meta["row_offsets"][1:], right=True)
        self.u_dim = meta["dims"][self.u_table]
        local = self.key - meta["row_offsets"][self.u_table]
        self.u_base = meta["elem_offsets"][self.u_table] + local * self.u_dim
        self.tables = sorted(set(layout.feature_table))


class TritonBackend:
    """TBE as triton kernels (CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``)."""

    name = "triton"

    def __init__(self) -> None:
        self._ref = ReferenceBackend()

    @property
    def interpret(self) -> bool:
        """Whether the kernels run in triton's interpreter: built for it, and
        ``TRITON_INTERPRET=1`` still set (triton reads it again while launching)."""
        return INTERPRET and bool(triton.knobs.runtime.interpret)

    def _check(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor | None:
        """Check the inputs: on the device for CUDA tensors (no host read; returns each id's bag,
        ``bag_of_ids``), by the reference's host checks for CPU ones (returns None)."""
        if weights.dtype != torch.float32 or weights.dim() != 1 or not weights.is_contiguous():
            raise TBEInputError(
                f"triton TBE backend: weights must be a flat contiguous float32 tensor, got "
                f"dtype {weights.dtype} shape {tuple(weights.shape)}"
            )
        indices, offsets = lookup.indices, lookup.offsets
        b = check_shapes(layout, weights, indices, offsets, lookup.per_sample_weights)
        if on_device(indices):
            return assert_inputs_async(layout, indices, offsets, b, self.name)
        self._ref._check(layout, weights, lookup)
        return None

    def forward(self, layout: TBELayout, weights: Tensor, lookup: Lookup) -> Tensor:
        """Pooled output [B, total_dim]."""
        self._check(layout, weights, lookup)
        ran("triton.forward")
        indices, offsets = lookup.indices, lookup.offsets
        per_sample_weights, pooling = lookup.per_sample_weights, lookup.pooling
        nf = layout.num_features
        b = (offsets.numel() - 1) // nf
        out = torch.empty(b, layout.total_dim, dtype=weights.dtype, device=weights.device)
        if b == 0 or layout.total_dim == 0:
            return out
        meta = layout.meta(weights.device)
        f_dims = meta["dims"][meta["feature_table"]]
        max_dim = max(layout.dims[t] for t in layout.feature_table)
        blk = _block(max_dim)
        psw = per_sample_weights.contiguous() if per_sample_weights is not None else weights
        grid = (nf * b, triton.cdiv(max_dim, blk))
        _pool_kernel[grid](
            weights,
            indices.contiguous(),
            offsets.contiguous(),
            psw,
            out,
            meta["elem_offsets"][meta["feature_table"]].contiguous(),
            f_dims.contiguous(),
            meta["out_offsets"][:-1].contiguous(),
            b,
            layout.total_dim,
            HAS_PSW=per_sample_weights is not None,
            MEAN=PoolingMode(pooling) == PoolingMode.MEAN,
            BLOCK_D=blk,
            **_launch_opts(),
        )
        return out

    def _summed(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor, bag: Tensor
    ) -> tuple[_Sorted, Tensor]:
        """The sorted batch and at each head its row's summed gradient [n, max dim] (padded;
        the rows of other occurrences are left zero)."""
        srt = _Sorted(layout, lookup, bag)
        max_dim = max((layout.dims[t] for t in srt.tables), default=1)
        n_u = lookup.indices.numel()
        summed = torch.zeros(n_u, max_dim, dtype=torch.float32, device=grad_output.device)
        if n_u:
            blk = _block(max_dim)
            _segment_grad_kernel[(n_u, triton.cdiv(max_dim, blk))](
                grad_output.contiguous(),
                srt.gbase,
                srt.glen,
                srt.psw if srt.psw is not None else grad_output,
                srt.seg_count,
                srt.u_dim,
                summed,
                max_dim,
                HAS_PSW=srt.psw is not None,
                MEAN=PoolingMode(lookup.pooling) == PoolingMode.MEAN,
                BLOCK_D=blk,
                **_launch_opts(),
            )
        return srt, summed

    def row_grads(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor
    ) -> list[tuple[int, Tensor, Tensor]]:
        """Per looked-up table: (t, sorted distinct ids [U], summed gradients [U, D]).

        The sizes are data-dependent: one host read (the per-table counts) per call
        (``row_grads_padded`` has none)."""
        bag = bag_of_ids(lookup.offsets, lookup.indices.numel())  # (unchecked, as the reference's)
        srt, summed = self._summed(layout, lookup, grad_output, bag)
        return rows_by_table(layout, srt.key, srt.head, summed, srt.tables)

    def row_grads_padded(
        self, layout: TBELayout, lookup: Lookup, grad_output: Tensor, bounds: list[int]
    ) -> list[PaddedRows]:
        """``row_grads`` in a block of ``bounds[t]`` rows per table t, the count on the device
        (``padded_rows.pad_heads``): no host read."""
        n = lookup.indices.numel()
        if n == 0:
            return pad_heads(layout, None, None, None, bounds, grad_output.device)
        bag = bag_of_ids(lookup.offsets, n)  # (unchecked, as the reference's)
        srt, summed = self._summed(layout, lookup, grad_output, bag)
        return pad_heads(layout, srt.key, srt.head, summed, bounds, grad_output.device)

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        lookup: Lookup,
        grad_output: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """Sum each distinct row's gradients in a fixed order, then apply the optimizer."""
        if opt.clips:
            raise ConfigError("CowClip (embedding.cowclip_ratio) is not in the triton backend")
        if opt.qat is not None:
            raise ConfigError("QAT (train.qat) is not in the triton backend")
        bag = self._check(layout, weights, lookup)
        ran("triton.backward")
        if bag is None:
            bag = bag_of_ids(lookup.offsets, lookup.indices.numel())
        check_grad_shape(grad_output, layout, lookup.offsets)
        if grad_output.dtype != torch.float32:
            raise TBEInputError(f"grad_output must be float32, got {grad_output.dtype}")
        for k in state_shapes(opt.kind, layout.total_rows, layout.total_elems):
            if k not in state:
                raise TBEInputError(f"triton TBE backend: optimizer '{opt.kind}' needs state '{k}'")
        srt, summed = self._summed(layout, lookup, grad_output, bag)
        n_u = lookup.indices.numel()
        if not n_u:
            return
        m1 = state.get("momentum1", weights)
        m = state.get("exp_avg", weights)
        v = state.get("exp_avg_sq", weights)
        _row_update_kernel[(n_u,)](
            weights,
            summed,
            summed.shape[1],
            m1,
            m,
            v,
            srt.u_base,
            srt.u_dim,
            srt.key,
            srt.seg_count,
            opt.lr,
            opt.eps,
            opt.weight_decay,
            opt.beta1,
            1.0 - opt.beta1,
            opt.beta2,
            1.0 - opt.beta2,
            1.0 - opt.beta1**step,
            1.0 - opt.beta2**step,
            KIND=_KINDS[opt.kind],
            HAS_WD=bool(opt.weight_decay),
            BLOCK_D=triton.next_power_of_2(summed.shape[1]),
            **_launch_opts(),
        )
