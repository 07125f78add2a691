"""``neorec plan``: read tables and topology, plan, print the report or JSON.

A config file is a neorec TOML config; an optional ``[planner]`` section (read only here) adds
what the planner needs beyond it::

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
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from neorec.config import (
    CheckpointConfig,
    CommConfig,
    Config,
    ConfigError,
    DataConfig,
    EmbeddingConfig,
    LowpConfig,
    ModelConfig,
    ShardingConfig,
    StorageConfig,
    TowersConfig,
    TrainConfig,
    load_config,
)
from neorec.errors import NeorecError
from neorec.sharding.cost_model import TableSpec, load_tables, tables_from_config
from neorec.sharding.gpu_topology import add_preset_argument, apply_preset
from neorec.sharding.learned_cost import (
    COST_MODEL_MODES,
    LearnedModelError,
    resolve,
    specs_dicts,
)
from neorec.sharding.planner import Planner, PlanResult, format_report
from neorec.sharding.planner_shortlist import TUNE_ROUNDS, check_tune, shortlist, with_plan
from neorec.sharding.topology import Topology
from neorec.sharding.towers_cost import (
    TOWER_MODULE_KINDS,
    TOWER_PARTITIONS,
    TowerPlanError,
    check_towers,
    format_tower_report,
    plan_towers,
)
from neorec.sharding.types import CACHED_STORAGES

__all__ = ["HELP", "add_arguments", "run", "main", "PlanInputs", "load_plan_inputs"]

HELP = "plan how tables are sharded over ranks"

_SECTIONS = {
    "model": ModelConfig,
    "embedding": EmbeddingConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sharding": ShardingConfig,
    # read by training, not by the planner; accepted so one config serves both
    "storage": StorageConfig,
    "checkpoint": CheckpointConfig,
    "comm": CommConfig,
    "lowp": LowpConfig,
    "towers": TowersConfig,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``neorec plan``."""
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


class PlanInputs:
    """Everything ``neorec plan`` needs: tables, topology, batch, optimizer and planner options."""

    def __init__(
        self,
        tables: list[TableSpec],
        topology: Topology,
        batch_size: int,
        optimizer: str,
        options: dict[str, Any],
    ) -> None:
        self.tables = tables
        self.topology = topology
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.options = options


def _config_from_dict(data: dict[str, Any], where: str) -> Config:
    """A Config from TOML data without the ``[planner]`` section (same checks as load_config)."""
    unknown = sorted(set(data) - set(_SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(_SECTIONS)}")
    try:
        sections = {k: cls(**data.get(k, {})) for k, cls in _SECTIONS.items()}
        return Config(**sections)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_plan_inputs(args: argparse.Namespace) -> PlanInputs:
    """Resolve tables, topology and batch size from the config, files and flags."""
    planner: dict[str, Any] = {}
    cfg = Config()
    base = Path(".")
    if args.config:
        path = Path(args.config)
        if not path.exists():
            raise ConfigError(f"config file not found: {path}")
        base = path.parent
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        planner = data.pop("planner", {})
        cfg = _config_from_dict(data, str(path)) if planner else load_config(path)
    topo_over = dict(planner.pop("topology", {}))
    tables_file = args.tables or (
        str(base / planner.pop("tables_file")) if "tables_file" in planner else ""
    )
    planner.pop("tables_file", None)
    sh = cfg.sharding
    cached = bool(planner.get("allow_cached_tiers", True)) and not getattr(
        args, "no_cached_tiers", False
    )
    planner["allow_cached_tiers"] = cached
    if tables_file:
        tables = load_tables(tables_file)
    else:
        # Synthetic Zipf ids: skew lowers the rows a batch touches (other distributions: uniform).
        d = cfg.data
        synthetic = d.source in ("synthetic", "stream")
        alpha = d.zipf_alpha if synthetic and d.id_distribution == "zipf" else 0.0
        dist = d.id_distribution if synthetic else ""
        tables = tables_from_config(cfg.embedding.tables, sh.types, sh.default_type, alpha, dist)
        if cached:
            _config_storage(tables, cfg)
    batch = args.batch_size or int(planner.pop("batch_size", cfg.data.batch_size))
    planner.pop("batch_size", None)
    optimizer = str(planner.pop("optimizer", cfg.embedding.optimizer))
    topo_file = str(planner.pop("topology_file", "") or "")
    if topo_file and not args.topology:
        tpath = base / topo_file
        if not tpath.exists():
            raise ConfigError(
                f"{args.config}: planner.topology_file {str(tpath)!r} does not exist; write one "
                "with neorec plan --calibrate --topology PATH, or drop the key"
            )
        topo = Topology.load(tpath).with_world(args.world_size, args.ranks_per_host or None)
    elif args.topology:  # written just now by --calibrate, or given: missing is an error
        topo = Topology.load(args.topology)
        topo = topo.with_world(args.world_size, args.ranks_per_host or None)
    else:
        fields = {"world_size": args.world_size, **topo_over}
        fields["world_size"] = args.world_size
        if args.ranks_per_host:
            fields["ranks_per_host"] = args.ranks_per_host
        if topo_over:
            topo = Topology.from_dict(fields)
        else:
            topo = Topology.local_cpu(args.world_size).with_world(
                args.world_size, args.ranks_per_host or args.world_size
            )
    topo = apply_preset(args, topo)  # --topology-preset: a GPU host preset instead
    if "cache_fractions" in planner:
        planner["cache_fractions"] = tuple(float(f) for f in planner["cache_fractions"])
    known = {"weight_bytes", "allow_host", "max_cw_slices", "allow_cached_tiers", "cache_fractions"}
    bad = sorted(set(planner) - known)
    if bad:
        raise ConfigError(f"unknown [planner] key(s) {bad}; known: {sorted(known)}")
    return PlanInputs(tables, topo, batch, optimizer, planner)


def _config_storage(tables: list[TableSpec], cfg: Config) -> None:
    """Config tables with ``storage = "dram" | "ssd"`` keep that tier and cache size."""
    by_name = {t.name: t for t in cfg.embedding.tables}
    for spec in tables:
        t = by_name[spec.name]
        if t.storage not in CACHED_STORAGES:
            continue
        spec.storage = t.storage
        spec.cache_policy = t.cache_policy
        # cache_rows / cache_fraction as the runtime sizes the cache (default 10%; of a dynamic
        # table's slots, spec.rows)
        rows = t.cache_rows or math.ceil((t.cache_fraction or 0.1) * spec.rows)
        spec.cache_fraction = min(1.0, max(1, rows) / spec.rows)


def _calibrate(args: argparse.Namespace) -> None:
    """Run ``neorec.measure.calibrate`` in a subprocess (keeps torch out of the planner); its
    progress goes to stderr, its one-line error becomes ours."""
    out = args.topology or "topology.json"
    args.topology = out
    cmd = [sys.executable, "-m", "neorec.measure.calibrate", "--out", out]
    cmd += ["--world-size", str(args.world_size)]
    if args.ranks_per_host:
        cmd += ["--ranks-per-host", str(args.ranks_per_host)]
    budget = getattr(args, "budget_s", None)
    if budget is not None:
        if budget < 0:
            raise LearnedModelError(f"--budget-s must be >= 0 seconds, got {budget}")
        cmd += ["--budget-s", str(budget)]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    errs = [x for x in proc.stderr.splitlines() if x.startswith("neorec: error: ")]
    if proc.returncode and errs:
        raise LearnedModelError(errs[-1].removeprefix("neorec: error: "))
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise LearnedModelError(
            f"--calibrate: the calibration crashed (exit {proc.returncode}); its output is above"
        )


def _tune_flags(args: argparse.Namespace) -> tuple[int, int]:
    """(K, rounds) of ``--tune`` (0 without it), the flags checked together."""
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


def _tune(planner: Planner, result: PlanResult, inp: PlanInputs, k: int, rounds: int) -> PlanResult:
    """``--tune``: measure ``result``'s shortlist in ``neorec.measure.plan_tune`` (a subprocess:
    torch stays out of the planner; its progress goes to stderr) and return the result with the
    fastest plan and the tuning record."""
    import tempfile

    cands = shortlist(planner, result, k)
    req = {
        "tables": specs_dicts(result.tables),
        "batch": inp.batch_size,
        "optimizer": inp.optimizer,
        "rounds": rounds,
        "plans": [
            {"label": c.label, "plan": c.plan.to_dict(), "predicted_ms": c.predicted_ms}
            for c in cands
        ],
    }
    with tempfile.TemporaryDirectory(prefix="neorec-tune-") as tmp:
        rq, out = Path(tmp) / "request.json", Path(tmp) / "tuning.json"
        rq.write_text(json.dumps(req))
        cmd = [sys.executable, "-m", "neorec.measure.plan_tune", "--request", str(rq)]
        try:  # progress straight to our stderr; captured and copied there when it has no fd
            sink: Any = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            sink = subprocess.PIPE
        proc = subprocess.run(
            [*cmd, "--out", str(out)], stdout=sink, stderr=subprocess.PIPE, text=True
        )
        if proc.stdout:
            sys.stderr.write(proc.stdout)
        errs = [x for x in proc.stderr.splitlines() if x.startswith("neorec: error: ")]
        if proc.returncode:
            if errs:
                raise ConfigError(errs[-1].removeprefix("neorec: error: "))
            sys.stderr.write(proc.stderr)
            raise ConfigError(f"--tune: the measurement crashed (exit {proc.returncode})")
        rec = json.loads(out.read_text())
    picked = next(c for c in cands if c.label == rec["picked"])
    tuned = with_plan(planner, result, picked.plan)
    tuned.tuning = rec
    tuned.plan.meta["tuning"] = {
        "picked": rec["picked"],
        "measured_ms": {m["label"]: round(m["ms_per_step"], 3) for m in rec["measured"]},
        "rounds": rec["rounds"],
        "world": rec["world"],
        "note": "measured here with neorec plan --tune (neorec.measure.plan_tune)",
    }
    return tuned


def run(args: argparse.Namespace) -> int:
    """``neorec plan``: print the report (or JSON), optionally write the plan.

    Bad input and an infeasible plan print ``neorec: error: ...`` on stderr and return 2.
    """
    try:
        _check_tower_flags(args)
        if getattr(args, "topology_preset", None) and args.topology:  # flags before any reading
            raise ConfigError("--topology-preset and --topology name two topologies: pass one")
        k, rounds = _tune_flags(args)
        if args.calibrate:
            _calibrate(args)
        inp = load_plan_inputs(args)
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
            result = _tune(planner, result, inp, k, rounds)
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


def _run_towers(args: argparse.Namespace, inp: PlanInputs, flat: Any) -> int:
    """``neorec plan --towers N``: the tower plan next to the flat plan."""
    k = getattr(args, "tower_out_vectors", None) or 1
    res = plan_towers(
        inp.tables,
        inp.topology,
        inp.batch_size,
        args.towers,
        inp.optimizer,
        out_vectors=k,
        module=getattr(args, "tower_module", "mlp"),
        partition=getattr(args, "tower_partition", "time+memory"),
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
