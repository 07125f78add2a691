"""Check-N-Run checkpoints in one process: codecs, pieces, policies, exact resume, corruption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    NoCheckpointError,
    list_checkpoints,
    open_storage,
    resolve_checkpoint,
    verify_checkpoint,
)
from neorec.checkpoint.format import decode_piece, encode_piece
from neorec.cli import main as cli_main
from neorec.config import CheckpointConfig, load_config
from neorec.ops.quant import (
    greedy_row_range,
    int_rowwise_dequantize,
    int_rowwise_quantize,
    pack_int_codes,
    unpack_int_codes,
)
from neorec.train.trainer import Trainer, train_step


def tiny_cfg(run_dir: Path, *extra: str):
    return load_config(
        overrides=[
            "embedding.num_tables=3",
            "embedding.rows=300",
            "embedding.dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=64",
            "data.train_samples=1280",
            "data.eval_samples=640",
            f"train.run_dir='{run_dir}'",
            "train.progress=false",
            "checkpoint.fsync=false",
            *extra,
        ]
    )


# ---- codecs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (7, 13), dtype=torch.int32)
    packed = pack_int_codes(codes, bits)
    assert packed.shape == (7, (13 * bits + 7) // 8)
    assert torch.equal(unpack_int_codes(packed, bits, 13), codes)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_int_rowwise_error_is_half_a_step(bits):
    x = torch.randn(200, 16) * torch.logspace(-2, 1, 200).unsqueeze(1) + torch.randn(200, 1)
    x[0] = 0.25  # constant row: exact
    q = int_rowwise_quantize(x, bits)
    err = (int_rowwise_dequantize(q) - x).abs().max(1).values
    step = (x.max(1).values - x.min(1).values) / ((1 << bits) - 1)
    assert err[0] == 0
    # fp16 scale and offset widen the step by at most ~2^-11 of |offset| / levels
    assert torch.all(err <= 0.5 * step * 1.01 + 1e-3 * x.abs().max(1).values / (1 << bits))


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_adaptive_range_never_worse_and_helps_heavy_tails(bits):
    torch.manual_seed(0)
    x = torch.distributions.StudentT(2.0).sample((300, 32))  # heavy tails: outliers waste levels
    lo, hi = greedy_row_range(x, bits)
    assert torch.all(lo >= x.min(1).values) and torch.all(hi <= x.max(1).values)
    plain = (int_rowwise_dequantize(int_rowwise_quantize(x, bits)) - x).square().sum(1)
    adapt = (int_rowwise_dequantize(int_rowwise_quantize(x, bits, True)) - x).square().sum(1)
    assert torch.all(adapt <= plain * 1.02 + 1e-6)  # fp16 scale rounding aside
    assert adapt.sum() < 0.9 * plain.sum()


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_requantizing_restored_rows_changes_nothing(bits, adaptive):
    """A restored row written again unchanged (the next baseline after a restore) stores the
    same values, in a piece of any other rows: k restores do not degrade the rows training has not
    touched since. (Rows centred within a few ranges of 0, as embedding rows are; a row whose mean
    is far beyond its range has an fp16 offset coarser than its step, and moves by up to a step.)"""
    torch.manual_seed(1)
    spread = torch.logspace(-3, 0, 600).unsqueeze(1)
    x = spread * (torch.randn(600, 16) + 0.3 * torch.randn(600, 1))
    once = int_rowwise_dequantize(int_rowwise_quantize(x, bits, adaptive))
    twice = int_rowwise_dequantize(int_rowwise_quantize(once, bits, adaptive))
    assert torch.equal(twice, once)
    for part in (slice(300, None), slice(0, 40)):  # other pieces: other fp16 units
        again = int_rowwise_dequantize(int_rowwise_quantize(once[part], bits, adaptive))
        assert torch.equal(again, once[part])


@pytest.mark.parametrize("n_ids", [None, 3, 90])  # every row, int32 offsets, bitmap
def test_piece_roundtrip_float32_is_exact(n_ids):
    span, cols = 100, 8
    ids = None if n_ids is None else torch.randperm(span)[:n_ids].sort().values
    n = span if ids is None else n_ids
    w, m1, ea = torch.randn(n, cols), torch.rand(n), torch.randn(n, cols)
    data = encode_piece(w, {"momentum1": m1, "exp_avg": ea}, ids, span, 32, 32, False)
    p = decode_piece(data)
    assert (p.ids is None) == (ids is None) and (ids is None or torch.equal(p.ids, ids))
    assert torch.equal(p.weight, w)
    assert torch.equal(p.state["momentum1"], m1) and torch.equal(p.state["exp_avg"], ea)


def test_piece_quantized_sizes_shrink():
    w = torch.randn(1000, 16)
    sizes = {b: len(encode_piece(w, {}, None, 1000, b, 0, True)) for b in (32, 8, 4, 2)}
    # per row: 64 B float32; 16 + 4 B at 8 bits; 8 + 4 B at 4 bits; 4 + 4 B at 2 bits
    assert sizes[32] > 3 * sizes[8] and sizes[8] > 1.6 * sizes[4] and sizes[4] > 1.4 * sizes[2]


# ---- manager -----------------------------------------------------------------------------------
def _model(cfg):
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    return model, dense_optimizer(cfg.train, model.dense_parameters())


def _train(model, opt, cfg, start, end):
    from neorec.data.synthetic import SyntheticClickData

    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    for s in range(start, end):
        train_step(model, opt, data.batch("train", s, cfg.data.batch_size), s + 1)


def _same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("policy", ["full", "one_shot", "consecutive", "adaptive"])
def test_policy_chain_restores_bitwise(tmp_path, policy):
    cfg = tiny_cfg(tmp_path)
    ck = CheckpointConfig(
        policy=policy, bits=32, opt_bits=32, async_write=True, adaptive_threshold=0.6, fsync=False
    )
    model, opt = _model(cfg)
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    for k in range(6):
        _train(model, opt, cfg, 2 * k, 2 * k + 2)
        mgr.save(2 * k + 2, {"k": k})
    mgr.close()
    hist = list_checkpoints(mgr.storage)
    kinds = [m["kind"] for m in hist]
    chains = [len(m["chain"]) for m in hist]
    if policy == "full":
        assert set(kinds) == {"baseline"}
    elif policy == "one_shot":
        assert kinds.count("baseline") == 1 and max(chains) == 2
    elif policy == "consecutive":
        assert kinds.count("baseline") == 1 and chains[-1] == 6
    else:
        assert 1 < kinds.count("baseline") < 6  # the chain got too heavy at least once
    assert sum(m["rows"] for m in hist if m["kind"] != "baseline") < sum(
        m["rows"] for m in hist if m["kind"] == "baseline"
    ) * len(hist)
    fresh, fresh_opt = _model(cfg)
    extra = CheckpointManager(ck, fresh, fresh_opt, str(tmp_path / "ck")).restore("latest")
    assert extra == {"k": 5}
    assert _same_state(model, fresh)
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_quantized_restore_is_close_and_optimizer_state_kept(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    ck = CheckpointConfig(bits=8, opt_bits=16, async_write=False, fsync=False)
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    _train(model, opt, cfg, 0, 3)
    mgr.save(3)
    fresh, fresh_opt = _model(cfg)
    CheckpointManager(ck, fresh, fresh_opt, str(tmp_path / "ck")).restore("latest")
    w, r = model.ebc.weights.view(-1, 8), fresh.ebc.weights.view(-1, 8)
    step = (w.max(1).values - w.min(1).values) / 255
    assert torch.all((w - r).abs().max(1).values <= 0.6 * step + 1e-6)
    m1, r1 = model.ebc.momentum1, fresh.ebc.momentum1
    assert torch.allclose(m1, r1, rtol=1e-2) and bool((r1 > 0).any())


def test_resume_exact_single_process(tmp_path):
    """N+M straight == N, checkpoint, new Trainer (a fresh process's view), resume, M more."""
    exact = ["checkpoint.bits=32", "checkpoint.opt_bits=32", "checkpoint.policy=consecutive"]
    common = ["train.eval_every=4", "embedding.optimizer=adam", *exact]
    straight = Trainer(tiny_cfg(tmp_path / "a", "train.steps=14", *common))
    ra = straight.fit()
    first = Trainer(tiny_cfg(tmp_path / "b", "train.steps=9", "checkpoint.every_steps=3", *common))
    first.fit()
    resumed = Trainer(
        tiny_cfg(
            tmp_path / "b",
            "train.steps=14",
            "checkpoint.every_steps=3",
            "checkpoint.resume=latest",
            *common,
        )
    )
    rb = resumed.fit()
    assert _same_state(straight.model, resumed.model)
    assert straight.opt.state_dict()["state"].keys() == resumed.opt.state_dict()["state"].keys()
    for k, v in straight.opt.state_dict()["state"].items():
        for name, t in v.items():
            assert torch.equal(t, resumed.opt.state_dict()["state"][k][name])
    assert ra["eval"] == rb["eval"] and ra["evals"] == rb["evals"]
    assert ra["train"]["final_loss"] == rb["train"]["final_loss"]
    assert ra["train"]["samples"] == rb["train"]["samples"] and rb["train"]["steps"] == 14
    root = tmp_path / "b" / "checkpoints"
    last = list_checkpoints(open_storage(str(root)))[-1]
    assert last["step"] == 12 and len(last["chain"]) == 4  # increments extend the restored chain


def test_corrupted_or_truncated_piece_is_detected(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    ck = CheckpointConfig(bits=4, async_write=False, fsync=False)
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    _train(model, opt, cfg, 0, 2)
    mgr.save(2)
    name = resolve_checkpoint(mgr.storage, "latest")
    assert verify_checkpoint(mgr.storage, name)["files"] == 4  # 3 tables + dense
    piece = sorted((tmp_path / "ck" / name / "emb" / "t1").iterdir())[0]
    data = bytearray(piece.read_bytes())
    data[len(data) // 2] ^= 0x40
    piece.write_bytes(bytes(data))
    fresh, fresh_opt = _model(cfg)
    with pytest.raises(CheckpointCorruptError, match=r"t1/r0-300.*checksum mismatch"):
        CheckpointManager(ck, fresh, fresh_opt, str(tmp_path / "ck")).restore("latest")
    piece.write_bytes(bytes(data[:-10]))
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        verify_checkpoint(open_storage(str(tmp_path / "ck")), name)


def test_incomplete_checkpoint_is_invisible_and_cleaned_only_in_its_lineage(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    ck = CheckpointConfig(async_write=False, fsync=False)
    root = tmp_path / "ck"
    first = CheckpointManager(ck, model, opt, str(root))
    first.save(1)
    mine = root / f"ckpt-0000000009-{first.lineage}-0badc0de"  # a writer of this run died here
    other = root / "ckpt-0000000009-deadbeef-deadbeef"  # another run's unfinished write
    for d in (mine, other):
        (d / "emb").mkdir(parents=True)
    storage = open_storage(str(root))
    assert resolve_checkpoint(storage, "latest").startswith("ckpt-0000000001-")
    resumed = CheckpointManager(ck, model, opt, str(root))
    assert mine.exists() and other.exists()  # creating (or failing to resume) deletes nothing
    resumed.restore("latest")
    assert resumed.lineage == first.lineage
    resumed.save(2)
    assert not mine.exists() and other.exists()
    with pytest.raises(NoCheckpointError, match="no checkpoint under"):
        resolve_checkpoint(open_storage(str(tmp_path / "empty")), "latest")


def test_keep_last_baselines_with_their_chains(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    ck = CheckpointConfig(
        policy="consecutive", full_every=2, keep_last=2, async_write=False, fsync=False
    )
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    for s in range(1, 10):
        _train(model, opt, cfg, s - 1, s)
        mgr.save(s)
    hist = list_checkpoints(mgr.storage)
    # baselines at 1, 4, 7 (each followed by 2 increments); the first family is gone
    assert [m["kind"] for m in hist] == ["baseline", "increment", "increment"] * 2
    assert [m["step"] for m in hist] == [4, 5, 6, 7, 8, 9]
    assert len([p for p in (tmp_path / "ck").iterdir()]) == 6


def test_fsspec_url_and_cli(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    ck = CheckpointConfig(bits=4, async_write=True, fsync=False)
    mem = CheckpointManager(ck, model, opt, "memory://neorec-test-ckpt")
    disk = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    for s in (1, 2):
        _train(model, opt, cfg, s - 1, s)
        mem.save(s)
        disk.save(s)
    mem.close()
    disk.close()
    fresh, fresh_opt = _model(cfg)
    CheckpointManager(ck, fresh, fresh_opt, "memory://neorec-test-ckpt").restore("latest")
    assert torch.allclose(fresh.ebc.weights, model.ebc.weights, atol=0.01)
    assert cli_main(["ckpt", "ls", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "increment" in out and "2 checkpoints" in out
    assert cli_main(["ckpt", "inspect", str(tmp_path / "ck"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "chain (restore applies in this order)" in out and "verified: " in out
    assert "4 bits (adaptive range)" in out and "restore reads" in out
    assert cli_main(["ckpt", "inspect", str(tmp_path / "nothing")]) == 2
    assert "neorec: error: no checkpoint under" in capsys.readouterr().err
    assert cli_main(["ckpt", "ls", str(tmp_path / "nothing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    manifest = json.loads(next((tmp_path / "ck").glob("*/manifest.json")).read_text())
    assert manifest["format_version"] == 2 and manifest["pieces"][0]["crc32"]


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_commits_the_inflight_write_and_propagates(tmp_path, monkeypatch, exc):
    """Ctrl-C (or an error) mid-run: not swallowed; the async write in flight commits, nothing
    unfinished is left, and the latest checkpoint verifies."""
    import neorec.train.steps as steps_mod

    real = steps_mod.train_step

    def step(model, opt, batch, s, *rest):
        if s == 6:
            raise exc("stop")
        return real(model, opt, batch, s, *rest)

    monkeypatch.setattr(steps_mod, "train_step", step)
    cfg = tiny_cfg(
        tmp_path, "train.steps=9", "checkpoint.every_steps=5", "train.pipeline='sequential'"
    )
    with pytest.raises(exc, match="stop"):
        Trainer(cfg).fit()
    root = tmp_path / "checkpoints"
    storage = open_storage(str(root))
    name = resolve_checkpoint(storage, "latest")
    assert name.startswith("ckpt-0000000005-") and verify_checkpoint(storage, name)["files"] == 4
    assert all((d / "manifest.json").exists() for d in root.iterdir())


def test_manifest_checksum_covers_every_field(tmp_path):
    cfg = tiny_cfg(tmp_path)
    model, opt = _model(cfg)
    mgr = CheckpointManager(
        CheckpointConfig(async_write=False, fsync=False), model, opt, str(tmp_path / "ck")
    )
    mgr.save(1)
    p = next((tmp_path / "ck").glob("*/manifest.json"))
    m = json.loads(p.read_text())
    assert m["checksum"].startswith("sha256:") and m["lineage"] == mgr.lineage and m["seq"] == 1
    m["step"] = 2
    p.write_text(json.dumps(m))
    with pytest.raises(CheckpointCorruptError, match="manifest checksum mismatch"):
        verify_checkpoint(open_storage(str(tmp_path / "ck")), p.parent.name)


def test_checkpoints_keep_the_eval_count_not_the_evals(tmp_path, capsys):
    """A checkpoint's size does not grow with the run's evals: it holds their number, and a
    resumed run reads them back from events.jsonl (equal to an uninterrupted run's); without
    the file, one line says how many it lacks."""
    common = ["train.eval_every=2", "checkpoint.bits=32", "checkpoint.opt_bits=32"]
    straight = Trainer(tiny_cfg(tmp_path / "a", "train.steps=12", *common)).fit()
    cfg = tiny_cfg(tmp_path / "b", "train.steps=8", "checkpoint.every_steps=4", *common)
    Trainer(cfg).fit()
    model, opt = _model(cfg)
    mgr = CheckpointManager(cfg.checkpoint, model, opt, str(tmp_path / "b" / "checkpoints"))
    extra = mgr.restore("latest")
    assert "evals" not in extra and extra["evals_count"] == 4, sorted(extra)
    again = [*common, "checkpoint.every_steps=4", "checkpoint.resume=latest", "train.steps=12"]
    resumed = Trainer(tiny_cfg(tmp_path / "b", *again)).fit()
    assert resumed["evals"] == straight["evals"] and len(straight["evals"]) == 6
    (tmp_path / "b" / "events.jsonl").unlink()
    Trainer(
        tiny_cfg(tmp_path / "b", *[a for a in again if "steps=" not in a], "train.steps=14")
    ).fit()
    assert "holds 0 of the 6 periodic evals before step 12" in capsys.readouterr().out
