"""The ``typed_trees`` candidate's boosted depth-2 trees: they fit what two features do together
(which additive stumps cannot), round-trip as JSON, and a broken tree is named on load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from neorec.sharding.learned_features import (
    FEATURES,
    _fit_stumps,
    _fit_trees,
    _stumps_log,
    _trees_log,
    check_params,
    predict,
)


def _interaction(n: int = 400, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, len(FEATURES)))
    a, b = x[:, 3] > 0, x[:, 7] > 0
    return x, np.where(a & b, 0.5, 0.0)  # only both together matter (an XOR-like corner)


def test_trees_fit_an_interaction_that_stumps_cannot() -> None:
    x, y = _interaction()
    trees = _fit_trees(x, y, rounds=60)
    stumps = _fit_stumps(x, y, rounds=60)
    err_t = float(np.mean((_trees_log(trees, x) - y) ** 2))
    err_s = float(np.mean((_stumps_log(stumps, x) - y) ** 2))
    assert err_t < 0.5 * err_s, (err_t, err_s)
    xt, yt = _interaction(seed=1)  # held out: the same rule
    assert float(np.mean((_trees_log(trees, xt) - yt) ** 2)) < float(np.mean(yt**2)) / 4


def test_typed_trees_params_round_trip_and_bad_trees_are_named() -> None:
    x, y = _interaction(200)
    base = np.full(len(y), 5.0)
    from neorec.sharding.learned_features import CANDIDATES

    p = dict(CANDIDATES)["typed_trees"](x, y, base)
    q = json.loads(json.dumps(p))
    check_params(q, "targets.step")
    assert np.allclose(predict(q, x, base), predict(p, x, base))
    k = len(FEATURES)
    for bad in (
        {**q, "trees": [[k, 0.0, q["trees"][0][2]]]},  # a feature index out of range
        {**q, "trees": [[0, 0.0, [[-1, 0.0, float("nan"), 0.0], [-1, 0.0, 0.0, 0.0]]]]},
        {**q, "trees": [[0, 0.0, [[-1, 0.0, 0.0, 0.0]]]]},  # one side only
        {k2: v for k2, v in q.items() if k2 != "base"},
    ):
        with pytest.raises(ValueError, match="targets.step: bad or missing field"):
            check_params(bad, "targets.step")
