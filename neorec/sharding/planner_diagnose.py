"""Why no plan fits: which tables do not fit where, and the fixes (``PlanningError``'s message).

Split out of ``neorec.sharding.planner``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING

from neorec.sharding.topology import GB
from neorec.sharding.types import ShardingType

if TYPE_CHECKING:
    from neorec.sharding.planner_search import _SearchCore


def diagnose(s: _SearchCore, failed: list[int]) -> str:
    """Which tables do not fit where, and what would make them fit."""
    topo = s.p.topo
    ssd_tier = "ssd" in s.p.cached_tiers
    ssd_txt = f", {s.ssd_cap / GB:.2f} GB SSD" if ssd_tier else ""
    lines = [
        f"no feasible sharding plan: {len(failed)} table(s) do not fit in memory on "
        f"{s.w} ranks ({s.k} per host; {s.dev_cap / GB:.2f} GB device for tables "
        f"and {s.host_cap / GB:.2f} GB host{ssd_txt} per rank):"
    ]
    free_dev = max(s.dev_cap - d for d in s.dev)
    free_host = max(s.host_cap - h for h in s.host)
    free_ssd = max(s.ssd_cap - x for x in s.ssd)
    free_ssd_txt = f", ssd {free_ssd / GB:.2f} GB" if ssd_tier else ""
    total_need = 0.0
    for i in failed[:20]:
        t = s.tables[i]
        best = min(s.opts[i], key=partial(s._mem_need, i))
        geo = s.geometry(i, best)
        per = s._mem_need(i, best)[0]
        whole = sum(c.device_bytes + c.host_bytes + c.ssd_bytes for *_, c in geo)
        total_need += whole
        lines.append(
            f"  - table '{t.name}' ({t.rows:,} x {t.dim}, {whole / GB:.2f} GB with optimizer "
            f"state and buffers): its smallest option {best.label()} needs {per / GB:.2f} GB "
            f"on each of {len(geo)} rank(s); most free: device {free_dev / GB:.2f} GB, host "
            f"{free_host / GB:.2f} GB{free_ssd_txt}"
        )
    if len(failed) > 20:
        lines.append(f"  ... and {len(failed) - 20} more")
    all_need = sum(min(sum(s._bytes(i, o)) for o in s.opts[i]) for i in range(len(s.tables)))
    per_rank = s.dev_cap + s.host_cap + s.ssd_cap
    cap_all = per_rank * s.w
    tiers = "device + host" + (" + ssd" if ssd_tier else "")
    lines.append(
        f"all tables need at least {all_need / GB:,.1f} GB; the ranks offer "
        f"{cap_all / GB:,.1f} GB ({tiers})."
    )
    more = math.ceil(all_need / (0.9 * per_rank)) if per_rank > 0 else 0
    pinned = [
        s.tables[i].name
        for i in failed
        if s.tables[i].allowed_types and ShardingType.ROW_WISE not in s.tables[i].allowed_types
    ]
    t0 = s.tables[failed[0]]
    scale = min(1.0, 0.9 * free_dev / max(1.0, total_need)) if total_need else 1.0
    lines.append("fixes:")
    lines.append(f"  - more ranks: about {max(more, s.w + 1)} ranks of this size would hold them")
    if topo.host_memory_gb <= 0 or not s.p.allow_host:
        lines.append(
            "  - a slower tier: give the topology host memory (host_memory_gb) so rows can "
            "live in host DRAM (UVM-like, or behind a row cache), or allow storage = host"
        )
    else:
        lines.append("  - a slower tier: more host memory per host (host_memory_gb)")
    if ssd_tier:
        lines.append(
            "  - the SSD tier: more SSD per host (ssd_capacity_gb), or smaller row caches "
            f"(cache_fractions, now {', '.join(f'{f:g}' for f in s.p.cache_fractions)})"
        )
    else:
        allow = (
            "allow cached tiers ([planner] allow_cached_tiers = true; `neorec plan` does "
            "unless --no-cached-tiers)"
        )
        if topo.ssd_capacity_gb > 0:
            how = f"the topology's SSD ({topo.ssd_capacity_gb:,.0f} GB per host) is unused: {allow}"
        else:
            how = "" if s.p.allow_cached else f"{allow} and "
            how += "give the topology SSD per host (ssd_capacity_gb, ssd_bw_gbs)"
        lines.append(
            f"  - an SSD tier: {how}; rows then live on SSD behind a row cache of "
            f"{s.p.cache_fractions[0] * 100:g}-{s.p.cache_fractions[-1] * 100:g}% of "
            "their rows in device memory (MTrainS; simulated: the distributed runtime does "
            "not run cached tiers)"
        )
    if pinned:
        lines.append(
            f"  - row-wise splits: allow row_wise / table_row_wise for {pinned[:5]} "
            "(their allowed types forbid splitting rows)"
        )
    else:
        lines.append("  - row-wise splits: already tried over every allowed rank")
    lines.append(
        f"  - smaller dims: e.g. table '{t0.name}' at dim <= {max(1, int(t0.dim * scale))}, "
        "or fewer rows (hashing) / a smaller optimizer (sgd, rowwise_adagrad instead of adam)"
    )
    return "\n".join(lines)
