"""Id -> slot map of a dynamic embedding table: raw 64-bit ids to ``capacity`` slots, no collisions.

``IdMap.map(ids)`` maps one batch of one table in a fixed order of decisions (expiry, lookups,
admission, eviction, assignment; see ``neorec/ops/csrc/id_map.c``, whose comment is the
specification). The compiled version (built into the cpu TBE kernel library) keeps an
open-addressing hash table next to the per-slot state; the NumPy version here (no C compiler, or
``system.native = false``) looks ids up in the sorted live ids instead and takes bitwise the same
decisions (tests compare the two on random streams). Both are deterministic for a seed.

Threshold admission counts the sightings of ids without a slot in a count-min sketch of
``SKETCH_DEPTH`` rows x ``sketch_width(capacity)`` int32 counters (saturating): a batch adds each
missing id's occurrences to its counters, then admits the ids whose smallest counter reaches the
threshold. While the sketch's count of sightings is at least ``SKETCH_PERIOD_FACTOR`` x width,
every counter (and that count) is halved, so old sightings fade. Collisions in the sketch can only over-count:
an id may be admitted early, never late. The sizes (the sketch's shape, a map's bytes per slot) are
in ``neorec.ops.id_map_size``, which loads no torch.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from neorec.errors import ConfigError
from neorec.ops import settings
from neorec.ops.id_map_size import SKETCH_DEPTH, sketch_width

__all__ = [
    "IdMap",
    "MapResult",
    "RowTarget",
    "native_lib",
    "mix64",
    "SKETCH_PERIOD_FACTOR",
    "ADMISSIONS",
    "EVICTIONS",
]

ADMISSIONS = ("always", "threshold", "probability")
EVICTIONS = ("lru", "lfu", "ttl")
SKETCH_PERIOD_FACTOR = 10
"""The sketch halves its counters after this many sightings per counter of a row."""
_M64 = (1 << 64) - 1
_I32_MAX = 2**31 - 1
_N_COUNTS = 8  # IM_ADMITTED, IM_EVICTED, IM_UNADMITTED, IM_NEW, IM_EV, IM_HITS, IM_USED, IM_FREED


_TLS = threading.local()


def _shared_scratch(n: int) -> np.ndarray:
    """int64 scratch of at least ``n`` words for compiled map calls, shared by every map of this
    thread (calls run one at a time; only sizes grow): the per-batch buffers cost memory once
    for the largest table, not per table."""
    buf = getattr(_TLS, "buf", None)
    if buf is None or buf.size < n:
        buf = _TLS.buf = np.empty(max(n, 2 * (0 if buf is None else buf.size)), dtype=np.int64)
    return buf


def mix64(x: int) -> int:
    """SplitMix64's finalizer of a 64-bit integer (the map's hash; same as ``im_mix64``)."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    """``mix64`` of a uint64 array (wrapping arithmetic, logical shifts)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class _State(ctypes.Structure):
    _fields_ = [
        ("cap", ctypes.c_int64),
        ("hmask", ctypes.c_int64),
        ("ht", ctypes.c_void_p),
        ("unused", ctypes.c_void_p),
        ("id_of", ctypes.c_void_p),
        ("last", ctypes.c_void_p),
        ("hits", ctypes.c_void_p),
        ("free_stack", ctypes.c_void_p),
        ("live", ctypes.c_void_p),
        ("sketch", ctypes.c_void_p),
        ("sk_salt", ctypes.c_void_p),
        ("sk_depth", ctypes.c_int64),
        ("sk_wmask", ctypes.c_int64),
        ("sk_period", ctypes.c_int64),
        ("policy", ctypes.c_int64),
        ("ttl", ctypes.c_int64),
        ("admission", ctypes.c_int64),
        ("threshold", ctypes.c_int64),
        ("prob_salt", ctypes.c_uint64),
        ("prob_limit", ctypes.c_uint64),
        ("n_free", ctypes.c_int64),
        ("sk_total", ctypes.c_int64),
        ("nxt", ctypes.c_void_p),
        ("prv", ctypes.c_void_p),
        ("head", ctypes.c_int64),
        ("tail", ctypes.c_int64),
    ]


class RowTarget(ctypes.Structure):
    """Where the compiled map writes the rows of the slots it assigns (the initial rows of
    ``neorec.storage.dynamic.dynamic_init_rows``) and frees (zeros), zeroing their optimizer
    state: a table's fp32 rows [*, dim] and state (per-row, then up to two [*, dim]; 0 = none)
    on the CPU, contiguous. Holds raw pointers: keep the tensors alive and unmoved."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("dim", ctypes.c_int64),
        ("row_state", ctypes.c_void_p),
        ("st1", ctypes.c_void_p),
        ("st2", ctypes.c_void_p),
        ("salt", ctypes.c_uint64),
        ("twob", ctypes.c_float),
        ("b", ctypes.c_float),
    ]


def native_lib() -> Any:
    """The compiled library with the id map's functions declared, or None (no C compiler, or
    ``neorec.ops.settings.NATIVE`` off)."""
    if not settings.NATIVE:
        return None
    from neorec.ops.cpu import declared_kernel

    return declared_kernel("id_map", _declare)


def _declare(lib: Any) -> None:
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.im_map_batch.argtypes = [vp, vp, i64, i64, vp, vp, vp, vp, i64, vp, vp, vp]
    lib.im_map_batch.argtypes += [vp, vp, vp, vp, vp, i64, vp, vp, i64, vp, vp, vp]
    lib.im_map_batch.restype = None
    f32, u64 = ctypes.c_float, ctypes.c_uint64
    lib.im_reset_rows.argtypes = [vp, vp, i64, vp, i64, vp, vp, vp, u64, f32, f32]
    lib.im_reset_rows.restype = None
    lib.im_lookup.argtypes = [vp, vp, i64, vp]
    lib.im_lookup.restype = None
    lib.im_rebuild.argtypes = [vp]
    lib.im_rebuild.restype = None


@dataclass
class MapResult:
    """What ``IdMap.map`` decided for one batch."""

    slots: Tensor
    """[n] int64: each id's slot, -1 = unadmitted (no slot in this batch)."""
    new_slots: Tensor
    """Slots assigned in this batch (their rows and optimizer state must be reset)."""
    new_ids: Tensor
    """The raw ids now in ``new_slots``."""
    evicted_slots: Tensor
    """Slots whose ids were evicted in this batch (a slot may also be in ``new_slots``)."""
    evicted_ids: Tensor
    """The raw ids evicted from ``evicted_slots``."""
    used: Tensor
    """The batch's slots (hits and new), each once (any order)."""
    freed_slots: Tensor
    """Evicted slots not reassigned in this batch (their rows must be zeroed)."""
    admitted: int
    """Ids admitted (= new slots)."""
    evicted: int
    """Ids evicted (ttl expiry and eviction for room)."""
    unadmitted: int
    """Lookups (occurrences) that got no slot."""
    rows_reset: bool = False
    """The map already reset the rows of ``freed_slots`` and ``new_slots`` (``rows``)."""


class IdMap:
    """Raw int64 ids -> slots ``[0, capacity)`` with admission and eviction (see the module doc).

    ``map(ids, pins)`` mutates (one step per call); ``lookup(ids)`` does not. ``pins``: an int32
    [capacity] tensor, > 0 where a slot must not be evicted (rows awaiting their update).
    ``sketch_cols``: counters per sketch row (a power of two; 0 = ``sketch_width(capacity)``;
    small values test collisions and decay). ``native``: None = compiled when available.
    """

    def __init__(
        self,
        capacity: int,
        admission: str = "always",
        threshold: int = 1,
        probability: float = 1.0,
        eviction: str = "lru",
        ttl_steps: int = 0,
        seed: int = 0,
        native: bool | None = None,
        sketch_cols: int = 0,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(f"IdMap: capacity must be an integer >= 1, got {capacity!r}")
        if admission not in ADMISSIONS:
            raise ConfigError(f"IdMap: admission must be one of {ADMISSIONS}, got {admission!r}")
        if eviction not in EVICTIONS:
            raise ConfigError(f"IdMap: eviction must be one of {EVICTIONS}, got {eviction!r}")
        if not (isinstance(threshold, int) and 1 <= threshold <= _I32_MAX):
            raise ConfigError(f"IdMap: threshold must be an integer >= 1, got {threshold!r}")
        if not (0.0 <= float(probability) <= 1.0):
            raise ConfigError(f"IdMap: probability must be in [0, 1], got {probability!r}")
        if eviction == "ttl" and ttl_steps < 1:
            raise ConfigError(f"IdMap: eviction 'ttl' needs ttl_steps >= 1, got {ttl_steps!r}")
        self.capacity = capacity
        self.admission, self.eviction = admission, eviction
        self.threshold, self.probability, self.ttl_steps = threshold, float(probability), ttl_steps
        self.seed = int(seed)
        s = self.seed & _M64
        self._sk_salt = [mix64(((s * 8 + d + 1) & _M64) ^ 0xA0761D6478BD642F) for d in range(4)]
        self._prob_salt = mix64(s ^ 0xD1B54A32D192ED03)
        self._prob_limit = min(1 << 53, int(self.probability * 2.0**53))
        if sketch_cols and (sketch_cols < 1 or sketch_cols & (sketch_cols - 1)):
            raise ConfigError(f"IdMap: sketch_cols must be a power of two, got {sketch_cols}")
        self.width = (sketch_cols or sketch_width(capacity)) if admission == "threshold" else 1
        self.period = SKETCH_PERIOD_FACTOR * self.width
        self._lib = native_lib() if native is None or native else None
        if native and self._lib is None:
            raise RuntimeError("IdMap: the compiled id map is unavailable (no C compiler?)")
        cap = capacity
        self.id_of = torch.zeros(cap, dtype=torch.int64)
        self.live = torch.zeros(cap, dtype=torch.uint8)
        self.last = torch.zeros(cap, dtype=torch.int64)
        self.hits = torch.zeros(cap, dtype=torch.int64)
        self.free = torch.arange(cap - 1, -1, -1, dtype=torch.int64)  # top of stack: slot 0
        self.sketch = torch.zeros(SKETCH_DEPTH * self.width, dtype=torch.int32)
        self.n_free = cap
        self.sk_total = 0
        self.steps = 0
        self.totals = {"admitted": 0, "evicted": 0, "unadmitted": 0, "lookups": 0}
        hsize = 1 << max(4, (2 * cap - 1).bit_length())  # load factor <= 1/2
        self._ht = torch.full((2 * hsize if self._lib else 0,), -1, dtype=torch.int64)  # pairs
        self._mark = torch.zeros(cap if self._lib else 0, dtype=torch.uint8)
        # lru / ttl: live slots in (last, id) order, a linked list (compiled version only)
        lst = self._lib is not None and eviction != "lfu"
        self._nxt = torch.full((cap if lst else 0,), -2, dtype=torch.int64)
        self._prv = torch.full((cap if lst else 0,), -2, dtype=torch.int64)
        self._head = self._tail = -1
        self._cst: _State | None = None  # the compiled version's state struct (built once)
        self._counts = torch.zeros(0, dtype=torch.int64)
        self._none = torch.zeros(0, dtype=torch.int64)
        self._salt_t = torch.tensor(
            [x - (1 << 64) if x >= 1 << 63 else x for x in self._sk_salt], dtype=torch.int64
        )

    # ---- inspection --------------------------------------------------------------------------
    @property
    def native(self) -> bool:
        """Whether the compiled version runs."""
        return self._lib is not None

    @property
    def occupancy(self) -> int:
        """Live ids (slots in use)."""
        return self.capacity - self.n_free

    def live_items(self) -> tuple[Tensor, Tensor]:
        """(slots, raw ids) of the live entries, in slot order."""
        slots = torch.nonzero(self.live).flatten()
        return slots, self.id_of[slots]

    def state_dict(self) -> dict[str, Tensor]:
        """The map's whole state as tensors (the hash table is rebuilt from it)."""
        scal = [self.n_free, self.sk_total, self.steps, *self.totals.values()]
        return {
            "id_of": self.id_of.clone(),
            "live": self.live.clone(),
            "last": self.last.clone(),
            "hits": self.hits.clone(),
            "free": self.free.clone(),
            "sketch": self.sketch.clone(),
            "scalars": torch.tensor(scal, dtype=torch.int64),
        }

    def load_state_dict(self, st: dict[str, Tensor]) -> None:
        """Restore ``state_dict()`` output of a map with the same settings."""
        for k in ("id_of", "live", "last", "hits", "free", "sketch"):
            getattr(self, k).copy_(st[k])
        scal = [int(x) for x in st["scalars"]]
        self.n_free, self.sk_total, self.steps = scal[:3]
        self.totals = dict(zip(self.totals, scal[3:], strict=True))
        self._rebuild()

    # ---- the C version -----------------------------------------------------------------------
    def _cstate(self) -> _State:
        pol = EVICTIONS.index(self.eviction)
        adm = ADMISSIONS.index(self.admission)
        lst = self._nxt.numel() > 0
        nxt, prv = (self._nxt.data_ptr(), self._prv.data_ptr()) if lst else (None, None)
        return _State(
            self.capacity, self._ht.numel() // 2 - 1, self._ht.data_ptr(), None,
            self.id_of.data_ptr(), self.last.data_ptr(), self.hits.data_ptr(),
            self.free.data_ptr(), self.live.data_ptr(), self.sketch.data_ptr(),
            self._salt_t.data_ptr(), SKETCH_DEPTH, self.width - 1, self.period, pol,
            self.ttl_steps, adm, self.threshold, self._prob_salt, self._prob_limit, self.n_free,
            self.sk_total, nxt, prv, self._head, self._tail,
        )  # fmt: skip

    def _rebuild(self) -> None:
        """Rebuild the compiled version's derived state (hash table, lru order)."""
        if self._lib is not None:
            st = self._cstate()
            self._lib.im_rebuild(ctypes.byref(st))
            self._head, self._tail = int(st.head), int(st.tail)

    def _map_native(
        self,
        ids: Tensor,
        step: int,
        pins: Tensor | None,
        miss: int,
        pin: bool,
        touched: Any,
        rows: Any = None,
    ) -> tuple[Any, ...]:
        lib, n, cap = self._lib, ids.numel(), self.capacity
        assert lib is not None
        st = self._cst
        if st is None:  # pointers never change (state is copied in place): built once
            st = self._cst = self._cstate()
            self._counts = torch.zeros(_N_COUNTS, dtype=torch.int64)
        st.n_free, st.sk_total, st.head, st.tail = (
            self.n_free,
            self.sk_total,
            self._head,
            self._tail,
        )
        size = 1 << max(4, (max(n, 1) - 1).bit_length())
        msize = 2 * size
        buf = _shared_scratch(9 * cap + 2 * msize + 5 * size)  # keys, ev 4 x cap, per-batch
        p0 = buf.ctypes.data
        o = [8 * x for x in (0, 5 * cap, 6 * cap, 7 * cap, 8 * cap, 9 * cap)]
        b0 = 9 * cap + 2 * msize  # miss, out, new slots, new ids, sort scratch: size each
        ob = [8 * (b0 + j * size) for j in range(5)]
        counts = self._counts
        lib.im_map_batch(
            ctypes.byref(st), ids.data_ptr(), n, step, None if pins is None else pins.data_ptr(),
            self._mark.data_ptr(), p0 + o[5], p0 + o[5] + 8 * msize, msize, p0 + ob[0], p0,
            p0 + ob[1], p0 + ob[2], p0 + ob[3], p0 + o[1], p0 + o[2], counts.data_ptr(), miss,
            p0 + o[3], p0 + o[4], int(pin), None if touched is None else touched.data_ptr(),
            p0 + ob[4], None if rows is None else ctypes.byref(rows),
        )  # fmt: skip
        self.n_free, self.sk_total = int(st.n_free), int(st.sk_total)
        self._head, self._tail = int(st.head), int(st.tail)
        c = counts.tolist()
        k, e, u, f = c[3], c[4], c[6], c[7]

        def cut(start: int, count: int) -> Tensor:  # a copy: the scratch is reused
            return torch.from_numpy(buf[start : start + count].copy())

        out, used = cut(b0 + size, n), cut(7 * cap, u)
        if rows is not None:  # rows reset here: the caller needs only the slots and used ones
            none = self._none
            return out, none, none, none, none, used, none, c[:3]
        return (
            out, cut(b0 + 2 * size, k), cut(b0 + 3 * size, k), cut(5 * cap, e), cut(6 * cap, e),
            used, cut(8 * cap, f), c[:3],
        )  # fmt: skip

    def reset_rows(
        self,
        slots: Tensor,
        ids: Tensor | None,
        weight: Tensor,
        states: list[Tensor | None],
        salt: int,
        bound: float,
    ) -> bool:
        """Compiled ``dynamic_init_rows`` of ``ids`` (zeros when None) into rows ``slots`` of
        ``weight`` [*, dim] and zero optimizer state there (``states``: a per-row [*] tensor,
        then up to two [*, dim] ones, or None); False when it cannot (no C, not on the CPU)."""
        lib = self._lib
        tensors = [weight, *(t for t in states if t is not None)]
        if lib is None or any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return False
        if slots.numel() == 0:
            return True
        slots = slots.contiguous()
        idp = None if ids is None else ids.contiguous()
        row, st1, st2 = (states + [None, None, None])[:3]
        ptr = [None if t is None else t.data_ptr() for t in (row, st1, st2)]
        lib.im_reset_rows(
            slots.data_ptr(), None if idp is None else idp.data_ptr(), slots.numel(),
            weight.data_ptr(), weight.shape[1], ptr[0], ptr[1], ptr[2], salt,
            float(2 * bound), float(bound),
        )  # fmt: skip
        return True

    # ---- the NumPy version -------------------------------------------------------------------
    def _find_np(self, ids: np.ndarray) -> np.ndarray:
        live = np.nonzero(self.live.numpy())[0]
        keys = self.id_of.numpy()[live]
        order = np.argsort(keys, kind="stable")
        skeys, sslots = keys[order], live[order]
        if skeys.size == 0:
            return np.full(ids.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(skeys, ids), skeys.size - 1)
        return np.where(skeys[pos] == ids, sslots[pos], -1).astype(np.int64)

    def _sketch_idx(self, ids: np.ndarray) -> list[np.ndarray]:
        u = ids.view(np.uint64)
        mask = np.uint64(self.width - 1)
        return [
            (_mix64_np(u ^ np.uint64(s)) & mask).astype(np.int64) + d * self.width
            for d, s in enumerate(self._sk_salt)
        ]

    def _map_numpy(
        self, ids: Tensor, step: int, pins: Tensor | None, miss_value: int, pin: bool, touched: Any
    ) -> tuple[Any, ...]:
        x = ids.numpy()
        live, last, hits = self.live.numpy(), self.last.numpy(), self.hits.numpy()
        id_of, free = self.id_of.numpy(), self.free.numpy()
        pinned = (pins.numpy() > 0) if pins is not None else np.zeros(self.capacity, dtype=bool)
        ev_s: list[np.ndarray] = []
        n_ev = 0
        if self.eviction == "ttl":  # 1. expiry
            exp = np.nonzero((live > 0) & ~pinned & (step - last > self.ttl_steps))[0]
            live[exp] = 0
            free[self.n_free : self.n_free + exp.size] = exp
            self.n_free += exp.size
            ev_s.append(exp)
        # 2. lookups
        slot = self._find_np(x)
        hit = slot >= 0
        hs = slot[hit]
        np.add.at(hits, hs, 1)
        last[hs] = step
        mark = np.zeros(self.capacity, dtype=bool)
        mark[hs] = True
        miss, cnt = np.unique(x[~hit], return_counts=True)
        cnt = cnt.astype(np.int64)
        # 3. admission
        if self.admission == "threshold" and miss.size:
            sk = self.sketch.numpy()
            idx = self._sketch_idx(miss)
            wide = sk.astype(np.int64)
            for ix in idx:
                np.add.at(wide, ix, cnt)
            sk[:] = np.minimum(wide, _I32_MAX).astype(np.int32)
            self.sk_total += int(cnt.sum())
            est = np.min(np.stack([sk[ix] for ix in idx]), axis=0)
            keep = est >= self.threshold
            miss, cnt = miss[keep], cnt[keep]
            while self.sk_total >= self.period:
                sk >>= 1
                self.sk_total >>= 1
        elif self.admission == "probability" and miss.size:
            h = _mix64_np(miss.view(np.uint64) ^ np.uint64(self._prob_salt)) >> np.uint64(11)
            keep = h < np.uint64(self._prob_limit)
            miss, cnt = miss[keep], cnt[keep]
        k = miss.size
        # 4. victims
        if k > self.n_free:
            need = k - self.n_free
            cand = np.nonzero((live > 0) & ~mark & ~pinned)[0]
            if self.eviction == "lfu":
                order = np.lexsort((id_of[cand], last[cand], hits[cand]))
            else:
                order = np.lexsort((id_of[cand], last[cand]))
            victims = np.sort(cand[order[:need]])
            live[victims] = 0
            free[self.n_free : self.n_free + victims.size] = victims
            self.n_free += victims.size
            ev_s.append(victims)
            k = min(k, self.n_free)
        evs = np.concatenate(ev_s) if ev_s else np.zeros(0, dtype=np.int64)
        evi = id_of[evs].copy()
        n_ev = evs.size
        # 5. assignment
        base = self.n_free - k
        new_s = free[base : self.n_free].copy()
        id_of[new_s] = miss[:k]
        live[new_s] = 1
        last[new_s] = step
        hits[new_s] = cnt[:k]
        self.n_free = base
        # 6. slots
        out = self._find_np(x)
        bad = out < 0
        unadm = int(bad.sum())
        # 7. used slots (raw-id order), freed slots
        got = out[~bad]
        used = got[np.unique(x[~bad], return_index=True)[1]]
        if pin and pins is not None:
            pins.numpy()[used] += 1
        if touched is not None:
            touched.numpy()[used] = 1
        freed = evs[live[evs] == 0].astype(np.int64)
        out[bad] = miss_value
        t = torch.from_numpy
        return (
            t(out), t(new_s), t(miss[:k].copy()), t(evs.astype(np.int64)), t(evi), t(used),
            t(freed), [k, n_ev, unadm],
        )  # fmt: skip

    # ---- public ------------------------------------------------------------------------------
    def map(
        self,
        ids: Tensor,
        pins: Tensor | None = None,
        miss_value: int = -1,
        pin_used: bool = False,
        touched: Tensor | None = None,
        rows: RowTarget | None = None,
    ) -> MapResult:
        """Map one batch (advances the map's step); see the module doc for the decisions.

        ``miss_value``: the slot given to unadmitted lookups; ``pin_used``: add 1 to ``pins``
        (int32 contiguous, changed in place) at the batch's slots; ``touched``: a bool
        [capacity] tensor set at the batch's slots; ``rows``: the compiled version also resets
        the rows of the freed and new slots there (``MapResult.rows_reset``; then the result
        holds only slots, used slots and counts: the other tensors are empty)."""
        ids = ids.to(torch.int64).contiguous()
        if pins is not None:
            if pin_used and (pins.dtype != torch.int32 or not pins.is_contiguous()):
                raise ValueError("IdMap.map: pin_used needs contiguous int32 pins")
            pins = pins.to(torch.int32).contiguous()
        self.steps += 1
        if self._lib is not None:
            out, new_s, new_i, ev_s, ev_i, used, freed, c = self._map_native(
                ids, self.steps, pins, miss_value, pin_used, touched, rows
            )
        else:
            out, new_s, new_i, ev_s, ev_i, used, freed, c = self._map_numpy(
                ids, self.steps, pins, miss_value, pin_used, touched
            )
        adm, ev, un = (int(v) for v in c)
        self.totals["admitted"] += adm
        self.totals["evicted"] += ev
        self.totals["unadmitted"] += un
        self.totals["lookups"] += ids.numel()
        done = rows is not None and self._lib is not None
        return MapResult(out, new_s, new_i, ev_s, ev_i, used, freed, adm, ev, un, done)

    def lookup(self, ids: Tensor) -> Tensor:
        """Each id's slot or -1, changing nothing."""
        ids = ids.to(torch.int64).contiguous()
        if self._lib is not None:
            out = torch.empty(ids.numel(), dtype=torch.int64)
            self._lib.im_lookup(
                ctypes.byref(self._cstate()), ids.data_ptr(), ids.numel(), out.data_ptr()
            )
            return out
        return torch.from_numpy(self._find_np(ids.numpy()))
