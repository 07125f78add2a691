"""Sharded dynamic tables on DRAM / SSD (issue 44): each rank's slot rows in its own store
(``<storage.dir>/rank<r>``) behind a row cache smaller than the rank's slots, so rows are evicted
to the store and read back. 2 gloo ranks built by ``neorec.builder.sharded_collection`` train
bitwise what the in-memory sharded module trains, and what the unsharded in-memory
``DynamicEmbeddingBagCollection`` (the specification) trains on the same global batches (as
``tests/test_dynamic_sharded.py`` claims it: tables bitwise with sum pooling, else to 1e-5);
their checkpoint by id restores in one process and trains on like the uninterrupted run;
``neorec train --nproc 2`` checkpoints and resumes in one process."""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from faults import campaign, run_cli

from neorec.builder import collection_spec
from neorec.distributed.dynamic_reshard import TableShard, merge_table_shards, owner_of
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection
from neorec.modules.collection import CollectionSpec
from neorec.sparse import SparseFeatures
from neorec.storage.dynamic import DynamicEmbeddingBagCollection
from neorec.storage.dynamic_state import DynamicTableState
from neorec.storage.store import StoreSettings

B, STEPS, EXTRA = 4, 10, 4  # global batch; steps before the checkpoint; steps after a restore
_R = random.Random(7)
POOL = [_R.randrange(-(2**63), 2**63) for _ in range(24)]  # raw ids, any int64
_T = "kind='dynamic', dim=8, rows=64"
VARIANTS = {
    # a on dram beside b in memory, one init bound: one cached part per rank, b in its fast tier
    "dram": (
        f"[{{name='a', features=['f', 'g'], capacity=80, storage='dram', cache_rows=CACHE, {_T}}}, "
        f"{{name='b', features=['h'], capacity=80, {_T}}}]",
        ["embedding.pooling='sum'"],
    ),
    # both on ssd, two init bounds (two cached parts per rank), mean pooling, probability
    # admission, the default row
    "ssd": (
        f"[{{name='a', features=['f', 'g'], capacity=80, storage='ssd', cache_rows=CACHE, "
        f"admission='probability', admit_probability=0.7, unadmitted='default_row', {_T}}}, "
        f"{{name='b', features=['h'], capacity=72, storage='ssd', cache_fraction=0.25, "
        f"cache_policy='lfu', {_T}}}]",
        ["embedding.pooling='mean'", "embedding.optimizer='sgd'", "embedding.lr=0.3"],
    ),
}
TABLES = ("a", "b")


def _cfg(name: str, store: Path, cache: int = 6) -> Any:
    """Table a's cache: ``cache`` rows (6: under the ids each of 2 ranks owns, over what a step
    of 2 ranks reads; 10: what a step reads in one process)."""
    from neorec.config import load_config

    tables, extra = VARIANTS[name]
    return load_config(
        overrides=[
            f"embedding.tables={tables.replace('CACHE', str(cache))}",
            "model.bottom_mlp=[16, 8]",
            f"storage.dir='{store}'",
            "train.seed=3",
            *extra,
        ]
    )


def _in_memory(cfg: Any, sharded: bool) -> Any:
    """The config's dynamic tables in memory: the sharded module, or the unsharded one."""
    ts = [replace(t, storage="memory") for t in cfg.embedding.tables]
    cls = ShardedDynamicEmbeddingBagCollection if sharded else DynamicEmbeddingBagCollection
    return cls(ts, collection_spec(cfg))


def _cached(cfg: Any) -> Any:
    """The config's sharded collection, as a run builds it."""
    from neorec.builder import sharded_collection

    m = sharded_collection(cfg, None)  # type: ignore[arg-type]  # (no fixed tables: no plan)
    assert isinstance(m, ShardedDynamicEmbeddingBagCollection)
    return m


def global_batch(step: int) -> tuple[SparseFeatures, torch.Tensor]:
    """Step ``step``'s B samples (0-2 ids a bag from 24, per-id weights) and the loss gradient."""
    rng = random.Random(step)
    feats = {k: [rng.sample(POOL, rng.randint(0, 2)) for _ in range(B)] for k in "fgh"}
    w = {k: [[rng.uniform(0.5, 1.5) for _ in bag] for bag in bags] for k, bags in feats.items()}
    g = torch.randn(B, 24, generator=torch.Generator().manual_seed(100 + step))
    return SparseFeatures.from_lists(feats, w), g


def train(m: Any, steps: range, rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """This rank's slice of each global batch; the loss scaled by W (the sharded backward's 1/W)."""
    b = B // world
    outs = []
    for step in steps:
        sp, g = global_batch(step)
        out = m(sp.select_samples(rank * b, (rank + 1) * b))
        (out * (g[rank * b : (rank + 1) * b] * world)).sum().backward()
        outs.append(out.detach().clone())
    return outs


def _ranks(rank: int, world: int, out: str) -> None:
    res: dict[str, Any] = {}
    for name in VARIANTS:
        cfg = _cfg(name, Path(out) / name)
        cached, mem = _cached(cfg), _in_memory(cfg, True)
        r: dict[str, Any] = {"outs": train(cached, range(1, STEPS + 1), rank, world)}
        r["mem_outs"] = train(mem, range(1, STEPS + 1), rank, world)
        r["stats"], r["global"] = cached.local_stats(), cached.stats()
        r["parts"] = [type(p).__name__ for p in cached.parts]
        for key, m in (("shards", cached), ("mem_shards", mem)):
            r[key] = {t: m.export_shard(t).to_dict() for t in TABLES}
        cached.close()
        res[name] = r
    torch.save(res, os.path.join(out, f"r{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = tmp_path_factory.mktemp("dyn_store")
    run_ranks(_ranks, 2, str(d))
    return d, [torch.load(d / f"r{r}.pt", weights_only=False) for r in range(2)]


_REF: dict[tuple[str, int], tuple[Any, list[torch.Tensor]]] = {}


def reference(name: str, steps: int, store: Path) -> tuple[Any, list[torch.Tensor]]:
    """The unsharded in-memory collection after ``steps`` steps of the global batches."""
    if (name, steps) not in _REF:
        m = _in_memory(_cfg(name, store), False)
        _REF[(name, steps)] = (m, train(m, range(1, steps + 1)))
    return _REF[(name, steps)]


def _same(got: DynamicTableState, want: DynamicTableState, bitwise: bool, where: str) -> None:
    """Ids and map bookkeeping exactly; rows, optimizer state and default row bitwise or close."""
    for k in ("ids", "uses", "last_use"):
        assert torch.equal(getattr(got, k), getattr(want, k)), f"{where}: {k}"
    assert got.step == want.step, where
    pairs = [("rows", got.rows, want.rows)] + [
        (k, got.states[k], want.states[k]) for k in want.states
    ]
    if want.default_row is not None:
        assert got.default_row is not None, where
        pairs.append(("default row", got.default_row, want.default_row))
    for what, a, b in pairs:
        if bitwise:
            assert torch.equal(a, b), f"{where}: {what} not bitwise equal"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{where}: {what}")


def _shards(results: list[dict[str, Any]], name: str, key: str, t: str) -> list[TableShard]:
    return [TableShard.from_dict(r[name][key][t]) for r in results]


@pytest.mark.bitwise
@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_ranks_on_stores_equal_in_memory(runs: tuple, name: str) -> None:
    d, results = runs
    ref, ref_outs = reference(name, STEPS, d)
    sum_pooling = name == "dram"
    for rank, r in enumerate(res[name] for res in results):
        want_parts = ["DynamicCachedEmbeddingBagCollection"] * (1 if name == "dram" else 2)
        assert r["parts"] == want_parts, r["parts"]
        for step, (got, mem, want) in enumerate(zip(r["outs"], r["mem_outs"], ref_outs)):
            where = f"{name} rank {rank} step {step + 1}"
            assert torch.equal(got, mem), f"{where}: output differs from the in-memory sharded"
            torch.testing.assert_close(got, want[rank * 2 : rank * 2 + 2], rtol=1e-5, atol=1e-6)
        for t in TABLES:  # this rank's ids, rows, state: bitwise the in-memory sharded module's
            got, mem = (TableShard.from_dict(r[k][t]).state for k in ("shards", "mem_shards"))
            assert bool((owner_of(got.ids, 2) == rank).all())
            _same(got, mem, True, f"{name} rank {rank} table {t} vs in-memory sharded")
        # the cache is smaller than the rank's slots: rows went to the store and came back
        a = r["stats"]["a"]["cache"]
        assert a["evictions"] > 0 and a["writebacks"] > 0 and a["misses"] > a["capacity"], a
        storage = "dram" if name == "dram" else "ssd"
        assert r["stats"][f"{storage}_bytes_read"] > 0
        assert r["global"]["a"]["cache"] == a and r["global"]["hits"] == r["stats"]["hits"]
        if name == "ssd":
            assert (d / name / f"rank{rank}" / "a.rows").is_file()
            assert (d / name / f"rank{rank}" / "b.rows").is_file()
    for t in TABLES:
        want = ref.export_table(t)
        got = merge_table_shards(_shards(results, name, "shards", t))
        _same(got, want, sum_pooling, f"{name} table {t} vs unsharded")
        assert results[0][name]["global"][t]["occupancy"] == want.ids.numel() > 10
        assert results[0][name]["global"][t]["total"] == ref.stats()[t]["total"]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_rank_checkpoint_restores_in_one_process(
    runs: tuple, name: str, tmp_path: Path
) -> None:
    """The 2-rank shards imported by the same collection built for one process (its store
    behind a small cache): ids, rows, optimizer state and map equal; training on equals the
    uninterrupted unsharded run (bitwise with sum pooling)."""
    d, results = runs
    one = _cached(_cfg(name, tmp_path, cache=10))
    assert one.world == 1 and one.host_resident
    for t in TABLES:
        shards = _shards(results, name, "shards", t)
        one.import_table(t, shards)
        _same(one.export_table(t), merge_table_shards(shards), True, f"{name} 2->1 import {t}")
    outs = train(one, range(STEPS + 1, STEPS + EXTRA + 1))
    ref, ref_outs = reference(name, STEPS + EXTRA, d)
    for got, want in zip(outs, ref_outs[STEPS:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for t in TABLES:
        _same(one.export_table(t), ref.export_table(t), name == "dram", f"{name} 2->1 on {t}")
    one.close()


def _spill_ranks(rank: int, world: int, out: str) -> None:
    cfg = _cfg("dram", Path(out) / "spill", cache=2)  # a rank's step needs up to 8 slots of a
    cached = _cached(cfg)
    r: dict[str, Any] = {"outs": train(cached, range(1, STEPS + 1), rank, world)}
    r["stats"] = cached.local_stats()
    r["shards"] = {t: cached.export_shard(t).to_dict() for t in TABLES}
    cached.close()
    torch.save(r, os.path.join(out, f"s{rank}.pt"))


def test_two_ranks_batch_beyond_the_cache(tmp_path: Path) -> None:
    """A rank's slots of one step outnumber its row cache (2 rows): the step runs in chunks that
    fit (``storage.spill``; it stopped the run with CacheCapacityError) and the 2 ranks train
    what the unsharded in-memory specification trains (outputs and tables to rounding)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(_spill_ranks, 2, str(tmp_path))
    results = [torch.load(tmp_path / f"s{r}.pt", weights_only=False) for r in range(2)]
    ref, ref_outs = reference("dram", STEPS, tmp_path)
    for rank, r in enumerate(results):
        for got, want in zip(r["outs"], ref_outs):
            torch.testing.assert_close(got, want[rank * 2 : rank * 2 + 2], rtol=1e-5, atol=1e-6)
        a = r["stats"]["a"]["cache"]
        assert a["spilled"] > 0 and a["capacity"] == 2, a
    for t in TABLES:
        got = merge_table_shards([TableShard.from_dict(r["shards"][t]) for r in results])
        _same(got, ref.export_table(t), False, f"spill table {t} vs unsharded")


CLI = [
    "embedding.tables=[{name='x', rows=40, dim=8}, {name='e', rows=300, dim=8, kind='dynamic', "
    "capacity=400, storage='ssd', cache_rows=40}, {name='g', rows=200, dim=8, kind='dynamic', "
    "capacity=300, eviction='lfu', storage='dram', cache_fraction=0.2}]",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=32",
    "data.train_samples=512",
    "data.eval_samples=64",
    "train.threads=1",
    "train.eval_every=100",
    "train.progress=false",
    "checkpoint.fsync=false",
    "checkpoint.bits=32",
    "checkpoint.opt_bits=32",
    "checkpoint.every_steps=2",
    "checkpoint.policy=consecutive",
]


def test_cli_two_ranks_on_stores_resume_in_one_process(tmp_path: Path) -> None:
    """``neorec train --nproc 2`` with an ssd and a dram dynamic table checkpoints (to step 4 of
    5); resumed in one process to step 6 it equals one uninterrupted in-memory process (ids,
    uses, last use exactly; rows and optimizer state to 1e-5: sum pooling, no eviction)."""
    from neorec.config import load_config
    from neorec.train.trainer import Trainer

    run = tmp_path / "two"
    sets = [*CLI, f"train.run_dir='{run}'", f"storage.dir='{run / 'store'}'"]
    argv = ["train", "--nproc", "2", "--set", "train.steps=5"]
    for s in sets:
        argv += ["--set", s]
    r = run_cli(argv, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert {p.name for p in (run / "store").iterdir()} == {"rank0", "rank1"}
    resumed = Trainer(load_config(overrides=[*sets, "train.steps=6", "checkpoint.resume=latest"]))
    resumed.fit()
    assert resumed.state.resumed_step == 4
    memory = CLI[0].replace("storage='ssd'", "storage='memory'")
    memory = memory.replace("storage='dram'", "storage='memory'")
    straight = Trainer(
        load_config(
            overrides=[*CLI, memory, f"train.run_dir='{tmp_path / 'one'}'", "train.steps=6"]
        )
    )
    straight.fit()
    for t in ("e", "g"):
        got = resumed.model.ebc.dynamic.export_table(t)
        want = straight.model.ebc.dynamic.export_table(t)
        _same(got, want, False, f"cli resume {t}")
        assert got.totals == want.totals and got.ids.numel() > 50


def test_faults_dynamic_sharded_store(tmp_path: Path) -> None:
    c = campaign("dynamic_sharded")
    afile = tmp_path / "a_file"
    afile.write_text("not a folder")
    c.expect_error(
        "store folder cannot be created",
        lambda: _cached(_cfg("ssd", afile)),
        ("rank 0", "rank0", "cannot be created", "storage.dir"),
    )
    cfg = _cfg("ssd", tmp_path)
    ts = [replace(t, storage="ssd") for t in cfg.embedding.tables]
    c.expect_error(
        "ssd without a storage directory",
        lambda: ShardedDynamicEmbeddingBagCollection(ts, CollectionSpec(), storage=StoreSettings()),
        ("'a'", "ssd", "storage.dir"),
    )
    m = _cached(_cfg("dram", tmp_path, cache=10))
    big = SparseFeatures.from_lists({"f": [POOL[:12]], "g": [[]], "h": [[]]})
    m(big).sum().backward()  # beyond the rank's cache: in chunks (it was refused)
    spilled = m.local_stats()["a"]["cache"]["spilled"]
    c.record("a batch beyond a rank's cache", "handled" if spilled else "crash", str(spilled))
    pins = [int(p.sum()) for part in m.parts for p in part._pins]
    if any(pins):
        c.record("slots pinned after a spilled batch", "data lost", str(pins))
    out = m(SparseFeatures.from_lists({"f": [POOL[:3]], "g": [[]], "h": [[]]}))
    out.sum().backward()  # trains on after it
    c.record("trains after it", "handled" if int(m.step) == 2 else "crash")
    c.check()
