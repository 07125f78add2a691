"""The planner's search state: pieces of each option, per-rank loads, the objective, greedy
assignment and the initial solution (cheapest options, tiering, pre-splits, LPT).

``neorec.sharding.planner_local`` adds the local search on top (``_Search``); infeasibility is
explained by ``neorec.sharding.planner_diagnose``. Split out of ``neorec.sharding.planner``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from neorec.sharding.cost_model import TableSpec
from neorec.sharding.cost_types import ShardCost
from neorec.sharding.planner_diagnose import diagnose
from neorec.sharding.planner_parts import (
    _EPS,
    _NPH,
    PlanningError,
    _Bound,
    _Geo,
    _Memo,
    _Option,
    _Piece,
    _Start,
)
from neorec.sharding.types import (
    CACHED_STORAGES,
    Shard,
    ShardingPlan,
    ShardingType,
    TablePlan,
    split_evenly,
)

if TYPE_CHECKING:
    from neorec.sharding.planner import Planner


class _SearchCore:
    """Mutable search state: per-table option and pieces, per-rank phase loads and memory."""

    def __init__(self, p: Planner, tables: list[TableSpec], memo: _Memo | None = None) -> None:
        self.p = p
        self.cm = p.cm
        self.tables = tables
        self.w = p.topo.world_size
        self.k = p.topo.ranks_per_host
        self.dev_cap = p.topo.device_capacity_bytes
        self.host_cap = p.topo.host_capacity_bytes if p.allow_host else 0.0
        self.ssd_cap = p.topo.ssd_capacity_bytes if "ssd" in p.cached_tiers else 0.0
        self.ph = [[0.0] * _NPH for _ in range(self.w)]
        """Per rank and phase: the sum of its pieces' loads."""
        self.dev = [0.0] * self.w
        self.host = [0.0] * self.w
        self.ssd = [0.0] * self.w
        self.rank_pieces: list[list[_Piece]] = [[] for _ in range(self.w)]
        self.cands = [p.candidate_ranks(t) for t in tables]
        self.opts = [p.options(t) for t in tables]
        self.choice: list[_Option | None] = [None] * len(tables)
        self.pieces: list[list[_Piece]] = [[] for _ in tables]
        self.uniform = 0.0
        self._sample = [0.0] * len(tables)
        self._memo = memo if memo is not None else _Memo()
        self._cache = self._memo.geo

    # ---- pieces of an option ------------------------------------------------------------------
    def geometry(self, i: int, o: _Option) -> _Geo:
        """(row range, col range, cost) of each shard of option ``o`` for table ``i``."""
        hit = self._cache.get((i, o))
        if hit is not None:
            return hit
        t = self.tables[i]
        full = ((0, t.rows), (0, t.dim))
        if o.stype is ShardingType.DATA_PARALLEL:
            geo = [full] * self.w
        elif o.stype is ShardingType.TABLE_WISE:
            geo = [full]
        elif o.stype is ShardingType.COLUMN_WISE:
            geo = [((0, t.rows), c) for c in split_evenly(t.dim, o.n)]
        else:
            geo = [(r, (0, t.dim)) for r in split_evenly(t.rows, o.n)]
        costs: dict[tuple[int, int], ShardCost] = {}
        out = []
        for rows, cols in geo:
            shape = (rows[1] - rows[0], cols[1] - cols[0])
            if shape not in costs:
                costs[shape] = self.cm.shard_cost(
                    t, o.stype, shape[0], shape[1], o.storage, None, o.frac
                )
            out.append((rows, cols, costs[shape]))
        self._cache[(i, o)] = out
        return out

    def make_pieces(self, i: int, o: _Option) -> list[_Piece]:
        """Unplaced pieces of option ``o`` of table ``i``."""
        return [_Piece(i, rows, cols, c) for rows, cols, c in self.geometry(i, o)]

    def total_time(self, i: int, o: _Option) -> float:
        """Sum of an option's shard times plus its sample-side time on every rank."""
        hit = self._memo.total.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            side = self.cm.sample_side_s(self.tables[i], o.stype, len(geo))
            hit = self._memo.total[(i, o)] = sum(c.time_s for _, _, c in geo) + self.w * side
        return hit

    def _time_key(self, i: int, o: _Option) -> tuple[float, int]:
        return (self.total_time(i, o), o.n)

    def _rest_key(self, i: int, storage: str, o: _Option) -> tuple[bool, float, int, float]:
        return (o.storage != storage, self.total_time(i, o), o.n, o.frac)

    def _excess_key(
        self, excess: Callable[[int, _Option], float], i: int, o: _Option
    ) -> tuple[float, float]:
        return (excess(i, o), self.total_time(i, o))

    def _max_shard_s(self, i: int, o: _Option) -> float:
        return max(c.time_s for *_, c in self.geometry(i, o))

    def _peak_key(self, i: int, o: _Option) -> tuple[float, float, int]:
        return (self._max_shard_s(i, o), self.total_time(i, o), o.n)

    def _split_key(self, i: int, o: _Option) -> tuple[float, int, str, str, float]:
        return (self.total_time(i, o), o.n, o.stype.value, o.storage, o.frac)

    def _mem_need(self, i: int, o: _Option) -> tuple[float, float]:
        return (
            max(c.device_bytes + c.host_bytes + c.ssd_bytes for *_, c in self.geometry(i, o)),
            o.frac,
        )

    def fits_empty(self, i: int, o: _Option) -> bool:
        """Whether each shard of the option fits on an empty rank."""
        hit = self._memo.fits.get((i, o))
        if hit is None:
            hit = self._memo.fits[(i, o)] = all(
                c.device_bytes <= self.dev_cap
                and c.host_bytes <= self.host_cap
                and c.ssd_bytes <= self.ssd_cap
                for c in {id(c): c for *_, c in self.geometry(i, o)}.values()
            )
        return hit

    # ---- objective ----------------------------------------------------------------------------
    def phase_max(self) -> list[float]:
        """Slowest rank's load in each phase."""
        return [max(row[p] for row in self.ph) for p in range(_NPH)]

    def objective(self) -> tuple[float, float]:
        """(critical path = sum of phase maxima + sample side, sum of squared loads)."""
        sq = sum(v * v for row in self.ph for v in row)
        return sum(self.phase_max()) + self.uniform, sq

    def _top3(self) -> list[list[tuple[float, int]]]:
        out = []
        for p in range(_NPH):
            best: list[tuple[float, int]] = []
            for r in range(self.w):
                v = self.ph[r][p]
                if len(best) < 3 or v > best[-1][0]:
                    best.append((v, r))
                    best.sort(key=lambda x: (-x[0], x[1]))
                    del best[3:]
            out.append(best)
        return out

    # ---- assignment ---------------------------------------------------------------------------
    def _fits(self, r: int, dev: float, host: float, ssd: float = 0.0) -> bool:
        return (
            self.dev[r] + dev <= self.dev_cap
            and self.host[r] + host <= self.host_cap
            and self.ssd[r] + ssd <= self.ssd_cap
        )

    def _add(self, pc: _Piece, r: int) -> None:
        pc.rank = r
        row = self.ph[r]
        for p in range(_NPH):
            row[p] += pc.ph[p]
        self.dev[r] += pc.dev
        self.host[r] += pc.host
        self.ssd[r] += pc.ssd
        self.rank_pieces[r].append(pc)

    def _remove(self, pc: _Piece) -> None:
        r = pc.rank
        row = self.ph[r]
        for p in range(_NPH):
            row[p] -= pc.ph[p]
        self.dev[r] -= pc.dev
        self.host[r] -= pc.host
        self.ssd[r] -= pc.ssd
        self.rank_pieces[r].remove(pc)
        pc.rank = -1

    def unassign(self, i: int) -> None:
        """Take table ``i`` off the ranks."""
        for pc in self.pieces[i]:
            self._remove(pc)
        self.pieces[i] = []
        self.uniform -= self._sample[i]
        self._sample[i] = 0.0
        self.choice[i] = None

    def assign(self, i: int, o: _Option) -> bool:
        """Place table ``i`` with option ``o`` greedily; False (state unchanged) if it does not fit."""
        pieces = self.make_pieces(i, o)
        ranks = self._choose_ranks(i, o, pieces)
        if ranks is None:
            return False
        for pc, r in zip(pieces, ranks):
            self._add(pc, r)
        self.pieces[i] = pieces
        self.choice[i] = o
        self._sample[i] = self.cm.sample_side_s(self.tables[i], o.stype, len(pieces))
        self.uniform += self._sample[i]
        return True

    def _choose_ranks(self, i: int, o: _Option, pieces: list[_Piece]) -> list[int] | None:
        cands = self.cands[i]
        if o.stype is ShardingType.DATA_PARALLEL:
            ok = all(self._fits(r, pieces[0].dev, pieces[0].host, pieces[0].ssd) for r in cands)
            return list(cands) if ok else None
        if o.stype is not ShardingType.TABLE_ROW_WISE:
            return self._greedy_distinct(pieces, cands)
        best: tuple[float, list[int]] | None = None
        cset = set(cands)
        m = self.phase_max()
        for h in range(self.p.topo.num_hosts):
            group = list(range(h * self.k, (h + 1) * self.k))
            if not cset.issuperset(group):
                continue
            ranks = self._greedy_distinct(pieces, group)
            if ranks is None:
                continue
            new = list(m)
            for pc, r in zip(pieces, ranks):
                for p in range(_NPH):
                    new[p] = max(new[p], self.ph[r][p] + pc.ph[p])
            score = sum(new)
            if best is None or score < best[0] - _EPS:
                best = (score, ranks)
        return None if best is None else best[1]

    def _greedy_distinct(self, pieces: list[_Piece], cands: list[int]) -> list[int] | None:
        """Largest piece first onto the fitting rank that lengthens the critical path least."""
        m = self.phase_max()
        used: set[int] = set()
        out = [-1] * len(pieces)
        for j in sorted(range(len(pieces)), key=lambda j: -pieces[j].tot):
            pc = pieces[j]
            best: tuple[float, float, int] | None = None
            for r in cands:
                if r in used or not self._fits(r, pc.dev, pc.host, pc.ssd):
                    continue
                row = self.ph[r]
                crit = 0.0
                tot = 0.0
                for p in range(_NPH):
                    v = row[p] + pc.ph[p]
                    crit += v if v > m[p] else m[p]
                    tot += v
                key = (crit, tot, r)
                if best is None or key < best:
                    best = key
            if best is None:
                return None
            r = best[2]
            out[j] = r
            used.add(r)
            for p in range(_NPH):  # later siblings see this piece in the maxima
                m[p] = max(m[p], self.ph[r][p] + pc.ph[p])
        return out

    # ---- initial solution ---------------------------------------------------------------------
    def initial(self, split_share: _Start = None) -> None:
        """Cheapest option per table, host tier for the coldest bytes if needed, then LPT.

        With a float ``split_share``, tables whose largest shard would exceed that share of a
        rank's mean load in any phase start split finely enough, so LPT can balance; with
        ``"bound"``, tables start split as ``_bound_split`` chooses.
        """
        n = len(self.tables)
        start: list[_Option] = []
        for i in range(n):
            # Cached options (never faster than the same split in device memory) are looked at
            # only when nothing else fits: their hit rates are computed on demand.
            plain = [o for o in self.opts[i] if not o.cached] or self.opts[i]
            fitting = (
                [o for o in plain if self.fits_empty(i, o)]
                or [o for o in self.opts[i] if o.cached and self.fits_empty(i, o)]
                or self.opts[i]
            )
            device = [o for o in fitting if o.storage == "device"] or fitting
            start.append(min(device, key=partial(self._time_key, i)))
        self._tier(start)
        if split_share == "bound":
            self._bound_split(start)
        elif isinstance(split_share, float):
            self._presplit(start, split_share)
        total_t = sum(self.total_time(i, start[i]) for i in range(n)) / self.w or 1.0
        total_m = sum(sum(c.device_bytes for *_, c in self.geometry(i, start[i])) for i in range(n))
        mem_share = total_m / self.w or 1.0

        def key(i: int) -> tuple[float, str]:
            geo = self.geometry(i, start[i])
            tmax = max(c.time_s for *_, c in geo) / total_t
            mmax = max(c.device_bytes for *_, c in geo) / mem_share
            return (-max(tmax, mmax), self.tables[i].name)

        failed = self._lpt(sorted(range(n), key=key), start)
        slow = [sum(self._bytes(i, start[i])[m] for i in range(n)) / self.w for m in (1, 2)]
        if failed and any(slow):
            # Second try, ordered by each table's share of every tier, counting all of its bytes
            # in host DRAM and on SSD: a row split over a whole host needs room on each of its
            # ranks, and placed after large table-wise tables it can find that tier fragmented.
            for i in range(n):
                if self.choice[i] is not None:
                    self.unassign(i)
            shares = [mem_share, *(x or 1.0 for x in slow)]

            def key_tiers(i: int) -> tuple[float, str]:
                geo = self.geometry(i, start[i])
                tmax = max(c.time_s for *_, c in geo) / total_t
                _, host, ssd = self._bytes(i, start[i])
                dev = max(c.device_bytes for *_, c in geo) / shares[0]
                return (-max(tmax, dev, host / shares[1], ssd / shares[2]), self.tables[i].name)

            failed = self._lpt(sorted(range(n), key=key_tiers), start)
        if failed:
            # Last try, largest device bytes first (first-fit decreasing): when memory is tight,
            # placing by time first can strand a large table that a memory-first order fits
            # (the size-greedy baseline's order).
            for i in range(n):
                if self.choice[i] is not None:
                    self.unassign(i)

            def key_mem(i: int) -> tuple[float, str]:
                return (-self._bytes(i, start[i])[0], self.tables[i].name)

            failed = self._lpt(sorted(range(n), key=key_mem), start)
        if failed:
            raise PlanningError(self._diagnose(failed), [self.tables[i].name for i in failed])

    def _lpt(self, order: list[int], start: list[_Option]) -> list[int]:
        """Assign tables in ``order`` at their start options, else their other options (same
        tier first); returns the tables that fit nowhere (the others stay assigned)."""
        failed = []
        for i in order:
            if self.assign(i, start[i]):
                continue
            rest = sorted(
                (o for o in self.opts[i] if o != start[i]),
                key=partial(self._rest_key, i, start[i].storage),
            )
            if not any(self.assign(i, o) for o in rest):
                failed.append(i)
        return failed

    def _presplit(self, start: list[_Option], share: float) -> None:
        """Re-split tables whose shards are too coarse for balancing (see ``initial``)."""
        mean = [0.0] * _NPH
        for i, o in enumerate(start):
            for *_, c in self.geometry(i, o):
                for p, v in enumerate(c.phases):
                    mean[p] += v / self.w
        limit = [share * m for m in mean]

        def excess(i: int, o: _Option) -> float:
            return max(
                max(v - lim for v, lim in zip(c.phases, limit)) for *_, c in self.geometry(i, o)
            )

        for i, o in enumerate(start):
            if excess(i, o) <= 0:
                continue
            alts = [
                a
                for a in self.opts[i]
                if a.storage == o.storage
                and a.frac == o.frac
                and a.stype is not ShardingType.DATA_PARALLEL
                and self.fits_empty(i, a)
            ]
            ok = [a for a in alts if excess(i, a) <= 0]
            if ok:
                start[i] = min(ok, key=partial(self._time_key, i))
            elif alts:
                start[i] = min(alts, key=partial(self._excess_key, excess, i))

    def _peaks(self, i: int, o: _Option) -> tuple[float, ...]:
        """Per phase: the largest shard load of option ``o`` of table ``i``."""
        hit = self._memo.peaks.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            hit = tuple(max(c.phases[p] for *_, c in geo) for p in range(_NPH))
            self._memo.peaks[(i, o)] = hit
        return hit

    def _loads(self, i: int, o: _Option) -> tuple[float, ...]:
        """Per phase: the load of option ``o`` of table ``i`` summed over its shards; then its
        sample-side time (the same on every rank)."""
        hit = self._memo.loads.get((i, o))
        if hit is None:
            geo = self.geometry(i, o)
            side = self.cm.sample_side_s(self.tables[i], o.stype, len(geo))
            hit = (*(sum(c.phases[p] for *_, c in geo) for p in range(_NPH)), side)
            self._memo.loads[(i, o)] = hit
        return hit

    def _bound_split(self, start: list[_Option]) -> None:
        """Re-split tables while that lowers a lower bound of the objective (``_Bound``).

        Greedy: of the tables whose shard sets a phase's bound, the one whose best other option
        (same tier, any type) lowers the bound most takes it; when no single split lowers it
        (two tables with equally large shards), the best two splits in a row. Every split costs
        time, which raises the means, so it stops once splitting the largest shards costs more
        than it balances. Catches splits that only pay together, which local search, one table
        at a time, does not.
        """
        bnd = _Bound(
            self.w,
            [self._peaks(i, o) for i, o in enumerate(start)],
            [self._loads(i, o) for i, o in enumerate(start)],
        )
        for _ in range(4 * len(start)):
            cur = bnd.value()
            steps = self._bound_steps(bnd, start)
            if not steps:
                return
            b, _, i, a = steps[0]
            if b < cur * (1 - 1e-9):
                start[i] = a
                bnd = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))
                continue
            # Two steps: the first need not lower the bound (the other large shard still sets it).
            best: tuple[float, float, int, _Option, int, _Option] | None = None
            for _, _, i, a in steps[:8]:
                nxt = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))
                more = self._bound_steps(nxt, [*start[:i], a, *start[i + 1 :]])
                if more and (best is None or more[0][:2] < best[:2]):
                    best = (more[0][0], more[0][1], i, a, more[0][2], more[0][3])
            if best is None or best[0] >= cur * (1 - 1e-9):
                return
            for i, a in ((best[2], best[3]), (best[4], best[5])):
                start[i] = a
                bnd = bnd.with_table(i, self._peaks(i, a), self._loads(i, a))

    def _bound_steps(
        self, bnd: _Bound, start: list[_Option]
    ) -> list[tuple[float, float, int, _Option]]:
        """(bound, total time, table, option) of re-splitting each table that sets a phase's
        bound to each of its other options (same tier), best first."""
        out = []
        for i in bnd.setters():
            o = start[i]
            for a in self.opts[i]:
                if a == o or a.storage != o.storage or a.frac != o.frac:
                    continue
                if not self.fits_empty(i, a):
                    continue
                b = bnd.value(i, self._peaks(i, a), self._loads(i, a))
                out.append((b, self.total_time(i, a), i, a))
        out.sort(key=lambda x: (x[0], x[1], x[2]))
        return out

    def _bytes(self, i: int, o: _Option) -> tuple[float, float, float]:
        """(device, host, ssd) bytes of option ``o`` of table ``i`` over all its shards."""
        geo = self.geometry(i, o)
        return (
            sum(c.device_bytes for *_, c in geo),
            sum(c.host_bytes for *_, c in geo),
            sum(c.ssd_bytes for *_, c in geo),
        )

    def _tier(self, start: list[_Option]) -> None:
        """Move tables to a slower tier until they fit in device memory: host (UVM-like), or a
        cached tier (dram / ssd behind a row cache), whichever loses least time per device byte
        freed, greedily over all tables, within the host DRAM and SSD left."""
        slower = (["host"] if self.p.allow_host else []) + self.p.cached_tiers
        if not slower:
            return
        cap = 0.92 * self.dev_cap * self.w
        mem = [self._bytes(i, o) for i, o in enumerate(start)]
        used = [m[0] for m in mem]
        need = sum(used) - cap
        if need <= 0:
            return
        room = {
            "host": 0.95 * self.host_cap * self.w - sum(m[1] for m in mem),
            "ssd": 0.95 * self.ssd_cap * self.w - sum(m[2] for m in mem),
        }
        # A cached tier moves misses at one rank's share of its host's bandwidth: its split is
        # the fastest whose largest shard stays within half a rank's mean load (else the finest): a
        # hot table is spread over ranks (their SSDs and links) rather than left to local search.
        limit = 0.5 * sum(self.total_time(i, o) for i, o in enumerate(start)) / self.w
        moves = []
        for i, o in enumerate(start):
            if o.storage != "device" or self.tables[i].storage:
                continue
            by: dict[tuple[str, float], list[_Option]] = {}  # options per tier and fraction
            for h in self.opts[i]:
                if h.storage in slower and self.fits_empty(i, h):
                    by.setdefault((h.storage, h.frac), []).append(h)
            best: dict[tuple[str, float], _Option] = {}
            for key, hs in by.items():
                if key[0] in CACHED_STORAGES:
                    ok = [h for h in hs if self._max_shard_s(i, h) <= limit]
                    best[key] = (
                        min(ok, key=partial(self._time_key, i))
                        if ok
                        else min(hs, key=partial(self._peak_key, i))
                    )
                else:
                    best[key] = min(hs, key=partial(self._time_key, i))
            for (sto, frac), h in best.items():
                dev, host, ssd = self._bytes(i, h)
                freed = used[i] - dev
                if freed > 0:
                    extra = self.total_time(i, h) - self.total_time(i, o)
                    moves.append(
                        (extra / freed, self.tables[i].name, slower.index(sto), frac, i, h)
                    )
        moved: set[int] = set()
        for *_, i, h in sorted(moves, key=lambda m: m[:4]):
            if need <= 0:
                break
            if i in moved:
                continue
            dev, host, ssd = self._bytes(i, h)
            if self.p.cached_tiers and (host > room["host"] or ssd > room["ssd"]):
                continue  # the next-best tier of this table may still fit
            start[i] = h
            moved.add(i)
            need -= used[i] - dev
            room["host"] -= host
            room["ssd"] -= ssd

    # ---- output -------------------------------------------------------------------------------
    def to_plan(self) -> ShardingPlan:
        """The current state as a ``ShardingPlan`` (tables in input order)."""
        out = []
        for i, t in enumerate(self.tables):
            o = self.choice[i]
            assert o is not None
            shards = [
                Shard(pc.rank, pc.rows[0], pc.rows[1], pc.cols[0], pc.cols[1])
                for pc in sorted(self.pieces[i], key=lambda p: (p.rows, p.cols, p.rank))
            ]
            out.append(TablePlan(t.name, t.rows, t.dim, o.stype, shards, o.storage, o.frac))
        return ShardingPlan(self.w, self.k, out)

    def _diagnose(self, failed: list[int]) -> str:
        """Which tables do not fit where, and what would make them fit."""
        return diagnose(self, failed)
