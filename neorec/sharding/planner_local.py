"""The planner's local search on the critical path: move a shard, swap two, or re-split a table.

``_Search`` is the full search state (``_SearchCore`` plus these steps). Split out of
``neorec.sharding.planner``.
"""

from __future__ import annotations

from functools import partial

from neorec.sharding.planner_parts import _EPS, _MOVABLE, _NPH, _Option, _Piece
from neorec.sharding.planner_search import _SearchCore


class _Search(_SearchCore):
    """Mutable search state with local search (see ``_SearchCore``)."""

    # ---- local search -------------------------------------------------------------------------
    def improve(self) -> int:
        """Local search on the critical path; returns the number of accepted steps."""
        n_pieces = sum(len(p) for p in self.pieces)
        cap = self.p.max_iters if self.p.max_iters is not None else 20 * n_pieces + 100
        it = 0
        while it < cap:
            top = self._top3()
            obj = self.objective()
            sources = list(dict.fromkeys(top[p][0][1] for p in range(_NPH)))
            if not (self._move_or_swap(sources, top, obj) or self._resplit(sources, obj)):
                break
            it += 1
        return it

    def _movable(self, pc: _Piece) -> bool:
        o = self.choice[pc.table]
        # A table with a shard on every rank it may use has nowhere to move one to.
        return o is not None and o.stype in _MOVABLE and o.n < len(self.cands[pc.table])

    def _may_hold(self, pc: _Piece, r: int, other: _Piece | None = None) -> bool:
        cset = self.cands[pc.table]
        if len(cset) != self.w and r not in cset:
            return False
        return not any(q.rank == r for q in self.pieces[pc.table] if q is not pc and q is not other)

    def _delta(
        self, top: list[list[tuple[float, int]]], c: int, t: int, x: tuple[float, ...]
    ) -> tuple[float, float]:
        """(new sum of phase maxima, change of squared loads) if ``x`` moves from ``c`` to ``t``."""
        rc, rt = self.ph[c], self.ph[t]
        crit = 0.0
        dsq = 0.0
        for p in range(_NPH):
            vc, vt = rc[p] - x[p], rt[p] + x[p]
            m = vc if vc > vt else vt
            for v, r in top[p]:
                if r != c and r != t:
                    m = v if v > m else m
                    break
            crit += m
            dsq += vc * vc - rc[p] * rc[p] + vt * vt - rt[p] * rt[p]
        return crit, dsq

    def _better(self, crit: float, dsq: float, obj: tuple[float, float]) -> bool:
        cur = obj[0] - self.uniform
        tol = 1e-9 * max(cur, 1e-12)
        return crit < cur - tol or (crit <= cur + tol and dsq < -1e-9 * max(obj[1], 1e-24))

    def _move_or_swap(
        self, sources: list[int], top: list[list[tuple[float, int]]], obj: tuple[float, float]
    ) -> bool:
        targets = sorted(range(self.w), key=lambda r: (sum(self.ph[r]), r))[:16]
        best: tuple[float, float, _Piece, _Piece | None, int] | None = None
        for c in sources:
            mine = [pc for pc in self.rank_pieces[c] if self._movable(pc)]
            for t in targets:
                if t == c:
                    continue
                for pc in mine:
                    if not self._fits(t, pc.dev, pc.host, pc.ssd) or not self._may_hold(pc, t):
                        continue
                    crit, dsq = self._delta(top, c, t, pc.ph)
                    if self._better(crit, dsq, obj) and (best is None or (crit, dsq) < best[:2]):
                        best = (crit, dsq, pc, None, t)
                for q in self.rank_pieces[t]:
                    if not self._movable(q):
                        continue
                    for pc in mine:
                        if pc.tot <= q.tot or pc.table == q.table:
                            continue
                        x = tuple(a - b for a, b in zip(pc.ph, q.ph))
                        crit, dsq = self._delta(top, c, t, x)
                        if not self._better(crit, dsq, obj):
                            continue
                        if best is not None and (crit, dsq) >= best[:2]:
                            continue
                        if self._swap_ok(pc, q, c, t):
                            best = (crit, dsq, pc, q, t)
        if best is None:
            return False
        _, _, mv, sw, t = best
        c = mv.rank
        self._remove(mv)
        if sw is not None:
            self._remove(sw)
            self._add(sw, c)
        self._add(mv, t)
        return True

    def _swap_ok(self, pc: _Piece, q: _Piece, c: int, r: int) -> bool:
        if not (self._may_hold(pc, r, q) and self._may_hold(q, c, pc)):
            return False
        dd, dh, ds = pc.dev - q.dev, pc.host - q.host, pc.ssd - q.ssd
        return self._fits(r, dd, dh, ds) and self._fits(c, -dd, -dh, -ds)

    def _resplit(self, sources: list[int], obj: tuple[float, float], tables: int = 3) -> bool:
        seen: list[int] = []
        cand = [pc for c in sources for pc in self.rank_pieces[c]]
        for pc in sorted(cand, key=lambda p: (-p.tot, p.table)):
            if pc.table not in seen:
                seen.append(pc.table)
        for i in seen[:tables]:
            cur = self.choice[i]
            assert cur is not None
            biggest = max(p.tot for p in self.pieces[i])
            # A table in device memory is not moved to a cached tier here (never faster at the
            # same split; ``_tier`` moves tables for memory).
            alts = [
                o
                for o in self.opts[i]
                if o != cur
                and not (o.cached and cur.storage == "device")
                and max(g[2].time_s for g in self.geometry(i, o)) < biggest - _EPS
            ]
            alts.sort(key=partial(self._split_key, i))
            for o in alts[:4]:
                if self._try_option(i, o, cur, obj):
                    return True
        return False

    def _try_option(self, i: int, o: _Option, cur: _Option, obj: tuple[float, float]) -> bool:
        """Switch table ``i`` to option ``o`` if that improves the objective; else restore."""
        old = [(pc, pc.rank) for pc in self.pieces[i]]
        self.unassign(i)
        if self.assign(i, o):
            new = self.objective()
            tol = 1e-9 * obj[0]
            if new[0] < obj[0] - tol or (new[0] <= obj[0] + tol and new[1] < obj[1] * (1 - 1e-9)):
                return True
            self.unassign(i)
        for pc, r in old:
            self._add(pc, r)
        self.pieces[i] = [pc for pc, _ in old]
        self.choice[i] = cur
        self._sample[i] = self.cm.sample_side_s(self.tables[i], cur.stype, len(old))
        self.uniform += self._sample[i]
        return False
