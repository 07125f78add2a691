"""Low-precision embedding rows (fp16 / bf16 / fp8 tables) against their specification: an fp32
table holding the decoded rows, whose updated rows are then rounded to the format."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_util import run_ranks

from neorec.builder import build_dlrm
from neorec.checkpoint import CheckpointManager
from neorec.config import ConfigError, EmbeddingConfig, TableConfig, load_config
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.ops.lowp_format import _bits_stochastic, _hash32, _hash_uniform
from neorec.ops.lowp_rows import LowpRowsBackend, RowFormat, bytes_per_row, stochastic_round
from neorec.ops.row_optim import RowOptimizer
from neorec.ops.tbe import Lookup, PoolingMode, TBEIdError, TBELayout, get_backend
from neorec.sharding.cost_model import CostModel, TableSpec, Topology
from neorec.sparse import SparseFeatures

LAYOUT = TBELayout(rows=(40, 7, 25), dims=(8, 4, 8), feature_table=(0, 1, 2, 0))
B = 12


def _batch(seed: int, weighted: bool = False, layout: TBELayout = LAYOUT):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (layout.num_features * B,), generator=g)
    lengths[3] = 0  # an empty bag
    ids = []
    for f, t in enumerate(layout.feature_table):
        n = int(lengths[f * B : (f + 1) * B].sum())
        ids.append(torch.randint(0, layout.rows[t], (n,), generator=g))
    indices = torch.cat(ids)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    psw = torch.rand(indices.numel(), generator=g) if weighted else None
    grad = torch.randn(B, layout.total_dim, generator=g)
    return indices, offsets, psw, grad


def _rows(seed: int, layout: TBELayout = LAYOUT) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(r, d, generator=g) * 0.1 for r, d in zip(layout.rows, layout.dims)]


@pytest.mark.bitwise
@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "fp8"])
def test_packed_rows_equal_fp32_rows_then_rounded(backend, kind, precision):
    """Forward = the fp32 kernel on the decoded rows; after an update, each stored row = the fp32
    kernel's updated row rounded to the format, and the fp32 state = the fp32 kernel's state."""
    fmt, inner = RowFormat(precision), get_backend(backend)
    lp = LowpRowsBackend(inner, fmt, "nearest")
    opt = RowOptimizer(kind=kind, lr=0.05)
    packed = fmt.empty(LAYOUT)
    for t, r in enumerate(_rows(0)):
        fmt.encode(packed, LAYOUT, t, None, r)
    ref_w = torch.cat([fmt.decode(packed, LAYOUT, t).reshape(-1) for t in range(3)])
    from neorec.ops.row_optim import zeros_state

    st_lp = zeros_state(kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu"))
    st_ref = copy.deepcopy(st_lp)
    for step in (1, 2, 3):
        idx, off, psw, grad = _batch(step, weighted=step == 2)
        for pooling in (PoolingMode.SUM, PoolingMode.MEAN):
            got = lp.forward(LAYOUT, packed, Lookup(idx, off, psw, pooling))
            want = inner.forward(LAYOUT, ref_w, Lookup(idx, off, psw, pooling))
            assert torch.equal(got, want), (precision, step, pooling)
        lp.backward_update(
            LAYOUT, packed, st_lp, Lookup(idx, off, psw, PoolingMode.SUM), grad, opt, step
        )
        inner.backward_update(
            LAYOUT, ref_w, st_ref, Lookup(idx, off, psw, PoolingMode.SUM), grad, opt, step
        )
        for k in st_ref:
            assert torch.equal(st_lp[k], st_ref[k]), (precision, k, step)
        # The specification's rows, rounded as the format stores them.
        spec = fmt.empty(LAYOUT)
        for t in range(3):
            fmt.encode(spec, LAYOUT, t, None, LAYOUT.table(ref_w, t))
            assert torch.equal(fmt.decode(packed, LAYOUT, t), fmt.decode(spec, LAYOUT, t)), (
                precision, kind, step, t,
            )  # fmt: skip
            LAYOUT.table(ref_w, t).copy_(fmt.decode(spec, LAYOUT, t))


def test_bad_ids_are_refused_before_anything_is_read_or_written():
    fmt = RowFormat("bf16")
    lp = LowpRowsBackend(get_backend("reference"), fmt)
    packed = fmt.empty(LAYOUT)
    for t, r in enumerate(_rows(0)):
        fmt.encode(packed, LAYOUT, t, None, r)
    before = packed.clone()
    idx, off, _, grad = _batch(1)
    idx[int(off[B])] = 7  # feature 1 reads table 1 (7 rows): out of range, not table 2's row
    with pytest.raises(TBEIdError, match="out of range"):
        lp.backward_update(
            LAYOUT,
            packed,
            {},
            Lookup(idx, off, None, PoolingMode.SUM),
            grad,
            RowOptimizer(kind="sgd"),
            1,
        )
    assert torch.equal(packed, before)


def test_stochastic_rounding_is_unbiased_between_neighbours_and_deterministic():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4000, generator=g) - 0.5) * 3
    elem = torch.arange(x.numel())

    def generic(dt, s):
        return stochastic_round(x, dt, _hash_uniform(elem, s, 0))

    def bits(dt, s):  # what tables use: random bits added below the last mantissa bit
        return _bits_stochastic(x, dt, _hash32(elem, s, 0))

    for dt, fn in [
        (torch.float16, generic),
        (torch.bfloat16, generic),
        (torch.float8_e4m3fn, generic),
        (torch.float16, bits),
        (torch.bfloat16, bits),
        (torch.float8_e4m3fn, bits),
    ]:
        q = x.to(dt).float()
        draws = torch.stack([fn(dt, s).float() for s in range(200)])
        # every draw is the nearest value or the neighbour on the other side of x
        other = (draws != q) & ((draws - x) * (q - x) < 0)
        assert bool(((draws == q) | other).all()), dt
        far = torch.where(draws != q, draws, torch.nan)
        assert bool((torch.nan_to_num(far.amax(0) - far.amin(0)) == 0).all())  # one neighbour
        # unbiased: the mean over draws is far closer to x than nearest rounding's bias
        sr_bias = float((draws.mean(0) - x).abs().mean())
        nearest_bias = float((q - x).abs().mean())
        assert sr_bias < 0.2 * nearest_bias, (dt, sr_bias, nearest_bias)
        assert torch.equal(fn(dt, 3).float(), draws[3])  # deterministic
    exact = torch.tensor([0.0, 1.0, -2.5, 0.125])
    assert torch.equal(
        stochastic_round(exact, torch.bfloat16, torch.rand(4).double()).float(), exact
    )


def test_fp8_rows_roundtrip_and_power_of_two_scales():
    fmt = RowFormat("fp8")
    packed = fmt.empty(LAYOUT)
    rows = _rows(3)
    rows[0][5] = 0.0  # an all-zero row
    for t, r in enumerate(rows):
        fmt.encode(packed, LAYOUT, t, None, r)
    sc = fmt.scales(packed, LAYOUT)
    mant, _ = torch.frexp(sc)
    assert bool((mant == 0.5).all())  # powers of two
    for t, r in enumerate(rows):
        dec = fmt.decode(packed, LAYOUT, t)
        amax = r.abs().amax(1, keepdim=True).clamp(min=1e-30)
        assert float(((dec - r).abs() / amax).max()) <= 2**-4  # e4m3: 3 mantissa bits
        again = fmt.empty(LAYOUT)
        fmt.encode(again, LAYOUT, t, None, dec)
        assert torch.equal(fmt.decode(again, LAYOUT, t), dec)  # decode -> encode is exact
    assert torch.equal(fmt.decode(packed, LAYOUT, 0)[5], torch.zeros(8))


def test_memory_halves_and_quarters():
    lay = TBELayout(rows=(1000,), dims=(64,), feature_table=(0,))
    fp32 = 1000 * 64 * 4
    assert RowFormat("fp16").nbytes(lay) == fp32 // 2 == RowFormat("bf16").nbytes(lay)
    assert RowFormat("fp8").nbytes(lay) == 1000 * (64 + 4)
    assert bytes_per_row("fp8", 64) == 68 and bytes_per_row("fp32", 64) == 256
    tabs = [TableConfig(name="t", rows=1000, dim=64, precision=p) for p in ("fp32", "fp8")]
    sizes = [
        EmbeddingBagCollection([t], CollectionSpec(backend="reference"))
        .weights.untyped_storage()
        .nbytes()
        for t in tabs
    ]
    assert sizes[1] <= sizes[0] * 0.27
    # the planner prices the stored bytes of each precision
    cm = CostModel(Topology.local_cpu(1), batch_size=64, optimizer="sgd")
    mem = {}
    for p in ("fp32", "fp16", "fp8"):
        spec = TableSpec(name="t", rows=1000, dim=64, precision=p)
        cost = cm.shard_cost(spec, _tw(), 1000, 64)
        mem[p] = cost.device_bytes + cost.host_bytes
    assert mem["fp16"] < mem["fp32"] and mem["fp8"] < mem["fp16"]
    assert mem["fp32"] - mem["fp16"] == pytest.approx(1000 * 64 * 2)
    # config tables carry their precision to the planner, which keeps them on fused shards
    from neorec.sharding.cost_model import tables_from_config
    from neorec.sharding.types import ShardingType

    emb = EmbeddingConfig(tables=[{"name": "a", "rows": 10, "dim": 4, "precision": "fp8"},
                                  {"name": "b", "rows": 10, "dim": 4}])  # fmt: skip
    a, b = tables_from_config(emb.tables)
    assert a.precision == "fp8" and ShardingType.DATA_PARALLEL not in a.allowed_types
    assert b.precision == "" and b.allowed_types == ()


def _tw():
    from neorec.sharding.types import ShardingType

    return ShardingType.TABLE_WISE


def _tables(precisions):
    return [
        TableConfig(name=f"t{i}", rows=30 + i, dim=8, precision=p, features=[f"f{i}"])
        for i, p in enumerate(precisions)
    ]


def _sparse(tables, seed):
    g = torch.Generator().manual_seed(seed)
    keys = [f for t in tables for f in t.features]
    lengths = torch.randint(0, 4, (len(keys) * B,), generator=g)
    vals = []
    for i, t in enumerate(tables):
        n = int(lengths[i * B : (i + 1) * B].sum())
        vals.append(torch.randint(0, t.rows, (n,), generator=g))
    return SparseFeatures(keys, torch.cat(vals), lengths)


def test_grouped_collection_equals_one_collection_per_precision():
    precs = ["fp16", "fp32", "fp8", "bf16", "fp16"]
    tabs = _tables(precs)
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.1)
    spec = CollectionSpec(opt, backend="cpu", seed=3)
    grouped = GroupedEmbeddingBagCollection(tabs, spec)
    singles = {
        p: EmbeddingBagCollection([t for t in tabs if t.precision == p], spec)
        for p in dict.fromkeys(precs)
    }
    for step in range(3):
        sp = _sparse(tabs, step)
        out = grouped(sp)
        cols = 0
        for t in tabs:
            single = singles[t.precision]
            ref = single(sp.select(single.feature_names))
            j = single.feature_names.index(t.features[0])
            assert torch.equal(out[:, cols : cols + 8], ref[:, 8 * j : 8 * j + 8])
            cols += 8
        g = torch.Generator().manual_seed(50 + step)
        grad = torch.randn(out.shape, generator=g)
        out.backward(grad)
        outs = {p: s(sp.select(s.feature_names)) for p, s in singles.items()}
        for p in singles:
            idx = [i for i, t in enumerate(tabs) if t.precision == p]
            outs[p].backward(torch.cat([grad[:, 8 * i : 8 * i + 8] for i in idx], dim=1))
    for t in tabs:
        assert torch.equal(grouped.table_weight(t.name), singles[t.precision].table_weight(t.name))
    # each table kept its own storage dtype
    assert {p: g.weights.dtype for p, g in grouped.groups.items()} == {
        "fp16": torch.float16,
        "fp32": torch.float32,
        "fp8": torch.uint8,
        "bf16": torch.bfloat16,
    }


def test_config_precision_inherits_and_refuses_bad_combinations():
    emb = EmbeddingConfig(
        tables=[
            {"name": "a", "rows": 10, "dim": 4},
            {"name": "b", "rows": 10, "dim": 4, "precision": "fp8"},
        ],
        precision="bf16",
    )
    assert [t.precision for t in emb.tables] == ["bf16", "fp8"]
    with pytest.raises(ConfigError, match="precision"):
        EmbeddingConfig(tables=[{"name": "a", "rows": 10, "dim": 4, "precision": "fp4"}])
    with pytest.raises(ConfigError, match="needs storage 'memory'"):
        EmbeddingConfig(
            tables=[{"name": "a", "rows": 10, "dim": 4, "precision": "fp16", "storage": "ssd"}]
        )
    with pytest.raises(ConfigError, match="rounding"):
        EmbeddingConfig(rounding="up")
    with pytest.raises(ConfigError, match="one precision"):
        EmbeddingBagCollection(_tables(["fp16", "bf16"]), CollectionSpec())


def _tiny(tmp_path, *extra):
    cfg = load_config(
        None,
        [
            "model.num_dense=4", "model.bottom_mlp=[8,8]", "model.top_mlp=[8,1]",
            "embedding.num_tables=3", "embedding.rows=50", "embedding.dim=8",
            "data.batch_size=16", "train.steps=4", f"train.run_dir={tmp_path}",
            *extra,
        ],
    )  # fmt: skip
    return cfg


@pytest.mark.parametrize("policy", ["full", "consecutive"])
def test_checkpoint_restores_low_precision_tables_exactly(tmp_path, policy):
    from neorec.builder import dense_optimizer
    from neorec.config import CheckpointConfig
    from neorec.data.synthetic import SyntheticClickData
    from neorec.train.trainer import train_step

    cfg = _tiny(tmp_path, "embedding.precision=fp16", "embedding.optimizer=adam")
    cfg.embedding.tables[1].precision = "fp8"
    cfg.embedding.tables[2].precision = "bf16"
    ck = CheckpointConfig(policy=policy, bits=32, opt_bits=32, async_write=False, fsync=False)

    def make():
        model = build_dlrm(cfg)
        return model, dense_optimizer(cfg.train, model.dense_parameters())

    model, opt = make()
    assert isinstance(model.ebc, GroupedEmbeddingBagCollection)
    data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    for step in range(1, 5):
        train_step(model, opt, data.batch("train", step, cfg.data.batch_size), step)
        mgr.save(step)
    mgr.close()
    fresh, fresh_opt = make()
    CheckpointManager(ck, fresh, fresh_opt, str(tmp_path / "ck")).restore("latest")
    sa, sb = model.state_dict(), fresh.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]) or (
            k.endswith("weights") and sa[k].dtype == torch.uint8  # fp8: scales may differ
        ), k
    for t in cfg.embedding.tables:
        assert torch.equal(fresh.ebc.table_weight(t.name), model.ebc.table_weight(t.name)), t.name


def _sharded_rank(rank: int, world: int, precision: str, rounding: str) -> None:
    import test_distributed as td

    from neorec.builder import distributed_model
    from neorec.sharding.fixed_plan import plan_by_type

    cfg = td.make_cfg("rowwise_adagrad")
    cfg.embedding.rounding = rounding
    for t in cfg.embedding.tables:
        t.precision = precision
    for kind in ("table_wise", "row_wise"):
        plan = plan_by_type(td.TABLES, world, world, kind)
        ref, dm, lo, hi = td.train_both(rank, world, plan, cfg, False, steps=3)
        assert dm.ebc.weights.dtype == RowFormat(precision).dtype
        test = td.global_batch(999, False)
        with torch.no_grad():
            want = ref(test.dense, test.sparse)[lo:hi]
            got = dm(test.dense[lo:hi], test.sparse.select_samples(lo, hi))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for t in td.TABLES:
            a, b = dm.ebc.gather_table(t.name), ref.ebc.table_weight(t.name)
            if kind == "table_wise":  # same rows, same sums, same rounding keys: bitwise
                assert torch.equal(a, b), (precision, kind, t.name)
            else:  # sums in another order may round a row to the neighbouring value
                torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-3)
    bad = plan_by_type(td.TABLES, world, world, "data_parallel")
    with pytest.raises(ConfigError, match="cannot be sharded data_parallel"):
        distributed_model(cfg, bad)


@pytest.mark.parametrize("precision,rounding", [("fp16", "nearest"), ("bf16", "stochastic")])
def test_sharded_low_precision_tables_equal_one_process(precision, rounding):
    run_ranks(_sharded_rank, 2, precision, rounding)


def test_dlrm_trains_with_low_precision_tables_like_fp32(tmp_path):
    from neorec.builder import dense_optimizer
    from neorec.data.synthetic import SyntheticClickData
    from neorec.train.trainer import train_step

    losses = {}
    for prec in ("fp32", "fp16", "bf16", "fp8"):
        cfg = _tiny(tmp_path, f"embedding.precision={prec}", "embedding.rows=200")
        model = build_dlrm(cfg)
        opt = dense_optimizer(cfg.train, model.dense_parameters())
        data = SyntheticClickData(cfg.data, cfg.embedding.tables, cfg.model.num_dense)
        run = [float(train_step(model, opt, data.batch("train", s, 64), s + 1)) for s in range(40)]
        losses[prec] = sum(run[-10:]) / 10
    for prec in ("fp16", "bf16", "fp8"):
        assert abs(losses[prec] - losses["fp32"]) < 0.03 * losses["fp32"], losses
