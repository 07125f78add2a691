"""LoKA: low precision where it is safe (probe) and faster (dispatch); see docs/lowp.md."""

from neorec.lowp.dispatch import MODES, Dispatcher, choose
from neorec.lowp.formats import CANDIDATES, Candidate, candidate, fp8_round, quantize
from neorec.lowp.probe import Probe

__all__ = [
    "MODES",
    "Dispatcher",
    "choose",
    "CANDIDATES",
    "Candidate",
    "candidate",
    "fp8_round",
    "quantize",
    "Probe",
]
