"""DMT tower plans and their predicted cost next to the flat plan's (a simulation).

A tower plan (DMT's Semantic-preserving Tower Transform, as ``neorec.distributed.towers`` runs
it): ``H`` towers on ``H`` hosts of ``k`` ranks; tower ``t``'s tables are planned by the ordinary
``Planner`` over host ``t``'s ranks only (a one-host topology of ``k`` ranks and the same global
batch ``B``: each of its ranks looks up tower ``t``'s features for ``H * b = B / k`` samples).
Per step, with ``b = B / (H k)`` samples per rank:

1. ids: each rank sends its samples' bags of tower ``t``'s features to its peer on host ``t``
   (lengths as int32, ids as int64): ``b * sum_j (pooling_j * 8 + 4)`` bytes to each of the
   ``H - 1`` other hosts (the peer on its own host is itself).
2. lookup: host ``t`` runs tower ``t``'s plan: its all-to-alls stay inside the host (the
   ``CostModel`` of the one-host topology prices them at ``intra_host_bw_gbs``).
3. tower module: each sample's ``F_t`` pooled vectors (``in_t = sum_j dim_j`` floats) become
   ``k_t`` vectors of the tower's widest dim ``D_t`` (``mlp``: one ``Linear(in_t -> k_t D_t)``;
   the runtime needs one dim for all tables, the simulation allows several); forward and backward
   are 3 GEMMs of ``2 * in_t * k_t D_t`` flops per sample at ``dense_tflops`` (or their bytes at
   ``device_bw_gbs``, whichever is slower). ``identity``: ``k_t = F_t``, no compute.
4. outputs: ``b * k_t D_t * 4`` bytes from each rank of host ``t`` to each of its ``H - 1``
   remote peers; backward sends their gradients back (the same bytes).
5. the tower modules' weights are replicated on every rank in one DDP module with the dense arch
   (as the runtime does): their gradients are all-reduced over all ranks each step (ring over
   hosts: ``2 (W - 1) / W * S / k`` bytes through each rank's NIC, ``S`` = the modules' fp32
   weights), not overlapped with anything here (an upper bound: DDP overlaps it in backward).

Times of the exchanges (1, 4, 5) charge a rank's bytes sent plus bytes received at its link's
bandwidth: the ``CostModel``'s convention for a flat plan (a rank pays its owner-side and its
sample-side traffic), so both plans are priced alike.

The flat plan's bytes come from the same ``CostModel``: a shard's owner-side communication time on
inter-host links (``ShardCost.inter_s``) times ``inter_host_bw_gbs`` is its inter-host bytes, the
rest of its communication time times ``intra_host_bw_gbs`` its intra-host bytes (every transfer
has one owner end, so the sum over shards counts each byte once). The flat step is
``PlanCost.max_time_s``; the DMT step is, per phase, the slowest rank of any host plus the
slowest host's sample side, plus the exchanges (1, 4), the slowest tower module (3) and the
all-reduce (5). Neither counts the dense arch (DMT's is smaller: it interacts ``sum k_t`` vectors
instead of ``sum F_t``; not modelled, so the speedup is conservative on that side).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from neorec.errors import NeorecError
from neorec.sharding.cost_model import CostModel, TableSpec
from neorec.sharding.cost_types import PHASES
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.planner import Planner, PlanningError
from neorec.sharding.planner_report import SIMULATION_NOTE, PlanResult
from neorec.sharding.topology import GB, Topology
from neorec.sharding.types import Shard, ShardingPlan, ShardingType, TablePlan

__all__ = [
    "TowerPlanError",
    "Traffic",
    "TowerCost",
    "TowerPlanResult",
    "TowerOptions",
    "TOWER_MODULE_KINDS",
    "TOWER_PARTITIONS",
    "time_memory_groups",
    "plan_traffic",
    "check_towers",
    "plan_towers",
    "format_tower_report",
]

MB = 1e6
TOWER_MODULE_KINDS = ("mlp", "identity")
TOWER_PARTITIONS = ("time+memory", "time")
"""Default partitions of ``plan_towers``: balanced in predicted time and memory, or time only."""
"""Tower modules the cost model prices: ``mlp`` (compression to ``k`` vectors), ``identity``."""


class TowerPlanError(NeorecError, ValueError):
    """Towers that do not match the world, the hosts or the tables (one line: what and the fix)."""


@dataclass
class Traffic:
    """Bytes moved per step, split by link: ``parts`` maps a component to (intra, inter) bytes."""

    parts: dict[str, tuple[float, float]] = field(default_factory=dict)

    def add(self, name: str, intra: float, inter: float) -> None:
        """Add bytes to component ``name``."""
        a, b = self.parts.get(name, (0.0, 0.0))
        self.parts[name] = (a + intra, b + inter)

    @property
    def intra_bytes(self) -> float:
        """Bytes on intra-host links (NVLink, shared memory)."""
        return sum(a for a, _ in self.parts.values())

    @property
    def inter_bytes(self) -> float:
        """Bytes on inter-host links (the NICs)."""
        return sum(b for _, b in self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: totals and components."""
        return {
            "intra_host_bytes": self.intra_bytes,
            "inter_host_bytes": self.inter_bytes,
            "parts": {
                k: {"intra_host_bytes": a, "inter_host_bytes": b}
                for k, (a, b) in self.parts.items()
            },
        }


def plan_traffic(cm: CostModel, plan: ShardingPlan, tables: Sequence[TableSpec]) -> Traffic:
    """Intra- and inter-host bytes per step of ``plan`` as ``cm`` prices it: each shard's owner-side
    communication time on each kind of link times that link's bandwidth (``ids`` = the ids and
    lengths sent to owners; ``pooled`` = the rest: pooled outputs, their gradients and the row-sum
    collectives of data-parallel and column-wise tables)."""
    specs = {t.name: t for t in tables}
    w, k = plan.world_size, plan.ranks_per_host
    intra_bw, inter_bw = cm.topo.intra_host_bw_gbs * GB, cm.topo.inter_host_bw_gbs * GB
    out = Traffic()
    for tp in plan.tables:
        spec = specs[tp.name]
        for s in tp.shards:
            c = cm.shard_cost(
                spec, tp.sharding_type, s.rows, s.cols, tp.storage, None, tp.cache_fraction
            )
            inter = c.inter_s * inter_bw
            intra = (c.comm_s - c.inter_s) * intra_bw
            ids_i = ids_e = 0.0
            if tp.sharding_type.value != "data_parallel":
                ids = (
                    cm.batch * spec.pooling_factor * s.rows / spec.rows * cm.id_bytes + cm.batch * 4
                )
                ids_i, ids_e = ids * (k - 1) / w, ids * (w - k) / w
            out.add("ids", ids_i, ids_e)
            out.add("pooled", intra - ids_i, inter - ids_e)
    return out


@dataclass
class TowerCost:
    """One tower: its host, tables, module shape and its per-host plan's predicted cost."""

    index: int
    tables: list[str]
    ranks: list[int]
    in_floats: int
    """Pooled floats per sample entering the tower module (sum of the tables' dims)."""
    out_vectors: int
    """k_t: vectors per sample leaving the module (identity: F_t, one per table)."""
    out_floats: int
    """Floats per sample leaving the module (mlp: k_t x the tower's widest dim)."""
    params: int
    """Weights of the tower module (identity: 0)."""
    ids_bytes: float
    """Id and length bytes per sample of the tower's tables."""
    sub: PlanResult
    """The tower's plan on its host (local ranks 0..k-1)."""
    module_s: float = 0.0
    """Tower module forward + backward on one rank of the host."""


@dataclass
class TowerPlanResult:
    """A tower plan next to the flat plan: predicted step times and bytes (simulation)."""

    towers: list[TowerCost]
    module: str
    plan: ShardingPlan
    """Every tower's tables on its host's global ranks (the placement; not a flat plan to run)."""
    flat: PlanResult
    flat_traffic: Traffic
    dmt_traffic: Traffic
    dmt_times: dict[str, float]
    """Seconds per step of each part of the DMT step (they add up to ``dmt_step_s``)."""

    @property
    def flat_step_s(self) -> float:
        """The flat plan's predicted embedding time per step."""
        return self.flat.cost.max_time_s

    @property
    def dmt_step_s(self) -> float:
        """The tower plan's predicted embedding time per step (with the tower modules)."""
        return sum(self.dmt_times.values())

    @property
    def speedup(self) -> float:
        """Flat step / DMT step (predicted)."""
        return self.flat_step_s / self.dmt_step_s if self.dmt_step_s > 0 else float("inf")

    @property
    def inter_reduction(self) -> float:
        """Flat inter-host bytes / DMT inter-host bytes."""
        d = self.dmt_traffic.inter_bytes
        return self.flat_traffic.inter_bytes / d if d > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary."""
        return {
            "note": f"simulation: times and bytes are {SIMULATION_NOTE}",
            "towers": len(self.towers),
            "ranks_per_host": self.plan.ranks_per_host,
            "world_size": self.plan.world_size,
            "batch_size": self.flat.batch_size,
            "tower_module": self.module,
            "flat_step_s": self.flat_step_s,
            "dmt_step_s": self.dmt_step_s,
            "speedup": self.speedup,
            "dmt_times_s": dict(self.dmt_times),
            "inter_host_bytes_flat": self.flat_traffic.inter_bytes,
            "inter_host_bytes_dmt": self.dmt_traffic.inter_bytes,
            "inter_host_bytes_reduction": self.inter_reduction,
            "intra_host_bytes_flat": self.flat_traffic.intra_bytes,
            "intra_host_bytes_dmt": self.dmt_traffic.intra_bytes,
            "flat_traffic": self.flat_traffic.to_dict(),
            "dmt_traffic": self.dmt_traffic.to_dict(),
            "tower_list": [
                {
                    "tower": t.index,
                    "host": t.index,
                    "ranks": t.ranks,
                    "tables": t.tables,
                    "features": len(t.tables),
                    "in_floats": t.in_floats,
                    "out_vectors": t.out_vectors,
                    "out_floats": t.out_floats,
                    "module_params": t.params,
                    "module_s": t.module_s,
                    "host_step_s": t.sub.cost.max_time_s,
                    "host_imbalance": t.sub.cost.imbalance,
                }
                for t in self.towers
            ],
            "topology": self.flat.topology.to_dict(),
        }


def check_towers(topology: Topology, towers: int, n_tables: int) -> None:
    """Raise ``TowerPlanError`` unless ``towers`` towers are the topology's hosts (one tower per
    host of ``ranks_per_host`` ranks) and there are at least as many tables."""
    w, k = topology.world_size, topology.ranks_per_host
    if isinstance(towers, bool) or not isinstance(towers, int) or towers < 1:
        raise TowerPlanError(f"towers must be an integer >= 1, got {towers!r}")
    if w % towers:
        raise TowerPlanError(
            f"--towers {towers} does not divide world size {w}: a tower is one host of "
            f"world / towers ranks; use a divisor of {w}"
        )
    if w // towers != k:
        raise TowerPlanError(
            f"--towers {towers} on {w} ranks makes hosts of {w // towers} ranks, but the topology "
            f"has {k} ranks per host ({topology.num_hosts} host(s)); towers are hosts: use "
            f"--towers {topology.num_hosts} or --ranks-per-host {w // towers}"
        )
    if towers > n_tables:
        raise TowerPlanError(
            f"--towers {towers} is more than the {n_tables} tables (a tower holds whole tables); "
            f"use at most {n_tables} towers"
        )


def _check_groups(groups: Sequence[Sequence[str]], tables: Sequence[TableSpec], n: int) -> None:
    names = [t.name for t in tables]
    if len(groups) != n:
        raise TowerPlanError(
            f"tower groups: {len(groups)} groups for {n} towers; give one per tower"
        )
    seen: dict[str, int] = {}
    for i, g in enumerate(groups):
        if not g:
            raise TowerPlanError(f"tower groups[{i}] is empty; every tower needs a table")
        for name in g:
            if name not in names:
                raise TowerPlanError(f"tower groups[{i}] names unknown table '{name}'")
            if name in seen:
                raise TowerPlanError(f"table '{name}' is in tower {seen[name]} and tower {i}")
            seen[name] = i
    missing = [x for x in names if x not in seen]
    if missing:
        raise TowerPlanError(
            f"tower groups leave out table(s) {missing[:5]}; every table needs a tower"
        )


def time_memory_groups(cm: CostModel, tables: Sequence[TableSpec], towers: int) -> list[list[str]]:
    """Tables into ``towers`` groups balanced in predicted time and in memory: LPT over both (the
    table with the largest share of either total first, onto the tower whose larger share after
    it is smallest; empty towers first). A tower's tables live on one host, so a partition
    balanced in time only can leave a tower too large for its host's memory. Deterministic;
    towers in the order of their first table, tables in the given order."""
    times = [cm.shard_cost(t, ShardingType.TABLE_WISE, t.rows, t.dim).time_s for t in tables]
    mem = [t.rows * cm.row_bytes(t, t.dim) + cm.state_bytes(t, t.rows, t.dim) for t in tables]
    ct, cmem = sum(times) or 1.0, sum(mem) or 1.0
    order = sorted(range(len(tables)), key=lambda i: (-max(times[i] / ct, mem[i] / cmem), i))
    lt, lm = [0.0] * towers, [0.0] * towers
    members: list[list[int]] = [[] for _ in range(towers)]
    for i in order:
        empty = [g for g in range(towers) if not members[g]]
        g = (
            empty[0]
            if empty
            else min(
                range(towers),
                key=lambda g: (
                    max((lt[g] + times[i]) / ct, (lm[g] + mem[i]) / cmem),
                    lt[g] + lm[g],
                    g,
                ),
            )
        )
        members[g].append(i)
        lt[g] += times[i]
        lm[g] += mem[i]
    groups = [[tables[i].name for i in sorted(m)] for m in members]
    return sorted(groups, key=lambda grp: [t.name for t in tables].index(grp[0]))


def _module_s(topo: Topology, cm: CostModel, samples: float, fin: int, fout: int) -> float:
    """Forward + backward of ``Linear(fin -> fout)`` on ``samples`` rows: 3 GEMMs (output, input
    grads, weight grads), at ``dense_tflops`` or, when slower, their bytes at device bandwidth."""
    flops = 3 * 2.0 * samples * fin * fout
    nbytes = cm.comm_bytes * (samples * (2 * fin + 3 * fout) + 3 * fin * fout)
    return max(flops / (topo.dense_tflops * 1e12), nbytes / (topo.device_bw_gbs * GB))


@dataclass(frozen=True)
class TowerOptions:
    """How ``plan_towers`` builds and prices the towers (checked there, not here)."""

    out_vectors: int = 1
    """Vectors each ``mlp`` tower module outputs per sample (``--tower-out-vectors``)."""
    module: str = "mlp"
    """The tower module priced: one of ``TOWER_MODULE_KINDS``."""
    groups: Sequence[Sequence[str]] | None = None
    """The towers' table names; None: made by ``partition``."""
    partition: str = "time+memory"
    """Without ``groups``: one of ``TOWER_PARTITIONS``."""


def plan_towers(
    tables: Sequence[TableSpec],
    topology: Topology,
    batch_size: int,
    towers: int,
    optimizer: str = "rowwise_adagrad",
    options: TowerOptions = TowerOptions(),
    flat: PlanResult | None = None,
    **planner_kw: Any,
) -> TowerPlanResult:
    """Plan ``tables`` as ``towers`` towers (one per host of ``topology``) and price the tower plan
    next to the flat plan (``flat``, else planned here). ``options.groups``: the towers' table
    names; by default ``options.partition``: ``time+memory`` (``time_memory_groups``: every tower
    must fit in one host's memory) or ``time`` (``neorec.sharding.towers.partition_tables``
    "balanced": LPT by each table's predicted time only, the runtime's default partition). Raises
    ``TowerPlanError`` for towers that do not fit the topology and ``PlanningError`` (naming the
    tower) when a tower does not fit in its host's memory."""
    out_vectors, module = options.out_vectors, options.module
    groups, partition = options.groups, options.partition
    check_towers(topology, towers, len(tables))
    if module not in TOWER_MODULE_KINDS:
        raise TowerPlanError(f"tower module must be one of {TOWER_MODULE_KINDS}, got {module!r}")
    if module == "mlp" and (
        isinstance(out_vectors, bool) or not isinstance(out_vectors, int) or out_vectors < 1
    ):
        raise TowerPlanError(
            f"tower out_vectors (--tower-out-vectors) must be an integer >= 1, got {out_vectors!r}"
        )
    pinned = [t.name for t in tables if t.ranks]
    if pinned:
        raise TowerPlanError(
            f"table(s) {pinned[:5]} pin ranks; a tower plan places each tower on its host: drop "
            "their ranks to plan towers"
        )
    if partition not in TOWER_PARTITIONS:
        raise TowerPlanError(
            f"tower partition must be one of {TOWER_PARTITIONS}, got {partition!r}"
        )
    cm = CostModel(topology, batch_size, optimizer, weight_bytes=planner_kw.get("weight_bytes", 4))
    groups_given = groups
    if groups is None:
        if partition == "time":
            from neorec.sharding.towers import partition_tables

            groups = partition_tables(list(tables), towers, "balanced", batch_size=batch_size)
        else:
            groups = time_memory_groups(cm, tables, towers)
    _check_groups(groups, tables, towers)
    if flat is None:
        flat = Planner(topology, batch_size, optimizer, **planner_kw).plan(tables)
    k = topology.ranks_per_host
    specs = {t.name: t for t in tables}
    host_topo = dataclasses.replace(
        topology, world_size=k, ranks_per_host=k, name=f"one host of {topology.name or 'custom'}"
    )
    host_cm = CostModel(host_topo, batch_size, optimizer, weight_bytes=cm.weight_bytes)
    out: list[TowerCost] = []
    placed: dict[str, TablePlan] = {}
    dmt = Traffic()
    for t, group in enumerate(groups):
        ts = [specs[n] for n in group]
        try:
            sub = Planner(host_topo, batch_size, optimizer, **planner_kw).plan(ts)
        except PlanningError as e:
            hint = (
                " (partition 'time' balances predicted time only; 'time+memory' also memory)"
                if partition == "time" and groups_given is None
                else ""
            )
            raise PlanningError(
                f"tower {t} (host {t}, {len(ts)} tables) does not fit on its host{hint}: {e}",
                e.tables,
            ) from None
        fin = sum(x.dim for x in ts)
        if module == "identity":
            kv, fout = len(ts), fin
        else:
            kv, fout = out_vectors, out_vectors * max(x.dim for x in ts)
        ids_b = sum(x.pooling_factor * cm.id_bytes + 4 for x in ts)
        params = 0 if module == "identity" else (fin + 1) * fout
        tc = TowerCost(
            t, list(group), list(range(t * k, (t + 1) * k)), fin, kv, fout, params, ids_b, sub
        )
        if params:
            tc.module_s = _module_s(topology, cm, batch_size / k, fin, fout)
        out.append(tc)
        for tp in sub.plan.tables:
            shards = [
                Shard(s.rank + t * k, s.row_start, s.row_end, s.col_start, s.col_end)
                for s in tp.shards
            ]
            placed[tp.name] = dataclasses.replace(tp, shards=shards)
        sub_traffic = plan_traffic(host_cm, sub.plan, ts)
        for name, (a, b) in sub_traffic.parts.items():
            dmt.add(f"host {name}", a, b)
    plan = ShardingPlan(
        topology.world_size,
        k,
        [placed[t.name] for t in tables],
        {"source": "neorec.sharding.towers_cost", "towers": [list(g) for g in groups]},
    )
    validate_plan(plan)
    times = _dmt_times(topology, cm, out, batch_size, dmt)
    return TowerPlanResult(out, module, plan, flat, plan_traffic(cm, flat.plan, tables), dmt, times)


def _dmt_times(
    topo: Topology, cm: CostModel, towers: list[TowerCost], batch: int, dmt: Traffic
) -> dict[str, float]:
    """Seconds per step of each part of the DMT step; adds the exchanges' bytes to ``dmt``."""
    h_n, k = len(towers), topo.ranks_per_host
    b = batch / topo.world_size
    inter_bw = topo.inter_host_bw_gbs * GB
    peers = h_n - 1
    ids = [t.ids_bytes for t in towers]
    outs = [t.out_floats * cm.comm_bytes for t in towers]
    # Per rank of host h: what it sends to and receives from its H - 1 remote peers, both charged
    # at its link's bandwidth as the CostModel charges a flat plan (owner side + sample side).
    ids_s = max(b * (sum(ids) - ids[h]) + peers * b * ids[h] for h in range(h_n)) / inter_bw
    out_s = max(peers * b * outs[h] + b * (sum(outs) - outs[h]) for h in range(h_n)) / inter_bw
    frac = peers / h_n
    dmt.add("peer ids", 0.0, frac * batch * sum(ids))
    dmt.add("peer outputs", 0.0, frac * batch * sum(outs))
    dmt.add("peer output grads", 0.0, frac * batch * sum(outs))
    lat = topo.collective_latency_us * 1e-6
    costs = [t.sub.cost for t in towers]
    times = {
        "peer_ids_s": ids_s + (2 * lat if peers else 0.0),
        "host_embedding_s": sum(max(c.phase_max()[p] for c in costs) for p in range(len(PHASES)))
        + max(c.sample_side_s for c in costs),
        "tower_module_s": max(t.module_s for t in towers),
        "peer_outputs_s": 2 * out_s + (2 * lat if peers else 0.0),
    }
    params = sum(t.params for t in towers)
    ar = 0.0
    w = topo.world_size
    if params and w > 1:
        # NCCL-style rings, one per local rank (channel), each over all W ranks with S / k of the
        # data: every rank sends 2 (W - 1) / W * S / k on each of its k ring edges, one of which
        # leaves the host (rail-aligned rings) when there are several hosts.
        edge = 2 * (w - 1) / w * params * 4.0 / k
        n_inter = 1 if h_n > 1 else 0
        # sent and received on each edge, charged as above (send + receive at the bandwidth)
        ar = 2 * max(
            edge * n_inter / inter_bw, edge * (k - n_inter) / (topo.intra_host_bw_gbs * GB)
        )
        ar += lat
        dmt.add("tower module all-reduce", w * edge * (k - n_inter), w * edge * n_inter)
    times["tower_allreduce_s"] = ar
    return times


def format_tower_report(res: TowerPlanResult, max_tables: int = 6) -> str:
    """The tower plan next to the flat plan: towers, per-host plans, step times, bytes, ratios."""
    topo = res.flat.topology
    k = res.plan.ranks_per_host
    ft, dt = res.flat_traffic, res.dmt_traffic
    mod = (
        "identity (k_t = F_t: the flat model's function)"
        if res.module == "identity"
        else f"mlp: Linear(sum of the tower's dims -> {res.towers[0].out_vectors} x its widest "
        "dim) per sample"
    )
    lines = [
        f"SIMULATION: all times and bytes below are {SIMULATION_NOTE}.",
        f"DMT tower plan: {len(res.towers)} towers = {len(res.towers)} hosts x {k} ranks "
        f"(intra-host {topo.intra_host_bw_gbs:g} GB/s, inter-host {topo.inter_host_bw_gbs:g} GB/s "
        f"per rank; tower modules at {topo.dense_tflops:g} TFLOP/s); tower module {mod}",
        "",
        f"{'tower':>5} {'ranks':>9} {'tables':>6} {'in':>6} {'out':>6} {'host ms':>8} "
        f"{'imbal':>6} {'TM ms':>7}  tables",
    ]
    for t in res.towers:
        names = ", ".join(t.tables[:max_tables])
        more = f", ... (+{len(t.tables) - max_tables})" if len(t.tables) > max_tables else ""
        lines.append(
            f"{t.index:>5} {f'{t.ranks[0]}-{t.ranks[-1]}':>9} {len(t.tables):>6} {t.in_floats:>6} "
            f"{t.out_floats:>6} {t.sub.cost.max_time_s * 1e3:>8.3f} {t.sub.cost.imbalance:>6.3f} "
            f"{t.module_s * 1e3:>7.3f}  {names}{more}"
        )
    lines += [
        "",
        "DMT step (ms): " + ", ".join(f"{n[:-2]} {v * 1e3:.3f}" for n, v in res.dmt_times.items()),
    ]
    lines += [
        "",
        f"{'plan':<6} {'step ms':>9} {'inter-host MB':>14} {'intra-host MB':>14}",
        f"{'flat':<6} {res.flat_step_s * 1e3:>9.3f} {ft.inter_bytes / MB:>14,.3f} "
        f"{ft.intra_bytes / MB:>14,.3f}",
        f"{'DMT':<6} {res.dmt_step_s * 1e3:>9.3f} {dt.inter_bytes / MB:>14,.3f} "
        f"{dt.intra_bytes / MB:>14,.3f}",
        f"ratio flat/DMT: step time {res.speedup:.2f}x (predicted speedup), inter-host bytes "
        f"{res.inter_reduction:.2f}x",
        "MB per step by part (intra / inter host): flat "
        + "; ".join(f"{n} {a / MB:,.3f} / {b / MB:,.3f}" for n, (a, b) in ft.parts.items()),
        "  DMT "
        + "; ".join(f"{n} {a / MB:,.3f} / {b / MB:,.3f}" for n, (a, b) in dt.parts.items()),
        "not modelled: the dense arch of either (DMT's interacts fewer vectors) and any overlap of "
        "the tower modules' all-reduce with the backward",
    ]
    return "\n".join(lines)
