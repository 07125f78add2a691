"""``neorec plan``: read tables and topology, plan, print the report or JSON.

A config file is a neorec TOML config; an optional ``[planner]`` section (read by this command
only: ``neorec.sharding.plan_inputs``) adds what the planner needs beyond it::

    [planner]
    tables_file = "paper_scale_tables.csv"   # relative to the TOML; replaces embedding.tables
    batch_size = 65536                       # default: data.batch_size
    weight_bytes = 4                         # bytes per stored weight element
    allow_host = true                        # may put tables in host memory (UVM-like tier)
    allow_cached_tiers = true                # may put tables in dram / ssd behind a row cache
    cache_fractions = [0.01, 0.05, 0.1, 0.25]  # row cache sizes the planner tries
    [planner.topology]                       # any Topology field (GB, GB/s, us)
    ranks_per_host = 8
    device_memory_gb = 80.0
    ssd_capacity_gb = 30720.0                # per host; 0 = no SSD tier

``neorec plan`` allows the cached tiers (``dram`` / ``ssd``) unless ``allow_cached_tiers = false``
or ``--no-cached-tiers``; the distributed runtime plans without them (it does not run cached
tables), so that flag shows the plan ``neorec train`` on several ranks would make. Tables of the
config with ``storage = "dram" | "ssd"`` keep that tier (and their cache size) in ``neorec plan``.

``--calibrate`` measures this machine (``neorec.measure.calibrate``): the topology constants, then
the designed placements (``neorec.sharding.learned_placements``: random and bench-like table
mixes, whole-plan kinds, the greedy baselines' and planner's plans, each block with the speed
references) on gloo ranks until ``--budget-s`` (default 300 s, the whole calibration) is spent,
fitting a learned cost model kept in the topology file with the
machine it was fitted on (samples beside it, ``<stem>.samples.json``). ``--cost-model`` picks what
scores plans (``neorec.sharding.learned_cost.resolve``); the report names it and its held-out
error, and a model fitted on another machine or world size is a warning line naming both.

``--towers N`` (DMT) also plans N towers, one per host (N x ranks per host = world size): each
tower's tables on its host's ranks (a partition balanced in predicted time and memory, or time
only with ``--tower-partition time``), a tower module compressing each sample's pooled vectors to
``--tower-out-vectors K`` (default 1) vectors; it prints the flat report, then the towers, their
per-host plans and the predicted step time and intra- / inter-host bytes of both plans with their
ratios (``neorec.sharding.towers_cost``; a simulation). ``--out`` is refused with ``--towers``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from neorec.errors import ConfigError, NeorecError

__all__ = ["HELP", "add_arguments", "run", "main"]

HELP = "plan how tables are sharded over ranks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``neorec plan``."""
    from neorec.sharding.gpu_topology import add_preset_argument
    from neorec.sharding.learned_cost import COST_MODEL_MODES
    from neorec.sharding.planner_shortlist import TUNE_ROUNDS
    from neorec.sharding.towers_cost import TOWER_MODULE_KINDS, TOWER_PARTITIONS

    parser.add_argument("--config", help="neorec TOML config (tables, batch size, [planner])")
    parser.add_argument("--tables", help="CSV/JSON table list instead of the config's tables")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks")
    parser.add_argument(
        "--ranks-per-host", type=int, default=0, help="ranks per host (0: topology)"
    )
    parser.add_argument("--batch-size", type=int, default=0, help="global batch (0: config)")
    parser.add_argument("--topology", help="topology JSON (written there with --calibrate)")
    add_preset_argument(parser)  # --topology-preset (neorec.sharding.gpu_topology)
    parser.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine with micro-benchmarks first and write --topology",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="--calibrate: wall-clock budget in seconds, the placements measured for the "
        "learned cost model included (default 300; 0: constants only, no learned model)",
    )
    parser.add_argument(
        "--cost-model",
        choices=COST_MODEL_MODES,
        default="auto",
        help="what scores plans: auto (the topology's learned model when it was fitted on this "
        "machine and world size, else the analytical one), learned (even if fitted elsewhere, "
        "with a warning; an error without one), analytical",
    )
    parser.add_argument(
        "--tune",
        type=int,
        default=0,
        metavar="K",
        help="MEASURE K >= 2 plans here and keep the fastest: the planner's, the greedy "
        "baselines', the cost model's best alternatives, each run on --world-size gloo ranks of "
        "this machine (2..8; plans without the cached tiers, as the distributed runtime runs)",
    )
    parser.add_argument(
        "--tune-rounds",
        type=int,
        default=None,
        help="--tune: rounds in fresh rank processes, each plan's figure their median "
        f"(default {TUNE_ROUNDS}; a round is 5 interleaved passes of 10 steps)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--out", help="write the ShardingPlan JSON here")
    parser.add_argument("--show-plan", action="store_true", help="also print the plan table")
    parser.add_argument(
        "--no-cached-tiers",
        action="store_true",
        help="no dram/ssd tiers behind a row cache (as the distributed runtime plans)",
    )
    parser.add_argument(
        "--towers",
        type=int,
        default=0,
        help="DMT: also plan N towers, one per host (N = world size / ranks per host), and "
        "compare with the flat plan",
    )
    parser.add_argument(
        "--tower-out-vectors",
        type=int,
        default=None,
        help="DMT: vectors each tower module outputs per sample (default 1)",
    )
    parser.add_argument(
        "--tower-partition",
        choices=TOWER_PARTITIONS,
        default="time+memory",
        help="DMT: balance the towers' predicted time and memory (default), or time only "
        "(neorec.sharding.towers 'balanced', the runtime's default)",
    )
    parser.add_argument(
        "--tower-module",
        choices=TOWER_MODULE_KINDS,
        default="mlp",
        help="DMT: tower module priced (mlp: compression to --tower-out-vectors; identity)",
    )


def _inputs(args: argparse.Namespace) -> Any:
    """The plan's inputs (``neorec.sharding.plan_inputs``) from ``--config`` and the flags."""
    from neorec.config import Config
    from neorec.config.planner_file import read_plan_config
    from neorec.sharding.plan_inputs import PlanFlags, plan_inputs

    cfg, base = Config(), Path(".")
    planner: dict[str, Any] = {}
    if args.config:
        cfg, planner = read_plan_config(args.config)
        base = Path(args.config).parent
    flags = PlanFlags(
        world_size=args.world_size,
        ranks_per_host=args.ranks_per_host,
        batch_size=args.batch_size,
        tables=args.tables or "",
        topology=args.topology or "",
        preset=getattr(args, "topology_preset", None),
        cached_tiers=not getattr(args, "no_cached_tiers", False),
    )
    return plan_inputs(
        cfg.embedding, cfg.data, cfg.sharding, planner, flags, base=base, source=args.config
    )


def _calibrate(args: argparse.Namespace) -> None:
    """``--calibrate``: measure this machine into ``--topology`` (default topology.json)."""
    from neorec.measure.spawn import calibrate

    args.topology = args.topology or "topology.json"
    budget = getattr(args, "budget_s", None)
    calibrate(args.topology, args.world_size, args.ranks_per_host, budget)


def _tune_flags(args: argparse.Namespace) -> tuple[int, int]:
    """(K, rounds) of ``--tune`` (0 without it), the flags checked together."""
    from neorec.sharding.planner_shortlist import TUNE_ROUNDS

    k = getattr(args, "tune", 0) or 0
    rounds = getattr(args, "tune_rounds", None)
    if not k:
        if rounds is not None:
            raise ConfigError("--tune-rounds needs --tune K (the plans to measure)")
        return 0, 0
    if getattr(args, "towers", 0):
        raise ConfigError("--tune measures one flat plan; drop --towers or --tune")
    rounds = TUNE_ROUNDS if rounds is None else rounds
    if k < 2 or rounds < 1:
        raise ConfigError(f"--tune needs K >= 2 and --tune-rounds >= 1, not {k} and {rounds}")
    return k, rounds


def run(args: argparse.Namespace) -> int:
    """``neorec plan``: print the report (or JSON), optionally write the plan.

    Bad input and an infeasible plan print ``neorec: error: ...`` on stderr and return 2.
    """
    from neorec.measure.spawn import tune
    from neorec.sharding.learned_cost import resolve
    from neorec.sharding.planner import Planner, format_report
    from neorec.sharding.planner_shortlist import check_tune
    from neorec.sharding.towers_cost import check_towers

    try:
        _check_tower_flags(args)
        if getattr(args, "topology_preset", None) and args.topology:  # flags before any reading
            raise ConfigError("--topology-preset and --topology name two topologies: pass one")
        k, rounds = _tune_flags(args)
        if args.calibrate:
            _calibrate(args)
        inp = _inputs(args)
        if k:
            check_tune(inp.tables, inp.topology.world_size, k, rounds)  # before any planning
            inp.options["allow_cached_tiers"] = False  # the runtime runs no cached tier
        towers = getattr(args, "towers", 0)
        if towers:
            check_towers(inp.topology, towers, len(inp.tables))  # before the (long) flat plan
        where = str(args.topology or "topology")
        scoring = resolve(inp.topology, getattr(args, "cost_model", "auto"), where)
        planner = Planner(
            inp.topology,
            inp.batch_size,
            inp.optimizer,
            cost_model=getattr(args, "cost_model", "auto"),
            **inp.options,
        )
        result = planner.plan(inp.tables)
        for w in scoring.warnings:
            print(w, file=sys.stderr)
        if towers:
            return _run_towers(args, inp, result)
        if k:
            result = tune(planner, result, inp.batch_size, inp.optimizer, k, rounds)
    except (NeorecError, ValueError) as e:  # PlanningError, ConfigError, bad table/topology files
        print(f"neorec: error: {e}", file=sys.stderr)
        return 2
    if args.out:
        result.plan.save(args.out)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print(format_report(result))
        if args.show_plan:
            print()
            print(result.plan.format_table())
        if args.out:
            print(f"\nplan written to {args.out}")
    return 0


def _check_tower_flags(args: argparse.Namespace) -> None:
    """The DMT flags make sense together (checked before any planning)."""
    from neorec.sharding.towers_cost import TowerPlanError

    towers = getattr(args, "towers", 0)
    k = getattr(args, "tower_out_vectors", None)
    if towers < 0:
        raise TowerPlanError(f"--towers must be >= 1 (or 0: no towers), got {towers}")
    if not towers:
        if k is not None:
            raise TowerPlanError("--tower-out-vectors needs --towers N (the towers to plan)")
        return
    if k is not None and k < 1:
        raise TowerPlanError(f"--tower-out-vectors must be >= 1, got {k}")
    if args.out:
        raise TowerPlanError(
            "--out writes one ShardingPlan, but with --towers the runtime plans each tower on its "
            "host itself (neorec.distributed.towers); drop --out, or drop --towers to write the "
            "flat plan"
        )


def _run_towers(args: argparse.Namespace, inp: Any, flat: Any) -> int:
    """``neorec plan --towers N``: the tower plan next to the flat plan."""
    from neorec.sharding.planner import format_report
    from neorec.sharding.towers_cost import TowerOptions, format_tower_report, plan_towers

    k = getattr(args, "tower_out_vectors", None) or 1
    options = TowerOptions(
        out_vectors=k,
        module=getattr(args, "tower_module", "mlp"),
        partition=getattr(args, "tower_partition", "time+memory"),
    )
    res = plan_towers(
        inp.tables,
        inp.topology,
        inp.batch_size,
        args.towers,
        inp.optimizer,
        options=options,
        flat=flat,
        **inp.options,
    )
    if args.json:
        print(json.dumps(res.to_dict()))
        return 0
    print(format_report(flat))
    print()
    print(format_tower_report(res))
    if args.show_plan:
        print()
        print(res.plan.format_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m neorec.cli.plan``)."""
    ap = argparse.ArgumentParser(prog="neorec plan", description="Plan embedding sharding.")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
