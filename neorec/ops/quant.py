"""Row-wise codecs for embedding rows.

Integer codecs (checkpoints, Check-N-Run): each row of ``x`` [n, d] is stored as ``bits``-bit codes
``c`` with a per-row scale ``s`` and offset ``b``, ``x ~ c * s + b`` (asymmetric, uniform). The range
``[b, b + s * (2^bits - 1)]`` is the row's [min, max], or, with ``adaptive_range``, a narrower one
found by greedily shrinking min or max while the row's L2 reconstruction error falls (Check-N-Run's
search; few bits spend their levels where the values are, at the cost of clipping outliers).

Scale and offset are stored as float16 relative to one power-of-two unit per call (``IntRows``), as
in FBGEMM's fused 4/2-bit rows, but without float16's underflow for rows of tiny values (rows whose
range is 2^14 times below the call's largest lose precision: keep calls to rows of one table). The
codes are computed from the rounded scale and offset, so rounding them costs little extra error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "INT_BITS",
    "IntRows",
    "int_rowwise_quantize",
    "int_rowwise_dequantize",
    "int_rowwise_quantize_device",
    "dequantize_rows",
    "int_rowwise_bytes_per_row",
    "greedy_row_range",
    "pack_int_codes",
    "unpack_int_codes",
]

INT_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
"""Code widths the integer codecs accept."""


@dataclass
class IntRows:
    """Rows quantized to ``bits``-bit codes with a per-row float16 scale and offset."""

    packed: Tensor  # uint8 [n, ceil(dim * bits / 8)]
    scale: Tensor  # float16 [n], in units of scale_unit
    offset: Tensor  # float16 [n], in units of offset_unit
    scale_unit: float
    offset_unit: float
    bits: int
    dim: int

    def nbytes(self) -> int:
        """Bytes of the codes, scales and offsets."""
        return self.packed.numel() + 2 * self.scale.numel() + 2 * self.offset.numel()


def int_rowwise_bytes_per_row(dim: int, bits: int) -> int:
    """Stored bytes of one row of ``dim`` values at ``bits`` bits (codes + fp16 scale, offset)."""
    return (dim * bits + 7) // 8 + 4


def _check_bits(bits: int) -> None:
    if bits not in INT_BITS:
        raise ValueError(f"integer row codec supports bits in {INT_BITS}, got {bits}")


def pack_int_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack codes [n, d] (values < 2^bits) into bytes [n, ceil(d * bits / 8)], big-endian bits."""
    _check_bits(bits)
    n, d = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.int32)
    bitplane = (codes.to(torch.int32).unsqueeze(2) >> shifts) & 1  # [n, d, bits]
    flat = bitplane.reshape(n, d * bits)
    nbytes = (d * bits + 7) // 8
    pad = nbytes * 8 - d * bits
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32)
    return (flat.view(n, nbytes, 8) * weights).sum(2).to(torch.uint8)


def unpack_int_codes(packed: Tensor, bits: int, dim: int) -> Tensor:
    """Inverse of ``pack_int_codes``: int32 codes [n, dim]."""
    _check_bits(bits)
    n = packed.shape[0]
    if bits == 8:
        return packed.to(torch.int32)
    shifts = torch.arange(7, -1, -1, dtype=torch.int32)
    flat = ((packed.to(torch.int32).unsqueeze(2) >> shifts) & 1).reshape(n, -1)[:, : dim * bits]
    weights = 2 ** torch.arange(bits - 1, -1, -1, dtype=torch.int32)
    return (flat.view(n, dim, bits) * weights).sum(2)


def _roundtrip_err(x: Tensor, lo: Tensor, hi: Tensor, levels: int) -> Tensor:
    """Squared L2 error per row of quantizing ``x`` [n, d] on the grid [lo, hi] with ``levels``."""
    scale = ((hi - lo) / (levels - 1)).clamp(min=1e-30).unsqueeze(1)
    codes = ((x - lo.unsqueeze(1)) / scale).round_().clamp_(0, levels - 1)
    return (codes * scale + lo.unsqueeze(1) - x).square_().sum(1)


def greedy_row_range(
    x: Tensor, bits: int, n_bins: int = 200, max_shrink: float = 0.16
) -> tuple[Tensor, Tensor]:
    """Per-row (lo, hi) [n] from shrinking [min, max] greedily while the L2 error falls.

    Each round moves min up or max down by (max - min) / n_bins, whichever lowers the row's error
    more; a row stops when neither lowers it, or after ``max_shrink`` of its range (the defaults
    are those of Check-N-Run's / FBGEMM's greedy search).
    """
    _check_bits(bits)
    x = x.float()
    lo, hi = x.min(1).values, x.max(1).values
    step = (hi - lo) / n_bins
    levels = 1 << bits
    err = _roundtrip_err(x, lo, hi, levels)
    active = (step > 0).nonzero().squeeze(1)
    for _ in range(int(n_bins * max_shrink)):
        if active.numel() == 0:
            break
        xa, la, ha, sa = x[active], lo[active], hi[active], step[active]
        e_lo = _roundtrip_err(xa, la + sa, ha, levels)
        e_hi = _roundtrip_err(xa, la, ha - sa, levels)
        take_lo = e_lo <= e_hi
        best = torch.where(take_lo, e_lo, e_hi)
        better = best < err[active]
        lo[active] = torch.where(better & take_lo, la + sa, la)
        hi[active] = torch.where(better & ~take_lo, ha - sa, ha)
        err[active] = torch.where(better, best, err[active])
        active = active[better]
    return lo, hi


def _pow2_unit(v: Tensor) -> float:
    """A power of two >= max|v| (1.0 for an empty or all-zero ``v``)."""
    m = float(v.abs().max()) if v.numel() else 0.0
    if not math.isfinite(m):
        raise ValueError("cannot quantize rows holding inf or nan")
    return 2.0 ** math.ceil(math.log2(m)) if m > 0 else 1.0


def _pow2_unit_device(v: Tensor) -> Tensor:
    """``_pow2_unit`` as a 0-dim float32 tensor on ``v``'s device, without a host read (the same
    value: frexp's exponent, one less for an exact power of two); inf/nan: a device assert."""
    m = v.abs().amax() if v.numel() else v.new_zeros(())
    torch._assert_async(torch.isfinite(m), "cannot quantize rows holding inf or nan")
    mant, e = torch.frexp(m)
    e = torch.where(mant == 0.5, e - 1, e)
    return torch.where(m > 0, torch.ldexp(torch.ones_like(m), e.float()), 1.0)


def _fp16(value: float, n: int, device: torch.device) -> Tensor:
    return torch.full((n,), value, dtype=torch.float16, device=device)


def _quantize(
    x: Tensor, bits: int, adaptive_range: bool, on_device: bool
) -> tuple[Tensor, Tensor, Tensor, float | Tensor, float | Tensor]:
    """(packed codes, fp16 scale, fp16 offset, scale unit, offset unit); the units are Python
    floats (a host read), or 0-dim tensors when ``on_device`` (none)."""
    _check_bits(bits)
    x = x.detach().float()
    n, d = x.shape
    dev = x.device
    unit = _pow2_unit_device if on_device else _pow2_unit
    levels = 1 << bits
    if adaptive_range and n:
        lo, hi = greedy_row_range(x, bits)
    else:
        lo = x.min(1).values if n else x.new_zeros(0)
        hi = x.max(1).values if n else x.new_zeros(0)
    # Offset rounded down and scale rounded up (from the rounded offset), so the grid still spans
    # [lo, hi]: fp16 rounding then only widens the step a little instead of clipping values.
    o_unit = unit(lo)
    offset_h = (lo / o_unit).to(torch.float16)
    offset_h = torch.where(
        offset_h.float() * o_unit > lo,
        torch.nextafter(offset_h, _fp16(-math.inf, n, dev)),
        offset_h,
    )
    offset = offset_h.float() * o_unit
    need = ((hi - offset) / (levels - 1)).clamp(min=0)
    s_unit = unit(need)
    scale_h = (need / s_unit).to(torch.float16)
    scale_h = torch.where(
        scale_h.float() * s_unit < need, torch.nextafter(scale_h, _fp16(math.inf, n, dev)), scale_h
    )
    scale = scale_h.float() * s_unit
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    codes = ((x - offset.unsqueeze(1)) / safe).round_().clamp_(0, levels - 1)
    codes = torch.where(scale.unsqueeze(1) > 0, codes, torch.zeros_like(codes))
    packed = pack_int_codes(codes.to(torch.int32), bits)
    return packed, scale_h, offset_h, s_unit, o_unit


def int_rowwise_quantize(x: Tensor, bits: int, adaptive_range: bool = False) -> IntRows:
    """Quantize rows ``x`` [n, d] to ``bits``-bit codes, per-row asymmetric uniform."""
    packed, scale_h, offset_h, s_unit, o_unit = _quantize(x, bits, adaptive_range, False)
    return IntRows(packed, scale_h, offset_h, float(s_unit), float(o_unit), bits, x.shape[1])


def int_rowwise_quantize_device(x: Tensor, bits: int) -> tuple[IntRows, Tensor]:
    """``int_rowwise_quantize`` without a host read: the same codes, scales and offsets, and the
    units as float32 [2] (scale unit, offset unit) on ``x``'s device (the ``IntRows``' own unit
    fields are left 0.0); inf/nan is a device assert."""
    packed, scale_h, offset_h, s_unit, o_unit = _quantize(x, bits, False, True)
    units = torch.stack([torch.as_tensor(s_unit), torch.as_tensor(o_unit)]).float()
    return IntRows(packed, scale_h, offset_h, 0.0, 0.0, bits, x.shape[1]), units


def dequantize_rows(q: IntRows, units: Tensor | None = None) -> Tensor:
    """Float32 rows [n, dim] from ``q``, with its unit fields or ``units`` (float32 [2]: scale
    unit, offset unit, on the device: no host read)."""
    codes = unpack_int_codes(q.packed, q.bits, q.dim).float()
    s_unit = q.scale_unit if units is None else units[0:1]
    o_unit = q.offset_unit if units is None else units[1:2]
    scale = q.scale.float() * s_unit
    offset = q.offset.float() * o_unit
    return codes * scale.unsqueeze(1) + offset.unsqueeze(1)


def int_rowwise_dequantize(q: IntRows) -> Tensor:
    """Float32 rows [n, dim] from ``IntRows``."""
    return dequantize_rows(q)
