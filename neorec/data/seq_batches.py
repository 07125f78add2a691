"""Training and evaluation arrays of sequential data (:mod:`neorec.data.sequential`), left-padded.

Training (Kang & McAuley's): one example per user from the train part of the history (all but
the last two interactions): inputs ``s[:-1]``, targets ``s[1:]``, the most recent ``max_len`` of
each, left-padded with 0. Evaluation of split ``valid``: input = the train part, target = the
validation item; of ``test``: input = train part + validation item, target = the test item;
inputs cut to the most recent ``max_len``, the seen items (for ``exclude_seen``) are the whole
input history, never cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from neorec.data.sequential import SeqData
from neorec.errors import ConfigError

__all__ = ["EvalSet", "train_arrays", "eval_set", "item_counts"]

SPLITS = ("valid", "test")


def _pad_left(seqs: list[np.ndarray], max_len: int) -> np.ndarray:
    out = np.zeros((len(seqs), max_len), np.int64)
    for i, s in enumerate(seqs):
        s = s[-max_len:]
        if len(s):
            out[i, -len(s) :] = s
    return out


def _train_part(s: SeqData, u: int) -> np.ndarray:
    h = s.history(u)
    return h[:-2] if len(h) >= 3 else h


def train_arrays(s: SeqData, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each ``[U', max_len]`` int64 (0 = padding; users with >= 2 train items)."""
    parts = [_train_part(s, u) for u in range(len(s.users))]
    parts = [p for p in parts if len(p) >= 2]
    return _pad_left([p[:-1] for p in parts], max_len), _pad_left([p[1:] for p in parts], max_len)


def item_counts(s: SeqData) -> np.ndarray:
    """How often each item index 0..V is a train target (index 0: 0)."""
    _, targets = train_arrays(s, max(int(s.lengths().max()), 1))
    return np.bincount(targets[targets > 0], minlength=s.num_items + 1)


@dataclass(frozen=True)
class EvalSet:
    """One split's evaluation: inputs ``[U', max_len]``, targets ``[U']``, histories (seen)."""

    users: np.ndarray
    inputs: np.ndarray
    targets: np.ndarray
    seen: list[np.ndarray]


def eval_set(s: SeqData, split: str, max_len: int) -> EvalSet:
    """The evaluable users' (>= 3 interactions) inputs and targets of ``split``."""
    if split not in SPLITS:
        raise ConfigError(f"split {split!r}: want one of {', '.join(SPLITS)}")
    cut = 2 if split == "valid" else 1
    users = np.flatnonzero(s.lengths() >= 3)
    hist = [s.history(int(u))[:-cut] for u in users]
    targets = np.array([s.history(int(u))[-cut] for u in users], np.int64)
    return EvalSet(users, _pad_left(hist, max_len), targets, hist)
