"""Reduced-precision codecs for the wire: float32 rows [n, d] -> bytes -> float32 rows.

One codec per collective (``comm.forward``: pooled embeddings, ``comm.backward``: their gradients,
``comm.allreduce``: dense gradients). Each message (one destination's chunk) is encoded alone and
carries its own scales, so a receiver needs nothing but the bytes and the shape:

    fp16      float16; per-message power-of-two scale (header int32) so the largest value lands in
              the top binade: nothing overflows, small gradients stay normal. With a static
              ``loss_scale`` the factor is fixed instead and overflow is an error.
    bf16      bfloat16 (float32's range, 8 bits of precision): no scaling needed.
    fp8_e4m3  float8 e4m3fn / e5m2 with a power-of-two scale per row (int8 exponent per row) or per
    fp8_e5m2  message (``fp8_scaling``); powers of two make scaling itself exact.
    int8      row-wise asymmetric uint8 codes with float16 scale and offset per row
              (``neorec.ops.quant.int_rowwise_quantize``, shared with checkpoints).

Every message is padded to 8 bytes so chunks of a concatenated buffer stay aligned for ``view``.
Non-finite input (inf/NaN) is refused with ``CodecError`` naming the collective: on the wire it
would silently become garbage (fp8 e4m3 saturates, int8 clamps). On a GPU that check (and a static
scale's overflow check) is a device assert instead of a host read per message
(``neorec.ops.tbe_checks.on_device``): every codec then encodes and decodes without a sync (int8's
scale units stay on the device too); the error is CUDA's device-side assert, raised at the next
sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from neorec.errors import NeorecError
from neorec.ops.quant import (
    IntRows,
    dequantize_rows,
    int_rowwise_quantize,
    int_rowwise_quantize_device,
)
from neorec.ops.tbe_checks import on_device

__all__ = ["CODECS", "CodecError", "Codec", "FloatCodec", "Int8RowCodec", "make_codec"]

CODECS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
"""Codec names accepted by ``make_codec`` and ``comm.*`` (fp32 = no codec)."""

_ALIGN = 8


class CodecError(NeorecError, ValueError):
    """A message cannot be encoded (inf/NaN in it, or overflow under a static loss scale)."""


@dataclass(frozen=True)
class _Format:
    dtype: torch.dtype
    mantissa: int  # explicit mantissa bits
    emin: int  # exponent of the smallest normal value
    emax: int  # floor(log2(largest finite value))
    fmax: float  # largest finite value


_FORMATS = {
    "fp16": _Format(torch.float16, 10, -14, 15, 65504.0),
    "bf16": _Format(torch.bfloat16, 7, -126, 127, float(torch.finfo(torch.bfloat16).max)),
    "fp8_e4m3": _Format(torch.float8_e4m3fn, 3, -6, 8, 448.0),
    "fp8_e5m2": _Format(torch.float8_e5m2, 2, -14, 15, 57344.0),
}


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _bytes(t: Tensor) -> Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _check_finite(x: Tensor, codec: str, what: str) -> None:
    # On the host: a read per message (not a sync on the CPU). On a GPU: a device assert.
    tail = (
        f"in the {what or 'message'} of shape {tuple(x.shape)}; the model diverged before "
        "communication (lower the learning rates) or the input holds inf/NaN"
    )
    if on_device(x):
        torch._assert_async(
            torch.isfinite(x).all(), f"{codec} codec: non-finite value(s) (inf/NaN) {tail}"
        )
        return
    bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise CodecError(f"{codec} codec: {bad} non-finite value(s) (inf/NaN) {tail}")


class Codec:
    """Encodes float32 rows [n, d] to uint8 bytes and back; ``bound`` is its round-trip error."""

    name: str = "codec"
    bits: int = 32

    def nbytes(self, n: int, d: int) -> int:
        """Bytes of one encoded message of [n, d] (a multiple of 8, 0 when empty)."""
        raise NotImplementedError

    def encode(self, x: Tensor, what: str = "") -> Tensor:
        """uint8 [nbytes(n, d)] for rows ``x`` [n, d]; ``what`` names the collective in errors."""
        raise NotImplementedError

    def decode(self, buf: Tensor, n: int, d: int) -> Tensor:
        """float32 [n, d] from ``encode``'s bytes."""
        raise NotImplementedError

    def bound(self, x: Tensor) -> Tensor:
        """Elementwise bound on |decode(encode(x)) - x| for ``x`` encoded as one message."""
        raise NotImplementedError


class FloatCodec(Codec):
    """A narrower float format with ``scaling``: none, static (fixed factor), tensor or row."""

    def __init__(self, name: str, scaling: str = "none", static_scale: float = 1.0) -> None:
        if name not in _FORMATS:
            raise ValueError(f"unknown float codec '{name}'; known: {sorted(_FORMATS)}")
        if scaling not in ("none", "static", "tensor", "row"):
            raise ValueError(f"scaling must be none, static, tensor or row, got '{scaling}'")
        if not (static_scale > 0 and math.isfinite(static_scale)):
            raise ValueError(f"static scale must be finite and > 0, got {static_scale}")
        self.name, self.scaling, self.static = name, scaling, float(static_scale)
        self.fmt = _FORMATS[name]
        self.bits = torch.finfo(self.fmt.dtype).bits

    def __repr__(self) -> str:
        return f"FloatCodec({self.name}, {self.scaling})"

    def _header(self, n: int) -> int:
        return {"tensor": 4, "row": n}.get(self.scaling, 0)

    def nbytes(self, n: int, d: int) -> int:
        """Payload + scale header, padded."""
        if n * d == 0:
            return 0
        return _pad(n * d * self.bits // 8 + self._header(n))

    def _exponents(self, x: Tensor) -> Tensor:
        """Power-of-two exponents e (per row [n, 1] or per message [1, 1]) with amax * 2^e < 2^emax."""
        amax = x.abs().amax(dim=1, keepdim=True) if self.scaling == "row" else x.abs().amax()
        _, k = torch.frexp(amax.reshape(-1, 1))  # amax < 2^k
        e = torch.where(amax.reshape(-1, 1) > 0, self.fmt.emax - k, torch.zeros_like(k))
        return e.clamp(-127, 127)

    def _scale(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """(factor [n,1] or [1,1], exponents to send or None)."""
        if self.scaling in ("tensor", "row"):
            e = self._exponents(x)
            return torch.ldexp(torch.ones((), device=x.device), e.float()), e
        return torch.full((1, 1), self.static, device=x.device), None

    def encode(self, x: Tensor, what: str = "") -> Tensor:
        """Scale, cast, append the exponents."""
        n, d = x.shape
        out = torch.zeros(self.nbytes(n, d), dtype=torch.uint8, device=x.device)
        if n * d == 0:
            return out
        x = x.detach().float()
        _check_finite(x, self.name, what)
        factor, e = self._scale(x)
        scaled = x * factor
        if e is None and on_device(scaled):
            torch._assert_async(
                scaled.abs().max() <= self.fmt.fmax,
                f"{self.name} codec: the {what or 'message'} overflows {self.name} under a static "
                "scale; lower comm.loss_scale, or set it to 0 for automatic per-message scaling",
            )
        elif e is None and float(scaled.abs().max()) > self.fmt.fmax:
            raise CodecError(
                f"{self.name} codec: the {what or 'message'} overflows {self.name} "
                f"(max |x| * scale = {float(scaled.abs().max()):.3g} > {self.fmt.fmax:g}); "
                f"lower comm.loss_scale, or set it to 0 for automatic per-message scaling"
            )
        payload = _bytes(scaled.to(self.fmt.dtype))
        out[: payload.numel()] = payload
        if e is not None:
            hdr = (
                _bytes(e.to(torch.int32)) if self.scaling == "tensor" else _bytes(e.to(torch.int8))
            )
            out[payload.numel() : payload.numel() + hdr.numel()] = hdr
        return out

    def decode(self, buf: Tensor, n: int, d: int) -> Tensor:
        """Cast back, undo the scale."""
        if n * d == 0:
            return torch.zeros(n, d, device=buf.device)
        size = n * d * self.bits // 8
        y = buf[:size].view(self.fmt.dtype).view(n, d).float()
        hdr = buf[size : size + self._header(n)].clone()
        if self.scaling == "tensor":
            return y * torch.ldexp(torch.ones((), device=y.device), -hdr.view(torch.int32).float())
        if self.scaling == "row":
            return y * torch.ldexp(
                torch.ones(n, 1, device=y.device), -hdr.view(torch.int8).float().view(n, 1)
            )
        return y / self.static

    def bound(self, x: Tensor) -> Tensor:
        """Half an ulp of the format at |x| (relative), or half its smallest subnormal (absolute)."""
        x = x.detach().float()
        factor, _ = self._scale(x) if x.numel() else (torch.ones(1, 1, device=x.device), None)
        # a static (non power-of-two) factor adds one float32 rounding on each side.
        rel = x.abs() * (2.0 ** -(self.fmt.mantissa + 1) + 2.0**-22)
        floor = 2.0 ** (self.fmt.emin - self.fmt.mantissa - 1) / factor
        # fp32 subnormals: the decoded product itself may round at 2^-149.
        return torch.maximum(rel, floor.expand_as(x)) + 2.0**-149


class Int8RowCodec(Codec):
    """Row-wise uint8 codes, float16 scale and offset per row (the checkpoint codec, 8 bits)."""

    name = "int8"
    bits = 8

    def __repr__(self) -> str:
        return "Int8RowCodec()"

    def nbytes(self, n: int, d: int) -> int:
        """8 header bytes (two float32 units) + 4 bytes per row + d codes per row, padded."""
        return 0 if n * d == 0 else _pad(8 + n * (d + 4))

    def encode(self, x: Tensor, what: str = "") -> Tensor:
        """Quantize with ``int_rowwise_quantize(x, 8)``; lay out units, scales, offsets, codes."""
        n, d = x.shape
        out = torch.zeros(self.nbytes(n, d), dtype=torch.uint8, device=x.device)
        if n * d == 0:
            return out
        _check_finite(x.detach(), self.name, what)
        q, units = int_rowwise_quantize_device(x, 8)  # (the units stay on the device)
        parts = [
            _bytes(units),
            _bytes(q.scale),
            _bytes(q.offset),
            q.packed.reshape(-1),
        ]
        flat = torch.cat(parts)
        out[: flat.numel()] = flat
        return out

    def decode(self, buf: Tensor, n: int, d: int) -> Tensor:
        """Inverse of ``encode``."""
        if n * d == 0:
            return torch.zeros(n, d, device=buf.device)
        units = buf[:8].clone().view(torch.float32)
        scale = buf[8 : 8 + 2 * n].clone().view(torch.float16)
        offset = buf[8 + 2 * n : 8 + 4 * n].clone().view(torch.float16)
        packed = buf[8 + 4 * n : 8 + 4 * n + n * d].view(n, d)
        return dequantize_rows(IntRows(packed, scale, offset, 0.0, 0.0, 8, d), units)

    def bound(self, x: Tensor) -> Tensor:
        """Half the row's quantization step (plus float32 rounding of code * scale + offset)."""
        x = x.detach().float()
        if x.numel() == 0:
            return torch.zeros_like(x)
        q = int_rowwise_quantize(x, 8)
        step = (q.scale.float() * q.scale_unit).unsqueeze(1)
        return (0.5 * step + x.abs().amax(1, keepdim=True) * 2.0**-22).expand_as(x)


def make_codec(name: str, fp8_scaling: str = "row", loss_scale: float = 0.0) -> Codec | None:
    """The codec a ``comm.*`` name asks for (None for fp32, i.e. send float32 as is).

    ``loss_scale`` (backward and all-reduce only) fixes the fp16/fp8 scale to that factor; 0 picks
    a power of two per message from its largest value (dynamic loss scaling that cannot overflow,
    so no step is ever skipped).
    """
    if name not in CODECS:
        raise ValueError(f"unknown comm codec '{name}'; choose one of {', '.join(CODECS)}")
    if fp8_scaling not in ("row", "tensor"):
        raise ValueError(f"fp8 scaling must be 'row' or 'tensor', got '{fp8_scaling}'")
    if name == "fp32":
        return None
    if name == "int8":
        return Int8RowCodec()
    if name == "bf16":
        return FloatCodec(name, "none")
    if loss_scale > 0:
        return FloatCodec(name, "static", loss_scale)
    return FloatCodec(name, "tensor" if name == "fp16" else fp8_scaling)
