"""DMT tower plans in the planner and cost model (``neorec.sharding.towers_cost``, ``neorec plan
--towers``): placement on hosts, intra- vs inter-host bytes against the flat plan, the command."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from neorec.cli.plan import run as run_plan
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.planner import Planner, PlanningError, plan_tables
from neorec.sharding.topology import Topology
from neorec.sharding.towers_cost import (
    TowerOptions,
    TowerPlanError,
    TowerPlanResult,
    plan_towers,
    plan_traffic,
    time_memory_groups,
)
from neorec.sharding.types import ShardingType

ROOT = Path(__file__).resolve().parents[1]
B = 4096


def _tables(n: int = 8, dim: int = 16, pooling: float = 3.0, tw_only: bool = False) -> list:
    allowed = (ShardingType.TABLE_WISE,) if tw_only else ()
    return [
        TableSpec(
            name=f"t{i}",
            rows=20_000 + 1_000 * i,
            dim=dim,
            pooling_factor=pooling,
            allowed_types=allowed,
        )
        for i in range(n)
    ]


def _topo(world: int = 8, rph: int = 2, inter: float = 12.5) -> Topology:
    return Topology(
        world_size=world,
        ranks_per_host=rph,
        device_memory_gb=2.0,
        device_reserve_gb=0.5,
        intra_host_bw_gbs=150.0,
        inter_host_bw_gbs=inter,
    )


def test_tower_plan_keeps_each_towers_shards_on_its_host() -> None:
    tables = _tables(12)
    topo = _topo(8, 2)
    res = plan_towers(tables, topo, B, towers=4, options=TowerOptions(out_vectors=1))
    validate_plan(res.plan)
    groups = res.plan.meta["towers"]
    assert sorted(n for g in groups for n in g) == sorted(t.name for t in tables)
    assert all(g for g in groups) and len(groups) == 4
    for t, g in enumerate(groups):
        assert res.towers[t].tables == g and res.towers[t].ranks == [2 * t, 2 * t + 1]
        for name in g:
            hosts = {topo.host_of(s.rank) for s in res.plan.table(name).shards}
            assert hosts == {t}, (name, hosts)
        # the tower's own plan is on its host's local ranks 0..k-1
        assert {s.rank for tp in res.towers[t].sub.plan.tables for s in tp.shards} <= {0, 1}
    # inside a host nothing crosses hosts; only the peer exchanges and the all-reduce do
    for name, (_, inter) in res.dmt_traffic.parts.items():
        if name.startswith("host "):
            assert inter == 0.0


def test_flat_bytes_match_the_closed_form_and_dmt_sends_fewer_inter_host_bytes() -> None:
    tables = _tables(8, dim=16, pooling=3.0, tw_only=True)
    topo = _topo(8, 2)  # 4 hosts
    flat = plan_tables(tables, topo, B)
    tr = plan_traffic(CostModel(topo, B), flat.plan, tables)
    h, w, k = 4, 8, 2
    ids = B * sum(t.pooling_factor * 8 + 4 for t in tables)
    pooled = 2 * B * sum(t.dim for t in tables) * 4
    # table-wise: every sample on another host sends its ids in and gets outputs + grads back
    assert tr.parts["ids"][1] == pytest.approx(ids * (h - 1) / h)
    assert tr.parts["pooled"][1] == pytest.approx(pooled * (h - 1) / h)
    assert tr.intra_bytes == pytest.approx((ids + pooled) * (k - 1) / w)
    res = plan_towers(tables, topo, B, towers=4, options=TowerOptions(out_vectors=1), flat=flat)
    assert res.flat_traffic.inter_bytes == pytest.approx(tr.inter_bytes)
    assert res.dmt_traffic.inter_bytes < res.flat_traffic.inter_bytes
    # the ids cross hosts once either way: to the owner (flat) or to the tower's host (DMT)
    assert res.dmt_traffic.parts["peer ids"][1] == pytest.approx(tr.parts["ids"][1])


@pytest.mark.parametrize("k", [1, 2])
def test_pooled_inter_host_bytes_shrink_by_k_over_f(k: int) -> None:
    tables = _tables(8, dim=16, tw_only=True)  # 4 towers of F = 2 tables each
    topo = _topo(8, 2)
    res = plan_towers(tables, topo, B, towers=4, options=TowerOptions(out_vectors=k))
    assert all(len(t.tables) == 2 for t in res.towers)
    flat_pooled = res.flat_traffic.parts["pooled"][1]
    dmt_pooled = sum(res.dmt_traffic.parts[p][1] for p in ("peer outputs", "peer output grads"))
    assert dmt_pooled / flat_pooled == pytest.approx(k / 2)
    assert all(t.out_vectors == k and t.params == (2 * 16 + 1) * k * 16 for t in res.towers)
    assert res.dmt_times["tower_module_s"] > 0 and res.dmt_times["tower_allreduce_s"] > 0


def test_identity_towers_send_the_flat_pooled_bytes_and_cost_no_module() -> None:
    tables = _tables(8, dim=16, tw_only=True)
    res = plan_towers(tables, _topo(8, 2), B, towers=4, options=TowerOptions(module="identity"))
    flat_pooled = res.flat_traffic.parts["pooled"][1]
    dmt_pooled = sum(res.dmt_traffic.parts[p][1] for p in ("peer outputs", "peer output grads"))
    assert dmt_pooled == pytest.approx(flat_pooled)
    assert all(t.params == 0 and t.out_vectors == len(t.tables) for t in res.towers)
    assert res.dmt_times["tower_module_s"] == 0 and res.dmt_times["tower_allreduce_s"] == 0
    assert "tower module all-reduce" not in res.dmt_traffic.parts


def test_speedup_comes_from_the_slow_inter_host_links() -> None:
    tables = _tables(12, dim=64, pooling=2.0)
    slow = plan_towers(tables, _topo(8, 2, inter=5.0), B, towers=4)
    fast = plan_towers(tables, _topo(8, 2, inter=150.0), B, towers=4)
    assert slow.speedup > 1.0
    assert fast.speedup < slow.speedup
    assert sum(slow.dmt_times.values()) == pytest.approx(slow.dmt_step_s)


def test_time_memory_groups_balance_memory_and_are_deterministic() -> None:
    # One hot table outweighs the rest in time: balanced by time only (the runtime's
    # partition_tables "balanced"), both memory-heavy cold tables share the other tower.
    tables = [TableSpec(name="hot", rows=100_000, dim=16, pooling_factor=500.0)]
    tables += [TableSpec(name=f"m{i}", rows=10_000, dim=16, pooling_factor=5.0) for i in range(4)]
    tables += [
        TableSpec(name=f"big{i}", rows=5_000_000, dim=128, pooling_factor=0.01) for i in range(2)
    ]
    from neorec.sharding.towers import partition_tables

    by_time = partition_tables(tables, 2, "balanced", batch_size=B)
    assert sorted(sum(n.startswith("big") for n in x) for x in by_time) == [0, 2]
    cm = CostModel(_topo(4, 2), B)
    g = time_memory_groups(cm, tables, 2)
    assert g == time_memory_groups(cm, tables, 2)
    assert sorted(n for x in g for n in x) == sorted(t.name for t in tables)
    assert sorted(sum(n.startswith("big") for n in x) for x in g) == [1, 1]
    # ... and here that tower does not fit in its host's memory; balanced in both it does
    with pytest.raises(
        PlanningError, match=r"tower 1 \(host 1, 6 tables\) does not fit on its host"
    ):
        plan_towers(tables, _topo(4, 2), B, towers=2, options=TowerOptions(partition="time"))
    assert plan_towers(tables, _topo(4, 2), B, towers=2).plan.meta["towers"] == g


def test_planner_retries_lpt_when_a_host_split_finds_dram_fragmented() -> None:
    # Paper-scale tables on one 8-GPU host (tower 12 of configs/paper_scale.toml --towers 16):
    # placed by time first, the large table-wise tables took host DRAM on some ranks, and the
    # 500 M-row table (a table-row-wise split needing 64 GB on each rank) found no host left.
    d = tomllib.loads((ROOT / "configs" / "paper_scale.toml").read_text())["planner"]["topology"]
    topo = Topology.from_dict({**d, "world_size": 8, "ranks_per_host": 8})
    rows = [
        ("f039", 499242578, 256, 33.15),
        ("f112", 519151408, 64, 1.57),
        ("f150", 279500880, 64, 3.56),
        ("f220", 406006049, 128, 2.86),
        ("f345", 360655549, 64, 1.51),
    ]
    tables = [TableSpec(name=n, rows=r, dim=dm, pooling_factor=p) for n, r, dm, p in rows]
    res = Planner(topo, 65536, allow_cached_tiers=True).plan(tables)
    assert res.cost.fits and sorted(t.name for t in res.plan.tables) == sorted(n for n, *_ in rows)


@pytest.mark.parametrize(
    "world,rph,towers,kw,match",
    [
        (8, 2, 3, {}, "does not divide world size 8"),
        (8, 2, 2, {}, "hosts of 4 ranks, but the topology has 2 ranks per host"),
        (8, 2, 0, {}, "towers must be an integer >= 1"),
        (
            8,
            8,
            1,
            {"out_vectors": 0},
            "out_vectors \\(--tower-out-vectors\\) must be an integer >= 1",
        ),
        (8, 2, 4, {"module": "dot"}, "tower module must be one of"),
        (8, 2, 4, {"groups": [["t0"], ["t1"], ["t2"]]}, "3 groups for 4 towers"),
        (8, 2, 4, {"groups": [["t0"], ["t1"], ["t2"], ["t3", "t0"]]}, "'t0' is in tower 0"),
        (8, 2, 4, {"groups": [["t0"], ["t1"], ["t2"], ["tx"]]}, "unknown table 'tx'"),
        (8, 2, 4, {"groups": [["t0"], ["t1"], ["t2"], ["t3"]]}, "leave out table"),
        (8, 2, 4, {"partition": "random"}, "tower partition must be one of"),
    ],
)
def test_tower_errors(world: int, rph: int, towers: int, kw: dict, match: str) -> None:
    with pytest.raises(TowerPlanError, match=match):
        plan_towers(_tables(6), _topo(world, rph), B, towers=towers, options=TowerOptions(**kw))


def test_more_towers_than_tables_and_pinned_tables_are_refused() -> None:
    with pytest.raises(TowerPlanError, match="more than the 3 tables"):
        plan_towers(_tables(3), _topo(8, 2), B, towers=4)
    pinned = _tables(6)
    pinned[2].ranks = (0,)
    with pytest.raises(TowerPlanError, match=r"\['t2'\] pin ranks"):
        plan_towers(pinned, _topo(8, 2), B, towers=4)


def _args(**kw):
    base = dict(
        config=None,
        tables=None,
        world_size=4,
        ranks_per_host=2,
        batch_size=0,
        topology=None,
        calibrate=False,
        json=False,
        out=None,
        show_plan=False,
        no_cached_tiers=False,
        towers=2,
        tower_out_vectors=None,
        tower_module="mlp",
        tower_partition="time+memory",
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_cli_reports_the_tower_plan_next_to_the_flat_plan(capsys) -> None:
    assert run_plan(_args(show_plan=True)) == 0
    out = capsys.readouterr().out
    assert "SIMULATION" in out and "DMT tower plan: 2 towers = 2 hosts x 2 ranks" in out
    assert "ratio flat/DMT: step time" in out and "inter-host bytes" in out
    assert "ShardingPlan: world_size=4, ranks_per_host=2" in out
    assert run_plan(_args(json=True, tower_out_vectors=2)) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["towers"] == 2 and rep["tower_module"] == "mlp"
    assert "simulation" in rep["note"]
    assert [t["out_vectors"] for t in rep["tower_list"]] == [2, 2]
    assert rep["speedup"] == pytest.approx(rep["flat_step_s"] / rep["dmt_step_s"])
    assert rep["inter_host_bytes_reduction"] == pytest.approx(
        rep["inter_host_bytes_flat"] / rep["inter_host_bytes_dmt"]
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"towers": 3}, "--towers 3 does not divide world size 4"),
        ({"towers": 4}, "hosts of 1 ranks, but the topology has 2 ranks per host"),
        ({"towers": 0, "tower_out_vectors": 2}, "--tower-out-vectors needs --towers"),
        ({"tower_out_vectors": 0}, "--tower-out-vectors must be >= 1"),
        ({"towers": -1}, "--towers must be >= 1"),
        ({"out": "plan.json"}, "--out writes one ShardingPlan"),
        ({"towers": 16, "world_size": 32}, "more than the 8 tables"),
    ],
)
def test_cli_tower_errors_are_one_line(kw: dict, match: str, capsys) -> None:
    assert run_plan(_args(**kw)) == 2
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and match in err
    assert err.count("\n") == 1


def test_neorec_plan_towers_exit_code_2() -> None:
    argv = [sys.executable, "-m", "neorec", "plan", "--world-size", "4", "--towers", "3"]
    p = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("neorec: error: --towers 3 does not divide world size 4")


def test_campaign_plan_towers() -> None:
    """Seeded combinations of world, hosts, towers, k, module and groups: each either plans with
    every tower's shards on its host and fewer pooled inter-host bytes (k < F), or is refused
    with one line naming the problem."""
    from faults import campaign

    camp = campaign("plan towers")
    rng = random.Random(0)
    for case in range(60):
        world = rng.choice([2, 4, 6, 8])
        rph = rng.choice([d for d in (1, 2, 3, 4, 8) if world % d == 0])
        hosts = world // rph
        towers = hosts if rng.random() < 0.6 else rng.choice([0, 1, 2, 3, 4, 8])
        n = rng.choice([2, 4, 6, 9])
        k = rng.choice([0, 1, 1, 2, 2, 3, 3, 3])
        module = rng.choice(["mlp"] * 6 + ["identity", "dcn"])
        groups = None
        if rng.random() < 0.3 and towers >= 1:
            names = [f"t{i}" for i in range(n)]
            rng.shuffle(names)
            groups = [names[i::towers] for i in range(towers)]
            if rng.random() < 0.5 and groups and len(groups[0]) > 1:
                groups[0] = groups[0][1:] + ["nope"]  # an unknown table in place of a known one
        tables = _tables(n, dim=16, tw_only=rng.random() < 0.5)
        topo = _topo(world, rph)
        name = f"{case}: world {world} x{rph}, towers {towers}, {n} tables, k {k}, {module}"

        def run(
            tables: list = tables,
            topo: Topology = topo,
            towers: int = towers,
            k: int = k,
            module: str = module,
            groups: list | None = groups,
        ) -> TowerPlanResult:
            return plan_towers(
                tables,
                topo,
                B,
                towers=towers,
                options=TowerOptions(out_vectors=k, module=module, groups=groups),
            )

        bad = (
            towers < 1
            or world % towers
            or world // towers != rph
            or towers > n
            or module == "dcn"
            or (module == "mlp" and k < 1)
            or (groups is not None and "nope" in groups[0])
        )
        if bad:
            camp.expect_error(name, run)
            continue
        try:
            res = run()
        except Exception as e:  # noqa: BLE001 - counted
            camp.record(name, "crash", f"{type(e).__name__}: {e}")
            continue
        wrong = [
            tp.name
            for t, g in enumerate(res.plan.meta["towers"])
            for tp in res.plan.tables
            if tp.name in g and {topo.host_of(s.rank) for s in tp.shards} != {t}
        ]
        flat_pooled = res.flat_traffic.parts["pooled"][1]
        dmt_pooled = res.dmt_traffic.parts["peer outputs"][1] * 2
        fewer = all(t.out_vectors < len(t.tables) for t in res.towers) and module == "mlp"
        if wrong:
            camp.record(name, "crash", f"tables off their tower's host: {wrong}")
        elif fewer and towers > 1 and not dmt_pooled < flat_pooled:
            camp.record(name, "crash", f"pooled inter-host bytes {dmt_pooled} >= {flat_pooled}")
        else:
            camp.record(name, "handled", f"speedup {res.speedup:.3f}")
    camp.check()


def test_cli_config_with_training_sections_and_a_topology_file(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[towers]\ncount = 2\n[checkpoint]\n[planner]\ntopology_file = "t.json"\n')
    assert run_plan(_args(config=str(cfg))) == 2  # the topology file is not there (yet)
    err = capsys.readouterr().err
    assert "planner.topology_file" in err and "t.json" in err and err.count("\n") == 1
    Topology.gpu_cluster(2, 2).save(tmp_path / "t.json")
    assert run_plan(_args(config=str(cfg), json=True)) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["topology"]["name"].startswith("gpu_cluster 2x2")
    assert rep["topology"]["inter_host_bw_gbs"] == Topology.gpu_cluster(2, 2).inter_host_bw_gbs
