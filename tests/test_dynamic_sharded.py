"""Dynamic tables sharded row-wise by a hash of the raw id (issue 21): 2 and 4 gloo ranks train
what one process trains, each rank's map holds exactly the ids it owns, and checkpoints restore
on another world size (2 -> 4 ranks, 4 -> 1 process); bad input is one clear error line.

One spawn per world size (2, then 4) runs every variant and saves what the ranks saw; the tests
compare those files with the unsharded ``DynamicEmbeddingBagCollection`` run in this process.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks
from faults import campaign

from neorec.config import TableConfig
from neorec.distributed.dynamic_reshard import (
    TableShard,
    merge_table_shards,
    owner_of,
    rank_state,
)
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection, rank_capacity
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.errors import NeorecError
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.id_map import mix64
from neorec.ops.row_optim import RowOptimizer
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sparse import SparseFeatures
from neorec.storage.dynamic import (
    DynamicEmbeddingBagCollection,
    MixedEmbeddingBagCollection,
    table_capacity,
)
from neorec.storage.dynamic_state import DynamicTableState

B = 8  # global batch: 4 samples a rank on 2 ranks, 2 on 4
STEPS = 4  # before a checkpoint
EXTRA = 2  # after a restore
SEED = 5
NAMES = ("a", "b")
VARIANTS: dict[str, dict[str, Any]] = {
    "sgd-sum": {"opt": "sgd"},
    "adagrad-sum-weighted": {"opt": "rowwise_adagrad", "weighted": True},
    "sgd-mean-zeros-prob": {"opt": "sgd", "pooling": "mean", "admission": "probability"},
    "adagrad-mean-default-prob": {
        "opt": "rowwise_adagrad",
        "pooling": "mean",
        "admission": "probability",
        "unadmitted": "default_row",
        "weighted": True,
    },
    "sgd-pf1": {"opt": "sgd", "pf1": True},
    "adagrad-pf1": {"opt": "rowwise_adagrad", "pf1": True},
    "adagrad-ttl": {"opt": "rowwise_adagrad", "eviction": "ttl"},
    # no sketch collisions among 44 ids in 4 x 1024 counters: the per-rank sketches decide
    # exactly as the one-process sketch (with collisions they may admit at other times)
    "sgd-sum-threshold": {"opt": "sgd", "admission": "threshold"},
}
RESTORED = "adagrad-mean-default-prob"  # the variant saved, restored elsewhere, trained on


def tables(v: dict[str, Any]) -> list[TableConfig]:
    """Two tables (one shared by two features) whose capacities hold every id on every rank
    (44 distinct ids; each of 4 ranks gets ceil(capacity / 4) >= 44 slots)."""
    kw: dict[str, Any] = {"kind": "dynamic", "unadmitted": v.get("unadmitted", "zeros")}
    if v.get("admission") == "probability":
        kw.update(admission="probability", admit_probability=0.6)
    if v.get("eviction") == "ttl":
        kw.update(eviction="ttl", ttl_steps=1)
    if v.get("admission") == "threshold":
        kw.update(admission="threshold", admit_threshold=2)
    return [
        TableConfig(name="a", rows=64, dim=8, features=["f", "g"], capacity=180, **kw),
        TableConfig(name="b", rows=40, dim=4, features=["h"], capacity=176, **kw),
    ]


def build(v: dict[str, Any], sharded: bool) -> Any:
    opt = RowOptimizer(kind=v["opt"], lr=0.1)
    cls = ShardedDynamicEmbeddingBagCollection if sharded else DynamicEmbeddingBagCollection
    return cls(tables(v), CollectionSpec(opt, v.get("pooling", "sum"), seed=SEED))


def global_batch(v: dict[str, Any], step: int) -> tuple[SparseFeatures, torch.Tensor]:
    """The step's batch of B samples (raw ids anywhere in int64, incl. the extremes) and the
    gradient of the loss with respect to its pooled output."""
    rng = random.Random(step)
    r0 = random.Random(0)
    pool = [r0.randrange(-(2**63), 2**63) for _ in range(40)]
    pool += [2**63 - 1, -(2**63), 0, -1]
    hi = 1 if v.get("pf1") else 4
    feats = {k: [rng.sample(pool, rng.randint(0 if hi > 1 else 1, hi)) for _ in range(B)]
             for k in "fgh"}  # fmt: skip
    weights = None
    if v.get("weighted"):
        weights = {k: [[rng.uniform(0.5, 1.5) for _ in bag] for bag in bags]
                   for k, bags in feats.items()}  # fmt: skip
    g = torch.Generator().manual_seed(1000 + step)
    return SparseFeatures.from_lists(feats, weights), torch.randn(B, 20, generator=g)


def train(m: Any, v: dict[str, Any], steps: range, rank: int = 0, world: int = 1) -> list:
    """Train ``m`` on this rank's slice of each step's global batch; the loss is scaled by W so
    that, with the 1/W of the sharded backward, every run applies the gradients ``g`` exactly."""
    b = B // world
    outs = []
    for step in steps:
        sp, g = global_batch(v, step)
        sp, g = sp.select_samples(rank * b, (rank + 1) * b), g[rank * b : (rank + 1) * b]
        out = m(sp)
        (out * (g * world)).sum().backward()
        outs.append(out.detach().clone())
    return outs


def evaluate(m: Any, v: dict[str, Any], rank: int = 0, world: int = 1) -> torch.Tensor:
    """Pooled outputs of an eval batch (no grad: maps are only read; unseen ids unadmitted)."""
    sp, _ = global_batch(v, 99)
    extra = SparseFeatures.from_lists({k: [[7 * i + 1]] * B for i, k in enumerate("fgh")})
    sp = SparseFeatures(  # every bag gets one more id, never seen in training
        sp.keys,
        torch.cat([sp.values, extra.values]),
        sp.lengths + 1,
        None,
    )
    order = torch.argsort(
        torch.cat(
            [torch.repeat_interleave(torch.arange(3 * B), sp.lengths - 1), torch.arange(3 * B)]
        ),
        stable=True,
    )
    sp = SparseFeatures(sp.keys, sp.values[order], sp.lengths)
    b = B // world
    with torch.no_grad():
        out: torch.Tensor = m(sp.select_samples(rank * b, (rank + 1) * b))
    return out


MIXED = "sgd-mean-zeros-prob"


def mixed_tables() -> list[TableConfig]:
    return [TableConfig(name="x", rows=23, dim=8, features=["u"]), *tables(VARIANTS[MIXED])]


def mixed_batch(step: int) -> tuple[SparseFeatures, torch.Tensor]:
    sp, g = global_batch(VARIANTS[MIXED], step)
    rng = random.Random(500 + step)
    u = SparseFeatures.from_lists(
        {"u": [rng.sample(range(23), rng.randint(0, 3)) for _ in range(B)]}
    )
    both = SparseFeatures(
        ["u", *sp.keys], torch.cat([u.values, sp.values]), torch.cat([u.lengths, sp.lengths])
    )
    return both, torch.cat([torch.randn(B, 8, generator=torch.Generator().manual_seed(step)), g], 1)


def _mixed(rank: int, world: int) -> dict[str, Any]:
    """A fixed table sharded row-wise (ShardedEmbeddingBagCollection) beside the dynamic ones
    (this module) in a MixedEmbeddingBagCollection: outputs, the fixed table, the dynamic map."""
    ts = mixed_tables()
    opt = RowOptimizer(kind="sgd", lr=0.1)
    plan = plan_by_type(ts[:1], world, world, "row_wise")
    spec = CollectionSpec(opt, "mean", seed=SEED)
    fixed = ShardedEmbeddingBagCollection(ts[:1], spec, plan=plan)
    dyn = ShardedDynamicEmbeddingBagCollection(ts[1:], spec)
    m = MixedEmbeddingBagCollection(ts, fixed, dyn)  # type: ignore[arg-type]
    b = B // world
    outs = []
    for step in range(1, STEPS + 1):
        sp, g = mixed_batch(step)
        out = m(sp.select_samples(rank * b, (rank + 1) * b))
        (out * (g[rank * b : (rank + 1) * b] * world)).sum().backward()
        outs.append(out.detach().clone())
    return {
        "outs": outs,
        "x": fixed.gather_table("x"),
        "a": dyn.export_shard("a").to_dict(),
        "b": dyn.export_shard("b").to_dict(),
    }


# ---- the ranks ---------------------------------------------------------------------------------
def _faults_on_ranks(rank: int, world: int) -> dict[str, str]:
    """Bad input that only a process group can see; every rank must raise the same one line."""
    got: dict[str, str] = {}
    v = VARIANTS["sgd-sum"]
    opt = RowOptimizer(kind="sgd", lr=0.1)
    ts = tables(v)
    if rank == 1:  # built with another capacity on one rank
        ts = [ts[0], TableConfig(**{**vars(ts[1]), "capacity": 20})]
    try:
        ShardedDynamicEmbeddingBagCollection(ts, CollectionSpec(opt, seed=SEED))
        got["ranks built differently"] = "no error"
    except NeorecError as e:
        got["ranks built differently"] = f"{type(e).__name__}: {e}"
    m = build(v, True)
    sp, _ = global_batch(VARIANTS["adagrad-sum-weighted"], 1)
    sp = sp.select_samples(rank * 2, rank * 2 + 2)
    if rank == 0:
        sp = SparseFeatures(sp.keys, sp.values, sp.lengths)  # no weights on rank 0 only
    before = [p.weights.clone() for p in m.parts]
    try:
        m(sp)
        got["weights on some ranks only"] = "no error"
    except NeorecError as e:
        got["weights on some ranks only"] = f"{type(e).__name__}: {e}"
    if any(not torch.equal(a, p.weights) for a, p in zip(before, m.parts)):
        got["weights on some ranks only"] = "data lost: rows changed"
    # the group still works after both refusals
    train(m, v, range(1, 2), rank, world)
    return got


def _ranks(rank: int, world: int, out: str, restore_from: str) -> None:
    torch.manual_seed(0)
    res: dict[str, Any] = {"outs": {}, "shards": {}, "stats": {}}
    for name, v in VARIANTS.items():
        m = build(v, True)
        res["outs"][name] = train(m, v, range(1, STEPS + 1), rank, world)
        res.setdefault("eval", {})[name] = evaluate(m, v, rank, world)
        res["shards"][name] = {t: m.export_shard(t).to_dict() for t in NAMES}
        res["stats"][name] = m.local_stats()  # this rank's maps
        res.setdefault("global", {})[name] = m.stats()  # every rank's, summed (what rank 0 logs)
    if restore_from:
        v = VARIANTS[RESTORED]
        m = build(v, True)
        old = [torch.load(p, weights_only=False) for p in sorted(Path(restore_from).glob("r*.pt"))]
        for t in NAMES:
            m.import_table(t, [TableShard.from_dict(o["shards"][RESTORED][t]) for o in old])
        res["imported"] = {t: m.export_shard(t).to_dict() for t in NAMES}
        res["restored_outs"] = train(m, v, range(STEPS + 1, STEPS + EXTRA + 1), rank, world)
        res["restored"] = {t: m.export_shard(t).to_dict() for t in NAMES}
    res["mixed"] = _mixed(rank, world)
    if world == 2:
        res["faults"] = _faults_on_ranks(rank, world)
    torch.save(res, os.path.join(out, f"r{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Every rank's results on 2 ranks, then on 4 (which restores the 2-rank checkpoint)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out: dict[int, list[dict[str, Any]]] = {}
    prev = ""
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"w{world}")
        run_ranks(_ranks, world, str(d), prev)
        out[world] = [torch.load(d / f"r{r}.pt", weights_only=False) for r in range(world)]
        prev = str(d)
    return out


# ---- the reference -----------------------------------------------------------------------------
_REF: dict[tuple[str, int], tuple[Any, list]] = {}


def reference(name: str, steps: int) -> tuple[DynamicEmbeddingBagCollection, list]:
    """The unsharded collection (capacity for every id) after ``steps`` steps, and its outputs."""
    if (name, steps) not in _REF:
        v = VARIANTS[name]
        m = build(v, False)
        _REF[(name, steps)] = (m, train(m, v, range(1, steps + 1)))
    return _REF[(name, steps)]


def shards_of(results: list[dict[str, Any]], key: str, name: str | None, t: str) -> list:
    return [TableShard.from_dict(r[key][name][t] if name else r[key][t]) for r in results]


def assert_same_table(got: DynamicTableState, want: DynamicTableState, bitwise: bool, where: str):
    """Same ids and map bookkeeping exactly; rows and optimizer state bitwise or close."""
    assert torch.equal(got.ids, want.ids), f"{where}: id sets differ"
    assert torch.equal(got.uses, want.uses), f"{where}: uses differ"
    assert torch.equal(got.last_use, want.last_use), f"{where}: last use differs"
    assert got.step == want.step, where
    pairs = [("rows", got.rows, want.rows)]
    pairs += [(k, got.states[k], want.states[k]) for k in want.states]
    if want.default_row is not None:
        assert got.default_row is not None, f"{where}: default row lost"
        pairs.append(("default row", got.default_row, want.default_row))
        pairs += [(k, got.default_states[k], want.default_states[k]) for k in want.default_states]
    for what, a, b in pairs:
        if bitwise:
            assert torch.equal(a, b), f"{where}: {what} not bitwise equal"
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{where}: {what}")


# ---- tests ---------------------------------------------------------------------------------------
def test_owner_hash_is_fixed_and_balanced() -> None:
    ids = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789], dtype=torch.int64)
    for world in (1, 2, 3, 4, 7):
        want = [((mix64(x & (2**64 - 1)) >> 32) * world) >> 32 for x in ids.tolist()]
        assert owner_of(ids, world).tolist() == want
    many = torch.arange(40_000, dtype=torch.int64) * 7919
    counts = torch.bincount(owner_of(many, 4), minlength=4)
    assert int(counts.min()) > 9_500 and int(counts.max()) < 10_500
    assert rank_capacity(10, 4) == 3 and rank_capacity(8, 4) == 2 and rank_capacity(1, 4) == 1


def test_one_rank_equals_unsharded_bitwise_rows() -> None:
    """World 1 (no process group): the sharded module is the unsharded one, rows bitwise."""
    v = VARIANTS["adagrad-sum-weighted"]
    m = build(v, True)
    train(m, v, range(1, STEPS + 1))
    ref, _ = reference("adagrad-sum-weighted", STEPS)
    for t in NAMES:
        assert_same_table(m.export_table(t), ref.export_table(t), True, f"world 1 table {t}")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_sharded_training_equals_one_process(runs: dict, world: int, name: str) -> None:
    results = runs[world]
    v = VARIANTS[name]
    ref, ref_outs = reference(name, STEPS)
    b = B // world
    sum_pooling = v.get("pooling", "sum") == "sum" and v.get("unadmitted") != "default_row"
    for rank, r in enumerate(results):
        for step, (got, want) in enumerate(zip(r["outs"][name], ref_outs)):
            exp = want[rank * b : (rank + 1) * b]
            where = f"{name} world {world} rank {rank} step {step + 1} output"
            if v.get("pf1"):  # one id per bag: one owner, others add exact zeros
                assert torch.equal(got, exp), where
            else:
                torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-6, msg=where)
    want_eval = evaluate(ref, v)
    for rank, r in enumerate(results):
        exp = want_eval[rank * b : (rank + 1) * b]
        torch.testing.assert_close(r["eval"][name], exp, rtol=1e-5, atol=1e-6)
    for t in NAMES:
        parts = shards_of(results, "shards", name, t)
        for s in parts:  # each rank's map holds exactly the ids it owns
            assert s.world == world
            assert bool((owner_of(s.state.ids, world) == s.rank).all())
            spec = tables(v)[NAMES.index(t)]
            assert s.state.ids.numel() <= rank_capacity(table_capacity(spec), world)
        want = ref.export_table(t)
        # sum pooling: each row's gradients arrive in the same order as in one process
        assert_same_table(
            merge_table_shards(parts), want, sum_pooling, f"{name} world {world} table {t}"
        )
        occupancy = sum(r["stats"][name][t]["occupancy"] for r in results)
        assert occupancy == want.ids.numel()
        for r in results:  # every rank reports the sums over ranks
            g = r["global"][name][t]
            assert g["occupancy"] == occupancy, (name, t)
            assert g["capacity"] == world * rank_capacity(table_capacity(spec), world)
            for k in ("admitted", "evicted", "unadmitted", "lookups"):
                assert g["total"][k] == sum(q["stats"][name][t]["total"][k] for q in results)
        assert occupancy == want.ids.numel()
        if v.get("admission") in ("probability", "threshold"):
            assert sum(r["stats"][name][t]["total"]["unadmitted"] for r in results) > 0
        if v.get("eviction") == "ttl":
            assert sum(r["stats"][name][t]["total"]["evicted"] for r in results) > 0


@pytest.mark.parametrize("world", [2, 4])
def test_fixed_row_wise_beside_dynamic(runs: dict, world: int) -> None:
    """A ShardedEmbeddingBagCollection (row-wise fixed table) and this module composed in a
    MixedEmbeddingBagCollection train what the unsharded mixed collection trains."""
    ts = mixed_tables()
    opt = RowOptimizer(kind="sgd", lr=0.1)
    ref = MixedEmbeddingBagCollection(
        ts,
        EmbeddingBagCollection(ts[:1], CollectionSpec(opt, "mean", seed=SEED)),
        DynamicEmbeddingBagCollection(ts[1:], CollectionSpec(opt, "mean", seed=SEED)),
    )
    outs = []
    for step in range(1, STEPS + 1):
        sp, g = mixed_batch(step)
        out = ref(sp)
        (out * g).sum().backward()
        outs.append(out.detach())
    b = B // world
    for rank, r in enumerate(runs[world]):
        for got, want in zip(r["mixed"]["outs"], outs):
            torch.testing.assert_close(got, want[rank * b : (rank + 1) * b], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["mixed"]["x"], ref.table_weight("x"), rtol=1e-5, atol=1e-6)
    for t in NAMES:
        got = merge_table_shards([TableShard.from_dict(r["mixed"][t]) for r in runs[world]])
        assert_same_table(got, ref.dynamic.export_table(t), False, f"mixed world {world} {t}")


def test_restore_two_ranks_on_four(runs: dict) -> None:
    """The 2-rank checkpoint imported on 4 ranks: the same map and rows; training on from there
    equals one process trained throughout."""
    saved = {t: merge_table_shards(shards_of(runs[2], "shards", RESTORED, t)) for t in NAMES}
    ref, ref_outs = reference(RESTORED, STEPS + EXTRA)
    b = B // 4
    for t in NAMES:
        imported = shards_of(runs[4], "imported", None, t)
        assert all(bool((owner_of(s.state.ids, 4) == s.rank).all()) for s in imported)
        assert_same_table(merge_table_shards(imported), saved[t], True, f"2->4 import {t}")
        after = merge_table_shards(shards_of(runs[4], "restored", None, t))
        assert_same_table(after, ref.export_table(t), False, f"2->4 then trained, {t}")
    for rank, r in enumerate(runs[4]):
        for got, want in zip(r["restored_outs"], ref_outs[STEPS:]):
            torch.testing.assert_close(got, want[rank * b : (rank + 1) * b], rtol=1e-5, atol=1e-6)


def test_restore_four_ranks_in_one_process(runs: dict) -> None:
    """The 4-rank checkpoint imported by the unsharded collection (and by the sharded one on a
    single rank): the same map and rows; training on equals one process trained throughout."""
    v = VARIANTS[RESTORED]
    ref, ref_outs = reference(RESTORED, STEPS + EXTRA)
    one = build(v, False)
    single = build(v, True)
    for t in NAMES:
        shards = shards_of(runs[4], "shards", RESTORED, t)
        whole = merge_table_shards(shards)
        one.import_table(t, whole)
        single.import_table(t, shards)
        assert_same_table(one.export_table(t), whole, True, f"4->1 import {t}")
        assert_same_table(single.export_table(t), whole, True, f"4->1 sharded import {t}")
        assert one.stats()[t]["total"] == whole.totals  # the totals of all ranks, summed
    outs = train(one, v, range(STEPS + 1, STEPS + EXTRA + 1))
    for got, want in zip(outs, ref_outs[STEPS:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for t in NAMES:
        assert_same_table(one.export_table(t), ref.export_table(t), False, f"4->1 trained {t}")


def test_unsharded_export_restores_sharded_subset() -> None:
    """An unsharded export split for 3 ranks: each rank gets exactly its ids, totals on rank 0."""
    ref, _ = reference("sgd-sum", STEPS)
    whole = ref.export_table("a")
    parts = [rank_state(whole, r, 3, rank_capacity(180, 3)) for r in range(3)]
    assert sum(p.ids.numel() for p in parts) == whole.ids.numel()
    for r, p in enumerate(parts):
        assert bool((owner_of(p.ids, 3) == r).all())
        assert p.totals == (whole.totals if r == 0 else {k: 0 for k in whole.totals})
    shards = [TableShard(r, 3, p) for r, p in enumerate(parts)]
    assert_same_table(merge_table_shards(shards), whole, True, "split and merged")


# ---- faults ------------------------------------------------------------------------------------
def test_faults_dynamic_sharded(runs: dict) -> None:
    c = campaign("dynamic_sharded")
    v = VARIANTS[RESTORED]
    good = [TableShard.from_dict(r["shards"][RESTORED]["a"]) for r in runs[2]]

    def importing(source: Any, into: Any = None, t: str = "a") -> Any:
        m = into if into is not None else build(v, True)
        return lambda: m.import_table(t, source)

    c.expect_error(
        "fixed table",
        lambda: ShardedDynamicEmbeddingBagCollection(
            [TableConfig(name="x", rows=4, dim=4)], CollectionSpec()
        ),
        ("'x'", "kind", "dynamic"),
    )
    c.expect_error(
        "no tables", lambda: ShardedDynamicEmbeddingBagCollection([], CollectionSpec()), "non-empty"
    )
    twice = [*tables(v), TableConfig(name="a", rows=4, dim=4, features=["z"], kind="dynamic")]
    c.expect_error(
        "a table twice",
        lambda: ShardedDynamicEmbeddingBagCollection(twice, CollectionSpec()),
        "more than once",
    )
    c.expect_error("a rank's shard missing", importing(good[:1]), ("ranks 0..1", "missing [1]"))
    c.expect_error("a rank twice", importing([good[0], good[0]]), ("repeated [0]", "missing [1]"))
    other = TableShard(1, 2, replace_step(good[1].state, good[1].state.step + 3))
    c.expect_error("shards of two saves", importing([good[0], other]), "different steps")
    swapped = [TableShard(0, 2, good[1].state), TableShard(1, 2, good[0].state)]
    c.expect_error("shards swapped", importing(swapped), ("rank 0's shard holds id", "owns"))
    mixed = [good[0], TableShard(1, 4, good[1].state)]
    c.expect_error("shards of two worlds", importing(mixed), "different world sizes")
    c.expect_error("dim mismatch", importing(good, t="b"), ("dim 8", "dim 4"))
    c.expect_error("not a checkpoint", importing({"ids": 1}), "TableShard")
    c.expect_error("nothing", importing([]), "TableShard")
    c.expect_error("unknown table", importing(good, t="zz"), ("'zz'", "tables"))
    c.expect_error("not a saved shard", lambda: TableShard.from_dict({"rank": 0}), "TableShard")
    c.expect_error(
        "another optimizer's state",
        importing(good, into=build({**v, "opt": "sgd"}, True)),
        "optimizer",
    )
    no_default = DynamicTableState(**{**merge_table_shards(good).to_dict(), "default_row": None})
    c.expect_error("checkpoint without the default row", importing(no_default), "default row")
    small_tables = [TableConfig(**{**vars(t), "capacity": 8}) for t in tables(v)]
    small = ShardedDynamicEmbeddingBagCollection(
        small_tables,
        CollectionSpec(RowOptimizer(kind="rowwise_adagrad", lr=0.1), "mean", seed=SEED),
    )
    c.expect_error("more ids than the slots", importing(good, into=small), ("slots", "capacity"))
    before = small.export_table("a")
    assert before.ids.numel() == 0  # the refused imports left the table as it was
    m = build(VARIANTS["sgd-sum"], True)
    bad = SparseFeatures(["f", "g", "x"], torch.tensor([1, 2]), torch.tensor([1, 0, 1]))
    c.expect_error("batch of other features", lambda: m(bad), ("missing ['h']", "'x'"))
    nan = SparseFeatures(
        ["f", "g", "h"], torch.tensor([1, 2]), torch.tensor([1, 0, 1]), torch.tensor([1.0, 0.0])
    )
    nan.weights[0] = float("nan")  # type: ignore[index]
    c.expect_error("non-finite per-id weight", lambda: m(nan), "finite")
    assert m.export_table("a").ids.numel() == 0  # refused batches mapped nothing
    empty = SparseFeatures(
        ["f", "g", "h"], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    out = m(empty)
    out.sum().backward()
    ok = out.shape == (0, 20) and int(m.step) == 0 and m.export_table("a").ids.numel() == 0
    c.record("empty batch", "handled" if ok else "silently accepted", f"{out.shape} {m.step}")
    for rank, r in enumerate(runs[2]):
        for case, msg in r["faults"].items():
            if msg == "no error":
                c.record(f"{case} (rank {rank})", "silently accepted", msg)
            elif msg.startswith("data lost"):
                c.record(f"{case} (rank {rank})", "data lost", msg)
            elif "\n" in msg or not msg.startswith(("ConfigError", "SparseFeatureError")):
                c.record(f"{case} (rank {rank})", "crash", msg)
            else:
                c.record(f"{case} (rank {rank})", "clear error", msg)
    c.check()


def replace_step(s: DynamicTableState, step: int) -> DynamicTableState:
    return DynamicTableState(**{**s.to_dict(), "step": step})
