"""Quantization-aware training of embedding rows: Naumov et al. 2018's periodic regularizer.

A row ``w`` [D] is exported as ``bits``-bit codes on the row-wise grid of the export's codec
(``neorec.ops.quant``): offset ``lo = min(w)``, step ``s = (max(w) - min(w)) / (2^bits - 1)``,
levels ``lo + k s`` for k = 0 .. 2^bits - 1. With ``u = (w - lo) / s`` (a value's position in
steps) and ``f = u - round(u)`` (its signed distance to the nearest level, in steps, in
[-1/2, 1/2]), the penalty added to the loss of every row a step touches is

- ``sin``: ``R = strength * s^2 / (2 pi^2) * sin^2(pi u)``, whose gradient is
  ``strength * s / (2 pi) * sin(2 pi f)``: near a level ``strength * (w - level)``, an L2 pull
  of weight ``strength`` toward the nearest level (``strength`` reads like a weight decay);
- ``hat``: the triangle wave of the same period and height, ``R = strength * s^2 / pi^2 * |f|``,
  whose gradient is ``strength * s / pi^2 * sign(f)``.

Both vanish on the levels, so min and max (levels 0 and 2^bits - 1) feel nothing: the grid is
read from the row before the update, as a constant (no gradient through min / max). A row whose
values are all equal has ``s = 0`` and no penalty. The gradient is added to the row's summed
batch gradient like ``weight_decay`` (``neorec.ops.row_optim.apply_rows``), once per touched row
and step, and every backend computes it per row from the row alone: deterministic.

The export's int4 / int2 codec narrows a row's range by Check-N-Run's greedy search before it
rounds; a row whose values sit on its [min, max] grid is a fixed point of that search (its error
is 0 and only rises when the range moves), so the rows this regularizer has pulled onto the grid
are exported on the same grid. fp16 rounding of the stored scale and offset is left out (it moves
a level by at most 2^-11 of its value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch
from torch import Tensor

from neorec.errors import ConfigError

__all__ = ["QAT_BITS", "QAT_SHAPES", "Periodic", "row_grid", "periodic_grad", "grid_error"]

QAT_BITS = (2, 4, 8)
"""Code widths the regularizer targets (the export's integer widths)."""
QAT_SHAPES = ("sin", "hat")
"""The periodic penalty's shape: a sine, or the triangle (hat) wave."""

_TWO_PI = 2.0 * math.pi
_PI2 = math.pi * math.pi


@dataclass(frozen=True)
class Periodic:
    """The periodic regularizer of the fused row update: grid width, strength and shape."""

    bits: int
    """The grid's code width: 2^bits levels over each row's [min, max]."""
    strength: float
    """The penalty's weight (near a level, an L2 pull toward it of this weight)."""
    shape: str = "sin"
    """``sin`` or ``hat``."""

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in QAT_BITS:
            raise ConfigError(f"QAT bits must be one of {QAT_BITS}, got {self.bits!r}")
        s = self.strength
        if isinstance(s, bool) or not isinstance(s, Real) or not math.isfinite(float(s)):
            raise ConfigError(f"QAT strength must be a finite number, got {s!r}"[:200])
        if not 0 < float(s) <= 3.0e38:
            raise ConfigError(f"QAT strength must be > 0 (and a float32), got {s}")
        if self.shape not in QAT_SHAPES:
            raise ConfigError(f"QAT shape must be one of {QAT_SHAPES}, got {self.shape!r}")

    @property
    def code(self) -> int:
        """The shape's code in the C kernel (0: sin, 1: hat)."""
        return QAT_SHAPES.index(self.shape)


def row_grid(w: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's [min, max] of ``w`` [U, D]: (lo [U, 1], hi [U, 1])."""
    return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)


def _positions(w: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(step s [U, 1], signed distance f [U, D] of each value to its nearest level, in steps);
    rows of one value get s = 0 and f = 0."""
    lo, hi = row_grid(w)
    s = (hi - lo) / ((1 << bits) - 1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    u = (w - lo) / safe
    f = torch.where(s > 0, u - torch.round(u), torch.zeros_like(u))
    return s, f


def periodic_grad(reg: Periodic, w: Tensor) -> Tensor:
    """The regularizer's gradient [U, D] at rows ``w`` [U, D] (float32; the specification of the
    C kernel's ``qat_row``: the same operations in the same order)."""
    s, f = _positions(w, reg.bits)
    if reg.shape == "sin":
        coef = reg.strength * s / _TWO_PI
        return coef * torch.sin(_TWO_PI * f)
    coef = reg.strength * s / _PI2
    return coef * torch.sign(f)


def grid_error(w: Tensor, bits: int) -> Tensor:
    """Each row's RMS distance [U] of ``w`` [U, D] to its nearest level of the ``bits`` grid over
    its [min, max], in the row's own units (what rounding to the grid would cost it)."""
    s, f = _positions(w.float(), bits)
    return (f * s).square().mean(dim=1).sqrt()
