"""ExFM's chain (``neorec exfm``) and the FM / VM distribution gap of the stream (a vertical)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from faults import campaign

from neorec.cli import main as cli_main
from neorec.config import load_config
from neorec.data.stream import DriftingClickData, stream_fingerprint
from neorec.serve import load_model
from neorec.train.exfm import check_pair, recalibrated_ne

C = campaign("exfm chain")
ROOT = Path(__file__).resolve().parents[1] / "configs"
STUDENT, FM = str(ROOT / "exfm_stream.toml"), str(ROOT / "exfm_fm.toml")
TINY = ["data.window_samples=512", "data.eval_samples=512", "data.windows=3"]


def _gen(cfg, window: int = 1) -> DriftingClickData:
    return DriftingClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense, window=window)


def test_vertical_keeps_features_and_moves_the_teacher() -> None:
    base = load_config(STUDENT, [*TINY, "data.vertical_bias=0", "data.vertical_shift=0"])
    biased = load_config(STUDENT, [*TINY, "data.vertical_bias=0.7", "data.vertical_shift=0"])
    shifted = load_config(STUDENT, [*TINY, "data.vertical_bias=0", "data.vertical_shift=0.4"])
    g0, gb, gs = _gen(base), _gen(biased), _gen(shifted)
    code = g0._split_code("train")
    (f0, z0, _), (fb, zb, _), (fs, zs, _) = (g._features(code, 2, 64) for g in (g0, gb, gs))
    for f in (fb, fs):  # the same samples: only the labels' teacher differs
        assert torch.equal(f["dense"], f0["dense"])
        assert torch.equal(f["sparse"].values, f0["sparse"].values)
    assert torch.allclose(zb - z0, torch.full_like(z0, 0.7), atol=1e-9)  # a click-rate offset
    d = zs - z0
    assert d.std() > 1e-3  # feature-dependent, deterministic
    assert torch.equal(_gen(shifted)._features(code, 2, 64)[1], zs)
    # fingerprints: unchanged without a vertical, distinct with one
    assert (
        stream_fingerprint(base.data, base.embedding.tables, base.model.num_dense)
        != stream_fingerprint(biased.data, biased.embedding.tables, biased.model.num_dense)
        != stream_fingerprint(shifted.data, shifted.embedding.tables, shifted.model.num_dense)
    )
    plain = load_config(STUDENT, TINY)
    none = dataclasses.replace(plain, data=dataclasses.replace(plain.data, vertical_bias=0.0))
    assert stream_fingerprint(
        none.data, none.embedding.tables, none.model.num_dense
    ) == stream_fingerprint(base.data, base.embedding.tables, base.model.num_dense)


def test_check_pair_accepts_a_vertical_student_and_refuses_a_vertical_fm() -> None:
    student = load_config(STUDENT, [*TINY, "data.vertical_bias=0.5"])
    fm = load_config(FM, TINY)
    check_pair(student, fm, "s.toml", "fm.toml")  # the FM learns from the stream itself
    bad = load_config(FM, [*TINY, "data.vertical_bias=0.5"])
    C.expect_error(
        "check: FM with a vertical", lambda: check_pair(student, bad, "s", "f"), "vertical"
    )
    other = load_config(FM, [*TINY, "data.drift=0.3"])
    C.expect_error(
        "check: another stream", lambda: check_pair(student, other, "s", "f"), "different streams"
    )


def test_recalibrated_ne_undoes_a_constant_offset() -> None:
    from neorec.metrics import binary_metrics

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4000, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(z), generator=g)

    class Shifted(torch.nn.Module):  # the "FM": the true logit, 1.5 too high
        def forward(self, dense, sparse):  # noqa: ARG002
            return dense[:, 0] + 1.5

    batches = [
        SimpleNamespace(dense=z[i : i + 1000, None].float(), sparse=None, labels=y[i : i + 1000])
        for i in range(0, 4000, 1000)
    ]
    raw = binary_metrics(torch.sigmoid(z + 1.5), y)["ne"]
    best = binary_metrics(torch.sigmoid(z), y)["ne"]
    got = recalibrated_ne(Shifted(), batches)
    assert got < raw - 0.01 and got <= best + 1e-3


def test_exfm_chain_runs_and_saves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chain"
    sets = [x for s in TINY for x in ("--set", s)] + [x for s in TINY for x in ("--fm-set", s)]
    argv = ["exfm", "--config", STUDENT, "--fm-config", FM, *sets, "--out", str(out)]
    assert cli_main(argv) == 0
    text = capsys.readouterr().out
    r = json.loads(text.strip().splitlines()[-1])
    # each window says so as it ends, with the time so far and an ETA until the last
    lines = text.splitlines()
    for who in ("FM", "student"):
        said = [x for x in lines if x.strip().startswith(f"{who} window ")]
        assert [x.split()[2].rstrip(":") for x in said] == ["1/3", "2/3", "3/3"], said
        assert "eta" in said[0] and "eta" not in said[-1] and "so far" in said[-1]
    assert r["windows"] == 3 and r["staleness"] == 1 and len(r["student_ne"]) == 3
    assert r["fm_logits_ne"][0] is None and all(x is not None for x in r["fm_logits_ne"][1:])
    # the FM of windows 0 and 1 (read by windows 1 and 2), their DAS files, the student
    assert (out / "fm_w0" / "model.json").exists() and (out / "fm_w1" / "model.json").exists()
    assert not (out / "fm_w2").exists()
    for w in (1, 2):
        for split in ("train", "eval"):
            assert (out / "das" / f"fm_w{w}_{split}.npy").exists()
    model, cfg = load_model(out / "student")
    assert cfg.data.window == 2
    # the saved student predicts (its serving head; aux head and adapter ride along for training)
    from neorec.builder import data_source

    batch = next(iter(data_source(cfg).eval_batches()))
    model.train(False)
    assert torch.isfinite(model(batch.dense, batch.sparse)).all()
    # a used --out is refused, one line, exit 2, nothing overwritten
    before = sorted(p.name for p in out.iterdir())
    assert cli_main(argv) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == before
    C.expect_cli_error(
        "cli: windows beyond the stream",
        [*argv[:-1], str(tmp_path / "new"), "--windows", "9"],
        "--windows 9",
    )
    C.check()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_hand_written_student_losses_equal_autograd(temperature: float) -> None:
    """The adapter's and the aux head's losses with their gradients by hand (one autograd node)
    equal the autograd formulation (the modules' forward + BCE) up to float rounding."""
    import torch.nn.functional as F

    from neorec.modules.exfm_heads import StudentAdapter, adapter_and_aux_losses, aux_soft_bce
    from neorec.train.distill import soft_bce

    g = torch.Generator().manual_seed(3)
    ad = StudentAdapter(16, 13, seed=0)
    with torch.no_grad():  # away from the identity init, so every gradient is nonzero
        for p in ad.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    head = torch.nn.Linear(16, 1)
    fm, s = torch.randn(96, generator=g), torch.randn(96, generator=g)
    dense, y = torch.rand(96, 13, generator=g), torch.randint(0, 2, (96,), generator=g).float()
    h = torch.randn(96, 16, generator=g, requires_grad=True)

    def grads(n: int = 5) -> list[torch.Tensor]:
        params = [h, head.weight, head.bias, *ad.parameters()][:n]
        out = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return out

    # the specification: autograd through the modules
    corrected = ad(fm, s, dense)
    ref_ad = F.binary_cross_entropy_with_logits(corrected, y)
    ref_aux = soft_bce(head(h).squeeze(1), corrected.detach(), temperature)
    (0.5 * ref_ad + 2.0 * ref_aux).backward()
    want = grads()
    got_ad, got_aux, got_out = adapter_and_aux_losses(ad, head, h, fm, s, dense, y, temperature)
    (0.5 * got_ad + 2.0 * got_aux).backward()
    got = grads()
    torch.testing.assert_close(got_ad, ref_ad.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_aux, ref_aux.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_out, corrected.detach(), rtol=1e-5, atol=1e-6)
    assert not got_out.requires_grad
    for a, w in zip(got, want):
        assert w.abs().sum() > 0
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
    # the aux head alone (no adapter): toward the FM logits
    ref = soft_bce(head(h).squeeze(1), fm, temperature)
    ref.backward()
    want = grads(3)
    got_one = aux_soft_bce(h, head.weight, head.bias, fm, temperature)
    got_one.backward()
    torch.testing.assert_close(got_one, ref.detach(), rtol=1e-6, atol=1e-7)
    for a, w in zip(grads(3), want):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-7)
