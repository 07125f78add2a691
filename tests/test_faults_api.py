"""Fault campaign "api inputs": bad arguments to the calls a user makes directly.

``SparseFeatures(...)`` / ``from_lists`` with wrong types, shapes, devices and values; a batch that
does not match the tables; non-finite, integer or float64 per-id weights; ids out of range, found
at forward or only at backward; a non-finite output gradient; bad ``EmbeddingBagCollection`` and
``RowOptimizer`` arguments. Each must be a one-line ``NeorecError`` -- and after every refused
batch the table weights, the optimizer state and the step counter must be bitwise what they were
("data lost" otherwise), for the ``reference`` and ``cpu`` backends, the row-cached collection
(a ``dram`` table) and the DLRM forward/backward. Specified non-errors are "handled": a zero-sample
batch (empty output, nothing updated, no step), features in another order, int32 ids, mean
pooling of empty bags.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from faults import Campaign, campaign
from torch import Tensor, nn

from neorec.config import ModelConfig, TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.modules.dlrm import DLRM
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatures
from neorec.storage.cached import CachedEmbeddingBagCollection

C = campaign("api inputs")
TABLES = [
    TableConfig(name="a", rows=40, dim=4),
    TableConfig(name="b", rows=7, dim=4, features=["b", "b2"]),
    TableConfig(name="c", rows=3, dim=4),
]
KEYS = ["a", "b", "b2", "c"]
ROWS = {"a": 40, "b": 7, "b2": 7, "c": 3}
BATCH = 5
KINDS = ["reference", "cpu", "cached"]


def good_batch(seed: int, weighted: bool = True, batch: int = BATCH) -> SparseFeatures:
    """A valid batch of the tables' features (some empty bags, repeated ids)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 4, (len(KEYS), batch), generator=g)
    lens[:, 0] = torch.clamp(lens[:, 0], min=1)  # every feature has ids
    vals = [
        torch.randint(0, ROWS[k], (int(lens[f].sum()),), generator=g) for f, k in enumerate(KEYS)
    ]
    values = torch.cat(vals)
    w = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return SparseFeatures(KEYS, values, lens.reshape(-1), w)


def make_ebc(kind: str, pooling: str = "sum", kind_opt: str = "adam") -> nn.Module:
    """An embedding collection: ``reference`` / ``cpu`` backend, or ``cached`` (table ``a`` in
    DRAM behind a 16-row cache, so batches evict, on the cpu backend)."""
    opt = RowOptimizer(kind=kind_opt, lr=0.05)
    if kind == "cached":
        tables = [dataclasses.replace(TABLES[0], storage="dram", cache_rows=16), *TABLES[1:]]
        return CachedEmbeddingBagCollection(tables, CollectionSpec(opt, pooling, "cpu", seed=3))
    return EmbeddingBagCollection(TABLES, CollectionSpec(opt, pooling, kind, seed=3))


def snapshot(m: nn.Module) -> dict[str, Tensor]:
    """Table weights, optimizer state and the step, as the user sees them (logical rows)."""
    ebc = m.ebc if isinstance(m, DLRM) else m
    out = {"step": ebc.step.clone()}
    if isinstance(ebc, CachedEmbeddingBagCollection):
        for t in ebc.tables:
            out.update({f"{t.name}.{k}": v.clone() for k, v in ebc.read_table(t.name).items()})
        return out
    out["weights"] = ebc.weights.clone()
    out.update({k: v.clone() for k, v in ebc.optimizer_state().items()})
    return out


def same(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Names of the tensors that differ (bitwise, NaN included)."""
    return [k for k in a if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def train_step(m: nn.Module, sparse: SparseFeatures, seed: int = 0) -> Tensor:
    """Forward and backward with a fixed random output gradient (the fused update runs)."""
    out = m(sparse)
    g = torch.Generator().manual_seed(seed)
    (out * torch.randn(out.shape, generator=g)).sum().backward()
    return out


def reject(
    c: Campaign, name: str, m: nn.Module, fn: Callable[[], Any], match: str | tuple[str, ...]
) -> None:
    """``fn`` must be refused with a one-line NeorecError, leaving ``m``'s tables as they were."""
    before = snapshot(m)
    c.expect_error(name, fn, match)
    changed = same(before, snapshot(m))
    if changed:
        case = c.cases[-1]
        c.cases[-1] = dataclasses.replace(
            case, outcome="data lost", detail=f"{changed} changed; {case.detail}"
        )


# ---- bad batches: (name, batch factory, what the message must name) -----------------------------
def _sf(keys: Any, values: Any, lengths: Any, weights: Any = None) -> Callable[[], SparseFeatures]:
    return lambda: SparseFeatures(keys, values, lengths, weights)


def _edit(fn: Callable[[SparseFeatures], None], seed: int = 11) -> Callable[[], SparseFeatures]:
    def make() -> SparseFeatures:
        sf = good_batch(seed)
        fn(sf)
        return sf

    return make


def _set_weight(pos: int, v: float) -> Callable[[SparseFeatures], None]:
    def fn(sf: SparseFeatures) -> None:
        assert sf.weights is not None
        sf.weights[pos] = v

    return fn


def _set_id(feature: str, v: int) -> Callable[[SparseFeatures], None]:
    def fn(sf: SparseFeatures) -> None:
        start = int(sf.lengths_per_key()[: sf.keys.index(feature)].sum())
        sf.values[start] = v

    return fn


def _retype(attr: str, dtype: torch.dtype) -> Callable[[], SparseFeatures]:
    def make() -> SparseFeatures:
        sf = good_batch(11)
        return SparseFeatures(
            sf.keys,
            sf.values.to(dtype) if attr == "values" else sf.values,
            sf.lengths.to(dtype) if attr == "lengths" else sf.lengths,
            sf.weights.to(dtype) if attr == "weights" and sf.weights is not None else sf.weights,
        )

    return make


def _lengths(edit: Callable[[Tensor], Tensor]) -> Callable[[], SparseFeatures]:
    def make() -> SparseFeatures:
        sf = good_batch(11)
        return SparseFeatures(sf.keys, sf.values, edit(sf.lengths.clone()), sf.weights)

    return make


def _neg_length(t: Tensor) -> Tensor:
    t[1], t[2] = -1, t[2] + 1
    return t


def _first_huge(t: Tensor) -> Tensor:
    t[0] = 2**62
    return t


def _select(keys: list[str]) -> Callable[[], SparseFeatures]:
    return lambda: good_batch(11).select(keys)


def _extra_feature() -> SparseFeatures:
    sf = good_batch(11)
    b = sf.batch_size
    return SparseFeatures(
        [*sf.keys, "zz"],
        sf.values,
        torch.cat([sf.lengths, torch.zeros(b, dtype=torch.int64)]),
        sf.weights,
    )


V, L = torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1, 0])
BAD_BATCHES: list[tuple[str, Callable[[], Any], str | tuple[str, ...]]] = [
    # constructor: types, shapes, devices
    ("keys a string", _sf("abcd", V, L), "list of feature names"),
    ("keys not strings", _sf([1, 2, 3, 4], V, L), "non-empty strings"),
    ("keys empty", _sf([], V, L), "at least one"),
    ("keys duplicated", _sf(["a", "a", "b", "c"], V, L), "duplicate"),
    ("values 2-D", _sf(KEYS, V.view(3, 1), L), "values must be a 1-D"),
    ("values a list", _sf(KEYS, [1, 2, 3], L), "values must be a 1-D"),
    ("values float", _sf(KEYS, V.float(), L), "integer ids"),
    ("values bool", _sf(KEYS, V > 1, L), "integer ids"),
    ("lengths float", _sf(KEYS, V, L.float()), "integer lengths"),
    ("lengths not F*B", _sf(KEYS, V, L[:3]), "not a multiple"),
    ("weights int64", _sf(KEYS, V, L, torch.tensor([1, 2, 3])), ("floating point", "int64")),
    ("weights shape", _sf(KEYS, V, L, torch.ones(4)), "shaped like values"),
    ("weights 2-D", _sf(KEYS, V, L, torch.ones(3, 1)), "shaped like values"),
    ("weights on meta", _sf(KEYS, V, L, torch.ones(3, device="meta")), "meta"),
    ("all on meta", _sf(KEYS, V.to("meta"), L.to("meta")), "meta"),
    # from_lists: Python values
    ("from_lists id 2**64", lambda: SparseFeatures.from_lists({"a": [[2**64]]}), "int64"),
    ("from_lists id 1.5", lambda: SparseFeatures.from_lists({"a": [[1.5]]}), "not an integer"),
    ("from_lists id True", lambda: SparseFeatures.from_lists({"a": [[True]]}), "not an integer"),
    ("from_lists id '3'", lambda: SparseFeatures.from_lists({"a": [["3"]]}), "not an integer"),
    (
        "from_lists weight 'x'",
        lambda: SparseFeatures.from_lists({"a": [[1]]}, {"a": [["x"]]}),
        "not a number",
    ),
    (
        "from_lists weights for other keys",
        lambda: SparseFeatures.from_lists({"a": [[1]]}, {"q": [[1.0]]}),
        "weights are given",
    ),
    (
        "from_lists batch sizes differ",
        lambda: SparseFeatures.from_lists({"a": [[1]], "c": [[1], [2]]}),
        "batch sizes",
    ),
    # values the module refuses at forward
    ("not a SparseFeatures", lambda: {"a": V}, "SparseFeatures"),
    ("missing features", _select(["a", "b"]), "missing"),
    ("unknown feature", _extra_feature, "zz"),
    ("negative length", _lengths(_neg_length), ("feature 'a'", "negative length")),
    ("length past the values", _lengths(_first_huge), ("feature 'a'", "exceeds")),
    ("lengths sum short", _lengths(lambda t: t.index_fill_(0, torch.tensor([0]), 0)), "sum"),
    ("id = rows", _edit(_set_id("b2", 7)), ("feature 'b2'", "table 'b'", "id 7")),
    ("id < 0", _edit(_set_id("c", -1)), ("feature 'c'", "id -1")),
    ("id 2**62", _edit(_set_id("a", 2**62)), ("feature 'a'", str(2**62))),
    ("id int64 max", _edit(_set_id("a", 2**63 - 1)), ("feature 'a'", str(2**63 - 1))),
    ("id int64 min", _edit(_set_id("a", -(2**63))), ("feature 'a'", str(-(2**63)))),
    ("weight NaN", _edit(_set_weight(0, math.nan)), ("feature 'a'", "nan")),
    ("weight +inf", _edit(_set_weight(-1, math.inf)), ("feature 'c'", "inf")),
    ("weight -inf", _edit(_set_weight(3, -math.inf)), "not finite"),
    ("weights float64", _retype("weights", torch.float64), ("float64", "float32")),
    ("weights float16", _retype("weights", torch.float16), ("float16", "float32")),
    ("weights bfloat16", _retype("weights", torch.bfloat16), "bfloat16"),
    ("ids uint8", _retype("values", torch.uint8), "uint8"),
    ("ids int16", _retype("values", torch.int16), "int16"),
    ("lengths int8", _retype("lengths", torch.int8), "int8"),
]


@pytest.mark.parametrize("kind", KINDS)
def test_api_bad_batches_change_nothing(kind: str) -> None:
    torch.manual_seed(0)
    m = make_ebc(kind)
    for i in range(2):  # non-trivial state and step first
        train_step(m, good_batch(i))
    for name, make, match in BAD_BATCHES:
        reject(C, f"{kind}: {name}", m, lambda make=make: train_step(m, make()), match)
    # Rejected at backward: ids / weights changed after forward, a non-finite output gradient.
    rejected_in_backward(C, kind, m)
    still_trains_like_a_twin(C, kind, m, steps=2)
    C.check()


def rejected_in_backward(c: Campaign, kind: str, m: nn.Module) -> None:
    """Batches that pass forward and are refused by backward (the kernel / the update checks)."""

    def mutated_id() -> None:
        sf = good_batch(12)
        out = m(sf)
        sf.values[-1] = 10**6  # the batch's tensor, changed after forward
        out.sum().backward()

    def mutated_weight() -> None:
        sf = good_batch(12)
        out = m(sf)
        assert sf.weights is not None
        sf.weights[1] = math.nan
        out.sum().backward()

    def nan_gradient() -> None:
        out = m(good_batch(13))
        (out * math.nan).sum().backward()

    def inf_gradient() -> None:
        out = m(good_batch(13))
        g = torch.zeros_like(out)
        g[2, 5] = math.inf
        (out * g).sum().backward()

    if kind != "cached":  # the cached collection has remapped the ids to slots at forward
        reject(c, f"{kind}: id changed after forward", m, mutated_id, "out of range")
    reject(c, f"{kind}: weight NaN after forward", m, mutated_weight, "not finite")
    reject(c, f"{kind}: NaN output gradient", m, nan_gradient, "not updated")
    reject(c, f"{kind}: inf output gradient", m, inf_gradient, ("sample 2", "inf"))


def still_trains_like_a_twin(c: Campaign, kind: str, m: nn.Module, steps: int) -> None:
    """After all those refusals, ``m`` trains exactly like a twin that never saw them."""
    torch.manual_seed(0)
    twin = make_ebc(kind)
    for i in range(2):
        train_step(twin, good_batch(i))
    for i in range(steps):
        train_step(m, good_batch(100 + i), seed=i)
        train_step(twin, good_batch(100 + i), seed=i)
    diff = same(snapshot(twin), snapshot(m))
    c.record(
        f"{kind}: trains on like a twin after the refusals",
        "data lost" if diff else "handled",
        f"differs: {diff}" if diff else "bitwise equal",
    )


# ---- specified non-errors --------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_api_zero_samples_order_int32_and_empty_mean_bags(kind: str) -> None:
    m, twin = make_ebc(kind), make_ebc(kind)
    for i in range(2):
        train_step(m, good_batch(i))
        train_step(twin, good_batch(i))
    # A zero-sample batch: [0, D] output; backward updates nothing and does not count a step.
    before = snapshot(m)
    empty = SparseFeatures(
        KEYS, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0)
    )
    out = train_step(m, empty)
    ok = tuple(out.shape) == (0, 16) and not same(before, snapshot(m))
    C.record(f"{kind}: zero-sample batch", "handled" if ok else "data lost", f"{tuple(out.shape)}")
    # Features in another order, ids and lengths as int32: the same step as the plain batch.
    sf = good_batch(20)
    shuffled = sf.select(["c", "b2", "a", "b"])
    narrow = SparseFeatures(sf.keys, sf.values.int(), sf.lengths.int(), sf.weights)
    for name, variant in (("features in another order", shuffled), ("int32 ids/lengths", narrow)):
        a, b = train_step(m, variant, seed=5), train_step(twin, sf, seed=5)
        ok = torch.equal(a, b) and not same(snapshot(twin), snapshot(m))
        C.record(f"{kind}: {name}", "handled" if ok else "data lost", "same output and update")
    C.check()


@pytest.mark.parametrize("kind", KINDS)
def test_api_mean_pooling_empty_bags(kind: str) -> None:
    """Mean of an empty bag is a zero row (as ``nn.EmbeddingBag``): finite, and no update."""
    m = make_ebc(kind, pooling="mean")
    lengths = torch.tensor([2, 0, 1, 0, 0, 0, 0, 3])  # features a, b, b2, c; batch of 2
    sf = SparseFeatures(KEYS, torch.tensor([1, 1, 4, 0, 1, 2]), lengths)
    before = snapshot(m)
    out = train_step(m, sf)
    after = snapshot(m)
    # columns: a 0:4, b 4:8, b2 8:12, c 12:16; sample 0 has a and b, sample 1 only c
    ok = bool(torch.isfinite(out).all()) and bool(out[1, 0:12].eq(0).all())
    ok = ok and bool(out[0, 8:16].eq(0).all())
    ok = ok and all(bool(torch.isfinite(v).all()) for v in after.values())
    C.record(f"{kind}: mean pooling with empty bags", "handled" if ok else "crash", str(out))
    assert same(before, after)  # (and the non-empty bags did train)
    C.check()


# ---- constructors -----------------------------------------------------------------------------
def _ns(**kw: Any) -> SimpleNamespace:
    return SimpleNamespace(**({"name": "t", "rows": 5, "dim": 4, "features": ["t"]} | kw))


BAD_COLLECTIONS: list[tuple[str, dict[str, Any], str | tuple[str, ...]]] = [
    ("tables empty", {"tables": []}, "non-empty list"),
    ("tables a string", {"tables": "a"}, "non-empty list"),
    ("table rows 0", {"tables": [_ns(rows=0)]}, ("table 0 't'", "rows")),
    ("table rows 2.5", {"tables": [_ns(rows=2.5)]}, "rows"),
    ("table rows True", {"tables": [_ns(rows=True)]}, "rows"),
    ("table dim -1", {"tables": [_ns(dim=-1)]}, "dim"),
    ("table without name", {"tables": [_ns(name="")]}, "name"),
    ("table features a string", {"tables": [_ns(features="t")]}, "features"),
    ("table features empty", {"tables": [_ns(features=[])]}, "features"),
    ("table features repeat", {"tables": [_ns(features=["x", "x"])]}, "repeat"),
    ("duplicate table names", {"tables": [_ns(), _ns(features=["u"])]}, "more than once"),
    ("feature in two tables", {"tables": [_ns(), _ns(name="u", features=["t"])]}, "feature 't'"),
    ("table rows 2**63-1", {"tables": [_ns(rows=2**63 - 1)]}, ("GiB", "'t'")),
    ("table rows 2**40", {"tables": [_ns(rows=2**40)]}, ("GiB", "'t'")),
    ("optimizer a string", {"optimizer": "adam"}, "RowOptimizer"),
    ("pooling max", {"pooling": "max"}, "pooling"),
    ("pooling None", {"pooling": None}, "pooling"),
    ("backend gpu", {"backend": "gpu"}, "gpu"),
    ("backend 3", {"backend": 3}, "backend"),
    ("device nonsense", {"device": "nonsense"}, "nonsense"),
    ("device meta", {"device": "meta"}, "meta"),
    ("init_scale NaN", {"init_scale": math.nan}, "init_scale"),
    ("init_scale -1", {"init_scale": -1.0}, "init_scale"),
    ("init_scale inf", {"init_scale": math.inf}, "init_scale"),
    ("init_scale '0.1'", {"init_scale": "0.1"}, "init_scale"),
    ("seed 1.5", {"seed": 1.5}, "seed"),
    ("validate_ids 'yes'", {"validate_ids": "yes"}, "validate_ids"),
]
if not torch.cuda.is_available():
    BAD_COLLECTIONS.append(("backend cuda without a GPU", {"backend": "cuda"}, "CUDA"))

BAD_OPTIMIZERS: list[tuple[str, dict[str, Any], str]] = [
    ("kind adamw", {"kind": "adamw"}, "adamw"),
    ("kind None", {"kind": None}, "None"),
    ("lr 0", {"lr": 0.0}, "lr"),
    ("lr -1", {"lr": -1.0}, "lr"),
    ("lr NaN", {"lr": math.nan}, "lr"),
    ("lr inf", {"lr": math.inf}, "lr"),
    ("lr 1e39 (not float32)", {"lr": 1e39}, "lr"),
    ("lr True", {"lr": True}, "lr"),
    ("lr '0.1'", {"lr": "0.1"}, "lr"),
    ("eps 0", {"eps": 0.0}, "eps"),
    ("eps 1e-50 (0 in float32)", {"eps": 1e-50}, "eps"),
    ("eps NaN", {"eps": math.nan}, "eps"),
    ("beta1 1.0", {"beta1": 1.0}, "beta1"),
    ("beta2 -0.1", {"beta2": -0.1}, "beta2"),
    ("beta1 NaN", {"beta1": math.nan}, "beta1"),
    ("weight_decay NaN", {"weight_decay": math.nan}, "weight_decay"),
    ("weight_decay -1", {"weight_decay": -1.0}, "weight_decay"),
    ("weight_decay inf", {"weight_decay": math.inf}, "weight_decay"),
]


@pytest.mark.parametrize("cls", [EmbeddingBagCollection, CachedEmbeddingBagCollection])
def test_api_bad_collection_arguments(cls: type) -> None:
    spec_fields = {f.name for f in dataclasses.fields(CollectionSpec)}

    def build(kw: dict[str, Any]) -> Any:
        args = {"tables": TABLES, **{k: v for k, v in kw.items() if k not in spec_fields}}
        spec = CollectionSpec(**{k: v for k, v in kw.items() if k in spec_fields})
        return cls(spec=spec, **args)

    for name, kw, match in BAD_COLLECTIONS:
        C.expect_error(f"{cls.__name__}: {name}", lambda kw=kw: build(kw), match)
    C.check()


def test_api_bad_row_optimizer() -> None:
    for name, kw, match in BAD_OPTIMIZERS:
        C.expect_error(f"RowOptimizer: {name}", lambda kw=kw: RowOptimizer(**kw), match)
    C.check()


# ---- through the DLRM ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_api_dlrm_bad_batches_change_nothing(backend: str) -> None:
    cfg = ModelConfig(num_dense=3, bottom_mlp=[8, 4], top_mlp=[6, 1])
    spec = CollectionSpec(RowOptimizer(kind="adam", lr=0.05), backend=backend, seed=1)
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, spec), seed=1)
    opt = torch.optim.SGD(model.dense_parameters(), lr=0.1)

    def step(sparse: SparseFeatures, dense: Tensor | None = None, scale: float = 1.0) -> None:
        b = sparse.batch_size
        dense = (
            torch.randn(b, 3, generator=torch.Generator().manual_seed(b))
            if dense is None
            else dense
        )
        labels = (torch.arange(b) % 2).float()
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels, reduction="sum")
        opt.zero_grad()
        (loss * scale).backward()
        opt.step()

    for i in range(2):
        step(good_batch(i))
    for name, make, match in BAD_BATCHES:
        if "from_lists" in name or name.startswith(
            ("keys", "values", "lengths not", "all on", "not")
        ):
            continue  # refused while the batch is built: the model is not reached
        reject(C, f"dlrm {backend}: {name}", model, lambda make=make: step(make()), match)
    reject(
        C,
        f"dlrm {backend}: NaN loss",
        model,
        lambda: step(good_batch(3), scale=math.nan),
        "not updated",
    )
    nan_dense = torch.full((BATCH, 3), math.nan)
    reject(
        C,
        f"dlrm {backend}: NaN dense features",
        model,
        lambda: step(good_batch(3), nan_dense),
        "not updated",
    )
    before = snapshot(model)
    empty = SparseFeatures(
        KEYS, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    step(empty, torch.zeros(0, 3))
    diff = same(before, snapshot(model))
    C.record(f"dlrm {backend}: zero-sample batch", "data lost" if diff else "handled", str(diff))
    C.check()


# ---- the TBE op itself ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_api_tbe_op_inputs(backend: str) -> None:
    """Malformed input straight to a backend: refused before anything is read or written."""
    from neorec.ops.row_optim import zeros_state
    from neorec.ops.tbe import Lookup, PoolingMode, TBELayout, get_backend

    lay = TBELayout(rows=(6, 4), dims=(4, 2), feature_table=(0, 1, 0))
    be = get_backend(backend)
    g = torch.Generator().manual_seed(4)
    w0 = torch.randn(lay.total_elems, generator=g)
    idx = torch.tensor([0, 5, 1, 3, 2, 2, 4])
    off = torch.tensor([0, 2, 3, 4, 5, 7, 7])  # F=3, B=2
    psw = torch.rand(7, generator=g)
    grad = torch.randn(2, lay.total_dim, generator=g)
    opt = RowOptimizer(kind="adam")

    def fwd(**kw: Any) -> Callable[[], Any]:
        a = {"indices": idx, "offsets": off, "per_sample_weights": psw} | kw
        return lambda: be.forward(
            lay, w, Lookup(a["indices"], a["offsets"], a["per_sample_weights"], PoolingMode.SUM)
        )

    def bwd(**kw: Any) -> Callable[[], Any]:
        a = {"indices": idx, "offsets": off, "per_sample_weights": psw, "grad": grad} | kw
        return lambda: be.backward_update(
            lay, w, st, Lookup(a["indices"], a["offsets"], a["per_sample_weights"], PoolingMode.SUM),
            a["grad"], opt, 1,
        )  # fmt: skip

    decreasing = torch.tensor([0, 2, 1, 4, 5, 7, 7])
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("offsets decrease", {"offsets": decreasing}, "decrease"),
        ("offsets first < 0", {"offsets": off - 1}, "offsets"),
        ("offsets past the ids", {"offsets": off + 1}, "offsets"),
        ("offsets not F*B+1", {"offsets": off[:-1]}, "F*B+1"),
        ("offsets float", {"offsets": off.float()}, "offsets"),
        ("indices float", {"indices": idx.float()}, "indices"),
        ("id past its table", {"indices": torch.tensor([0, 5, 1, 4, 2, 2, 4])}, "out of range"),
        ("id < 0", {"indices": torch.tensor([0, 5, 1, 3, 2, 2, -1])}, "out of range"),
        ("weights float64", {"per_sample_weights": psw.double()}, "float32"),
        ("weights shape", {"per_sample_weights": psw[:5]}, "per_sample_weights"),
    ]
    for name, kw, match in cases:
        w = w0.clone()
        st = zeros_state("adam", lay.total_rows, lay.total_elems, torch.device("cpu"))
        for phase, fn in (("forward", fwd(**kw)), ("backward", bwd(**kw))):
            C.expect_error(f"{backend} op {phase}: {name}", fn, match)
            if not torch.equal(w, w0) or any(bool(v.ne(0).any()) for v in st.values()):
                C.cases[-1] = dataclasses.replace(C.cases[-1], outcome="data lost")
    w = w0.clone()
    st = zeros_state("adam", lay.total_rows, lay.total_elems, torch.device("cpu"))
    C.expect_error(f"{backend} op backward: grad shape", bwd(grad=grad[:1]), "grad_output")
    if not torch.equal(w, w0):
        C.cases[-1] = dataclasses.replace(C.cases[-1], outcome="data lost")
    C.check()


def test_api_dlrm_dense_inputs() -> None:
    """Dense features that do not match the model or the sparse batch: one clear error."""
    cfg = ModelConfig(num_dense=3, bottom_mlp=[8, 4], top_mlp=[6, 1])
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, CollectionSpec(backend="cpu", seed=1)), seed=1)
    sparse = good_batch(1)
    for name, dense, match in [
        ("dense batch != sparse batch", torch.randn(BATCH + 1, 3), "batch"),
        ("dense width != num_dense", torch.randn(BATCH, 5), "num_dense"),
        ("dense 1-D", torch.randn(BATCH), "dense"),
        ("dense float64", torch.randn(BATCH, 3).double(), "float64"),
        ("dense int64", torch.ones(BATCH, 3, dtype=torch.int64), "int64"),
        ("dense not a tensor", [[0.0] * 3] * BATCH, "dense"),
    ]:
        reject(C, f"dlrm: {name}", model, lambda d=dense: model(d, sparse), match)
    C.check()
