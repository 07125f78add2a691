"""Low-precision embedding rows: how fp16 / bf16 tables, and fp8 (e4m3) with a per-row scale, are
stored, decoded and encoded (``RowFormat``), and how an update is rounded to them.

A table batch whose ``precision`` is not ``fp32`` stores its weights packed (LoKA's low-precision
embedding weights; FBGEMM's fp16 and fp8 TBE tables), in one flat buffer with the ``TBELayout``
element order:

- ``fp16`` / ``bf16``: a ``torch.float16`` / ``torch.bfloat16`` buffer of ``total_elems`` values
  (half the memory of fp32);
- ``fp8``: a ``torch.uint8`` buffer: ``total_elems`` e4m3 codes, padded to 4 bytes, then one fp32
  scale per row (``total_rows``); a row's value is ``code * scale`` with ``scale = amax / 448``, so
  a row's largest magnitude is exact (a quarter of the memory plus 4 bytes a row).

Rounding is ``nearest`` (round to nearest even) or ``stochastic`` (unbiased: up with probability
equal to the distance from the lower neighbour, from a counter-based hash of (seed, step,
element): deterministic for a seed, for any thread count).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops.tbe_types import TBELayout

__all__ = [
    "PRECISIONS",
    "ROUNDINGS",
    "DEFAULT_ROUNDING",
    "FP8_MAX",
    "RowFormat",
    "row_format",
    "bytes_per_row",
    "stochastic_round",
    "pow2_scale",
    "DecodedRows",
    "table_key",
]

PRECISIONS = ("fp32", "fp16", "bf16", "fp8")
"""Storage formats of embedding rows."""

ROUNDINGS = ("auto", "nearest", "stochastic")
"""How updated rows are rounded to their storage format (``auto``: ``DEFAULT_ROUNDING``)."""

DEFAULT_ROUNDING = {"fp32": "nearest", "fp16": "nearest", "bf16": "nearest", "fp8": "stochastic"}
"""What ``auto`` picks, per format, from ``neorec bench lowp --emb ...`` (docs/lowp.md): on the
default config (3 seeds) stochastic rounding moved fp8 tables from +0.19% to +0.08% eval NE vs
fp32; for fp16 and bf16 the two roundings were within the seed spread, so the cheaper nearest."""

FP8_MAX = 448.0  # largest finite e4m3fn value
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def bytes_per_row(precision: str, dim: int) -> int:
    """Bytes one row of ``dim`` values takes in ``precision`` (fp8 includes its fp32 scale)."""
    if precision == "fp8":
        return dim + 4
    if precision in ("fp16", "bf16"):
        return 2 * dim
    if precision == "fp32":
        return 4 * dim
    raise ConfigError(f"unknown embedding precision {precision!r}, expected one of {PRECISIONS}")


def _hash_uniform(elem: Tensor, step: int, seed: int) -> Tensor:
    """Uniform [0, 1) float32 per element (24 random bits) from (seed, step, element index)."""
    return ((_hash32(elem, step, seed) >> 8) & 0xFFFFFF).to(torch.float32) * (1.0 / 16777216.0)


def _i32(c: int) -> int:
    """A 32-bit constant as the int32 with the same bits."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _step_key(step: int, seed: int) -> int:
    """The int32 that (seed, step) add to every hash (``_hash32``)."""
    return _i32((step * 0x85EBCA77 + seed * 0xC2B2AE3D) & 0xFFFFFFFF)


def _hash32(elem: Tensor, step: int, seed: int) -> Tensor:
    """32 random bits (int32) per element from (seed, step, element index): lowbias32 in
    wrapping int32 arithmetic (the index's high half folded in first)."""
    return _hash32_k(elem, _step_key(step, seed))


def _hash32_k(elem: Tensor, k: int | Tensor) -> Tensor:
    """``_hash32`` with its (seed, step) key given (an int32 per element, or one for all)."""
    e = elem.to(torch.int64)
    x = (e ^ (e >> 32)).to(torch.int32)
    x = x * _i32(0x9E3779B1) + k
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _i32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def _element_bits(rows: Tensor, col0: int, d: int, step: int, seed: int) -> Tensor:
    """32 random bits (int32) per element of global ``rows`` [n] x columns ``col0 ..
    col0 + d``: a full hash per row and per column, then one multiply-xorshift round per element
    (a few passes over the [n, d] block instead of a whole hash)."""
    rh = _hash32(rows, step, seed).unsqueeze(1)
    cols = torch.arange(col0, col0 + d, device=rows.device)
    ch = _hash32(cols, 0, seed ^ 0x5BD1E995).unsqueeze(0)
    x = (rh ^ ch) * _i32(0x9E3779B1)
    return x ^ ((x >> 15) & 0x1FFFF)


_MBITS = {torch.float16: 10, torch.bfloat16: 7, torch.float8_e4m3fn: 3}


def _bits_stochastic(x: Tensor, dtype: torch.dtype, bits32: Tensor) -> Tensor:
    """Stochastic rounding of fp32 ``x`` to ``dtype`` in bit arithmetic: add random bits below
    the format's last mantissa bit and truncate (a carry rounds the magnitude up with
    probability equal to the dropped fraction: unbiased). Exact for normal values of ``dtype``;
    in fp16's and fp8's subnormal range (below 2^-14, 2^-6) the final cast rounds to nearest.
    Values that are not finite round to nearest."""
    drop = 23 - _MBITS[dtype]
    mask = (1 << drop) - 1
    b = x.contiguous().view(torch.int32)
    y = ((b + (bits32 & mask)) & ~mask).view(torch.float32).to(dtype)
    # inf / nan round to nearest (always selected: no host read of whether there are any)
    return torch.where(torch.isfinite(x), y, x.to(dtype))


_GRID = {  # mantissa bits, exponent of the smallest (subnormal) spacing
    torch.float16: (10, -24),
    torch.bfloat16: (7, -133),
    torch.float8_e4m3fn: (3, -9),
}


def stochastic_round(x: Tensor, dtype: torch.dtype, u: Tensor) -> Tensor:
    """``x`` (fp32, within ``dtype``'s finite range) rounded to ``dtype`` stochastically: up in
    magnitude with probability equal to the fraction of a spacing ``|x|`` lies above the
    representable value below it, given ``u`` uniform in [0, 1) per element: unbiased,
    ``E[result] = x``; representable values stay as they are.

    In fp32 arithmetic that is exact: the spacing ``s`` of ``dtype`` at ``|x|`` is a power of
    two, so ``|x| / s`` and its fractional part are exact."""
    mbits, min_exp = _GRID[dtype]
    ax = x.abs()
    _, e = torch.frexp(ax)  # ax in [2^(e-1), 2^e)
    sp = torch.ldexp(torch.ones_like(ax), torch.clamp(e - 1 - mbits, min=min_exp))
    scaled = ax / sp
    low = torch.floor(scaled)
    q = (low + (u < (scaled - low)).to(ax.dtype)) * sp
    return torch.copysign(q, x).to(dtype)


@dataclass(frozen=True)
class RowFormat:
    """How one precision packs, decodes and encodes the rows of a flat table batch."""

    precision: str

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"unknown embedding precision {self.precision!r}, expected one of {PRECISIONS}"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the packed buffer."""
        return torch.uint8 if self.precision == "fp8" else _DTYPES[self.precision]

    @property
    def element_dtype(self) -> torch.dtype:
        """The dtype one stored value rounds to."""
        return torch.float8_e4m3fn if self.precision == "fp8" else _DTYPES[self.precision]

    def numel(self, layout: TBELayout) -> int:
        """Elements of the packed buffer for ``layout``."""
        if self.precision == "fp8":
            return _scale_start(layout) + 4 * layout.total_rows
        return layout.total_elems

    def nbytes(self, layout: TBELayout) -> int:
        """Bytes of the packed buffer."""
        return self.numel(layout) * self.dtype.itemsize

    def empty(self, layout: TBELayout, device: torch.device | str = "cpu") -> Tensor:
        """An uninitialized packed buffer (fp8 scales set to 1)."""
        out = torch.empty(self.numel(layout), dtype=self.dtype, device=device)
        if self.precision == "fp8":
            self.scales(out, layout).fill_(1.0)
        return out

    def codes(self, weights: Tensor, layout: TBELayout, t: int) -> Tensor:
        """View [rows, dim] of table ``t``'s stored values (e4m3 codes for fp8)."""
        lo, hi = layout.elem_offsets[t], layout.elem_offsets[t + 1]
        block = weights[lo:hi]
        if self.precision == "fp8":
            block = block.view(torch.float8_e4m3fn)
        return block.view(layout.rows[t], layout.dims[t])

    def scales(self, weights: Tensor, layout: TBELayout) -> Tensor:
        """The fp32 per-row scales of an fp8 buffer [total_rows] (a view)."""
        lo = _scale_start(layout)
        return weights[lo : lo + 4 * layout.total_rows].view(torch.float32)

    def decode(
        self, weights: Tensor, layout: TBELayout, t: int, ids: Tensor | None = None
    ) -> Tensor:
        """Rows ``ids`` (all when None) of table ``t`` as fp32 [n, dim] (a new tensor)."""
        codes = self.codes(weights, layout, t)
        rows = (codes if ids is None else codes[ids]).float()
        if self.precision == "fp8":
            sc = self.scales(weights, layout)[layout.row_offsets[t] : layout.row_offsets[t + 1]]
            rows.mul_((sc if ids is None else sc[ids]).unsqueeze(1))
        return rows

    def encode(
        self,
        weights: Tensor,
        layout: TBELayout,
        t: int,
        ids: Tensor | None,
        rows: Tensor,
        rounding: str = "nearest",
        step: int = 0,
        seed: int = 0,
        key: tuple[int, int, int, int] | None = None,
    ) -> None:
        """Store fp32 ``rows`` [n, dim] as rows ``ids`` (all when None) of table ``t``.

        Stochastic rounding draws each element's number from (seed, step, ``key``'s table key,
        the element's global row and column): ``key = (table_key, first_row, first_col,
        full_dim)`` places a shard in its table (default: table ``t`` is the whole table), so a
        sharded table rounds as the unsharded one does."""
        rows = rows.float()
        codes = self.codes(weights, layout, t)
        if self.precision == "fp8":
            sc = pow2_scale(rows)
            scaled = (rows / sc.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX)
            allsc = self.scales(weights, layout)[layout.row_offsets[t] : layout.row_offsets[t + 1]]
            if ids is None:
                allsc.copy_(sc)
            else:
                allsc[ids] = sc
            rows = scaled
        if rounding == "stochastic" and self.precision != "fp32":
            d = layout.dims[t]
            r = torch.arange(layout.rows[t], device=rows.device) if ids is None else ids
            tkey, row0, col0, width = key or (t, 0, 0, d)
            hseed = (seed * 1_000_003 + tkey) & 0xFFFFFFFF
            bits = _element_bits(row0 + r.to(torch.int64), col0, d, step, hseed)
            q = _bits_stochastic(rows, self.element_dtype, bits)
        else:
            q = rows.to(self.element_dtype)
        if ids is None:
            codes.copy_(q)
        else:
            codes[ids] = q


def pow2_scale(rows: Tensor) -> Tensor:
    """Per row of ``rows`` [n, d], the smallest power of two ``s`` with ``amax / s <= 448``
    (1 for an all-zero row)."""
    amax = rows.abs().amax(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    mant, exp = torch.frexp(amax / FP8_MAX)  # amax/448 = mant * 2^exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    sc = torch.ldexp(torch.ones_like(amax), exp)
    # amax/448 itself rounds: step up where that rounding hid an overflow
    sc = torch.where(amax / sc > FP8_MAX, sc * 2, sc)
    return torch.where(amax > 0, sc, torch.ones_like(amax))


class DecodedRows:
    """Table ``t`` of a packed buffer seen as fp32 [rows, dim]: indexing decodes the rows it
    selects, assignment encodes them back (nearest). For code written against fp32 views
    (checkpoints read rows and restore them in place)."""

    def __init__(self, fmt: RowFormat, weights: Tensor, layout: TBELayout, t: int) -> None:
        self.fmt, self.weights, self.layout, self.t = fmt, weights, layout, t
        self.shape = torch.Size((layout.rows[t], layout.dims[t]))
        self.dtype = torch.float32

    def _rows(self, key: Any) -> Tensor:
        if isinstance(key, Tensor) and key.dtype in (torch.int64, torch.int32) and key.dim() == 1:
            return self.fmt.decode(self.weights, self.layout, self.t, key)
        return self.fmt.decode(self.weights, self.layout, self.t)[key]

    def __getitem__(self, key: Any) -> Tensor:
        return self._rows(key)

    def __setitem__(self, key: Any, value: Tensor) -> None:
        full = self.fmt.decode(self.weights, self.layout, self.t)
        full[key] = value
        self.fmt.encode(self.weights, self.layout, self.t, None, full)

    def clone(self) -> Tensor:
        """All rows, fp32."""
        return self.fmt.decode(self.weights, self.layout, self.t)

    def float(self) -> Tensor:
        """All rows, fp32."""
        return self.clone()


def table_key(name: str) -> int:
    """A table's stochastic-rounding key: the same in every process and layout."""
    return zlib.crc32(name.encode())


def _scale_start(layout: TBELayout) -> int:
    return (layout.total_elems + 3) // 4 * 4


def row_format(precision: str) -> RowFormat:
    """The ``RowFormat`` of ``precision`` (``ConfigError`` when unknown)."""
    return RowFormat(precision)
