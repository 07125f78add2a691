"""The parts of a run that a checkpoint keeps beside the model: ``Stateful`` objects registered
with the ``CheckpointManager`` (as torchtitan registers its train state).

A checkpoint's extra state is one flat dict (``dense.pt``'s ``extra``): every registered part's
``state_dict()`` merged at each save, and handed whole to every part's ``load_state_dict`` after
a restore, so the parts' keys must not collide. A part that finds its keys missing or malformed
raises ``KeyError`` / ``TypeError`` / ``ValueError``; the restore turns it into one
``CheckpointError`` line naming the checkpoint and the part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from neorec.checkpoint.format import CheckpointError

__all__ = ["Stateful", "merged_state", "load_states"]


class Stateful(Protocol):
    """What a checkpoint keeps of a part of a run."""

    def state_dict(self) -> dict[str, Any]:
        """The part's state (plain values; called on every rank at each save)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state of a restored checkpoint (the merged dict of every part)."""


def merged_state(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """Every part's ``state_dict()``, merged in registration order."""
    out: dict[str, Any] = {}
    for part in parts.values():
        out.update(part.state_dict())
    return out


def load_states(parts: Mapping[str, Stateful], state: dict[str, Any], where: str) -> None:
    """Hand ``state`` (the checkpoint at ``where``) to every part, in registration order."""
    for name, part in parts.items():
        try:
            part.load_state_dict(state)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: no {name} state ({type(e).__name__}: {e}); it was not written by "
                f"neorec train: restore it with the CheckpointManager API"
            ) from None
