"""Sequence (non-pooled) lookup of many tables in one call, backward fused with the row optimizer.

A sequence feature's ids are not pooled: each id's row is an output row. Feature ``f`` (of a
``TBELayout``: its table ``feature_table[f]``) owns ids ``indices[fpos[f]:fpos[f+1]]``; the output
is one flat float32 buffer in which feature ``f``'s rows are a [n_f, D_f] block at
``seq_out_offsets(layout, fpos)[f]`` (mixed dims allowed). The backward is the pooled TBE's with
bags of length 1: each distinct row's gradients summed in (feature, position) order, then one
update of ``row_optim`` per row, so the result is bitwise reproducible.

Backends: ``reference`` (the pooled reference backend on bags of length 1: the specification's
arithmetic; any device) and ``cpu`` (``csrc/seq_cpu.c``, which reuses the pooled kernel's sort and
fused row update). No GPU kernel yet: ``auto`` on CUDA takes the reference.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.fastpath import ran
from neorec.ops.row_optim import RowOptimizer, state_shapes
from neorec.ops.tbe_checks import TBEIdError, TBEInputError
from neorec.ops.tbe_reference import ReferenceBackend
from neorec.ops.tbe_types import Lookup, PoolingMode, TBELayout

__all__ = [
    "SeqBackend",
    "ReferenceSeqBackend",
    "CpuSeqBackend",
    "get_seq_backend",
    "seq_out_offsets",
    "as_pooled",
    "seq_lookup",
]


def seq_out_offsets(layout: TBELayout, fpos: list[int]) -> list[int]:
    """Where each feature's [n_f, D_f] block starts in the flat output, [F + 1]."""
    out = [0]
    for f, t in enumerate(layout.feature_table):
        out.append(out[-1] + (fpos[f + 1] - fpos[f]) * layout.dims[t])
    return out


def _check(layout: TBELayout, weights: Tensor, indices: Tensor, fpos: list[int]) -> None:
    """One ``TBEInputError`` for malformed input, before any read."""
    if weights.numel() != layout.total_elems:
        raise TBEInputError(
            f"weights has {weights.numel()} elements, expected {layout.total_elems}"
        )
    if indices.dim() != 1 or indices.dtype not in (torch.int32, torch.int64):
        raise TBEInputError(
            f"indices must be 1-D int32/int64, got {tuple(indices.shape)} {indices.dtype}"
        )
    if len(fpos) != layout.num_features + 1:
        raise TBEInputError(
            f"fpos has {len(fpos)} entries, expected F+1 = {layout.num_features + 1}"
        )
    if fpos[0] < 0 or fpos[-1] > indices.numel() or any(a > b for a, b in zip(fpos, fpos[1:])):
        raise TBEInputError(f"fpos {fpos} must ascend within the {indices.numel()} indices")


def _check_ids(layout: TBELayout, indices: Tensor, fpos: list[int]) -> None:
    for f, t in enumerate(layout.feature_table):
        ids = indices[fpos[f] : fpos[f + 1]]
        bad = (ids < 0) | (ids >= layout.rows[t])
        if ids.numel() and bool(bad.any()):
            _raise_id(layout, indices, fpos, fpos[f] + int(bad.nonzero()[0, 0]))


def _raise_id(layout: TBELayout, indices: Tensor, fpos: list[int], pos: int) -> None:
    f = max(i for i in range(layout.num_features) if fpos[i] <= pos)
    t = layout.feature_table[f]
    raise TBEIdError(
        f"feature {f} (table {t}, rows {layout.rows[t]}): id {int(indices[pos])} at position "
        f"{pos} is out of range [0, {layout.rows[t]})"
    )


def as_pooled(
    layout: TBELayout, indices: Tensor, fpos: list[int], grad: Tensor | None = None
) -> tuple[Lookup, Tensor | None]:
    """The same lookup as a pooled one with bags of length 1: B = the longest feature's ids, the
    shorter features' last bags empty; with ``grad`` (flat), its pooled [B, total_dim] form."""
    counts = [fpos[f + 1] - fpos[f] for f in range(layout.num_features)]
    b = max([1, *counts])
    lengths = torch.zeros(layout.num_features, b, dtype=torch.int64)
    for f, n in enumerate(counts):
        lengths[f, :n] = 1
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.view(-1), 0, out=offsets[1:])
    dev = indices.device
    lookup = Lookup(indices[fpos[0] : fpos[-1]], (offsets).to(dev), None, PoolingMode.SUM)
    if grad is None:
        return lookup, None
    g = torch.zeros(b, layout.total_dim, dtype=grad.dtype, device=grad.device)
    oo = seq_out_offsets(layout, fpos)
    for f, t in enumerate(layout.feature_table):
        block = grad[oo[f] : oo[f + 1]].view(counts[f], layout.dims[t])
        g[: counts[f], layout.out_offsets[f] : layout.out_offsets[f + 1]] = block
    return lookup, g


class SeqBackend(Protocol):
    """A sequence lookup implementation (``reference`` is the specification)."""

    name: str

    def forward(
        self, layout: TBELayout, weights: Tensor, indices: Tensor, fpos: list[int]
    ) -> Tensor:
        """The flat output: feature f's rows as [n_f, D_f] at ``seq_out_offsets[f]``."""
        ...

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        batch: tuple[Tensor, list[int]],
        grad: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """Apply ``opt`` in place to the rows ``batch`` (indices, fpos) touched, from the flat
        gradient ``grad`` of the output: each row's gradients summed in (feature, position)
        order, one update per distinct row."""
        ...


class ReferenceSeqBackend:
    """Plain PyTorch: a gather forward, the pooled reference backward on bags of length 1."""

    name = "reference"

    def forward(
        self, layout: TBELayout, weights: Tensor, indices: Tensor, fpos: list[int]
    ) -> Tensor:
        """The flat output (see ``SeqBackend.forward``)."""
        _check(layout, weights, indices, fpos)
        _check_ids(layout, indices, fpos)
        parts = [
            layout.table(weights, t)[indices[fpos[f] : fpos[f + 1]]].reshape(-1)
            for f, t in enumerate(layout.feature_table)
        ]
        return torch.cat(parts) if parts else weights.new_zeros(0)

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        batch: tuple[Tensor, list[int]],
        grad: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """The pooled reference's fused update on bags of length 1."""
        indices, fpos = batch
        _check(layout, weights, indices, fpos)
        lookup, g = as_pooled(layout, indices, fpos, grad)
        assert g is not None
        ReferenceBackend().backward_update(layout, weights, state, lookup, g, opt, step)


_OPT_CODES = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.seq_forward.argtypes = [vp, vp, vp, vp, vp, i32, vp]
    lib.seq_forward.restype = i32
    lib.seq_backward_workspace.argtypes = [vp, vp, i32, i32]
    lib.seq_backward_workspace.restype = i64
    lib.seq_backward_update.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, i32, i32, vp, i64, vp]
    lib.seq_backward_update.restype = i32


class CpuSeqBackend:
    """The C kernel (``csrc/seq_cpu.c``); the reference's semantics, bitwise the pooled cpu
    kernel's on bags of length 1."""

    name = "cpu"

    def __init__(self, force_pairs: bool = False) -> None:
        from neorec.ops.cpu import declared_kernel

        lib = declared_kernel("seq_lookup", _declare)
        if lib is None:
            raise ConfigError(
                "sequence backend 'cpu' needs the C kernel, which does not build here"
            )
        self._lib = lib
        self._force_pairs = force_pairs
        self._ws = torch.empty(0, dtype=torch.uint8)

    def _layout(self, layout: TBELayout, fpos: list[int]) -> tuple[Any, Tensor, list[Tensor]]:
        from neorec.ops.cpu import _Layout

        oo = seq_out_offsets(layout, fpos)
        meta = layout.meta(torch.device("cpu"))
        keep = [torch.tensor(oo, dtype=torch.int64), torch.tensor(fpos, dtype=torch.int64)]
        ptrs = [meta[k].data_ptr() for k in ("feature_table", "rows", "dims", "elem_offsets")]
        lay = _Layout(
            layout.num_features, 1, layout.num_tables, oo[-1], *ptrs,
            meta["row_offsets"].data_ptr(), keep[0].data_ptr(),
        )  # fmt: skip
        return lay, keep[1], keep

    def forward(
        self, layout: TBELayout, weights: Tensor, indices: Tensor, fpos: list[int]
    ) -> Tensor:
        """The flat output (see ``SeqBackend.forward``)."""
        _check(layout, weights, indices, fpos)
        _cpu_f32("weights", weights)
        ran("cpu.seq_forward")
        idx = indices.to(torch.int64).contiguous()
        lay, fp, _keep = self._layout(layout, fpos)
        out = torch.empty(lay.total_dim, dtype=torch.float32)
        err = (ctypes.c_int64 * 2)()
        nt = torch.get_num_threads()
        rc = self._lib.seq_forward(
            ctypes.byref(lay), weights.data_ptr(), idx.data_ptr(), fp.data_ptr(), out.data_ptr(), nt, err
        )  # fmt: skip
        self._raise(rc, err, layout, idx, fpos)
        return out

    def backward_update(
        self,
        layout: TBELayout,
        weights: Tensor,
        state: dict[str, Tensor],
        batch: tuple[Tensor, list[int]],
        grad: Tensor,
        opt: RowOptimizer,
        step: int,
    ) -> None:
        """The fused update in one kernel call (see ``SeqBackend.backward_update``)."""
        from neorec.ops.cpu import _Optim

        indices, fpos = batch
        _check(layout, weights, indices, fpos)
        _cpu_f32("weights", weights)
        ran("cpu.seq_backward")
        idx = indices.to(torch.int64).contiguous()
        lay, fp, _keep = self._layout(layout, fpos)
        _cpu_f32("grad", grad)
        if grad.numel() != lay.total_dim:
            raise TBEInputError(f"grad has {grad.numel()} elements, expected {lay.total_dim}")
        st = {}
        for k, n in state_shapes(opt.kind, layout.total_rows, layout.total_elems).items():
            if k not in state or state[k].numel() != n:
                raise TBEInputError(f"optimizer '{opt.kind}' needs state '{k}' of {n} elements")
            _cpu_f32(f"state['{k}']", state[k])
            st[k] = state[k].data_ptr()
        if opt.kind == "adam" and step < 1:
            raise TBEInputError(f"adam step count must be >= 1 (1-based), got {step}")
        b1, b2 = opt.beta1, opt.beta2
        o = _Optim(
            _OPT_CODES[opt.kind], opt.lr, opt.eps, b1, b2, 1.0 - b1, 1.0 - b2, opt.weight_decay,
            1.0 - b1 ** max(step, 1), 1.0 - b2 ** max(step, 1), opt.clip_ratio, opt.clip_bound,
        )  # fmt: skip
        nt = torch.get_num_threads()
        err = (ctypes.c_int64 * 2)()
        nbytes = self._lib.seq_backward_workspace(
            ctypes.byref(lay), fp.data_ptr(), nt, int(self._force_pairs)
        )
        if self._ws.numel() < nbytes:
            self._ws = torch.empty(nbytes, dtype=torch.uint8)
        rc = self._lib.seq_backward_update(
            ctypes.byref(lay), weights.data_ptr(), idx.data_ptr(), fp.data_ptr(),
            grad.contiguous().data_ptr(), ctypes.byref(o), st.get("momentum1"), st.get("exp_avg"),
            st.get("exp_avg_sq"), nt, int(self._force_pairs), self._ws.data_ptr(),
            self._ws.numel(), err,
        )  # fmt: skip
        self._raise(rc, err, layout, idx, fpos)

    @staticmethod
    def _raise(rc: int, err: Any, layout: TBELayout, idx: Tensor, fpos: list[int]) -> None:
        if rc == 0:
            return
        if rc == 1:
            _raise_id(layout, idx, fpos, int(err[0]))
        if rc == 2:
            raise TBEInputError(f"fpos decreases at feature {int(err[0])}")
        raise RuntimeError(f"cpu sequence kernel returned code {rc}")


def _cpu_f32(name: str, t: Tensor) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise TBEInputError(
            f"cpu sequence backend: {name} must be a contiguous float32 CPU tensor, got "
            f"{t.dtype} on {t.device}"
        )


@functools.cache
def _make(name: str) -> Any:
    return CpuSeqBackend() if name == "cpu" else ReferenceSeqBackend()


def get_seq_backend(name: str, device: torch.device | str = "cpu") -> SeqBackend:
    """``reference``, ``cpu`` (CPU weights), or ``auto``: cpu on the CPU when the C kernel
    builds, else the reference (also on CUDA: no GPU sequence kernel yet)."""
    device = torch.device(device)
    if name == "auto":
        from neorec.ops.tbe import get_backend

        pooled = get_backend("auto", device) if device.type == "cpu" else None
        name = "cpu" if pooled is not None and pooled.name == "cpu" else "reference"
    if name not in ("reference", "cpu"):
        raise ConfigError(
            f"sequence lookup backend {name!r}: expected auto, cpu or reference (no "
            f"cuda/triton sequence kernel yet)"
        )
    if name == "cpu" and device.type != "cpu":
        raise ConfigError(f"sequence backend 'cpu' needs weights on the CPU, not {device}")
    backend: SeqBackend = _make(name)
    return backend


def seq_lookup(
    anchor: Tensor, run: Callable[[], Tensor], update: Callable[[Tensor], None]
) -> Tensor:
    """``run()`` (the flat output) in the autograd graph through the zero-element ``anchor``
    (``requires_grad``): its backward calls ``update(grad)``, the weights get no ``.grad``."""
    from neorec.ops.tbe import fused_op

    return fused_op(anchor, run, update)
