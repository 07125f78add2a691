import math

import torch

from neorec.metrics import auc, binary_metrics, log_loss, normalized_entropy


def brute_auc(s, y):
    pos = [a for a, b in zip(s, y) if b == 1]
    neg = [a for a, b in zip(s, y) if b == 0]
    tot = 0.0
    for p in pos:
        for n in neg:
            tot += 1.0 if p > n else 0.5 if p == n else 0.0
    return tot / (len(pos) * len(neg))


def test_auc_matches_brute_force_with_ties():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 20, (300,), generator=g).float() / 20  # many ties
    y = (torch.rand(300, generator=g) < 0.3).float()
    assert abs(auc(s, y) - brute_auc(s.tolist(), y.tolist())) < 1e-12


def test_logloss_ne():
    y = torch.tensor([1.0, 0.0, 0.0, 1.0])
    p = torch.full((4,), 0.5)
    assert abs(log_loss(p, y) - math.log(2)) < 1e-12
    assert abs(normalized_entropy(p, y) - 1.0) < 1e-12  # base-rate prediction -> NE = 1
    m = binary_metrics(torch.tensor([0.9, 0.1, 0.2, 0.8]), y)
    assert m["auc"] == 1.0 and m["ne"] < 1.0 and abs(m["calibration"] - 1.0) < 1e-6
