"""Dynamic embedding tables (issue 21): the id map (C and NumPy), its policies, and training
through a DynamicEmbeddingBagCollection against a plain EmbeddingBagCollection."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from faults import campaign

from neorec.config import TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.id_map import IdMap, mix64, native_lib
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage.dynamic import DynamicEmbeddingBagCollection, dynamic_init_rows

HAVE_C = native_lib() is not None
IMPLS = [pytest.param(True, id="c", marks=pytest.mark.skipif(not HAVE_C, reason="no C")), False]
POLICIES = [
    {},
    {"eviction": "lfu"},
    {"eviction": "ttl", "ttl_steps": 3},
    {"admission": "threshold", "threshold": 3},
    {"admission": "probability", "probability": 0.4},
    {"admission": "threshold", "threshold": 2, "eviction": "lfu"},
    {"admission": "threshold", "threshold": 4, "sketch_cols": 8},  # collisions, halving
]


def _stream(seed: int, steps: int, cap: int):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        n = int(torch.randint(0, 2 * cap, (1,), generator=g))  # some batches overflow
        ids = torch.randint(-60, 60, (n,), generator=g) * 1_000_000_007
        if step % 5 == 0:
            ids = torch.cat([ids, torch.tensor([2**63 - 1, -(2**63), 0, -1])])
        pins = (torch.rand(cap, generator=g) < 0.1).to(torch.int32)
        yield ids, pins


def _run(native: bool, kw: dict, seed: int = 0, cap: int = 24, steps: int = 50) -> tuple:
    m = IdMap(cap, seed=7, native=native, **kw)
    decisions = []
    for ids, pins in _stream(seed, steps, cap):
        before = m.id_of.clone(), m.live.clone()
        r = m.map(ids, pins)
        # no two live ids share a slot; every mapped id is the id of its slot
        _, live_ids = m.live_items()
        assert live_ids.unique().numel() == live_ids.numel()
        assert m.occupancy == int(m.live.sum())
        ok = r.slots >= 0
        assert torch.equal(m.id_of[r.slots[ok]], ids[ok])
        assert bool(m.live[r.slots[ok]].all())
        assert r.unadmitted == int((~ok).sum())
        # pinned slots keep their ids
        kept = (pins > 0) & (before[1] > 0)
        assert torch.equal(m.id_of[kept], before[0][kept]) and bool(m.live[kept].all())
        assert torch.equal(m.lookup(ids), r.slots)
        decisions.append(
            [t.tolist() for t in (r.slots, r.new_slots, r.new_ids, r.evicted_slots, r.evicted_ids)]
            + [r.admitted, r.evicted, r.unadmitted]
        )
    if kw.get("sketch_cols"):
        assert m.totals["lookups"] > 2 * m.period  # the sketch halved at least once
    return decisions, m.state_dict()


@pytest.mark.parametrize("kw", POLICIES, ids=lambda k: "-".join(map(str, k.values())) or "lru")
@pytest.mark.parametrize("native", IMPLS)
def test_no_shared_slots_random(native: bool, kw: dict) -> None:
    dec, st = _run(native, kw)
    assert sum(d[5] for d in dec) > 0 and sum(d[6] for d in dec) > 0  # admitted and evicted


@pytest.mark.skipif(not HAVE_C, reason="no C compiler")
@pytest.mark.parametrize("kw", POLICIES, ids=lambda k: "-".join(map(str, k.values())) or "lru")
def test_c_equals_numpy(kw: dict) -> None:
    for seed, cap in ((0, 24), (1, 24), (2, 300)):
        a, sa = _run(True, kw, seed, cap)
        b, sb = _run(False, kw, seed, cap)
        assert a == b
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _m(native: bool, cap: int, **kw) -> IdMap:
    return IdMap(cap, seed=1, native=native, **kw)


def _t(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("native", IMPLS)
def test_lru_script(native: bool) -> None:
    m = _m(native, 2)
    s10 = int(m.map(_t(10)).slots[0])
    s20 = int(m.map(_t(20)).slots[0])
    m.map(_t(10))  # 20 is now least recently used
    r = m.map(_t(30))
    assert r.evicted_ids.tolist() == [20] and r.evicted_slots.tolist() == [s20]
    assert r.slots.tolist() == [s20] and r.new_ids.tolist() == [30]
    r = m.map(_t(40, 10))  # 10 is used by this batch: 30 goes although 10 is older
    assert r.evicted_ids.tolist() == [30] and r.slots.tolist() == [s20, s10]


@pytest.mark.parametrize("native", IMPLS)
def test_lfu_script(native: bool) -> None:
    m = _m(native, 2, eviction="lfu")
    m.map(_t(10, 10, 10))
    m.map(_t(20))
    r = m.map(_t(30))  # 20 has 1 hit, 10 has 3: 20 goes though 10 is older
    assert r.evicted_ids.tolist() == [20]
    m.map(_t(30, 30))  # 30: 3 hits, like 10; tie -> the older last use (10) goes
    r = m.map(_t(40))
    assert r.evicted_ids.tolist() == [10]


@pytest.mark.parametrize("native", IMPLS)
def test_ttl_script(native: bool) -> None:
    m = _m(native, 4, eviction="ttl", ttl_steps=2)
    m.map(_t(1))  # step 1
    m.map(_t(2))  # step 2
    r = m.map(_t(2))  # step 3: 1 unused for 2 steps, kept
    assert r.evicted == 0 and m.occupancy == 2
    r = m.map(_t(2))  # step 4: unused for 3 > 2 steps: expired though not full
    assert r.evicted_ids.tolist() == [1] and m.occupancy == 1
    assert m.lookup(_t(1)).tolist() == [-1]


@pytest.mark.parametrize("native", IMPLS)
def test_threshold_script(native: bool) -> None:
    m = _m(native, 8, admission="threshold", threshold=3)
    assert m.map(_t(5)).slots.tolist() == [-1]
    r = m.map(_t(5))
    assert r.slots.tolist() == [-1] and r.unadmitted == 1
    r = m.map(_t(5, 7))  # third sighting of 5
    assert r.slots[0] >= 0 and r.slots[1] == -1 and r.admitted == 1
    r = m.map(_t(9, 9, 9))  # three sightings in one batch
    assert (r.slots >= 0).all() and r.admitted == 1
    assert m.totals["unadmitted"] == 3


@pytest.mark.parametrize("native", IMPLS)
def test_probability_script(native: bool) -> None:
    ids = torch.arange(-500, 500, dtype=torch.int64) * 7919
    m = _m(native, 2000, admission="probability", probability=0.3)
    got = m.map(ids).slots >= 0
    salt = mix64((1 & (2**64 - 1)) ^ 0xD1B54A32D192ED03)
    want = [(mix64(i & (2**64 - 1) ^ salt) >> 11) < int(0.3 * 2**53) for i in ids.tolist()]
    assert got.tolist() == want and 200 < int(got.sum()) < 400
    other = IdMap(2000, admission="probability", probability=0.3, seed=2, native=native)
    assert not torch.equal(other.map(ids).slots >= 0, got)  # another seed, other ids


@pytest.mark.parametrize("native", IMPLS)
def test_overflow_and_pins(native: bool) -> None:
    m = _m(native, 3)
    r = m.map(_t(50, 40, 30, 20, 10, 10))
    assert (r.slots >= 0).tolist() == [False, False, True, True, True, True]  # smallest ids fit
    assert r.unadmitted == 2 and r.admitted == 3 and m.totals["unadmitted"] == 2
    pins = torch.ones(3, dtype=torch.int32)
    r = m.map(_t(60), pins)  # nothing evictable
    assert r.slots.tolist() == [-1] and r.evicted == 0


# ---- the collection ------------------------------------------------------------------------
def _dyn_table(**kw: Any) -> TableConfig:
    base: dict[str, Any] = {
        "name": "a",
        "rows": 64,
        "dim": 8,
        "features": ["f", "g"],
        "kind": "dynamic",
    }
    return TableConfig(**{**base, **kw})


def _batches(seed: int, steps: int, pool: int = 40, b: int = 6):
    rng = random.Random(seed)
    ids = [rng.randrange(-(2**63), 2**63) for _ in range(pool)]
    for _ in range(steps):
        feats = {k: [rng.sample(ids, rng.randrange(0, 4)) for _ in range(b)] for k in "fg"}
        yield SparseFeatures.from_lists(feats)


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
def test_training_equals_plain_table(opt: str) -> None:
    optim = RowOptimizer(kind=opt, lr=0.1)
    pooling = "mean" if opt == "adam" else "sum"
    backend = "cpu" if HAVE_C else "reference"
    dyn = DynamicEmbeddingBagCollection(
        [_dyn_table()], CollectionSpec(optim, pooling, backend=backend, seed=3)
    )
    batches = list(_batches(0, 6))
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(sp.batch_size, 16, generator=g) for sp in batches]
    outs = []
    for sp, go in zip(batches, grads):
        out = dyn(sp)
        outs.append(out.detach().clone())
        out.backward(go)
    m = dyn.id_map("a")
    assert m.totals["evicted"] == 0 and m.totals["unadmitted"] == 0
    # the plain table: row s starts as the init row of the id in slot s
    plain = EmbeddingBagCollection(
        [TableConfig(name="a", rows=64, dim=8, features=["f", "g"])],
        CollectionSpec(optim, pooling, backend=backend),
    )
    rows = torch.zeros(64, 8)
    slots, ids = m.live_items()
    rows[slots] = dynamic_init_rows(dyn.tables[0], 3, ids)
    plain.set_table_weight("a", rows)
    for sp, go, want in zip(batches, grads, outs):
        mapped = SparseFeatures(sp.keys, dyn.slots_of("a", sp.values), sp.lengths)
        out = plain(mapped)
        assert torch.equal(out, want)
        out.backward(go)
    assert torch.equal(plain.table_weight("a"), dyn.table_weight("a"))
    for k, v in plain.optimizer_state().items():
        assert torch.equal(v, dyn.optimizer_state()[k]), k
    assert int(plain.step) == int(dyn.step) == 6


def _one(ids: list[int]) -> SparseFeatures:
    return SparseFeatures.from_lists({"f": [[i] for i in ids]})


def test_readmitted_id_starts_fresh() -> None:
    t = _dyn_table(capacity=2, features=["f"])
    dyn = DynamicEmbeddingBagCollection(
        [t], CollectionSpec(RowOptimizer(kind="adam", lr=0.5), seed=5)
    )
    a, b, c = -(2**62), 12345, 2**63 - 1
    first = dyn(_one([a]))
    first.backward(torch.ones_like(first))
    assert not torch.equal(dyn.table_weight("a")[dyn.slots_of("a", _t(a))[0]], first[0])
    for x in (b, c):
        out = dyn(_one([x]))
        out.backward(torch.ones_like(out))
    assert dyn.slots_of("a", _t(a)).tolist() == [-1]  # evicted
    again = dyn(_one([a]))
    assert torch.equal(again, first)  # the same deterministic init row
    s = int(dyn.slots_of("a", _t(a))[0])
    assert all(float(v.view(2, 8)[s].abs().sum()) == 0 for v in dyn.optimizer_state().values())
    again.backward(torch.ones_like(again))
    st = dyn.stats()["a"]
    assert st["total"]["admitted"] == 4 and st["total"]["evicted"] == 2 and st["occupancy"] == 2


def test_unadmitted_zeros_and_default_row() -> None:
    opt = RowOptimizer(kind="sgd", lr=1.0)
    t = _dyn_table(admission="threshold", admit_threshold=2, features=["f"])
    z = DynamicEmbeddingBagCollection([t], CollectionSpec(opt))
    out = z(SparseFeatures.from_lists({"f": [[7], [7, 8], [9]]}))
    s7 = int(z.slots_of("a", _t(7))[0])  # seen twice in the batch: admitted for both
    assert torch.equal(out[0], z.table_weight("a")[s7])
    assert torch.equal(out[1], z.table_weight("a")[s7])  # 8 dropped from the bag
    assert torch.equal(out[2], torch.zeros(8))  # 9 dropped: an empty bag
    assert z.stats()["a"]["step"]["unadmitted"] == 2
    d = DynamicEmbeddingBagCollection([_dyn_table(unadmitted="default_row", features=["f"],
                                                   admission="probability",
                                                   admit_probability=0.0)],
                                      CollectionSpec(opt))  # fmt: skip
    before = d.table_weight("a")[64].clone()
    out = d(SparseFeatures.from_lists({"f": [[1, 2]]}))
    assert torch.equal(out[0], 2 * before)
    out.backward(torch.ones_like(out))
    assert torch.equal(d.table_weight("a")[64], before - 2.0)  # the default row trains
    with torch.no_grad():  # eval changes no map
        d(SparseFeatures.from_lists({"f": [[3]]}))
    assert d.id_map("a").steps == 1


def test_build_mixed_model() -> None:
    from neorec.builder import build_dlrm
    from neorec.config import load_config
    from neorec.storage.dynamic import MixedEmbeddingBagCollection

    cfg = load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=10, dim=4}, {name='a', rows=16, dim=4, "
            "kind='dynamic', capacity=8, eviction='lfu'}]",
            "model.bottom_mlp=[8, 4]",
            "model.top_mlp=[8, 1]",
        ]
    )
    model = build_dlrm(cfg)
    assert isinstance(model.ebc, MixedEmbeddingBagCollection)
    sp = SparseFeatures.from_lists({"a": [[2**40, -5], [7]], "x": [[1], [9, 0]]})
    before = model.ebc.table_weight("x").clone()
    loss = model(torch.randn(2, cfg.model.num_dense), sp).sum()
    loss.backward()
    assert not torch.equal(before, model.ebc.table_weight("x"))
    assert model.ebc.stats()["a"]["occupancy"] == 3


def test_config_errors() -> None:
    c = campaign("dynamic config")
    base: dict[str, Any] = {"name": "a", "rows": 8, "dim": 4}
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "capacity on fixed": ({"capacity": 4}, "capacity"),
        "admission on fixed": ({"admission": "threshold"}, "admission"),
        "eviction on fixed": ({"eviction": "lfu"}, "eviction"),
        "unadmitted on fixed": ({"unadmitted": "default_row"}, "unadmitted"),
        "bad kind": ({"kind": "elastic"}, "kind"),
        "bad admission": ({"kind": "dynamic", "admission": "often"}, "admission"),
        "bad eviction": ({"kind": "dynamic", "eviction": "fifo"}, "eviction"),
        "negative capacity": ({"kind": "dynamic", "capacity": -1}, "capacity"),
        "threshold 0": (
            {"kind": "dynamic", "admission": "threshold", "admit_threshold": 0},
            "admit_threshold",
        ),  # noqa: E501
        "threshold w/o admission": ({"kind": "dynamic", "admit_threshold": 3}, "admit_threshold"),
        "probability > 1": (
            {"kind": "dynamic", "admission": "probability", "admit_probability": 1.5},
            "admit_probability",
        ),  # noqa: E501
        "probability nan": (
            {"kind": "dynamic", "admission": "probability", "admit_probability": float("nan")},
            "admit_probability",
        ),  # noqa: E501
        "probability w/o admission": (
            {"kind": "dynamic", "admit_probability": 0.5},
            "admit_probability",
        ),  # noqa: E501
        "ttl without steps": ({"kind": "dynamic", "eviction": "ttl"}, "ttl_steps"),
        "ttl steps without ttl": ({"kind": "dynamic", "ttl_steps": 5}, "ttl_steps"),
        "dynamic fp16 on ssd": (
            {"kind": "dynamic", "storage": "ssd", "precision": "fp16"},
            "precision",
        ),
        "dynamic fp16": ({"kind": "dynamic", "precision": "fp16"}, "precision"),
        "capacity type": ({"kind": "dynamic", "capacity": "many"}, "capacity"),
    }
    for name, (kw, match) in cases.items():

        def make(kw: dict[str, Any] = kw) -> TableConfig:
            return TableConfig(**{**base, **kw})

        c.expect_error(name, make, ("'a'", match))
    fixed = TableConfig(**base)
    c.expect_error(
        "fixed table in dynamic collection",
        lambda: DynamicEmbeddingBagCollection([fixed], CollectionSpec()),
        ("'a'", "kind"),
    )
    c.expect_error("IdMap capacity 0", lambda: IdMap(0), "capacity")
    c.expect_cli_error(
        "cli: capacity on a fixed table",
        ["train", "--set", "embedding.tables=[{name='a', rows=3, dim=4, capacity=2}]"],
        ("embedding.tables['a'].capacity", "kind = 'dynamic'"),
    )
    # a valid dynamic config loads
    ok = TableConfig(**base, kind="dynamic", eviction="ttl", ttl_steps=2, capacity=4)
    c.record("valid ttl table", "handled" if ok.capacity == 4 else "crash")
    c.check()
    assert c.counts()["clear error"] >= len(cases) + 3


@pytest.mark.parametrize("native", IMPLS)
def test_state_round_trip(native: bool) -> None:
    kw: dict[str, Any] = {"admission": "threshold", "threshold": 2, "eviction": "lfu"}
    stream = list(_stream(4, 40, 24))
    a = IdMap(24, seed=7, native=native, **kw)
    for ids, pins in stream[:20]:
        a.map(ids, pins)
    b = IdMap(24, seed=7, native=native, **kw)
    b.load_state_dict(a.state_dict())
    for ids, pins in stream[20:]:
        ra, rb = a.map(ids, pins), b.map(ids, pins)
        assert torch.equal(ra.slots, rb.slots) and torch.equal(ra.evicted_ids, rb.evicted_ids)
    assert a.totals == b.totals
