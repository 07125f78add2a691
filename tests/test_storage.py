"""Memory hierarchy: training through the row cache equals the all-in-memory module, bitwise."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path

import pytest
import torch

from neorec.config import TableConfig
from neorec.data.ids import zipf_ids
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops import settings
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage import cache_ops, rowio
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.store import HEADER_BYTES, SsdStore, StoreError, StoreSettings, record_fields

# Bitwise equalities: make test-isa reruns them under every other vector ISA of the CPU.
pytestmark = pytest.mark.bitwise

TABLES = [
    TableConfig(name="a", rows=300, dim=8),
    TableConfig(name="b", rows=120, dim=8, features=["b1", "b2"]),
    TableConfig(name="c", rows=50, dim=8),
]
BATCH = 16


def _batches(n: int, seed: int = 0, weighted: bool = False) -> list[SparseFeatures]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        vals, lens = [], []
        for t in TABLES:
            for _f in t.features:
                ln = torch.randint(0, 4, (BATCH,), generator=g)
                vals.append(zipf_ids(t.rows, int(ln.sum()), 1.1, generator=g, salt=len(vals)))
                lens.append(ln)
        values, lengths = torch.cat(vals), torch.cat(lens)
        w = torch.rand(values.numel(), generator=g) if weighted else None
        keys = [f for t in TABLES for f in t.features]
        out.append(SparseFeatures(keys, values, lengths, w))
    return out


def _with(storage: str, cache_rows: int, policy: str) -> list[TableConfig]:
    # table c stays in memory: one collection mixes cached and plain tables
    return [
        t
        if t.name == "c"
        else dataclasses.replace(t, storage=storage, cache_rows=cache_rows, cache_policy=policy)
        for t in TABLES
    ]


def _train(model: torch.nn.Module, batches: list[SparseFeatures], seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for b in batches:
        out = model(b)
        out.backward(torch.randn(out.shape, generator=g))


def _reference_state(ref: EmbeddingBagCollection, name: str) -> dict[str, torch.Tensor]:
    i = ref._table_index(name)
    out = {"weight": ref.table_weight(name)}
    for k, s in ref.optimizer_state().items():
        if k == "momentum1":
            out[k] = s[ref.layout.row_offsets[i] : ref.layout.row_offsets[i + 1]]
        else:
            out[k] = ref.layout.table(s, i)
    return out


def _assert_same(cached: CachedEmbeddingBagCollection, ref: EmbeddingBagCollection) -> None:
    for t in TABLES:
        got, want = cached.read_table(t.name), _reference_state(ref, t.name)
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), f"table {t.name} {k} differs"


@pytest.mark.parametrize(
    ("kind", "storage", "cache_rows", "policy"),
    [
        ("sgd", "dram", 40, "lru"),
        ("rowwise_adagrad", "dram", 40, "lfu"),
        ("rowwise_adagrad", "ssd", 40, "lru"),
        ("adam", "ssd", 60, "lfu"),
        ("adam", "dram", 1000, "lru"),  # larger than the table: never evicts
        ("rowwise_adagrad", "ssd", -1, "lru"),  # tiny: the most distinct rows of one batch
        ("adam", "dram", -1, "lfu"),
    ],
)
def test_cache_training_equals_memory(tmp_path, kind, storage, cache_rows, policy):
    opt = RowOptimizer(kind=kind, lr=0.05)
    batches = _batches(8)
    spec = CollectionSpec(opt, backend="cpu", seed=3)
    ref = EmbeddingBagCollection(TABLES, spec)
    rows = cache_rows if cache_rows > 0 else _max_distinct(batches)
    cached = CachedEmbeddingBagCollection(
        _with(storage, rows, policy), spec, storage=StoreSettings(dir=tmp_path)
    )
    _train(ref, batches)
    _train(cached, batches)
    _assert_same(cached, ref)
    st = cached.stats()
    assert st["misses"] > 0 and st["hits"] > 0
    assert st["evictions"] > 0 or cache_rows == 1000


def _max_distinct(batches: list[SparseFeatures]) -> int:
    """Most distinct rows one batch reads from one table (the smallest workable cache)."""
    best = 0
    for b in batches:
        for t in TABLES:
            ids = torch.cat([b.values[_feature_slice(b, f)] for f in t.features])
            best = max(best, torch.unique(ids).numel())
    return best


def _feature_slice(b: SparseFeatures, f: str) -> slice:
    nb = b.lengths.numel() // len(b.keys)
    k = b.keys.index(f)
    start = int(b.lengths[: k * nb].sum())
    return slice(start, start + int(b.lengths[k * nb : (k + 1) * nb].sum()))


def test_reference_backend_mean_pooling_weights_and_eval(tmp_path):
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.1)
    batches = _batches(5, seed=4, weighted=True)
    spec = CollectionSpec(opt, pooling="mean", backend="reference", seed=1)
    ref = EmbeddingBagCollection(TABLES, spec)
    stores = StoreSettings(dir=tmp_path)
    cached = CachedEmbeddingBagCollection(_with("ssd", 45, "lru"), spec, storage=stores)
    _train(ref, batches)
    _train(cached, batches)
    with torch.no_grad():  # eval goes through the cache too, and equals the reference
        for b in _batches(3, seed=9, weighted=True):
            assert torch.equal(cached(b), ref(b))
    _assert_same(cached, ref)


def test_prefetch_pipeline_equals_memory(tmp_path):
    opt = RowOptimizer(kind="adam", lr=0.05)
    batches = _batches(8, seed=5)
    spec = CollectionSpec(opt, backend="cpu")
    ref = EmbeddingBagCollection(TABLES, spec)
    cached = CachedEmbeddingBagCollection(
        _with("ssd", 50, "lfu"), spec, storage=StoreSettings(dir=tmp_path)
    )
    _train(ref, batches)
    g = torch.Generator().manual_seed(1)
    for i, b in enumerate(batches):
        out = cached(b)
        if i + 1 < len(batches):
            cached.prefetch(batches[i + 1])  # reads while this batch's backward runs
        out.backward(torch.randn(out.shape, generator=g))
    assert cached.stats()["staged"] > 0
    _assert_same(cached, ref)


@pytest.mark.parametrize(
    ("kind", "storage", "pooling", "weighted"),
    [
        ("sgd", "dram", "sum", False),
        ("adam", "ssd", "mean", True),
        ("rowwise_adagrad", "ssd", "sum", True),
    ],
)
def test_batch_beyond_the_cache_spills(tmp_path, kind, storage, pooling, weighted):
    """A batch needing more distinct rows than the cache holds runs in chunks that fit
    (``storage.spill``; it stopped the run with CacheCapacityError): the same model as in
    memory, the pooled outputs within rounding (rows added in another order)."""
    batches = _batches(6, weighted=weighted)
    small = max(2, _max_distinct(batches) // 3)
    spec = CollectionSpec(RowOptimizer(kind=kind, lr=0.05), pooling, backend="cpu", seed=3)
    ref = EmbeddingBagCollection(TABLES, spec)
    cached = CachedEmbeddingBagCollection(
        _with(storage, small, "lru"), spec, storage=StoreSettings(dir=tmp_path)
    )
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for b in batches:
        want, got = ref(b), cached(b)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        want.backward(torch.randn(want.shape, generator=g1))
        got.backward(torch.randn(got.shape, generator=g2))
    with torch.no_grad():  # eval spills too
        torch.testing.assert_close(cached(batches[0]), ref(batches[0]), rtol=1e-6, atol=1e-6)
    st = cached.stats()
    assert st["spilled"] >= len(batches) and st["tables"]["a"]["resident"] <= small
    for t in TABLES:
        got_t, want_t = cached.read_table(t.name), _reference_state(ref, t.name)
        for k in want_t:
            torch.testing.assert_close(got_t[k], want_t[k], rtol=1e-5, atol=1e-6)
    cached.close()


def test_eviction_writes_back_before_flush(tmp_path):
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05)
    batches = _batches(8, seed=2)
    spec = CollectionSpec(opt, backend="cpu")
    ref = EmbeddingBagCollection(TABLES, spec)
    cached = CachedEmbeddingBagCollection(
        _with("ssd", 40, "lru"), spec, storage=StoreSettings(dir=tmp_path)
    )
    _train(ref, batches)
    _train(cached, batches)
    assert cached.stats()["writebacks"] > 0
    for name, store in cached.stores().items():
        c = next(c for c in cached._cached.values() if c.name == name)
        gone = torch.nonzero(c.slot_of < 0).flatten()  # rows not resident: the store is current
        rec = store.read(gone)
        want = _reference_state(ref, name)
        assert torch.equal(rec[:, :8], want["weight"][gone])
        assert torch.equal(rec[:, 8], want["momentum1"][gone])
    cached.flush()
    for name in ("a", "b"):  # after flush the file alone holds the trained table
        st = SsdStore.open(tmp_path / f"{name}.rows", record_fields("rowwise_adagrad", 8))
        assert st.clean
        rec = st.read(torch.arange(st.rows))
        assert torch.equal(rec[:, :8], ref.table_weight(name))
        st.close()


def _small_store(path: Path) -> SsdStore:
    fields = record_fields("sgd", 4)
    return SsdStore.create(
        path, 10, fields, lambda lo, hi: torch.arange(lo, hi).float()[:, None].expand(-1, 4)
    )


def test_missing_truncated_and_unclean_files(tmp_path):
    with pytest.raises(StoreError, match="not found"):
        SsdStore.open(tmp_path / "nope.rows")
    path = tmp_path / "s.rows"
    _small_store(path).close()
    with open(path, "r+b") as fh:
        fh.truncate(HEADER_BYTES + 9 * 16 + 3)
    with pytest.raises(StoreError, match="truncated"):
        SsdStore.open(path)
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(StoreError, match="not a neorec row store"):
        SsdStore.open(path)
    st = _small_store(path)
    st.write(torch.tensor([3]), torch.ones(1, 4))  # written, never flushed: a crash here
    st.close()
    with pytest.raises(StoreError, match="after its last flush"):
        SsdStore.open(path)
    assert not SsdStore.open(path, allow_unclean=True).clean


def test_store_truncated_while_open_is_a_clear_error(tmp_path):
    st = SsdStore.create(
        tmp_path / "t.rows", 10, record_fields("sgd", 4), lambda lo, hi: torch.zeros(hi - lo, 4)
    )
    os.truncate(st.path, HEADER_BYTES + 16 * 5)
    with pytest.raises(StoreError, match="truncated or damaged"):
        st.read(torch.tensor([8]))


def test_store_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(StoreError, match=r"row store folder .*file/sub cannot be created.*storage"):
        SsdStore.create(
            tmp_path / "file" / "sub" / "t.rows", 10, record_fields("sgd", 4),
            lambda lo, hi: torch.zeros(hi - lo, 4),
        )  # fmt: skip


def test_disk_full_on_create_keeps_the_old_store(tmp_path, monkeypatch):
    path = tmp_path / "s.rows"
    _small_store(path).close()
    before = path.read_bytes()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StoreError, match="disk is full.*unchanged"):
        _small_store(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["s.rows"]  # no temporary left behind


def test_disk_full_on_write_back_loses_nothing(tmp_path, monkeypatch):
    import neorec.storage.store as store_mod

    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05)
    batches = _batches(8, seed=6)
    spec = CollectionSpec(opt, backend="cpu")
    ref = EmbeddingBagCollection(TABLES, spec)
    cached = CachedEmbeddingBagCollection(
        _with("ssd", 40, "lru"), spec, storage=StoreSettings(dir=tmp_path)
    )
    _train(ref, batches)
    _train(cached, batches[:4])
    cached.flush()
    flushed = (tmp_path / "a.rows").read_bytes()
    real = store_mod._write_mapped

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod, "_write_mapped", full)
    with pytest.raises(StoreError, match="disk is full"):
        _train(cached, batches[4:], seed=99)  # evictions need write-backs
        cached.flush()
    assert (tmp_path / "a.rows").read_bytes()[HEADER_BYTES:] == flushed[HEADER_BYTES:]
    monkeypatch.setattr(store_mod, "_write_mapped", real)
    cached.flush()  # the dirty rows were kept: nothing lost once there is space again


def test_config_and_build_dlrm_choose_the_cache(tmp_path):
    from neorec.builder import build_dlrm
    from neorec.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="storage"):
        TableConfig(name="x", rows=10, dim=4, storage="tape")
    with pytest.raises(ConfigError, match="not both"):
        TableConfig(name="x", rows=10, dim=4, cache_rows=3, cache_fraction=0.5)
    sets = ["model.bottom_mlp=[8, 4]", f"storage.dir='{tmp_path}'"]
    tables = (
        "[{name='a', rows=500, dim=4, storage='ssd', cache_rows=64}, {name='b', rows=40, dim=4}]"
    )
    cfg = load_config(None, [*sets, f"embedding.tables={tables}"])
    model = build_dlrm(cfg)
    assert isinstance(model.ebc, CachedEmbeddingBagCollection)
    assert (tmp_path / "a.rows").exists() and not (tmp_path / "b.rows").exists()


def test_expected_hit_rate():
    from neorec.sharding.hit_rate import expected_hit_rate

    p = 1.0 / torch.arange(1, 3001, dtype=torch.float64) ** 1.05
    exact_lfu = float(p[:300].sum() / p.sum())
    assert expected_hit_rate(3000, 0.1, 1.05, "lfu") == pytest.approx(exact_lfu, rel=1e-6)
    lru = [expected_hit_rate(10**6, f, None, "lru") for f in (0.01, 0.05, 0.1, 0.25)]
    assert lru == sorted(lru) and 0 < lru[0] < lru[-1] < 1
    assert expected_hit_rate(100, 1.0, 1.0) == 1.0


def test_rowio_pread_paths_match_the_mapped_read(tmp_path, monkeypatch):
    # rowio (pread) is the measured alternative to the mapped reads (bench cache --io).
    st = SsdStore.create(
        tmp_path / "r.rows", 50, record_fields("adam", 4), lambda lo, hi: torch.rand(hi - lo, 12)
    )
    ids = torch.tensor([0, 1, 2, 7, 30, 31, 49])
    mapped = st.read(ids)
    for mode in ("native", "python"):
        if mode == "python":
            monkeypatch.setattr(settings, "NATIVE", False)
        got = torch.empty_like(mapped)
        rowio.read_records(st.fd, ids, st.record_bytes, HEADER_BYTES, got, 2)
        assert torch.equal(got, mapped), mode
    assert rowio.native_available() in (True, False)


def _cache_state(cached: CachedEmbeddingBagCollection) -> dict[str, object]:
    out: dict[str, object] = {}
    for i, c in cached._cached.items():
        for k in ("slot_of", "id_of", "key", "dirty", "pins", "free"):
            out[f"{i}.{k}"] = getattr(c, k).clone()
        out[f"{i}.n_free"] = c.n_free
        out[f"{i}.counts"] = dict(c.counts)
    out["weights"] = cached.weights.clone()
    for k, v in cached.optimizer_state().items():
        out[k] = v.clone()
    return out


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_compiled_bookkeeping_takes_the_torch_paths_decisions(tmp_path, monkeypatch, policy):
    # Same misses, victims, slots and counters, step by step, with prefetch, compiled or not.
    if cache_ops.native() is None:
        pytest.skip("no C compiler: only the torch bookkeeping exists")
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05)
    batches = _batches(10, seed=11)
    rows = _max_distinct(batches) + 3
    runs = []
    for native in ("1", "0"):
        monkeypatch.setattr(settings, "NATIVE", native == "1")
        cached = CachedEmbeddingBagCollection(
            _with("ssd", rows, policy),
            CollectionSpec(opt, backend="cpu"),
            storage=StoreSettings(dir=tmp_path / native),
        )
        g = torch.Generator().manual_seed(1)
        states = []
        for i, b in enumerate(batches):
            out = cached(b)
            if i % 3 and i + 1 < len(batches):
                cached.prefetch(batches[i + 1])
            out.backward(torch.randn(out.shape, generator=g))
            states.append(_cache_state(cached))
        runs.append(states)
    for step, (a, b) in enumerate(zip(*runs, strict=True)):
        for k in a:
            same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
            assert same, f"step {step}: {k} differs between compiled and torch bookkeeping"


@pytest.mark.parametrize("native", ["1", "0"])
def test_copy_rows_matches_indexing(monkeypatch, native):
    monkeypatch.setattr(settings, "NATIVE", native == "1")
    g = torch.Generator().manual_seed(0)
    src = torch.rand(40, 7, generator=g)
    wide = torch.zeros(30, 10)
    dst = wide[:, 2:9]  # a column block: rows strided
    sidx = torch.tensor([3, 0, 39, 5, 5])
    didx = torch.tensor([1, -1, 29, 0, 7])  # -1 skips
    cache_ops.copy_rows(src, sidx, dst, didx)
    want = torch.zeros(30, 10)
    keep = didx >= 0
    want[didx[keep], 2:9] = src[sidx[keep]]
    assert torch.equal(wide, want)
    flat = torch.zeros(6)
    cache_ops.copy_rows(torch.arange(4.0).unsqueeze(1), None, flat, torch.tensor([5, 0, 2, 3]))
    assert flat.tolist() == [1.0, 0.0, 2.0, 3.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="row widths differ"):
        cache_ops.copy_rows(src, None, torch.zeros(40, 6), None)


def test_store_unmaps_its_pages_when_the_file_rss_passes_the_budget(tmp_path, monkeypatch):
    import neorec.storage.store as store_mod

    st = _small_store(tmp_path / "s.rows")
    st.mapped_budget = 1 << 20
    dropped = []
    monkeypatch.setattr(st, "drop_mapped_pages", lambda: dropped.append(True))
    monkeypatch.setattr(store_mod, "_file_rss_bytes", lambda: 10 << 20)
    st.read(torch.arange(8))  # over the budget after the copy: unmapped
    assert dropped
    dropped.clear()
    st.write(torch.arange(3), torch.zeros(3, 4))  # writes check too
    assert dropped
    dropped.clear()
    monkeypatch.setattr(store_mod, "_file_rss_bytes", lambda: 100)  # under the budget
    st.read(torch.arange(8))
    st.write(torch.arange(3), [(torch.zeros(5, 4), torch.tensor([4, 0, 2]))])
    assert not dropped
    assert torch.equal(st.read(torch.arange(3)), torch.zeros(3, 4))
    assert store_mod._file_rss_bytes() >= 0


def test_prefetch_read_error_is_raised_in_the_training_thread(tmp_path):
    """A background read that fails raises its error at the next forward (the batch that needed
    it), with nothing staged; the reader thread serves the next prefetch and close ends it."""
    spec = CollectionSpec(RowOptimizer(kind="sgd", lr=0.05), backend="cpu")
    cached = CachedEmbeddingBagCollection(
        _with("ssd", 50, "lru"), spec, storage=StoreSettings(dir=tmp_path)
    )
    batches = _batches(3, seed=7)
    cached(batches[0]).sum().backward()
    store = next(iter(cached._cached.values())).store
    real = store.read

    def broken(ids):
        raise OSError(errno.EIO, "read failed")

    store.read = broken
    cached.prefetch(batches[1])
    with pytest.raises(OSError, match="read failed"):
        cached(batches[1])
    assert cached.stats()["staged"] == 0
    store.read = real
    cached.prefetch(batches[2])
    cached(batches[2]).sum().backward()
    assert cached.stats()["staged"] > 0
    reader = cached._prefetcher
    cached.close()
    assert reader is not None and reader._shutdown and cached._prefetcher is None
