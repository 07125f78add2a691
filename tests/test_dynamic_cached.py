"""Dynamic tables behind the row cache (issue 21): slot rows in a DRAM / SSD store, compared with
the in-memory DynamicEmbeddingBagCollection (the specification), bitwise."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from neorec.config import TableConfig
from neorec.errors import ConfigError
from neorec.modules.collection import CollectionSpec
from neorec.ops.id_map import native_lib
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage.dynamic import DynamicEmbeddingBagCollection, DynamicTableState
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.store import StoreSettings

BACKEND = "cpu" if native_lib() is not None else "reference"
POLICIES = {
    "lru": {},
    "ttl": {"eviction": "ttl", "ttl_steps": 2},  # slots freed and not reassigned
    "lfu-threshold-default": {
        "eviction": "lfu",
        "admission": "threshold",
        "admit_threshold": 2,
        "unadmitted": "default_row",
    },
    "probability": {"admission": "probability", "admit_probability": 0.7},
}


def _tables(storage: str, cache_rows: int = 8, **kw: Any) -> list[TableConfig]:
    a = {"name": "a", "rows": 64, "dim": 4, "features": ["f", "g"], "capacity": 12}
    b = {"name": "b", "rows": 64, "dim": 3, "features": ["h"], "capacity": 9}
    cache = {"storage": storage, "cache_rows": cache_rows} if storage != "memory" else {}
    return [
        TableConfig(kind="dynamic", **{**a, **kw, **cache}),
        TableConfig(kind="dynamic", **{**b, **kw}),  # in the fast tier of the same collection
    ]


def _batches(seed: int, steps: int, pool: int = 30, b: int = 2) -> list[SparseFeatures]:
    """Ids from a pool larger than the capacities: admission, eviction and re-admission."""
    rng = random.Random(seed)
    ids = [rng.randrange(-(2**63), 2**63) for _ in range(pool)]
    out = []
    for _ in range(steps):
        feats = {k: [rng.sample(ids, rng.randrange(0, 3)) for _ in range(b)] for k in "fgh"}
        out.append(SparseFeatures.from_lists(feats))
    return out


def _make(storage: str, opt: str, pooling: str, root: Path, **kw: Any) -> Any:
    spec = CollectionSpec(RowOptimizer(kind=opt, lr=0.1), pooling, BACKEND, seed=3)
    if storage == "memory":
        return DynamicEmbeddingBagCollection(_tables(storage, **kw), spec)
    stores = StoreSettings(dir=root)
    return DynamicCachedEmbeddingBagCollection(_tables(storage, **kw), spec, storage=stores)


def _train(dyn: Any, batches: list[SparseFeatures], start: int = 0) -> list[torch.Tensor]:
    outs = []
    for j, sp in enumerate(batches):
        out = dyn(sp)
        outs.append(out.detach().clone())
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(start + j)))
    return outs


def _same_state(a: DynamicTableState, b: DynamicTableState) -> None:
    for k in ("ids", "rows", "uses", "last_use", "sketch"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert sorted(a.states) == sorted(b.states)
    assert all(torch.equal(a.states[k], b.states[k]) for k in a.states)
    assert (a.step, a.sketch_total, a.totals) == (b.step, b.sketch_total, b.totals)
    assert (a.default_row is None) == (b.default_row is None)
    if a.default_row is not None and b.default_row is not None:
        assert torch.equal(a.default_row, b.default_row)
        assert all(torch.equal(a.default_states[k], b.default_states[k]) for k in a.states)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize(
    "storage,opt,pooling",
    [("ssd", "sgd", "sum"), ("ssd", "rowwise_adagrad", "mean"), ("dram", "rowwise_adagrad", "sum")],
)
def test_training_equals_in_memory(
    tmp_path: Path, storage: str, opt: str, pooling: str, policy: str
) -> None:
    kw = POLICIES[policy]
    batches = _batches(0, 16)
    ref = _make("memory", opt, pooling, tmp_path, **kw)
    got = _make(storage, opt, pooling, tmp_path, **kw)
    for want, have in zip(_train(ref, batches), _train(got, batches)):
        assert torch.equal(want, have)
    for t in ("a", "b"):
        assert torch.equal(ref.table_weight(t), got.table_weight(t)), t
        _same_state(ref.export_table(t), got.export_table(t))
    assert int(ref.step) == int(got.step) == len(batches)
    s, r = got.stats(), ref.stats()
    for t in ("a", "b"):  # the id maps' counters, and the cache's of the dram/ssd table
        assert {k: s[t][k] for k in r[t]} == r[t]
    assert s["a"]["total"]["evicted"] > 0 and s["a"]["total"]["admitted"] > 12  # re-admissions
    c = s["a"]["cache"]
    assert c["misses"] > 0 and c["hits"] > 0 and c["evictions"] > 0 and c["writebacks"] > 0
    assert s["misses"] == c["misses"] and "cache" not in s["b"]
    assert f"{storage} r/w" in got.stats_line()
    got.close()


SCRIPTS = {  # capacity, small cache, policy, batches of one bag ("!": a NaN gradient, refused)
    "lru": (2, 1, {}, [[10], [11], [12, "!"], [10], [13, "!"], [11], [10], [12]]),
    "ttl": (3, 2, {"eviction": "ttl", "ttl_steps": 1}, [[1, 2], [3], [3], [4, 5, "!"], [5], [5]]),
}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_resets_reach_resident_and_stored_slots(tmp_path: Path, script: str) -> None:
    """Slots reassigned (lru) or freed (ttl) while resident in the cache (all slots fit) or not
    (a smaller cache), with the cache flushed (clean) before each step and some updates refused:
    the fresh and zeroed rows reach the store, and an evicted id's row never comes back."""
    cap, small, kw, script_batches = SCRIPTS[script]
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.5)
    for cache_rows in (cap, small):
        t = TableConfig(name="a", rows=8, dim=4, kind="dynamic", capacity=cap, features=["f"], **kw)
        ref = DynamicEmbeddingBagCollection([t], CollectionSpec(opt, seed=1))
        ct = TableConfig(**{**t.__dict__, "storage": "ssd", "cache_rows": cache_rows})
        got = DynamicCachedEmbeddingBagCollection(
            [ct], CollectionSpec(opt, seed=1), storage=StoreSettings(dir=tmp_path)
        )
        for ids in script_batches:
            refused = "!" in ids
            sp = SparseFeatures.from_lists({"f": [[i for i in ids if i != "!"]]})
            for m in (ref, got):
                out = m(sp)
                g = torch.full_like(out, float("nan") if refused else 1.0)
                if refused:
                    with pytest.raises(FloatingPointError, match="nan"):
                        out.backward(g)
                else:
                    out.backward(g)
            assert torch.equal(ref.table_weight("a"), got.table_weight("a"))  # (flushes)
        _same_state(ref.export_table("a"), got.export_table("a"))
        assert got.stats()["a"]["total"]["evicted"] >= 3
        got.close()


def test_pipelined_forwards_and_prefetch(tmp_path: Path) -> None:
    """Forward i+1 (with the next batch prefetched, deferred) before backward i: slots in use
    stay pinned in the map and the cache; the results are those of the in-memory table."""
    kw = {"eviction": "lfu", "unadmitted": "default_row", "capacity": 20}
    batches = _batches(5, 16, pool=30, b=1)  # two batches of at most 5 slots: a cache of 10
    res = []
    for storage in ("memory", "ssd"):
        m = _make(storage, "rowwise_adagrad", "sum", tmp_path, cache_rows=10, **kw)
        outs, pending = [], None
        for j, sp in enumerate(batches):
            if storage == "ssd" and j + 1 < len(batches):
                m.prefetch(batches[j + 1], defer=True)
            out = m(sp)
            outs.append(out.detach().clone())
            if pending is not None:
                pending[0].backward(pending[1])
            pending = (out, torch.randn(out.shape, generator=torch.Generator().manual_seed(j)))
        assert pending is not None
        pending[0].backward(pending[1])
        res.append((outs, {t: m.export_table(t) for t in ("a", "b")}, m))
    for x, y in zip(res[0][0], res[1][0]):
        assert torch.equal(x, y)
    for t in ("a", "b"):
        _same_state(res[0][1][t], res[1][1][t])
    assert res[1][2].stats()["a"]["cache"]["staged"] > 0  # prefetched rows were used


@pytest.mark.parametrize("into", ["memory", "ssd"])
def test_export_import_continue_bitwise(tmp_path: Path, into: str) -> None:
    """Export a cached table after 8 steps, import it into a fresh collection (cached or not) and
    train on: the same as one uninterrupted in-memory run."""
    kw = POLICIES["lfu-threshold-default"]
    batches = _batches(2, 16)
    whole = _make("memory", "rowwise_adagrad", "sum", tmp_path, **kw)
    want = _train(whole, batches)
    first = _make("ssd", "rowwise_adagrad", "sum", tmp_path / "first", **kw)
    _train(first, batches[:8])
    fresh = _make(into, "rowwise_adagrad", "sum", tmp_path / "fresh", **kw)
    _train(fresh, batches[8:11], 99)  # something to replace
    for t in ("a", "b"):
        fresh.import_table(t, first.export_table(t))
        w, m = fresh.table_weight(t), fresh.id_map(t)
        free = torch.ones(m.capacity, dtype=torch.bool)
        free[m.live_items()[0]] = False
        assert free.any() and not w[: m.capacity][free].any()  # the replaced rows were zeroed
    fresh.step.copy_(first.step)
    for x, y in zip(_train(fresh, batches[8:], 8), want[8:]):
        assert torch.equal(x, y)
    for t in ("a", "b"):
        _same_state(fresh.export_table(t), whole.export_table(t))


def test_build_from_config_and_refusals(tmp_path: Path) -> None:
    from neorec.builder import build_dlrm
    from neorec.config import load_config
    from neorec.storage.dynamic import MixedEmbeddingBagCollection

    cfg = load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=10, dim=4}, {name='a', rows=16, dim=4, "
            "kind='dynamic', capacity=8, storage='ssd', cache_fraction=0.5}]",
            "model.bottom_mlp=[8, 4]",
            "model.top_mlp=[8, 1]",
            f"storage.dir='{tmp_path}'",
        ]
    )
    model = build_dlrm(cfg)
    assert isinstance(model.ebc, MixedEmbeddingBagCollection)
    dyn = model.ebc.dynamic
    assert isinstance(dyn, DynamicCachedEmbeddingBagCollection)
    assert dyn.slot_cache.layout.rows == (4,)  # half of the 8 slots
    sp = SparseFeatures.from_lists({"a": [[2**40, -5], [7]], "x": [[1], [9, 0]]})
    model(torch.randn(2, cfg.model.num_dense), sp).sum().backward()
    assert (tmp_path / "a.rows").exists() and model.ebc.stats()["a"]["occupancy"] == 3
    # the in-memory collection refuses dram / ssd tables and names the cached one
    t = TableConfig(name="a", rows=8, dim=4, kind="dynamic", storage="ssd")
    with pytest.raises(ConfigError, match="'a'.*storage 'ssd'.*sharded"):
        DynamicEmbeddingBagCollection([t], CollectionSpec())
    with pytest.raises(ConfigError, match="precision"):
        TableConfig(name="a", rows=8, dim=4, kind="dynamic", storage="ssd", precision="bf16")
    with pytest.raises(ValueError, match="storage.dir"):
        DynamicCachedEmbeddingBagCollection([t], CollectionSpec())


def _cfg(run_dir: Path, storage: str, *extra: str) -> Any:
    from neorec.config import load_config

    where = f", storage='{storage}', cache_rows=36" if storage != "memory" else ""
    return load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=50, dim=8}, {name='d', rows=400, dim=8, "
            "kind='dynamic', capacity=40, eviction='lfu', admission='probability', "
            f"admit_probability=0.8, unadmitted='default_row'{where}}}]",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=32",
            "data.train_samples=640",
            "data.eval_samples=64",
            f"train.run_dir='{run_dir}'",
            f"storage.dir='{run_dir / 'store'}'",
            "train.progress=false",
            "train.eval_every=3",
            "checkpoint.fsync=false",
            "checkpoint.bits=32",
            "checkpoint.opt_bits=32",
            *extra,
        ]
    )


def test_trainer_checkpoint_resume_equals_in_memory(tmp_path: Path) -> None:
    """A run whose dynamic table is on SSD, interrupted and resumed from its Check-N-Run
    checkpoints (baseline + increments by raw id), ends where the in-memory run ends."""
    from neorec.train.trainer import Trainer

    ref = Trainer(_cfg(tmp_path / "ref", "memory", "train.steps=6"))
    want = ref.fit()
    ckpt = ["checkpoint.every_steps=2", "checkpoint.policy=consecutive"]
    Trainer(_cfg(tmp_path / "b", "ssd", "train.steps=5", *ckpt)).fit()  # last checkpoint: 4
    resumed = Trainer(
        _cfg(tmp_path / "b", "ssd", "train.steps=6", "checkpoint.resume=latest", *ckpt)
    )
    got = resumed.fit()
    assert isinstance(resumed.model.ebc.dynamic, DynamicCachedEmbeddingBagCollection)
    _same_state(
        ref.model.ebc.dynamic.export_table("d"), resumed.model.ebc.dynamic.export_table("d")
    )
    assert want["eval"] == got["eval"] and want["train"]["final_loss"] == got["train"]["final_loss"]
    st = resumed.model.ebc.stats()
    assert st["d"]["total"]["evicted"] > 0 and st["d"]["cache"]["misses"] > 0
    assert got["storage"]["hits"] == st["hits"] > 0  # the run summary reports the cache


@pytest.mark.parametrize(
    "storage,opt,pooling",
    [("ssd", "sgd", "sum"), ("ssd", "rowwise_adagrad", "mean"), ("dram", "adam", "sum")],
)
@pytest.mark.parametrize("policy", ["lru", "lfu-threshold-default"])
def test_batch_beyond_the_cache_spills(
    tmp_path: Path, storage: str, opt: str, pooling: str, policy: str
) -> None:
    """Batches whose slots do not fit the cache (3 rows; a batch uses up to 12) run in chunks
    that fit (``storage.spill``; they stopped the run with CacheCapacityError): the in-memory
    collection's outputs, rows, state and counters."""
    kw = POLICIES[policy]
    batches = _batches(0, 12, b=6)
    ref = _make("memory", opt, pooling, tmp_path, **kw)
    got = _make(storage, opt, pooling, tmp_path, cache_rows=3, **kw)
    for want, have in zip(_train(ref, batches), _train(got, batches)):
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)
    for t in ("a", "b"):
        a, b = ref.export_table(t), got.export_table(t)
        assert torch.equal(a.ids, b.ids) and a.step == b.step
        torch.testing.assert_close(b.rows, a.rows, rtol=1e-5, atol=1e-6)
    c = got.stats()["a"]["cache"]
    assert (
        c["spilled"] > 0 and c["resident"] <= 3 and int(got.slot_cache._cached[0].pins.sum()) == 0
    )
    got.close()


def test_new_slots_are_not_read_from_the_store(tmp_path: Path) -> None:
    """Admitted ids get their fresh rows in the cache directly (two dram/ssd tables): with every
    slot fitting the cache, nothing is ever read from the stores."""
    ts = [
        TableConfig(name=n, rows=64, dim=4, kind="dynamic", capacity=10, storage=st, cache_rows=10)
        for n, st in (("a", "ssd"), ("b", "dram"))
    ]
    got = DynamicCachedEmbeddingBagCollection(
        ts, CollectionSpec(), storage=StoreSettings(dir=tmp_path)
    )
    for j in range(6):  # 3 new ids a table a step: full after 4 steps, then evictions
        sp = SparseFeatures.from_lists({n: [[100 * j + k for k in range(3)]] for n in "ab"})
        out = got(sp)
        out.backward(torch.ones_like(out))
    st = got.stats()
    assert st["a"]["total"]["evicted"] > 0 and st["b"]["total"]["evicted"] > 0
    assert all(s.bytes_read == 0 for s in got.stores().values())
    assert st["misses"] == 2 * 10  # each slot filled once, fresh


def test_mixed_collection_forwards_flush_and_close(tmp_path: Path) -> None:
    """A fixed + dynamic collection flushes and closes both parts (it did neither)."""
    from neorec.builder import build_dlrm
    from neorec.config import load_config

    cfg = load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=10, dim=4, storage='dram', cache_rows=4}, "
            "{name='a', rows=16, dim=4, kind='dynamic', capacity=8, storage='ssd', "
            "cache_fraction=0.5}]",
            "model.bottom_mlp=[8, 4]",
            "model.top_mlp=[8, 1]",
            f"storage.dir='{tmp_path}'",
        ]
    )
    ebc: Any = build_dlrm(cfg).ebc
    calls: list[tuple[str, str]] = []
    for name in ("fixed", "dynamic"):
        part = getattr(ebc, name)
        for what in ("flush", "close"):
            inner = getattr(part, what)
            setattr(part, what, lambda w=what, n=name, f=inner: (calls.append((w, n)), f()))
    ebc.flush()
    ebc.close()
    assert calls[:2] == [("flush", "fixed"), ("flush", "dynamic")]
    assert {("close", "fixed"), ("close", "dynamic")} <= set(calls[2:])
