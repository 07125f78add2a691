"""LoKA's pinned plan (``lowp.plan``), the drift watch's passes and the casts of a dispatched MLP,
and ``neorec bench lowp``'s verdicts."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch
from test_lowp import _cfg, _train
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from neorec.bench.lowp_runs import verdict
from neorec.config import LowpConfig
from neorec.errors import ConfigError
from neorec.lowp.dispatch import Dispatcher, _amax, install
from neorec.lowp.formats import CANDIDATES
from neorec.lowp.probe import Probe
from neorec.lowp.timing import Timings


class _Ops(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.n: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.n[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _timings(tmp_path, cfg, bf16_ms: float) -> Timings:
    """A timing cache where every site's bf16 takes ``bf16_ms`` and fp32 1 ms."""
    from neorec.builder import build_dlrm

    t = Timings(tmp_path / f"t{bf16_ms}.json")
    for s in Probe(build_dlrm(cfg).dense_arch).sites:
        if s.kind in ("linear", "interaction"):
            shape = s.shape if s.kind == "linear" else (len(cfg.embedding.feature_names) + 1, 16)
            for c in CANDIDATES:
                t.set(s.kind, shape, cfg.data.batch_size, c, {"fp32": 1.0, "bf16": bf16_ms}.get(c.name, math.inf))  # fmt: skip
    return t


def _auto(cfg, timings: Timings, plan: str = ""):
    policy = LowpConfig("auto", 0.05, probe_steps=2, reprobe_every=0, plan=plan)
    return lambda m: Dispatcher(m.dense_arch, cfg.data.batch_size, policy, timings=timings)


def test_a_pinned_plan_runs_the_same_sites_whatever_the_timings(tmp_path):
    cfg = _cfg()
    _, chosen, _ = _train(cfg, 3, _auto(cfg, _timings(tmp_path, cfg, 0.5)))
    assert "bf16" in chosen.plan.values()  # bf16 faster: auto picks it somewhere
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"plan": chosen.plan}))
    # bf16 now slower: auto alone keeps fp32 everywhere, the pinned plan keeps its sites
    _, free, _ = _train(cfg, 3, _auto(cfg, _timings(tmp_path, cfg, 3.0)))
    assert set(free.plan.values()) == {"fp32"}
    _, pinned, _ = _train(cfg, 3, _auto(cfg, _timings(tmp_path, cfg, 3.0), str(path)))
    assert pinned.plan == chosen.plan and pinned.decisions[0].plan == chosen.plan


def test_a_pinned_plan_that_does_not_fit_is_refused(tmp_path):
    cfg = _cfg()
    from neorec.builder import build_dlrm

    dense = build_dlrm(cfg).dense_arch
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"top.0": "bf16", "nowhere.1": "bf16"}))
    with pytest.raises(ConfigError, match="sites the model lacks: nowhere.1"):
        Dispatcher(dense, 256, LowpConfig("auto", plan=str(bad)))
    bad.write_text(json.dumps({"top.0": "bf17"}))
    with pytest.raises(ConfigError, match="unknown precision 'bf17'"):
        Dispatcher(dense, 256, LowpConfig("auto", plan=str(bad)))
    with pytest.raises(ConfigError, match="needs lowp.mode = 'auto'"):
        LowpConfig("bf16", plan=str(bad))


def test_the_drift_watch_reads_each_output_once():
    y = torch.randn(64, 32)
    with _Ops() as ops:
        a = _amax(y)
    assert a == float(y.abs().max())
    assert ops.n["abs"] == 0 and ops.n["aminmax"] == 1  # one pass, no |y| written
    assert math.isnan(_amax(torch.tensor([1.0, math.nan])))
    assert _amax(torch.tensor([-math.inf, 1.0])) == math.inf


def _mlp_ops(plan: dict[str, str] | None) -> collections.Counter[str]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                        nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))  # fmt: skip
    if plan is not None:
        install(mlp, plan)
    x = torch.randn(8, 16)
    with _Ops() as ops:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=plan is None):
            y = mlp(x)
        y.float().sum().backward()
    return ops.n


def test_a_dispatched_mlp_casts_no_more_than_autocast():
    autocast = _mlp_ops(None)
    every = _mlp_ops({"0": "bf16", "2": "bf16", "4": "bf16", "6": "bf16"})
    inner = _mlp_ops({"0": "fp32", "2": "bf16", "4": "bf16", "6": "fp32"})
    assert every["_to_copy"] == autocast["_to_copy"] == 19  # the same sites: the same casts
    assert inner["_to_copy"] == 12  # fp32 ends: fewer casts, not more
    for n in (every, inner):
        assert n["mm"] + n["addmm"] == autocast["mm"] + autocast["addmm"]
        assert n["add_"] == autocast["add_"] == 0


def test_no_verdict_when_the_reference_learned_nothing():
    rel = {"value": 0.0002, "lo": -0.003, "hi": 0.0034, "n": 5}
    assert verdict(rel, 1.01).startswith("no verdict")
    assert verdict(rel, 0.92) == "within noise, interval wider than ±0.1%"
    tight = {"value": 0.0002, "lo": -0.0005, "hi": 0.0008, "n": 5}
    assert verdict(tight, 0.92) == "within noise, inside ±0.1%"
    assert verdict({"value": 0.01, "lo": 0.005, "hi": 0.02, "n": 5}, 0.92) == "worse beyond noise"
    assert verdict({"value": 0.0, "lo": 0.0, "hi": 0.0, "n": 5}, 0.92).startswith("identical")
