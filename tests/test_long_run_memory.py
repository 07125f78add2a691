"""A long run holds no per-step or per-eval history in memory: the progress keeps the last
``keep`` losses, the train state a count of its evals (the evals are in ``events.jsonl``)."""

from __future__ import annotations

import io

import torch

from neorec.train.progress import KEEP_LOSSES, Progress
from neorec.train.state import TrainState


def test_progress_keeps_only_the_recent_losses() -> None:
    p = Progress(total=None, every=10, out=io.StringIO(), enabled=False)
    p.begin()
    for step in range(1, 1001):
        p.update(step, 4, torch.tensor(float(step)))
    assert len(p.losses) == KEEP_LOSSES
    assert p.losses == [float(s) for s in range(1001 - KEEP_LOSSES, 1001)]
    wide = Progress(total=None, every=80, out=io.StringIO(), enabled=False)
    wide.losses = [float(x) for x in range(500)]  # a checkpoint's list is cut the same way
    assert wide.keep == 80 and wide.losses == [float(x) for x in range(420, 500)]


def test_train_state_counts_evals_and_reads_old_checkpoints() -> None:
    st = TrainState()
    st.evals_count = 3
    assert st.state_dict()["evals_count"] == 3 and not hasattr(st, "evals")
    old = TrainState()
    old.load_state_dict({"step": 9, "epoch": 0, "next_batch": 9, "evals": [{"step": 3}] * 2})
    assert old.evals_count == 2 and old.step == 9
