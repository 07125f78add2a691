"""Dynamic tables (issue 21) beyond one collection: the by-id state (export / import), restore
into fresh collections, checkpoints and saved models of dynamic tables, metrics, planner memory,
raw Criteo ids."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from faults import campaign

from neorec.config import TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.ops.id_map import native_lib
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage.dynamic import DynamicEmbeddingBagCollection, DynamicTableState

HAVE_C = native_lib() is not None
BACKEND = "cpu" if HAVE_C else "reference"


def _tables(**kw: Any) -> list[TableConfig]:
    a = {"name": "a", "rows": 64, "dim": 4, "features": ["f"], "kind": "dynamic", "capacity": 12}
    b = {"name": "b", "rows": 64, "dim": 4, "features": ["g"], "kind": "dynamic", "capacity": 9}
    return [TableConfig(**{**a, **kw}), TableConfig(**{**b, **kw})]


def _batches(seed: int, steps: int, pool: int = 40, b: int = 5) -> list[SparseFeatures]:
    rng = random.Random(seed)
    ids = [rng.randrange(-(2**63), 2**63) for _ in range(pool)]
    out = []
    for _ in range(steps):
        feats = {k: [rng.sample(ids, rng.randrange(0, 4)) for _ in range(b)] for k in "fg"}
        out.append(SparseFeatures.from_lists(feats))
    return out


def _make(opt: str, native: bool | None = None, **kw: Any) -> DynamicEmbeddingBagCollection:
    spec = CollectionSpec(RowOptimizer(kind=opt, lr=0.1), backend=BACKEND, seed=3)
    return DynamicEmbeddingBagCollection(_tables(**kw), spec, native=native)


def _train(dyn: Any, batches: list[SparseFeatures], start: int = 0) -> list[torch.Tensor]:
    """Forward + backward of each batch (gradients seeded by the batch's index)."""
    outs = []
    for j, sp in enumerate(batches):
        out = dyn(sp)
        outs.append(out.detach().clone())
        g = torch.Generator().manual_seed(start + j)
        out.backward(torch.randn(out.shape, generator=g))
    return outs


def _same_state(a: DynamicTableState, b: DynamicTableState) -> None:
    for k in ("ids", "rows", "uses", "last_use", "sketch"):
        assert torch.equal(getattr(a, k), getattr(b, k)), k
    assert sorted(a.states) == sorted(b.states)
    for k in a.states:
        assert torch.equal(a.states[k], b.states[k]), k
    assert (a.step, a.sketch_total, a.totals) == (b.step, b.sketch_total, b.totals)
    assert (a.default_row is None) == (b.default_row is None)
    if a.default_row is not None and b.default_row is not None:
        assert torch.equal(a.default_row, b.default_row)


POLICIES = [
    {},
    {"eviction": "lfu"},
    {"eviction": "ttl", "ttl_steps": 3},
    {"admission": "threshold", "admit_threshold": 2, "unadmitted": "default_row"},
    {"admission": "probability", "admit_probability": 0.6},
]


@pytest.mark.parametrize("kw", POLICIES, ids=lambda k: "-".join(map(str, k.values())) or "lru")
@pytest.mark.parametrize("opt", ["rowwise_adagrad", "adam"])
def test_continue_after_restore_is_bitwise(opt: str, kw: dict[str, Any]) -> None:
    batches = _batches(0, 14)
    whole = _make(opt, **kw)
    want = _train(whole, batches)
    first = _make(opt, **kw)
    _train(first, batches[:7])
    fresh = _make(opt, **kw)
    for t in ("a", "b"):
        fresh.import_table(t, first.export_table(t))
    fresh.step.copy_(first.step)
    _same_state(fresh.export_table("a"), first.export_table("a"))
    got = _train(fresh, batches[7:], 7)
    for x, y in zip(got, want[7:]):
        assert torch.equal(x, y)
    for t in ("a", "b"):
        _same_state(fresh.export_table(t), whole.export_table(t))
    assert whole.id_map("a").totals["evicted"] > 0


@pytest.mark.skipif(not HAVE_C, reason="no C")
def test_state_moves_between_c_and_numpy_and_capacities() -> None:
    kw = {"eviction": "lfu"}
    batches = _batches(1, 10)
    c = _make("rowwise_adagrad", native=True, **kw)
    _train(c, batches[:5])
    py = _make("rowwise_adagrad", native=False, **kw)
    big = DynamicEmbeddingBagCollection(
        _tables(capacity=30, **kw),
        CollectionSpec(RowOptimizer(kind="rowwise_adagrad", lr=0.1), backend=BACKEND, seed=3),
    )
    for t in ("a", "b"):
        py.import_table(t, c.export_table(t))
        big.import_table(t, c.export_table(t))
    _same_state(py.export_table("a"), c.export_table("a"))
    _same_state(big.export_table("b"), c.export_table("b"))
    py.step.copy_(c.step)
    assert all(
        torch.equal(x, y) for x, y in zip(_train(py, batches[5:], 5), _train(c, batches[5:], 5))
    )


def test_import_refusals() -> None:
    c = campaign("dynamic import_table")
    src = _make("adam")
    _train(src, _batches(2, 4))
    st = src.export_table("a")
    small = DynamicEmbeddingBagCollection(
        _tables(capacity=2), CollectionSpec(RowOptimizer(kind="adam", lr=0.1), backend=BACKEND)
    )
    c.expect_error("ids beyond capacity", lambda: small.import_table("a", st), ("capacity 2",))
    wide = DynamicEmbeddingBagCollection(
        [TableConfig(name="a", rows=64, dim=8, features=["f"], kind="dynamic", capacity=12)],
        CollectionSpec(RowOptimizer(kind="adam", lr=0.1), backend=BACKEND),
    )
    c.expect_error("dim mismatch", lambda: wide.import_table("a", st), ("'a'", "dim is 8"))
    sgd = _make("sgd")
    c.expect_error("other optimizer", lambda: sgd.import_table("a", st), ("optimizer state",))
    dst = _make("adam")
    rev = DynamicTableState(**{**st.to_dict(), "ids": st.ids.flip(0)})
    c.expect_error("unsorted ids", lambda: dst.import_table("a", rev), ("ascending",))
    c.expect_error("unknown table", lambda: dst.import_table("zz", st), ("zz",))
    before = dst.export_table("a")
    _same_state(before, _make("adam").export_table("a"))  # refusals changed nothing
    c.record("refusal leaves table", "handled")
    c.check()


# ---- the trainer: checkpoints, resume, saved model ---------------------------------------------
def _cfg(run_dir: Any, *extra: str) -> Any:
    from neorec.config import load_config

    return load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=50, dim=8}, {name='d', rows=400, dim=8, "
            "kind='dynamic', capacity=60, eviction='lfu', admission='threshold', "
            "admit_threshold=2, unadmitted='default_row'}, {name='e', rows=300, dim=8, "
            "kind='dynamic', capacity=40}]",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=32",
            "data.train_samples=640",
            "data.eval_samples=64",
            f"train.run_dir='{run_dir}'",
            "train.progress=false",
            "checkpoint.fsync=false",
            "checkpoint.bits=32",
            "checkpoint.opt_bits=32",
            "embedding.optimizer=adam",
            *extra,
        ]
    )


def _dyn_states(model: Any) -> dict[str, DynamicTableState]:
    dyn = model.ebc.dynamic
    return {t.name: dyn.export_table(t.name) for t in dyn.tables}


def _same_model(a: Any, b: Any) -> None:
    for t, st in _dyn_states(a).items():
        _same_state(st, _dyn_states(b)[t])
    fa, fb = a.ebc.fixed.state_dict(), b.ebc.fixed.state_dict()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)
    da, db = a.dense_arch.state_dict(), b.dense_arch.state_dict()
    assert all(torch.equal(da[k], db[k]) for k in da)
    assert int(a.ebc.step) == int(b.ebc.step) == int(b.ebc.fixed.step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An uninterrupted 14-step run (with its saved model) and its result."""
    from neorec.train.trainer import Trainer

    run = tmp_path_factory.mktemp("straight")
    tr = Trainer(
        _cfg(
            run, "train.steps=14", "train.eval_every=5", "train.log_every=4", "train.progress=true"
        )
    )
    return tr, tr.fit(), run


@pytest.mark.parametrize("policy", ["consecutive", "one_shot"])
def test_trainer_resume_equals_uninterrupted(tmp_path: Any, policy: str, straight: Any) -> None:
    from neorec.checkpoint import list_checkpoints, open_storage
    from neorec.train.trainer import Trainer

    common = [f"checkpoint.policy={policy}", "train.eval_every=5"]
    straight, ra, _ = straight
    first = Trainer(_cfg(tmp_path / "b", "train.steps=10", "checkpoint.every_steps=3", *common))
    first.fit()  # stops after step 10: the last checkpoint is step 9 (an interrupted run)
    resumed = Trainer(
        _cfg(
            tmp_path / "b", "train.steps=14", "checkpoint.every_steps=3",
            "checkpoint.resume=latest", *common,
        )
    )  # fmt: skip
    rb = resumed.fit()
    _same_model(straight.model, resumed.model)
    assert ra["eval"] == rb["eval"] and ra["train"]["final_loss"] == rb["train"]["final_loss"]
    stats = straight.model.ebc.stats()
    assert stats["d"]["total"]["evicted"] > 0 and stats["e"]["total"]["evicted"] > 0
    chk = list_checkpoints(open_storage(str(tmp_path / "b" / "checkpoints")))
    incs = [m for m in chk if m["kind"] == "increment"]
    assert incs and all(m["dynamic"] and not m["dynamic"][0]["full"] for m in incs)
    # an increment holds fewer ids than the table has live (only the touched ones)
    assert any(e["n"] < 60 for m in incs for e in m["dynamic"] if e["table"] == "d")


def test_saved_model_and_export_read_raw_ids_through_the_map(straight: Any) -> None:
    import importlib.util

    import numpy as np

    from neorec.serve import load_model
    from neorec.serve.export import export_model
    from neorec.train.trainer import predict

    trainer, _, run = straight
    want = torch.cat(predict(trainer.model, trainer.source.eval_batches()).probs)
    model, _ = load_model(run)
    for t, st in _dyn_states(trainer.model).items():  # a model holds no optimizer state
        got_st = _dyn_states(model)[t]
        assert all(torch.equal(getattr(st, k), getattr(got_st, k)) for k in ("ids", "rows"))
    got = torch.cat(predict(model, trainer.source.eval_batches()).probs)
    assert torch.equal(got, want)  # unadmitted ids: default row ('d') / dropped ('e') alike
    art = export_model(run, run / "art")
    spec = importlib.util.spec_from_file_location("serving_dyn", art / "serving.py")
    assert spec is not None and spec.loader is not None
    serving = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving)
    fn = serving.load(str(art))
    outs = []
    for b in trainer.source.eval_batches():
        sparse = {}
        for f in b.sparse.keys:
            values, lengths, _ = b.sparse.feature(f)
            sparse[f] = (lengths.numpy(), values.numpy())
        outs.append(fn(b.dense.numpy(), sparse))
    served = torch.from_numpy(np.concatenate(outs))
    assert float((served - want).abs().max()) <= 1e-6
    # ids the map never held: the default row ('d'), left out of the bag ('e'), as in the model
    from neorec.sparse import SparseFeatures

    raw = {"x": [[3]], "d": [[2**62 + 5]], "e": [[-7, 2**62 + 9]]}
    sp = SparseFeatures.from_lists({f: raw[f] for f in fn.features})
    dense = torch.zeros(1, 13)
    with torch.no_grad():
        ref = torch.sigmoid(model(dense, sp))
    unseen = {f: (np.array([len(raw[f][0])]), np.array(raw[f][0])) for f in fn.features}
    assert float(np.abs(fn(dense.numpy(), unseen) - ref.numpy()).max()) <= 1e-6


def test_metrics_in_progress_line_and_events(straight: Any) -> None:
    import json

    trainer, _, run = straight
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    logged = [e for e in events if "dynamic" in e]
    assert logged and set(logged[-1]["dynamic"]) == {"d", "e"}
    total = {t: trainer.model.ebc.stats()[t]["total"] for t in ("d", "e")}
    for t in ("d", "e"):  # the windows add up to the map's totals
        steps = [e["step"] for e in logged]
        widths = [b - a for a, b in zip([0, *steps[:-1]], steps)]
        for k in ("admitted", "evicted", "unadmitted"):
            got = sum(e["dynamic"][t][f"{k}_per_step"] * w for e, w in zip(logged, widths))
            assert abs(got - total[t][k]) < 1e-6, (t, k)
        assert logged[-1]["dynamic"][t]["occupancy"] == trainer.model.ebc.stats()[t]["occupancy"]
    assert logged[-1]["dynamic"]["d"]["capacity"] == 60
    log = (run / "train.log").read_text()
    assert " d 60/60 +" in log and "unadm" in log


# ---- planner: capacity rows + the map's bytes ---------------------------------------------------
def test_planner_memory_of_a_dynamic_table() -> None:
    from neorec.ops.id_map_size import map_bytes_per_slot
    from neorec.sharding.cost_model import CostModel
    from neorec.sharding.tables import TableSpec
    from neorec.sharding.topology import Topology
    from neorec.sharding.types import ShardingType

    dyn = TableConfig(name="d", rows=10**6, dim=16, kind="dynamic", capacity=1000)
    thr = TableConfig(
        name="d", rows=10**6, dim=16, kind="dynamic", capacity=1000, admission="threshold",
        admit_threshold=2, unadmitted="default_row",
    )  # fmt: skip
    fixed = TableConfig(name="d", rows=1000, dim=16)
    cm = CostModel(Topology(world_size=1, device_memory_gb=100.0), 64)
    tw = ShardingType.TABLE_WISE
    specs = [TableSpec.from_config(t) for t in (dyn, thr, fixed)]
    assert [s.rows for s in specs] == [1000, 1001, 1000]  # slots, + the default row
    per = map_bytes_per_slot(1000)
    assert per == 55 + 16 * 2048 / 1000  # 87.8 bytes a slot (lru)
    assert map_bytes_per_slot(1000, "threshold") == per + 4 * 4 * 2048 / 1000
    mem = [cm.shard_cost(s, tw, s.rows, 16).device_bytes for s in specs]
    assert mem[0] - mem[2] == pytest.approx(1000 * per)
    extra = mem[1] - mem[2]  # the map with its sketch, and the default row with its state
    assert 1000 * map_bytes_per_slot(1000, "threshold") < extra
    assert extra < 1000 * map_bytes_per_slot(1000, "threshold") + 200


# ---- Criteo: raw 64-bit ids for dynamic tables ------------------------------------------------
def test_criteo_reader_emits_raw_ids_for_dynamic_tables(tmp_path: Any) -> None:
    from neorec.data.criteo import CriteoFormatError, CriteoTSVDataset, parse_line

    cats = [f"{(j + 1) * 0x1000F:08x}" for j in range(26)]
    lines = [
        "\t".join(["1", *map(str, range(13)), *cats]),
        "\t".join(["0", *[""] * 13, "", "DEADBEEF", *cats[2:]]),
        "\t".join(["1", *[""] * 13, "fffffffffffff", "a", *cats[2:]]),  # 13 digits: slow path
    ]
    p = tmp_path / "day_0.tsv"
    p.write_text("\n".join(lines) + "\n")

    def tables(fixed_rows: int) -> list[TableConfig]:
        return [
            TableConfig(name=f"C{j + 1}", rows=100, dim=4, kind="dynamic")
            if j < 2
            else TableConfig(name=f"C{j + 1}", rows=fixed_rows, dim=4)
            for j in range(26)
        ]

    for hashed, rows in ((True, 100), (False, 10**7)):  # unhashed: fixed ids must be < rows
        got = CriteoTSVDataset(p, tables(rows), batch_size=8, hash_categories=hashed)
        (b,) = list(got)
        c1, _, _ = b.sparse.feature("C1")
        c2, _, _ = b.sparse.feature("C2")
        assert c1.tolist() == [0x1000F, 0, 0xFFFFFFFFFFFFF]  # raw (> rows), empty -> 0
        assert c2.tolist() == [2 * 0x1000F, 0xDEADBEEF, 0xA]
        c3, _, _ = b.sparse.feature("C3")
        assert c3.tolist() == [3 * 0x1000F % rows] * 3
    bounded = CriteoTSVDataset(p, tables(10**5), batch_size=8, hash_categories=False)
    with pytest.raises(CriteoFormatError, match="C3"):  # a fixed table still refuses
        list(bounded)
    every = CriteoTSVDataset(p, tables(100), batch_size=8, raw_ids=True)
    (b,) = list(every)
    assert b.sparse.feature("C3")[0].tolist() == [3 * 0x1000F] * 3
    none = CriteoTSVDataset(p, tables(100), batch_size=8, raw_ids=False)
    want = [0x1000F % 100, 0, 0xFFFFFFFFFFFFF % 100]
    assert list(none)[0].sparse.feature("C1")[0].tolist() == want
    assert parse_line(lines[1], [100] * 26, raw=[True] * 26)[2][1] == 0xDEADBEEF


@pytest.mark.skipif(not HAVE_C, reason="no C")
@pytest.mark.parametrize("dim", [5, 8])
def test_compiled_init_rows_equal_the_reference(dim: int) -> None:
    from neorec.storage.dynamic import dynamic_init_rows

    t = TableConfig(name="z", rows=50, dim=dim, features=["f"], kind="dynamic", capacity=30)
    dyn = DynamicEmbeddingBagCollection(
        [t], CollectionSpec(RowOptimizer(kind="adam", lr=0.1), seed=9)
    )
    ids = torch.tensor([-(2**63), -1, 0, 7, 2**63 - 1] + list(range(100, 125)))
    dyn(SparseFeatures.from_lists({"f": [[x] for x in ids.tolist()]}))
    slots = dyn.slots_of("z", ids)
    assert bool((slots >= 0).all())
    assert torch.equal(dyn.table_weight("z")[slots], dynamic_init_rows(t, 9, ids))


def test_checkpoint_faults(tmp_path: Any) -> None:
    from neorec.builder import build_dlrm
    from neorec.checkpoint import CheckpointManager, list_checkpoints, open_storage
    from neorec.config import CheckpointConfig

    c = campaign("dynamic checkpoints")
    cfg = _cfg(tmp_path)
    model = build_dlrm(cfg)
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)
    ck = CheckpointConfig(policy="consecutive", bits=32, opt_bits=32, async_write=False,
                          fsync=False)  # fmt: skip
    mgr = CheckpointManager(ck, model, opt, str(tmp_path / "ck"))
    from neorec.builder import data_source

    src = data_source(cfg)
    for j, b in enumerate(src.train_batches()):
        if j == 4:
            break
        model(b.dense, b.sparse).sum().backward()
        if j % 2:
            mgr.save(j)
    want = _dyn_states(model)
    entries = list_checkpoints(open_storage(str(tmp_path / "ck")))
    last = entries[-1]["name"]

    def restore_into(overrides: list[str]) -> Any:
        m2 = build_dlrm(_cfg(tmp_path, *overrides))
        o2 = torch.optim.SGD(m2.dense_parameters(), lr=0.1)
        CheckpointManager(ck, m2, o2, str(tmp_path / "ck")).restore(last)
        return m2

    got = restore_into([])
    for t, st in want.items():
        _same_state(st, _dyn_states(got)[t])
    c.record("restore chain", "handled")
    small = (
        "embedding.tables=[{name='x', rows=50, dim=8}, {name='d', rows=400, dim=8, "
        "kind='dynamic', capacity=5, eviction='lfu', admission='threshold', admit_threshold=2, "
        "unadmitted='default_row'}, {name='e', rows=300, dim=8, kind='dynamic', capacity=40}]"
    )
    c.expect_error("restore into a smaller capacity", lambda: restore_into([small]),
                   ("capacity 5", "'d'"))  # fmt: skip
    fixed = (
        "embedding.tables=[{name='x', rows=50, dim=8}, {name='d', rows=400, dim=8}, "
        "{name='e', rows=300, dim=8}]"
    )
    # a checkpoint of fixed tables restored into dynamic ones, and the other way round
    mgr_fixed = CheckpointManager(ck, build_dlrm(_cfg(tmp_path, fixed)), opt,
                                  str(tmp_path / "ck_fixed"))  # fmt: skip
    mgr_fixed.save(1)

    def dyn_from_fixed() -> None:
        m2 = build_dlrm(_cfg(tmp_path))
        o2 = torch.optim.SGD(m2.dense_parameters(), lr=0.1)
        CheckpointManager(ck, m2, o2, str(tmp_path / "x")).restore(str(tmp_path / "ck_fixed"))

    c.expect_error("fixed checkpoint into dynamic tables", dyn_from_fixed, ("no pieces", "'d'"))
    piece = next((tmp_path / "ck" / last / "dyn").iterdir())
    piece.write_bytes(piece.read_bytes()[:-3] + b"xyz")
    c.expect_error("corrupt dynamic piece", lambda: restore_into([]), ("dyn/",))
    c.check()


def test_neorec_train_cli_runs_and_resumes_a_dynamic_table(tmp_path: Any, capsys: Any) -> None:
    """The command line (in process): one process trains, checkpoints and resumes."""
    from neorec.cli import main

    base = [
        "train",
        "--set",
        "embedding.tables=[{name='a', rows=300, dim=8, kind='dynamic', capacity=40}]",
        "--set", "model.bottom_mlp=[8, 8]", "--set", "model.top_mlp=[8, 1]",
        "--set", "data.batch_size=32", "--set", "data.train_samples=320",
        "--set", "data.eval_samples=64", "--set", f"train.runs_dir='{tmp_path}'",
        "--set", "checkpoint.every_steps=2", "--set", "train.steps=4",
    ]  # fmt: skip
    assert main(base) == 0
    (run,) = [p for p in tmp_path.iterdir() if not p.is_symlink() and (p / "model").is_dir()]
    capsys.readouterr()
    small = [x.replace("capacity=40", "capacity=3") for x in base[:-1]]
    assert main([*small, "train.steps=6", "--resume", str(run / "checkpoints")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "capacity 3" in err[0] and "'a'" in err[0], err
    more = [*base[:-1], "train.steps=6", "--resume", str(run / "checkpoints")]
    assert main(more) == 0
    assert "resumed from step 4" in capsys.readouterr().out
