"""Number formats LoKA chooses between, and their emulation in fp32.

A candidate is a storage format for a GEMM's operands (the accumulation stays fp32, as in the
bf16 / fp16 / fp8 GEMMs of AMX, AVX512-BF16 and tensor cores): ``bf16``, ``fp16``, and fp8
``e4m3`` / ``e5m2`` with a per-tensor or a per-row scale. ``quantize`` returns the fp32 value an
operand has after the round trip, so the error of a kernel can be measured on any machine: the
scaled fp8 paths use exactly the scaling ``torch._scaled_mm`` is given on a GPU (amax / the
format's largest value, saturating), and :func:`fp8_round` rounds in plain fp32 arithmetic, bit
for bit what a cast to ``torch.float8_*`` gives (tested), for backends without fp8 dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Candidate",
    "CANDIDATES",
    "FP8",
    "candidate",
    "quantize",
    "fp8_round",
    "fp8_scale",
]


@dataclass(frozen=True)
class Fp8Format:
    """An fp8 format: mantissa bits, smallest normal exponent, largest finite value."""

    name: str
    mbits: int
    emin: int
    fmax: float
    dtype: torch.dtype


FP8 = {
    "e4m3": Fp8Format("e4m3", 3, -6, 448.0, torch.float8_e4m3fn),
    "e5m2": Fp8Format("e5m2", 2, -14, 57344.0, torch.float8_e5m2),
}


@dataclass(frozen=True)
class Candidate:
    """A precision a site may run in: ``fp32``, ``bf16``, ``fp16`` or ``fp8-<fmt>-<scaling>``."""

    name: str
    kind: str  # "fp32" | "bf16" | "fp16" | "fp8"
    fp8: str = ""  # "e4m3" | "e5m2"
    scaling: str = ""  # "tensor" | "row"

    @property
    def dtype(self) -> torch.dtype:
        """The operands' storage dtype."""
        if self.kind == "fp8":
            return FP8[self.fp8].dtype
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.kind]

    @property
    def bits(self) -> int:
        """Bits per stored element."""
        return {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8}[self.kind]


CANDIDATES: tuple[Candidate, ...] = (
    Candidate("fp32", "fp32"),
    Candidate("bf16", "bf16"),
    Candidate("fp16", "fp16"),
    Candidate("fp8-e4m3-tensor", "fp8", "e4m3", "tensor"),
    Candidate("fp8-e4m3-row", "fp8", "e4m3", "row"),
    Candidate("fp8-e5m2-tensor", "fp8", "e5m2", "tensor"),
    Candidate("fp8-e5m2-row", "fp8", "e5m2", "row"),
)
_BY_NAME = {c.name: c for c in CANDIDATES}


def candidate(name: str) -> Candidate:
    """The candidate called ``name`` (``ValueError`` listing the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown precision {name!r}; known: {', '.join(_BY_NAME)}") from None


def fp8_scale(x: Tensor, fmt: str, scaling: str) -> Tensor:
    """The dequantization scale of ``x`` (amax / fmax; a scalar, or one per row of a 2-D ``x``).

    An all-zero tensor or row gets scale 1 (anything times 0 is 0)."""
    fmax = FP8[fmt].fmax
    a = x.detach().abs().float()
    amax = a.amax() if scaling == "tensor" or x.dim() < 2 else a.flatten(1).amax(dim=1)
    scale = amax / fmax
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_round(x: Tensor, fmt: str) -> Tensor:
    """Round fp32 ``x`` to the nearest fp8 ``fmt`` value (ties to even), saturating at ±fmax;
    NaN stays NaN. Plain fp32 arithmetic: equal bit for bit to ``x.clamp(-fmax, fmax)`` cast to
    ``torch.float8_*`` and back."""
    f = FP8[fmt]
    x = x.float()
    c = x.clamp(-f.fmax, f.fmax)
    _, e = torch.frexp(c)  # c = m * 2**e, 0.5 <= |m| < 1, so floor(log2 |c|) = e - 1
    exp = torch.clamp(e - 1, min=f.emin)  # subnormals share the smallest normal's quantum
    quantum = torch.ldexp(torch.ones_like(c), (exp - f.mbits).to(torch.int32))
    q = torch.round(c / quantum) * quantum  # exact: scaling by powers of two; round: half-even
    return torch.where(torch.isnan(x), x, q)


def quantize(x: Tensor, cand: Candidate, cast: bool = True) -> Tensor:
    """``x`` after a round trip through ``cand``'s format, in fp32.

    fp8 is scaled (per tensor, or per row of a 2-D ``x``) to the format's range first, rounded,
    and scaled back. ``cast=False`` rounds fp8 with :func:`fp8_round` instead of a dtype cast."""
    x = x.float()
    if cand.kind == "fp32":
        return x
    if cand.kind in ("bf16", "fp16"):
        return x.to(cand.dtype).float()
    scale = fp8_scale(x, cand.fp8, cand.scaling)
    s = scale.view(-1, *([1] * (x.dim() - 1))) if scale.dim() == 1 else scale
    fmax = FP8[cand.fp8].fmax
    y = (x / s).clamp(-fmax, fmax)
    q = y.to(cand.dtype).float() if cast else fp8_round(y, cand.fp8)
    return q * s
