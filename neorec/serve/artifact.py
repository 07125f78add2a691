"""A serving artifact (``neorec export``) loaded from neorec: the artifact's own loader
(``standalone.py``, its ``serving.py``) with every refusal raised as a ``NeorecError``.

The loader checks every file against the sealed manifest before anything is used (sizes always,
CRC-32 unless ``verify=False``); a damaged file is one line naming it. Predictions equal those of
the artifact's ``serving.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.errors import DataError
from neorec.serve import standalone

__all__ = ["ServingError", "ServingArtifact", "load_artifact"]


class ServingError(DataError):
    """A serving artifact's file is missing or damaged, or predict's input is refused."""


class ServingArtifact:
    """``predict(dense, sparse)`` of an artifact (``standalone.Predictor``'s), refusing with a
    ``ServingError``."""

    def __init__(self, predictor: standalone.Predictor) -> None:
        self.predictor = predictor
        self.features = predictor.features
        self.manifest = predictor.manifest

    def logits(self, dense: Any, sparse: dict[str, Any]) -> torch.Tensor:
        """Logits [B] (float32)."""
        try:
            return self.predictor.logits(dense, sparse)
        except ValueError as e:
            raise ServingError(str(e)) from None

    def __call__(self, dense: Any, sparse: dict[str, Any]) -> np.ndarray:
        """Click probabilities float32 [B]."""
        return torch.sigmoid(self.logits(dense, sparse)).numpy()


def load_artifact(path: str | Path, verify: bool = True) -> ServingArtifact:
    """The artifact in directory ``path``, every file checked against its manifest first
    (``verify=False``: sizes only, no CRC pass over the tables)."""
    try:
        return ServingArtifact(standalone.load(str(path), verify))
    except ValueError as e:  # standalone.ArtifactError: names the file
        raise ServingError(str(e)) from None
