"""``neorec bench sequential`` end to end on a tiny MovieLens-shaped folder, and SASRec's pieces."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.bench.sequential import main
from neorec.errors import ConfigError
from neorec.modules.sasrec import SASRec, full_softmax_loss, sampled_softmax_loss


def _tiny(d: Path, users: int = 12, items: int = 9) -> Path:
    rng = np.random.default_rng(0)
    d.mkdir()
    rows = []
    for u in range(1, users + 1):
        for t in range(int(rng.integers(4, 9))):
            rows.append(f"{u}\t{(u + t) % items + 1}\t4\t{1000 + t}")
    (d / "u.data").write_text("\n".join(rows) + "\n")
    return d


def test_bench_runs_and_prints_the_json_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tiny(tmp_path / "ml")
    argv = ["--input", str(src), "--dropouts", "0.1", "--epochs", "1,2", "--dim", "8",
            "--max-len", "5", "--seeds", "2", "--seed-base", "10", "--exclude-seen", "on"]  # fmt: skip
    assert main(argv) == 0
    j = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for m in ("hr@10", "ndcg@10", "mrr@10"):
        assert set(j["sasrec"][m]) == {"value", "lo", "hi", "n"} and j["sasrec"][m]["n"] == 2
        assert 0 <= j["pop"][m]["value"] <= 1
    assert (
        j["protocol"]["exclude_seen"] is True
        and "full corpus (9 items)" == j["protocol"]["candidates"]
    )
    assert j["settings"]["epochs"] in (1, 2) and j["seeds"] == [10, 11]


def test_select_seeds_must_not_be_reported() -> None:
    with pytest.raises(ConfigError, match="overlap"):
        main(["--seeds", "2", "--seed-base", "0", "--select-seeds", "1"])


def test_sasrec_is_causal_and_ignores_padding() -> None:
    torch.manual_seed(0)
    m = SASRec(10, 8, 6, blocks=2, heads=2, dropout=0.0).eval()
    a = torch.tensor([[0, 0, 3, 4, 5, 6]])
    b = torch.tensor([[0, 0, 3, 4, 5, 9]])  # only the last item differs
    ha, hb = m(a), m(b)
    assert torch.equal(ha[:, :5], hb[:, :5]) and not torch.equal(ha[:, 5], hb[:, 5])
    assert m.scores(a).shape == (1, 11)


def test_sampled_softmax_with_every_item_once_equals_full_softmax() -> None:
    torch.manual_seed(0)
    h, table = torch.randn(4, 3), torch.randn(6, 3)  # 5 items
    targets = torch.tensor([1, 2, 5, 3])
    negatives = torch.arange(1, 6)
    log_q = torch.full((6,), -float(np.log(5)))  # uniform, S = V: log(S q) = 0
    full = full_softmax_loss(h, targets, table)
    # the accidental hit is removed and the positive kept: the same classes as the full softmax
    torch.testing.assert_close(sampled_softmax_loss(h, targets, table, negatives, log_q), full)


def test_logq_correction_brings_the_sampled_loss_to_the_full_one() -> None:
    torch.manual_seed(1)
    v = 50
    h, table = torch.randn(8, 4), torch.randn(v + 1, 4)
    targets = torch.randint(1, v + 1, (8,))
    q = torch.cat([torch.zeros(1), torch.linspace(1.0, 30.0, v)])
    q = q / q.sum()
    log_q = q.log()
    neg = torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    full = full_softmax_loss(h, targets, table)
    fixed = sampled_softmax_loss(h, targets, table, neg, log_q)
    raw = sampled_softmax_loss(h, targets, table, neg, torch.zeros(v + 1))
    assert abs(fixed - full) < 0.05 < abs(raw - full)


def test_neorec_train_sequential_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from neorec.cli import main as cli_main
    from neorec.data.sequential import write_sequential

    write_sequential(_tiny(tmp_path / "ml"), tmp_path / "seq")
    sets = [f"sequential.path='{tmp_path / 'seq'}'", "sequential.epochs=2", "sequential.dim=8",
            "sequential.max_len=5", "sequential.loss='sampled'", "sequential.negatives=4",
            f"train.run_dir='{tmp_path / 'run'}'"]  # fmt: skip
    argv = ["train", "--config", "configs/sasrec_movielens.toml"]
    assert cli_main(argv + [x for s in sets for x in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "test: HR@10" in out and "valid: HR@10" in out
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["test"]["n"] == 12 and 0 <= m["test"]["ndcg@10"] <= 1 and m["candidates"] == 9
    assert (tmp_path / "run" / "sequential" / "model.pt").is_file()
    assert cli_main(["eval", "--model", str(tmp_path / "run"), "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["test"] == m["test"] and again["valid"] == m["valid"]  # the saved model, reloaded
    assert cli_main(["eval", "--model", str(tmp_path / "run"), "--exclude-seen", "on"]) == 0
    assert "seen items excluded" in capsys.readouterr().out
