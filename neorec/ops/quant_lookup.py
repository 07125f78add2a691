"""Pooled lookup of serving tables: fp32, fp16 or row-wise int8 / int4 / int2 rows, decoded and
pooled in one pass of compiled C (``csrc/quant_lookup.c``, built with the TBE kernel by
``neorec.ops.cpu``).

A table's stored rows (``StoredRows``: what ``neorec export`` writes and the serving loader
``neorec.serve.standalone.Table`` reads) are, per row:

- ``none`` (fp32) / ``fp16``: ``dim`` floats / halves;
- ``int8`` / ``int4`` / ``int2``: ``ceil(dim * bits / 8)`` bytes of codes (``neorec.ops.quant``'s
  packing: big-endian bits, int4's high nibble first), then the row's scale and offset as float16
  in units of the table's ``scale_unit`` / ``offset_unit`` (powers of two, in the manifest), so
  that ``row = code * (scale * scale_unit) + offset * offset_unit``. One fused row: a lookup reads
  one run of bytes per id, not three arrays.

``pooled(table, ids, offsets, weights, mean)`` is the kernel; the specification is
``Table.rows(ids)`` (dequantized fp32 rows, times the weights) summed per bag by ``index_add_``
(``tests/test_quant_lookup.py``).
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from neorec.errors import NeorecError
from neorec.ops.quant import int_rowwise_quantize

__all__ = [
    "KINDS",
    "INT_KINDS",
    "QuantLookupError",
    "StoredRows",
    "QuantRows",
    "row_bytes",
    "quantize_rows",
    "native_lib",
    "pooled",
]

KINDS = {"none": 32, "fp16": 16, "int8": 8, "int4": 4, "int2": 2}
"""Stored row kinds (``neorec export --quantize``) and their bits per value; the kernel's code."""
INT_KINDS = ("int8", "int4", "int2")
CHUNK_ROWS = 65536
"""Rows quantized per call (bounds the temporaries of the range search)."""
_OK, _EID, _EOFFSETS = 0, 1, 2  # QL_* return codes of quant_lookup.c


class QuantLookupError(NeorecError, ValueError):
    """A lookup's ids, offsets or weights are refused; the message names what and where."""


class StoredRows(Protocol):
    """A table's stored rows as the kernel reads them (``QuantRows``, the loader's ``Table``)."""

    quantization: str
    data: np.ndarray
    dim: int
    scale_unit: float
    offset_unit: float


@dataclass(frozen=True)
class QuantRows:
    """A table's stored rows: ``data`` float32 / float16 [rows, dim] (``none`` / ``fp16``), or
    uint8 [rows, row_bytes] (integer kinds, scale and offset in units of the two units)."""

    quantization: str
    data: np.ndarray
    dim: int
    scale_unit: float = 1.0
    offset_unit: float = 1.0


def row_bytes(quantization: str, dim: int) -> int:
    """Stored bytes of one row (integer kinds: codes + float16 scale and offset)."""
    bits = KINDS[quantization]
    if quantization in INT_KINDS:
        return (dim * bits + 7) // 8 + 4
    return dim * bits // 8


def _float16(w: Tensor, name: str) -> np.ndarray:
    big = float(w.abs().max()) if w.numel() else 0.0
    if not math.isfinite(big) or big > float(np.finfo(np.float16).max):
        raise QuantLookupError(
            f"table '{name}': |value| up to {big:g} does not fit float16 (max 65504); "
            "export it as none or int8"
        )
    return w.numpy().astype(np.float16)


def quantize_rows(
    w: Tensor, quantization: str, adaptive_range: bool | None = None, name: str = "?"
) -> QuantRows:
    """``w`` [rows, dim] stored as ``quantization``: fp32, fp16, or ``neorec.ops.quant``'s
    row-wise codes (``adaptive_range``: Check-N-Run's range search; default at <= 4 bits)."""
    if quantization not in KINDS:
        raise QuantLookupError(
            f"quantization must be one of {', '.join(KINDS)}, got {quantization!r}"
        )
    w = w.detach().float().cpu().contiguous()
    dim = int(w.shape[1])
    if quantization == "none":
        return QuantRows(quantization, w.numpy(), dim)
    if quantization == "fp16":
        return QuantRows(quantization, _float16(w, name), dim)
    bits = KINDS[quantization]
    adaptive = bits <= 4 if adaptive_range is None else adaptive_range
    chunks = [
        int_rowwise_quantize(w[lo : lo + CHUNK_ROWS], bits, adaptive)
        for lo in range(0, w.shape[0], CHUNK_ROWS)
    ]
    s_unit = max((q.scale_unit for q in chunks), default=1.0)
    o_unit = max((q.offset_unit for q in chunks), default=1.0)
    nb = (dim * bits + 7) // 8
    out = np.empty((w.shape[0], nb + 4), dtype=np.uint8)
    lo = 0
    for q in chunks:
        n = q.packed.shape[0]
        # One unit per table: each chunk's halves rescaled by a power of two <= 1 (exact, unless
        # a row's value falls to float16's subnormals: rows 2^14 below the table's largest)
        scale = (q.scale.float() * (q.scale_unit / s_unit)).to(torch.float16).numpy()
        offset = (q.offset.float() * (q.offset_unit / o_unit)).to(torch.float16).numpy()
        out[lo : lo + n, :nb] = q.packed.numpy()
        out[lo : lo + n, nb : nb + 2] = scale.astype("<f2").view(np.uint8).reshape(n, 2)
        out[lo : lo + n, nb + 2 :] = offset.astype("<f2").view(np.uint8).reshape(n, 2)
        lo += n
    return QuantRows(quantization, out, dim, float(s_unit), float(o_unit))


def native_lib() -> Any:
    """The compiled library with ``ql_pool`` declared, or None (no C compiler)."""
    from neorec.ops.cpu import declared_kernel

    return declared_kernel("quant_lookup", _declare)


def _declare(lib: Any) -> None:
    vp, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.ql_pool.argtypes = [vp, i64, i64, i64, i32, f32, f32, vp, i64, vp, i64, vp, i32, vp, i32]
    lib.ql_pool.argtypes += [vp]
    lib.ql_pool.restype = i32


def _check_data(table: StoredRows) -> int:
    """The row stride in bytes, after checking ``table.data``'s dtype, shape and layout."""
    kind, data = table.quantization, table.data
    want = {"none": np.float32, "fp16": np.float16}.get(kind, np.uint8)
    stride = row_bytes(kind, table.dim)
    width = stride if kind in INT_KINDS else table.dim
    if data.dtype != want or data.ndim != 2 or data.shape[1] != width:
        raise QuantLookupError(
            f"{kind} rows must be {np.dtype(want)} [rows, {width}], got {data.dtype} "
            f"{list(data.shape)}"
        )
    if not data.flags.c_contiguous:
        raise QuantLookupError(f"{kind} rows must be C-contiguous")
    return stride


def _as_i64(a: Any, name: str) -> np.ndarray:
    out = np.ascontiguousarray(a.numpy() if isinstance(a, Tensor) else np.asarray(a))
    if out.ndim != 1 or (out.size and not np.issubdtype(out.dtype, np.integer)):
        raise QuantLookupError(f"{name} must be a 1-D integer array, got {out.dtype} {out.shape}")
    return np.ascontiguousarray(out, dtype=np.int64)


def pooled(
    table: StoredRows,
    ids: Any,
    offsets: Any,
    weights: Any = None,
    mean: bool = False,
    threads: int | None = None,
) -> Tensor:
    """Pooled rows float32 [bags, dim]: bag i sums (``mean``: averages; empty: zeros) the rows of
    ``ids[offsets[i]:offsets[i + 1]]``, each times its weight when ``weights`` [len(ids)] is
    given. Raises ``QuantLookupError`` naming a bad id's position, bad offsets or weights;
    ``RuntimeError`` when the kernel cannot be built (callers keep a NumPy path)."""
    lib = native_lib()
    if lib is None:
        raise RuntimeError("quant_lookup: the C kernel is not available (no C compiler)")
    stride = _check_data(table)
    idx, off = _as_i64(ids, "ids"), _as_i64(offsets, "offsets")
    if off.size < 1:
        raise QuantLookupError("offsets must hold bags + 1 entries, got none")
    w = None
    if weights is not None:
        w = np.ascontiguousarray(
            weights.numpy() if isinstance(weights, Tensor) else weights, dtype=np.float32
        )
        if w.shape != idx.shape:
            raise QuantLookupError(f"weights must be shaped like ids {idx.shape}, got {w.shape}")
    nbags = off.size - 1
    out = torch.empty(nbags, table.dim, dtype=torch.float32)
    err = (ctypes.c_int64 * 2)()
    rc = lib.ql_pool(
        table.data.ctypes.data, table.data.shape[0], table.dim, stride,
        KINDS[table.quantization], table.scale_unit, table.offset_unit, idx.ctypes.data,
        idx.size, off.ctypes.data, nbags, w.ctypes.data if w is not None else None, int(mean),
        out.data_ptr(), threads or torch.get_num_threads(), err,
    )  # fmt: skip
    if rc == _EID:
        p = int(err[0])
        raise QuantLookupError(
            f"id {int(idx[p])} at position {p} is outside the table's rows [0, {table.data.shape[0]})"
        )
    if rc == _EOFFSETS:
        raise QuantLookupError(
            f"offsets of bag {int(err[0])} decrease or leave [0, {idx.size}] (the ids)"
        )
    if rc != _OK:
        raise RuntimeError(f"quant_lookup: kernel returned unknown code {rc}")
    return out
