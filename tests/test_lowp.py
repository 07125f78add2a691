"""LoKA: the probe, the emulated formats, dispatch and the mods, each against fp32 (the spec)."""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F
from test_trainer import tiny_cfg

from neorec.builder import build_dlrm, data_source, dense_optimizer
from neorec.config import LowpConfig, load_config
from neorec.lowp.dispatch import Dispatcher, LowpLinear, choose, install, uninstall
from neorec.lowp.formats import CANDIDATES, FP8, candidate, fp8_round, quantize
from neorec.lowp.kernels import dot_bmm, linear
from neorec.lowp.probe import Probe, Site, SiteStats, upper_bound
from neorec.lowp.timing import Timings
from neorec.train.trainer import train_step


def _cfg(*extra: str):
    return load_config(
        overrides=[
            "embedding.num_tables=3",
            "embedding.rows=500",
            "data.train_samples=6000",
            "data.eval_samples=1000",
            "data.batch_size=256",
            *extra,
        ]
    )


def _policy(mode: str, tolerance: float, keep_ends: bool = True) -> LowpConfig:
    """Probe the first 2 steps, never re-probe."""
    return LowpConfig(mode, tolerance, probe_steps=2, reprobe_every=0, keep_ends=keep_ends)


def _train(cfg, steps: int, disp_factory=None, probe: Probe | None = None):
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    disp = disp_factory(model) if disp_factory else None
    losses = []
    for i, b in enumerate(data_source(cfg).train_batches()):
        if i >= steps:
            break
        if disp is not None:
            disp.before_step(i)
        if probe is not None:
            probe.step_begin(i)
        losses.append(float(train_step(model, opt, b, i)))
        if disp is not None:
            disp.after_step(i)
        if probe is not None:
            probe.collect()
    return model, disp, losses


# ---- formats --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(FP8))
def test_fp8_emulation_matches_real_casts_bitwise(fmt):
    f = FP8[fmt]
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (400_000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = x[torch.isfinite(x)]
    edges = [0.0, -0.0, 2.0**f.emin, 2.0 ** (f.emin - f.mbits), 1.5 * 2.0 ** (f.emin - f.mbits)]
    edges += [f.fmax, -f.fmax, 1e30, -1e30, 2.0 ** (f.emin - f.mbits - 1)]
    scaled = torch.cat([torch.randn(20_000, generator=g) * s for s in (1e-3, 1.0, 30.0, 1e4)])
    for v in (x, scaled, torch.tensor(edges)):
        ours = fp8_round(v, fmt)
        real = v.clamp(-f.fmax, f.fmax).to(f.dtype).float()
        assert torch.equal(ours.view(torch.int32), real.view(torch.int32))
    assert torch.isnan(fp8_round(torch.tensor([math.nan]), fmt)).all()
    # the scaled round trip: the arithmetic and the dtype cast agree bit for bit too
    w = torch.randn(64, 32, generator=g) * 5
    for c in CANDIDATES:
        if c.kind == "fp8" and c.fp8 == fmt:
            assert torch.equal(quantize(w, c), quantize(w, c, cast=False))


def test_quantize_errors_are_ordered_by_precision():
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    err = {c.name: float((quantize(x, c) - x).norm() / x.norm()) for c in CANDIDATES}
    assert err["fp32"] == 0
    assert err["fp16"] < err["bf16"] < err["fp8-e4m3-row"] < err["fp8-e5m2-row"]
    # per-row scaling never loses to per-tensor scaling on rows of very different range
    x[::2] *= 1000
    for fmt in ("e4m3", "e5m2"):
        rt = quantize(x, candidate(f"fp8-{fmt}-row")) - x
        tt = quantize(x, candidate(f"fp8-{fmt}-tensor")) - x
        assert rt[1::2].norm() < tt[1::2].norm()


def test_kernels_equal_their_specification():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(33, 17, generator=g), torch.randn(9, 17, generator=g), torch.randn(9)
    assert torch.equal(linear(x, w, b, candidate("fp32")), F.linear(x, w, b))
    y = linear(x, w, b, candidate("bf16"))
    assert torch.equal(y, F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float())
    assert torch.equal(
        linear(x, w, None, candidate("bf16")), F.linear(x.bfloat16(), w.bfloat16()).float()
    )
    t = torch.randn(5, 4, 8, generator=g)
    assert torch.equal(dot_bmm(t, candidate("fp32")), torch.bmm(t, t.transpose(1, 2)))
    ref = torch.bmm(t, t.transpose(1, 2))
    for name in ("bf16", "fp8-e4m3-row"):
        assert torch.allclose(dot_bmm(t, candidate(name)), ref, rtol=0.2, atol=0.2)
    # the fp8 kernel's gradients reach the fp32 masters
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    linear(xg, wg, None, candidate("fp8-e4m3-row")).sum().backward()
    assert xg.grad is not None and wg.grad is not None and wg.grad.dtype == torch.float32
    ref_w = torch.ones(33, 9).t() @ x
    assert float((wg.grad - ref_w).norm() / ref_w.norm()) < 0.1


# ---- probe -----------------------------------------------------------------------------------


def test_upper_bound():
    assert upper_bound([0.5]) == 0.5
    assert math.isnan(upper_bound([]))
    vals = [0.1, 0.2, 0.3, 0.2]
    assert upper_bound(vals) > sum(vals) / 4
    assert upper_bound([0.2] * 10) == pytest.approx(0.2)


def test_probe_covers_every_site_and_is_deterministic():
    cfg = _cfg("train.steps=6")
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_dlrm(cfg)
        probe = Probe(
            model.dense_arch,
            first=3,
            every=0,
            weights=lambda m=model: {
                t.name: m.ebc.table_weight(t.name) for t in cfg.embedding.tables
            },
        )
        opt = dense_optimizer(cfg.train, model.dense_parameters())
        for i, b in enumerate(data_source(cfg).train_batches()):
            if i >= 5:
                break
            probe.step_begin(i)
            train_step(model, opt, b, i)
            probe.collect()
        runs.append(probe.to_json())
    a, b = runs
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["steps_probed"] == 3
    kinds = {s["kind"] for s in a["sites"]}
    assert kinds == {"pooled", "linear", "interaction", "embedding"}
    linears = [s for s in a["sites"] if s["kind"] == "linear"]
    assert len(linears) == len(cfg.model.bottom_mlp) + len(cfg.model.top_mlp)
    for s in a["sites"]:
        assert s["samples"] == 3
        assert set(s["errors"]) == {c.name for c in CANDIDATES if c.kind != "fp32"}
        errs = s["errors"]
        assert errs["fp16"]["bound"] < errs["bf16"]["bound"] < errs["fp8-e5m2-row"]["bound"]
        assert 0 < errs["bf16"]["bound"] < 0.02
        if s["kind"] == "linear":  # forward, input gradient and weight gradient all measured
            assert {"fwd", "dgrad", "wgrad"} <= set(errs["bf16"])
            assert {"act", "weight", "grad"} <= set(s["stats"])


def test_probe_errors_equal_a_direct_measurement():
    # one Linear site, one step: the probe's forward error is the error of the bf16 kernel itself
    lin = torch.nn.Linear(24, 8)
    seq = torch.nn.Sequential(lin)
    probe = Probe(seq, first=1, every=0)
    x = torch.randn(64, 24, generator=torch.Generator().manual_seed(3)) * 3
    probe.step_begin(0)
    seq(x).sum().backward()
    probe.collect()
    got = probe.results["0"].errors["bf16"]["fwd"][0]
    with torch.no_grad():
        ref = F.linear(x, lin.weight, lin.bias)
        low = linear(x, lin.weight, lin.bias, candidate("bf16"))
    want = float((low - ref).norm() / ref.norm())
    assert got == pytest.approx(want, rel=0.05)


# ---- dispatch --------------------------------------------------------------------------------


def _fake_results(rng: random.Random, n: int) -> tuple[dict, dict]:
    results, times = {}, {}
    for i in range(n):
        name = f"s{i}"
        r = SiteStats(Site(name, "linear", None, (8, 8)))
        for c in CANDIDATES[1:]:
            for _ in range(rng.randint(1, 6)):
                r._add_error(c.name, "fwd", rng.uniform(0, 0.05))
                r._add_error(c.name, "dgrad", rng.uniform(0, 0.05))
        results[name] = r
        times[name] = {c.name: rng.choice([rng.uniform(0.1, 2.0), math.inf]) for c in CANDIDATES}
    return results, times


def test_dispatch_never_selects_an_unsafe_or_slower_site():
    rng = random.Random(0)
    picked_low = 0
    for trial in range(200):
        results, times = _fake_results(rng, 6)
        tol = rng.choice([0.005, 0.01, 0.03])
        plan = choose(results, times, tol)
        for name, prec in plan.items():
            if prec == "fp32":
                continue
            picked_low += 1
            assert results[name].bound(prec) <= tol, (trial, name, prec)
            assert times[name][prec] <= 0.9 * times[name]["fp32"], (trial, name, prec)
            # and it is the fastest safe one
            safe = [
                c for c in results[name].errors
                if results[name].bound(c) <= tol and times[name][c] <= 0.9 * times[name]["fp32"]
            ]  # fmt: skip
            assert times[name][prec] == min(times[name][c] for c in safe)
    assert picked_low > 50  # the property was exercised


def test_auto_keeps_fp32_when_bf16_is_slower(tmp_path):
    cfg = _cfg()
    timings = Timings(tmp_path / "t.json")
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    for s in Probe(model.dense_arch).sites:
        if s.kind in ("linear", "interaction"):
            shape = s.shape if s.kind == "linear" else (len(cfg.embedding.feature_names) + 1, 16)
            for c in CANDIDATES:
                ms = {"fp32": 1.0, "bf16": 3.0, "fp16": 5.0}.get(c.name, math.inf)
                timings.set(s.kind, shape, cfg.data.batch_size, c, ms)
    timings.save()
    forced = Timings(tmp_path / "t.json")  # read back from the file: the cache is what decides

    def factory(m):
        return Dispatcher(m.dense_arch, cfg.data.batch_size, _policy("auto", 0.05), timings=forced)

    _, disp, _ = _train(cfg, 3, factory)
    assert forced.measured == 0  # everything came from the cache
    assert disp.plan and set(disp.plan.values()) == {"fp32"}
    # with bf16 faster the same probe picks it where it is safe (keep_ends keeps the ends fp32)
    fast = Timings(tmp_path / "t.json")
    for key in list(fast._all[fast.machine]):
        if key.endswith(":bf16"):
            fast._all[fast.machine][key] = 0.5

    def factory2(m):
        return Dispatcher(m.dense_arch, cfg.data.batch_size, _policy("auto", 0.05), timings=fast)

    _, disp2, _ = _train(cfg, 3, factory2)
    linears = [n for n in disp2.plan if n.startswith(("bottom", "top"))]
    assert disp2.plan[linears[0]] == "fp32" and disp2.plan[linears[-1]] == "fp32"
    assert "bf16" in disp2.plan.values()


def test_install_keeps_parameters_state_dict_and_fp32_function():
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    dense = model.dense_arch
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    x = torch.randn(7, cfg.model.num_dense)
    pooled = torch.randn(7, len(cfg.embedding.feature_names) * 16)
    ref = dense(x, pooled)
    names = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)]
    install(dense, {n: "fp32" for n in names} | {"interaction": "fp32"})
    assert torch.equal(dense(x, pooled), ref)
    install(dense, {n: "bf16" for n in names} | {"interaction": "bf16"})
    assert all(type(dict(dense.named_modules())[n]) is LowpLinear for n in names)
    assert dense.state_dict().keys() == before.keys()
    for k, v in dense.state_dict().items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k])  # fp32 masters
    low = dense(x, pooled)
    assert not torch.equal(low, ref) and torch.allclose(low, ref, rtol=0.05, atol=0.05)
    uninstall(dense)
    assert torch.equal(dense(x, pooled), ref)
    assert all(type(dict(dense.named_modules())[n]) is torch.nn.Linear for n in names)


@pytest.mark.bitwise
def test_inner_mlp_layers_keep_their_format_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Linear whose ReLU feeds another bf16 Linear keeps its output in bf16: logits and
    every dense gradient are bit for bit those of the path that widens it to fp32 and back."""
    cfg = _cfg()
    batch = next(iter(data_source(cfg).train_batches()))
    runs = []
    for keep in (True, False):
        model = build_dlrm(cfg)  # the same seed: the same weights
        dense = model.dense_arch
        names = [n for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear)]
        install(dense, {n: "bf16" for n in names} | {"interaction": "bf16"})
        kept = [n for n in names if dense.get_submodule(n).keep_low]
        if not keep:
            for n in kept:
                dense.get_submodule(n).keep_low = False
        logits = model(batch.dense, batch.sparse)
        F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        runs.append((kept, logits.detach(), [p.grad.clone() for p in model.dense_parameters()]))
    (kept, la, ga), (_, lb, gb) = runs
    # the inner layers of both MLPs; never the last of one (its output leaves the MLP)
    assert kept == ["bottom.0", "bottom.2", "top.0", "top.2"]
    assert torch.equal(la, lb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))
    install(dense, {n: "bf16" for n in names} | {"top.2": "fp32"})  # top.0 feeds an fp32 site
    assert [n for n in names if getattr(dense.get_submodule(n), "keep_low", False)] == kept[:2]
    uninstall(dense)
    assert not any(getattr(m, "keep_low", False) for m in dense.modules())


def test_drift_falls_back_to_fp32_and_reprobes(tmp_path):
    cfg = _cfg()
    timings = Timings(tmp_path / "t.json")
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    disp = Dispatcher(model.dense_arch, cfg.data.batch_size, _policy("bf16", 0.05), timings=timings)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    batches = list(b for _, b in zip(range(6), data_source(cfg).train_batches()))
    for i in range(3):
        disp.before_step(i)
        train_step(model, opt, batches[i], i)
        disp.after_step(i)
    low = [n for n, p in disp.plan.items() if p != "fp32"]
    assert low
    big = batches[3]
    big.dense.mul_(1e4)  # activations far beyond what was probed
    disp.before_step(3)
    train_step(model, opt, big, 3)
    disp.after_step(3)
    last = disp.decisions[-1]
    assert last.fallbacks and all(disp.plan[n] == "fp32" for n in last.fallbacks)
    disp.before_step(4)
    assert disp.probe._active  # the next step is probed again
    disp.close()


def test_lowp_step_tracks_fp32(tmp_path):
    # the specification is the fp32 model: the same weights and batch in bf16 everywhere give
    # logits and dense gradients within the probed tolerance, and training follows the fp32 run
    cfg = _cfg()
    ref, low = build_dlrm(cfg), build_dlrm(cfg)  # the same seed: the same weights
    names = [n for n, m in low.dense_arch.named_modules() if isinstance(m, torch.nn.Linear)]
    install(low.dense_arch, {n: "bf16" for n in names} | {"interaction": "bf16"})
    batch = next(iter(data_source(cfg).train_batches()))
    grads = []
    for m in (ref, low):
        logits = m(batch.dense, batch.sparse)
        F.binary_cross_entropy_with_logits(logits, batch.labels).backward()
        grads.append((logits.detach(), [p.grad.clone() for p in m.dense_parameters()]))
    (la, ga), (lb, gb) = grads
    assert not torch.equal(la, lb)
    assert float((la - lb).norm() / la.norm()) < 0.01
    for x, y in zip(ga, gb):
        assert float((x - y).norm() / x.norm()) < 0.05
    _, _, fp32_losses = _train(cfg, 12)
    timings = Timings(tmp_path / "t.json")

    def factory(m):
        return Dispatcher(m.dense_arch, cfg.data.batch_size, _policy("bf16", 0.01), timings=timings)

    _, disp, low_losses = _train(cfg, 12, factory)
    assert "bf16" in disp.plan.values()
    assert fp32_losses[:2] == low_losses[:2]  # the probe steps ran in fp32
    assert sum(low_losses) == pytest.approx(sum(fp32_losses), rel=0.02)


def test_row_scale_mod_makes_an_fp16_interaction_safe():
    # pooled embeddings that grew large: their dot products pass fp16's 65504
    g = torch.Generator().manual_seed(4)
    dense = torch.randn(32, 16, generator=g)
    pooled = torch.randn(32, 5, 16, generator=g) * 200
    t = torch.cat([dense.unsqueeze(1), pooled], dim=1)
    ref = torch.bmm(t, t.transpose(1, 2))
    fp16 = candidate("fp16")
    assert not torch.isfinite(dot_bmm(t, fp16)).all()
    scaled = dot_bmm(t, fp16, row_scale=True)
    assert torch.isfinite(scaled).all()
    assert float((scaled - ref).norm() / ref.norm()) < 1e-3
    # and the probe sees it: fp16 unsafe without the mod, safe with it
    from neorec.modules.dlrm import DotInteraction

    bounds = {}
    for mod in (False, True):
        inter = DotInteraction(5, 16)
        probe = Probe(torch.nn.Sequential(inter), first=1, every=0, row_scale=mod)
        probe.step_begin(0)
        d, p = dense.clone().requires_grad_(), pooled.clone().requires_grad_()
        inter(d, p).sum().backward()
        probe.collect()
        bounds[mod] = probe.results["0"].bound("fp16")
    assert bounds[False] == math.inf
    assert bounds[True] < 1e-3


def test_keep_ends_mod_keeps_first_and_last_linear_fp32(tmp_path):
    cfg = _cfg()
    timings = Timings(tmp_path / "t.json")
    for keep in (True, False):

        def factory(m, keep=keep):
            return Dispatcher(
                m.dense_arch,
                cfg.data.batch_size,
                _policy("bf16", 0.01, keep_ends=keep),
                timings=timings,
            )

        _, disp, _ = _train(cfg, 2, factory)
        lin = [n for n in disp.plan if n.startswith(("bottom", "top"))]
        ends = {disp.plan[lin[0]], disp.plan[lin[-1]]}
        assert ends == ({"fp32"} if keep else {"bf16"})
        assert all(disp.plan[n] == "bf16" for n in lin[1:-1])


def test_trainer_runs_lowp_and_reports(tmp_path, monkeypatch):
    from neorec.train.trainer import Trainer

    monkeypatch.setenv("NEOREC_LOWP_TIMINGS", str(tmp_path / "timings.json"))

    def cfg(run, *extra):
        return tiny_cfg(tmp_path / run, *extra)

    ref = Trainer(cfg("fp32")).fit()
    m = Trainer(
        cfg("bf16", "lowp.mode='bf16'", "lowp.probe_steps=2", "lowp.reprobe_every=10")
    ).fit()
    rep = json.loads((tmp_path / "bf16" / "lowp.json").read_text())
    assert rep["mode"] == "bf16" and rep["probe"]["steps_probed"] >= 3  # 2 first + re-probes
    kinds = {s["kind"] for s in rep["probe"]["sites"]}
    assert {"linear", "interaction", "pooled", "embedding"} <= kinds
    assert m["lowp"]["low_precision_sites"] == sum(p != "fp32" for p in rep["plan"].values()) > 0
    assert m["lowp"]["decisions"] >= 2
    assert (tmp_path / "timings.json").exists()  # the machine's timings were cached
    # the specification: the fp32 run; bf16 sites train to nearly the same model
    assert m["eval"]["ne"] == pytest.approx(ref["eval"]["ne"], rel=0.01)
    assert "lowp" not in ref


def _wire_rank(rank: int, world: int, tmp: str) -> None:
    from neorec.train.trainer import Trainer

    os.environ["NEOREC_LOWP_TIMINGS"] = f"{tmp}/timings-{rank}.json"
    over = ["train.threads=1", "sharding.default_type='table_wise'", "lowp.probe_steps=2"]
    ref = Trainer(tiny_cfg(f"{tmp}/ref", *over)).fit()
    tr = Trainer(tiny_cfg(f"{tmp}/w", *over, "lowp.mode='auto'", "lowp.tolerance=0.01"))
    m = tr.fit()
    wire = m["lowp"]["wire"]
    # the pooled vectors and gradients are within 1% in fp16 (probed ~2.5e-4): fp16 on the wire
    assert wire == {"pooled.forward": "fp16", "pooled.backward": "fp16"}, wire
    assert all(c is not None and "fp16" in type(c).__name__.lower() + repr(c).lower()
               for c in tr.model.ebc.codecs)  # fmt: skip
    assert m["eval"]["ne"] == pytest.approx(ref["eval"]["ne"], rel=0.01)
    if rank == 0:
        rep = json.loads(open(f"{tmp}/w/lowp.json").read())
        assert rep["plan"]["pooled.forward"] == "fp16"


def test_distributed_auto_puts_the_pooled_all_to_all_on_the_wire_format(tmp_path):
    from dist_util import run_ranks

    run_ranks(_wire_rank, 2, str(tmp_path))
