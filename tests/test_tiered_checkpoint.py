"""Check-N-Run checkpoints of tables behind the row cache (dram / ssd) equal those of the same
tables in memory: dirty rows tracked by global row across eviction and write-back, a snapshot that
is the table at its moment while training writes rows back, and save / restore across storage
settings (an ssd table's checkpoint restores into memory and back)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from neorec.builder import build_dlrm, dense_optimizer
from neorec.checkpoint import CheckpointManager, DirtyRowTracker, list_checkpoints, open_storage
from neorec.checkpoint.dynamic import dynamic_part, fixed_part
from neorec.config import TableConfig, load_config
from neorec.data.ids import zipf_ids
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.store import StoreSettings
from neorec.storage.tiered_rows import RowSnapshot
from neorec.train.trainer import train_step

pytestmark = pytest.mark.bitwise

TABLES = [
    TableConfig(name="a", rows=300, dim=8),
    TableConfig(name="b", rows=120, dim=8, features=["b1", "b2"]),
    TableConfig(name="c", rows=50, dim=8),
]


def _batches(n: int, seed: int = 0) -> list[SparseFeatures]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        vals, lens = [], []
        for t in TABLES:
            for _f in t.features:
                ln = torch.randint(0, 4, (16,), generator=g)
                vals.append(zipf_ids(t.rows, int(ln.sum()), 1.1, generator=g, salt=len(vals)))
                lens.append(ln)
        out.append(
            SparseFeatures(
                [f for t in TABLES for f in t.features], torch.cat(vals), torch.cat(lens)
            )
        )
    return out


def _train(model: torch.nn.Module, batches: list[SparseFeatures], seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in batches:
        out = model(b)
        out.backward(torch.randn(out.shape, generator=g))


def _cached(tmp_path: Path, kind: str = "rowwise_adagrad") -> CachedEmbeddingBagCollection:
    tables = [
        dataclasses.replace(t, storage=s, cache_rows=40)
        for t, s in zip(TABLES, ("ssd", "dram", "memory"), strict=True)
    ]
    spec = CollectionSpec(RowOptimizer(kind=kind, lr=0.05), backend="cpu", seed=3)
    return CachedEmbeddingBagCollection(tables, spec, storage=StoreSettings(dir=tmp_path))


def test_dirty_rows_tracked_by_global_row_across_eviction_and_write_back(tmp_path: Path) -> None:
    spec = CollectionSpec(RowOptimizer(kind="rowwise_adagrad", lr=0.05), backend="cpu", seed=3)
    ref, cached = EmbeddingBagCollection(TABLES, spec), _cached(tmp_path)
    t_ref, t_cached = DirtyRowTracker(ref), DirtyRowTracker(cached)
    batches = _batches(12)
    for lo in (0, 5):  # two takes: rows dirty since the last one only
        _train(ref, batches[lo : lo + 5])
        _train(cached, batches[lo : lo + 5])
        want, got = t_ref.take(), t_cached.take()
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
    st = cached.stats()
    assert st["evictions"] > 0 and st["writebacks"] > 0  # rows left the cache and came back


def _records(cached: CachedEmbeddingBagCollection, name: str) -> torch.Tensor:
    t = cached.read_table(name)  # (flushes)
    return torch.cat([t["weight"], t["momentum1"].unsqueeze(1)], 1)


def _read(snap: RowSnapshot) -> tuple[torch.Tensor, torch.Tensor]:
    got_ids, got = snap.read(0, 150)  # in two chunks
    more_ids, more = snap.read(150, 300)
    snap.close()
    return torch.cat([got_ids, more_ids]), torch.cat([got, more])


@pytest.mark.parametrize("subset", [False, True])
def test_snapshot_is_the_table_at_its_moment_while_rows_are_written_back(
    tmp_path: Path, subset: bool
) -> None:
    """Two snapshots of one table, overlapping (two checkpoint managers), each the table at its
    moment while training writes rows back to the store."""
    cached = _cached(tmp_path)
    batches = _batches(16)
    _train(cached, batches[:6])
    (c,) = [c for c in cached.cache_tables().values() if c.name == "a"]
    ids = torch.arange(0, 300, 3) if subset else None
    want = [_records(cached, "a")]
    snaps = [RowSnapshot(cached, c, ids)]
    _train(cached, batches[6:10], seed=2)  # rows updated, evicted, written back
    want.append(_records(cached, "a"))
    snaps.append(RowSnapshot(cached, c, ids))
    _train(cached, batches[10:], seed=3)
    cached.flush()
    now = _records(cached, "a")
    expect_ids = torch.arange(300) if ids is None else ids
    for snap, w in zip(snaps, want, strict=True):
        assert snap.stash_ids.numel() > 0, "no write-back of a row still to read: nothing tested"
        assert not torch.equal(now[expect_ids], w[expect_ids])  # the table moved on
        got_ids, got = _read(snap)
        assert torch.equal(got_ids, expect_ids)
        assert torch.equal(got, w[expect_ids])
    assert c.write_guards == []


# ---- the manager: mixed storage against all in memory ----------------------------------------
SETS = [
    "embedding.tables=[{name='s', rows=300, dim=8, storage='ssd', cache_rows=60}, "
    "{name='d', rows=200, dim=8, storage='dram', cache_rows=50}, {name='m', rows=100, dim=8}, "
    "{name='y', rows=500, dim=8, kind='dynamic', capacity=150, storage='ssd', cache_rows=60}]",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=32",
    "data.train_samples=640",
    "train.progress=false",
    "checkpoint.fsync=false",
    "checkpoint.bits=32",
    "checkpoint.opt_bits=32",
    "checkpoint.policy=consecutive",
    "embedding.optimizer=adam",  # two state fields of the rows' width (the e2e: row-wise Adagrad)
]


def _model(tmp_path: Path, tiered: bool, *extra: str):
    sets = [*SETS, f"storage.dir='{tmp_path / 'store'}'", *extra]
    if not tiered:
        sets[0] = (
            sets[0]
            .replace("storage='ssd'", "storage='memory'")
            .replace("storage='dram'", "storage='memory'")
        )
        for n in (60, 50):
            sets[0] = sets[0].replace(f", cache_rows={n}", "")
    cfg = load_config(overrides=sets)
    torch.manual_seed(0)
    model = build_dlrm(cfg)
    return cfg, model, dense_optimizer(cfg.train, model.dense_parameters())


_DATA: dict[int, object] = {}  # step -> batch (the same for every storage setting)


def _fit(cfg, model, opt, start: int, end: int) -> None:
    from neorec.data.synthetic import SyntheticClickData

    for s in range(start, end):
        if s not in _DATA:
            data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
            _DATA.update({i: data.batch("train", i, cfg.data.batch_size) for i in range(24)})
        train_step(model, opt, _DATA[s], s + 1)


def _tables(model) -> dict[str, torch.Tensor]:
    """Every table's rows and optimizer state (a dynamic table's by raw id, with its uses)."""
    fixed, out = fixed_part(model.ebc), {}
    for t in fixed.tables:
        if isinstance(fixed, CachedEmbeddingBagCollection):
            for k, v in fixed.read_table(t.name).items():
                out[f"{t.name}.{k}"] = v
            continue
        i, lay = fixed._table_index(t.name), fixed.layout
        out[f"{t.name}.weight"] = fixed.table_weight(t.name)
        for k, v in fixed.optimizer_state().items():
            rows = v[lay.row_offsets[i] : lay.row_offsets[i + 1]]
            out[f"{t.name}.{k}"] = rows if k == "momentum1" else lay.table(v, i)
    dyn = dynamic_part(model.ebc)
    for t in dyn.tables:
        st = dyn.export_table(t.name)
        order = torch.argsort(st.ids)
        for k, v in [("ids", st.ids), ("rows", st.rows), ("uses", st.uses), *st.states.items()]:
            out[f"{t.name}.{k}"] = v[order]
    return {k: v.clone() for k, v in out.items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), k


def _step(root: Path, step: int) -> str:
    hist = list_checkpoints(open_storage(str(root)))
    return str(root / next(m["name"] for m in hist if m["step"] == step))


def test_checkpoints_of_tiered_tables_equal_in_memory_and_restore_across_storage(
    tmp_path: Path,
) -> None:
    spec_cfg, spec, spec_opt = _model(tmp_path / "spec", tiered=False)
    cfg, model, opt = _model(tmp_path / "tier", tiered=True)
    assert isinstance(fixed_part(model.ebc), CachedEmbeddingBagCollection)
    assert isinstance(dynamic_part(model.ebc), DynamicCachedEmbeddingBagCollection)
    mgr = CheckpointManager(cfg.checkpoint, model, opt, str(tmp_path / "ck"))
    spec_mgr = CheckpointManager(spec_cfg.checkpoint, spec, spec_opt, str(tmp_path / "ck_mem"))
    at: dict[int, dict[str, torch.Tensor]] = {}
    for lo, hi in ((0, 4), (4, 9)):  # a baseline at 4, an increment at 9
        _fit(cfg, model, opt, lo, hi)
        _fit(spec_cfg, spec, spec_opt, lo, hi)
        at[hi] = _tables(spec)
        _assert_equal(_tables(model), at[hi])  # training through the cache is exact
        mgr.save(hi)  # in the background: the next steps train while it is read
        spec_mgr.save(hi)
    _fit(cfg, model, opt, 9, 14)
    mgr.close()
    spec_mgr.close()
    kinds = [m["kind"] for m in list_checkpoints(open_storage(str(tmp_path / "ck")))]
    assert kinds == ["baseline", "increment"]

    # the tiered checkpoint of step 9 into memory tables, and the in-memory one into tiered ones
    # (their caches warm from other training first: the restore leaves them cold)
    _, mem, mem_opt = _model(tmp_path / "r1", tiered=False)
    CheckpointManager(spec_cfg.checkpoint, mem, mem_opt, str(tmp_path / "x1")).restore(
        _step(tmp_path / "ck", 9)
    )
    _, tier, tier_opt = _model(tmp_path / "r2", tiered=True)
    _fit(cfg, tier, tier_opt, 20, 23)
    CheckpointManager(cfg.checkpoint, tier, tier_opt, str(tmp_path / "x2")).restore(
        _step(tmp_path / "ck_mem", 9)
    )
    assert all(c.n_free == c.capacity for c in fixed_part(tier.ebc).cache_tables().values())
    _assert_equal(_tables(mem), at[9])
    _assert_equal(_tables(tier), at[9])
    # ... and both train on alike
    _fit(cfg, tier, tier_opt, 9, 12)
    _fit(spec_cfg, mem, mem_opt, 9, 12)
    _assert_equal(_tables(tier), _tables(mem))


def test_checkpoints_of_tiered_tables_are_accepted(tmp_path: Path) -> None:
    from neorec.builder.run import check_run

    check_run(load_config(None, [*SETS, "checkpoint.every_steps=10"]))  # (refused before)


def test_saved_model_of_tiered_tables_holds_their_rows(tmp_path: Path) -> None:
    """``save_model`` of dram / ssd tables stores their rows (it stored the cache's slots as if
    they were the table's rows), and ``load_model`` reads them into memory tables."""
    from neorec.serve import load_model, save_model

    cfg, model, opt = _model(tmp_path, tiered=True)
    _fit(cfg, model, opt, 0, 4)
    want = _tables(model)
    save_model(model, cfg, tmp_path / "model")
    loaded, _ = load_model(tmp_path / "model")
    got = _tables(loaded)
    rows = [k for k in want if k.endswith((".weight", ".ids", ".rows", ".uses"))]
    _assert_equal({k: got[k] for k in rows}, {k: want[k] for k in rows})
