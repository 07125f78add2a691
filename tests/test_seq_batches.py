"""Training / evaluation arrays of leave-one-out sequences, and the loop learning a plain pattern."""

from __future__ import annotations

import numpy as np
import pytest

from neorec.builder.sequential import SeqSettings
from neorec.data.seq_batches import eval_set, item_counts, train_arrays
from neorec.data.sequential import build_sequences
from neorec.errors import ConfigError
from neorec.metrics_rank import rank_metrics
from neorec.train.sequential import fit, ranks_of


def _data(hists: list[list[int]]):  # type: ignore[no-untyped-def]
    users = np.concatenate([[u] * len(h) for u, h in enumerate(hists)])
    items = np.concatenate(hists)
    ts = np.concatenate([np.arange(len(h)) for h in hists])
    return build_sequences(users, items, ts)


def test_train_arrays_left_padded_most_recent_kept() -> None:
    s = _data([[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2]])  # raw ids = indices here (1..9 all seen)
    x, y = train_arrays(s, 3)
    # user 0: train part 1..4 -> inputs 1,2,3 targets 2,3,4; user 1: train part [7] (< 2): none;
    # user 2: < 3 interactions: all train -> inputs [1] targets [2]
    assert x.tolist() == [[1, 2, 3], [0, 0, 1]]
    assert y.tolist() == [[2, 3, 4], [0, 0, 2]]
    assert item_counts(s).tolist() == [0, 0, 2, 1, 1, 0, 0, 0, 0, 0]


def test_eval_sets_valid_and_test() -> None:
    s = _data([[1, 2, 3, 4, 5, 6], [7, 8, 9], [1, 2]])
    v, t = eval_set(s, "valid", 3), eval_set(s, "test", 3)
    assert v.users.tolist() == [0, 1] and t.users.tolist() == [0, 1]
    assert v.targets.tolist() == [5, 8] and t.targets.tolist() == [6, 9]
    assert v.inputs.tolist() == [[2, 3, 4], [0, 0, 7]]
    assert t.inputs.tolist() == [[3, 4, 5], [0, 7, 8]]
    assert t.seen[0].tolist() == [1, 2, 3, 4, 5]  # the whole history, not cut to max_len
    with pytest.raises(ConfigError, match="split"):
        eval_set(s, "train", 3)


@pytest.mark.parametrize("loss", ["full", "sampled"])
def test_the_loop_learns_a_successor_pattern(loss: str) -> None:
    # every user walks i -> i+1 (mod 12): the next item is fully determined by the last one
    hists = [[(u + k) % 12 + 1 for k in range(8)] for u in range(24)]
    s = _data(hists)
    st = SeqSettings(dim=16, max_len=6, blocks=1, dropout=0.0, lr=0.01, batch_size=8,
                     epochs=30, loss=loss, negatives=8)  # fmt: skip
    model = fit(s, st, 0)
    m = rank_metrics(ranks_of(model, eval_set(s, "test", 6), False), ks=(1, 10))
    assert m["hr@1"] > 0.9
