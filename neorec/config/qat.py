"""Config section ``[train.qat]``: quantization-aware training of the embedding rows.

Over the last ``start_fraction`` of the run's steps, the fused row update adds the gradient of
Naumov et al. 2018's periodic regularizer to every row a step touches: a sine (or hat) penalty
whose minima are the row's ``bits``-bit grid over its [min, max], the grid ``neorec export
--quantize int<bits>`` stores the row on (``neorec.ops.qat`` has the formulas). Rows pulled onto
their grid lose little when the export rounds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from neorec.config.checks import check_fields, rule
from neorec.errors import ConfigError

__all__ = ["QatConfig", "QAT_BITS", "QAT_SHAPES"]

QAT_BITS = (0, 2, 4, 8)
"""``bits`` values: 0 = off, else the export's integer width the rows are trained toward."""
QAT_SHAPES = ("sin", "hat")


@dataclass(kw_only=True)
class QatConfig:
    """The periodic regularizer toward the export's row-wise integer grid (off by default)."""

    bits: int = field(default=0, metadata=rule(choices=QAT_BITS))
    """The grid's width: 8, 4 or 2 (the ``--quantize int8 | int4 | int2`` the model will be
    exported at: 2^bits levels over each row's [min, max]); 0 = off."""
    start_fraction: float = field(default=0.25, metadata=rule(hi=1, gt=0))
    """The last part of the run the regularizer runs in: train steps s > T * (1 - start_fraction)
    of a run of T steps (train.steps, or the epochs' batches)."""
    strength: float = field(default=1.0, metadata=rule(hi=1e6, gt=0))
    """The penalty's weight; near a grid level its gradient is ``strength * (w - level)`` (an L2
    pull toward the nearest level, in the units of ``embedding.weight_decay``)."""
    shape: str = field(default="sin", metadata=rule(choices=QAT_SHAPES))
    """``sin``: ``strength * s^2 / (2 pi^2) * sin^2(pi (w - min) / s)`` (s: the grid's step);
    ``hat``: the triangle wave of the same period and height."""

    def __post_init__(self) -> None:
        check_fields(self, "train.qat")
        if self.bits == 0:
            changed = [
                f.name
                for f in fields(self)
                if f.name != "bits" and getattr(self, f.name) != f.default
            ]
            if changed:
                names = ", ".join(f"train.qat.{n}" for n in changed)
                raise ConfigError(
                    f"{names}: set but train.qat.bits is 0 (QAT is off: it would be ignored); "
                    "set train.qat.bits = 8, 4 or 2, or remove it"
                )

    @property
    def active(self) -> bool:
        """Whether the run trains with the regularizer."""
        return self.bits != 0

    def start_step(self, total_steps: int) -> int:
        """The last train step without the regularizer (it runs on steps after it)."""
        return int(total_steps * (1.0 - self.start_fraction))
