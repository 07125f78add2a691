"""The sequence (non-pooled) lookup against its specification: ``nn.Embedding`` per table plus
the reference row optimizer (``neorec.ops.row_optim.apply_rows``); and the C kernel against the
pooled C kernel on bags of length 1 (the same sort and fused update: bitwise)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from neorec.config import TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.sequence import SequenceEmbeddingCollection
from neorec.ops.row_optim import RowOptimizer, apply_rows, zeros_state
from neorec.ops.seq_lookup import as_pooled, get_seq_backend, seq_out_offsets
from neorec.ops.tbe import TBEIdError, TBELayout, get_backend
from neorec.sparse import JaggedFeatures, SparseFeatureError, from_torchrec, to_torchrec

pytestmark = pytest.mark.bitwise

OPTIMIZERS = ["sgd", "rowwise_adagrad", "adam"]
# Mixed dims; table 0 read by features 0 and 2 (history and candidate); feature 1 has no ids.
LAYOUT = TBELayout(rows=(40, 7, 30, 5), dims=(8, 4, 16, 3), feature_table=(0, 2, 0, 1))


def make_batch(seed: int, counts: tuple[int, ...] = (23, 0, 9, 6)) -> tuple[Tensor, list[int]]:
    """Ids of each feature of LAYOUT (few distinct: many repeats), and the feature offsets."""
    gen = torch.Generator().manual_seed(seed)
    ids = [
        torch.randint(0, min(6, LAYOUT.rows[t]), (n,), generator=gen)
        for n, t in zip(counts, LAYOUT.feature_table)
    ]
    fpos = [0]
    for n in counts:
        fpos.append(fpos[-1] + n)
    return torch.cat(ids), fpos


def run_kernel(
    kind: str, backend: str, steps: int = 3, wd: float = 0.0, clip: float = 0.0
) -> tuple[Tensor, dict]:
    """``steps`` updates of the sequence backend (or ``pooled``: the pooled cpu kernel on bags
    of length 1) from fixed weights, each on its own batch and gradient."""
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(LAYOUT.total_elems, generator=gen)
    st = zeros_state(kind, LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu"))
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=wd, clip_ratio=clip)
    for s in range(1, steps + 1):
        idx, fpos = make_batch(s)
        grad = torch.randn(seq_out_offsets(LAYOUT, fpos)[-1], generator=gen)
        if backend == "pooled":
            lookup, g = as_pooled(LAYOUT, idx, fpos, grad)
            get_backend("cpu").backward_update(LAYOUT, w, st, lookup, g, opt, s)
        else:
            get_seq_backend(backend).backward_update(LAYOUT, w, st, (idx, fpos), grad, opt, s)
    return w, st


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_forward_is_nn_embedding(backend: str, fast_paths: Any) -> None:
    w = torch.randn(LAYOUT.total_elems)
    idx, fpos = make_batch(1)
    out = get_seq_backend(backend).forward(LAYOUT, w, idx, fpos)
    oo = seq_out_offsets(LAYOUT, fpos)
    for f, t in enumerate(LAYOUT.feature_table):
        emb = torch.nn.Embedding.from_pretrained(LAYOUT.table(w, t))
        want = emb(idx[fpos[f] : fpos[f + 1]])
        assert torch.equal(out[oo[f] : oo[f + 1]].view_as(want), want)
    assert (fast_paths()["cpu.seq_forward"] > 0) == (backend == "cpu")


@pytest.mark.parametrize(("wd", "clip"), [(0.0, 0.0), (0.01, 0.0), (0.0, 0.1)])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_kernel_is_the_pooled_kernel_on_bags_of_one(kind: str, wd: float, clip: float) -> None:
    # wd = clip = 0: SGD and row-wise Adagrad take the blocked update; clip: CowClip's counts
    w_seq, st_seq = run_kernel(kind, "cpu", wd=wd, clip=clip)
    w_pool, st_pool = run_kernel(kind, "pooled", wd=wd, clip=clip)
    assert torch.equal(w_seq, w_pool)
    for k in st_seq:
        assert torch.equal(st_seq[k], st_pool[k])


@pytest.mark.parametrize("clip", [0.0, 0.1])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_equals_reference(kind: str, clip: float) -> None:
    w_cpu, st_cpu = run_kernel(kind, "cpu", wd=0.01, clip=clip)
    w_ref, st_ref = run_kernel(kind, "reference", wd=0.01, clip=clip)
    if kind == "sgd" and not clip:  # the same sums in the same order, one exact update: bitwise
        assert torch.equal(w_cpu, w_ref)
    torch.testing.assert_close(w_cpu, w_ref, rtol=1e-6, atol=1e-6)
    for k in st_ref:
        torch.testing.assert_close(st_cpu[k], st_ref[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cpu_bitwise_across_threads(kind: str) -> None:
    old = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(run_kernel(kind, "cpu"))
    finally:
        torch.set_num_threads(old)
    for w, st in runs[1:]:
        assert torch.equal(w, runs[0][0])
        assert all(torch.equal(st[k], runs[0][1][k]) for k in st)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_bad_id_is_refused_before_any_write(backend: str) -> None:
    w = torch.randn(LAYOUT.total_elems)
    w0 = w.clone()
    idx, fpos = make_batch(2)
    idx[fpos[3] + 2] = 7  # feature 3 reads table 1, of 7 rows
    be = get_seq_backend(backend)
    with pytest.raises(TBEIdError, match=r"feature 3 \(table 1, rows 7\): id 7 at position"):
        be.forward(LAYOUT, w, idx, fpos)
    st = zeros_state("adam", LAYOUT.total_rows, LAYOUT.total_elems, torch.device("cpu"))
    grad = torch.randn(seq_out_offsets(LAYOUT, fpos)[-1])
    with pytest.raises(TBEIdError):
        be.backward_update(LAYOUT, w, st, (idx, fpos), grad, RowOptimizer(kind="adam"), 1)
    assert torch.equal(w, w0)


# ---- the collection against nn.Embedding + the reference optimizer ---------------------------

TABLES = [
    TableConfig(name="item", rows=30, dim=8, features=["hist", "cand", "liked"]),
    TableConfig(name="cat", rows=6, dim=4, features=["hist_cat"]),
]
SEQ = ["hist", "cand", "hist_cat"]  # "liked" is a pooled bag over the item table


def collection_batch(seed: int) -> JaggedFeatures:
    """4 samples: histories of 0 to 9 ids (one empty), one candidate each, a pooled bag."""
    gen = torch.Generator().manual_seed(seed)
    lens = [0, 9, 4, 7]

    def seqs(n_of: list[int], rows: int) -> list[list[int]]:
        return [torch.randint(0, rows, (n,), generator=gen).tolist() for n in n_of]

    hist = seqs(lens, 8)  # few distinct items: repeats within and across samples
    return JaggedFeatures.from_sequences(
        {
            "hist": hist,
            "cand": seqs([1, 1, 1, 1], 8),
            "liked": seqs([2, 0, 3, 1], 8),
            "hist_cat": seqs(lens, 6),
        }
    )


def spec_step(
    tables: dict[str, Tensor], state: dict, batch: JaggedFeatures, grads: dict, opt, step: int
) -> None:
    """One step of the specification (float64): nn.Embedding lookups (pooled: the bag's sum),
    the loss sum(out * grad), autograd, then ``apply_rows`` on each touched row."""
    embs = {n: torch.nn.Embedding.from_pretrained(w, freeze=False) for n, w in tables.items()}
    table_of = {f: t.name for t in TABLES for f in t.features}
    loss = torch.zeros((), dtype=torch.float64)
    for f in batch.keys:
        s = batch.sequence(f)
        rows = embs[table_of[f]](s["values"])
        if f not in SEQ:
            bag = torch.repeat_interleave(torch.arange(batch.batch_size), s["lengths"])
            rows = torch.zeros(batch.batch_size, rows.shape[1], dtype=rows.dtype).index_add(
                0, bag, rows
            )
        loss = loss + (rows * grads[f].double()).sum()
    loss.backward()
    for name, emb in embs.items():
        ids = torch.cat([batch.sequence(f)["values"] for f in batch.keys if table_of[f] == name])
        u, counts = torch.unique(ids, return_counts=True)
        w = tables[name][u]
        st = {k: v[name][u] for k, v in state.items()}
        apply_rows(opt, w, emb.weight.grad[u], st, step, counts)
        tables[name][u] = w
        for k in state:
            state[k][name][u] = st[k]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_collection_matches_nn_embedding(kind: str, backend: str) -> None:
    opt = RowOptimizer(kind=kind, lr=0.05, weight_decay=0.01)
    ec = SequenceEmbeddingCollection(
        TABLES, CollectionSpec(optimizer=opt, backend=backend, seed=3), sequence_features=SEQ
    )
    tables = {t.name: ec.table_weight(t.name).double().clone() for t in TABLES}
    shapes = {"momentum1": lambda t: torch.zeros(t.rows, dtype=torch.float64)}
    shapes["exp_avg"] = shapes["exp_avg_sq"] = lambda t: torch.zeros(
        t.rows, t.dim, dtype=torch.float64
    )
    state = {k: {t.name: shapes[k](t) for t in TABLES} for k in ec.state_names}
    gen = torch.Generator().manual_seed(11)
    for step in (1, 2, 3):
        batch = collection_batch(step)
        out = ec.lookup(batch)
        for f in batch.keys:  # forward: exactly the rows (float32 sums of float32 rows)
            s = batch.sequence(f)
            rows = ec.table_weight(ec._table_by_feature[f])[s["values"]]
            if f in SEQ:
                assert torch.equal(out[f], rows)
            assert out[f].shape[0] == (rows.shape[0] if f in SEQ else batch.batch_size)
        grads = {f: torch.randn(out[f].shape, generator=gen) for f in batch.keys}
        sum((out[f] * grads[f]).sum() for f in batch.keys).backward()
        spec_step(tables, state, batch, grads, opt, step)
    assert int(ec.step) == 3
    for t in TABLES:
        got = ec.table_weight(t.name).double()
        torch.testing.assert_close(got, tables[t.name], rtol=1e-5, atol=2e-6)
    assert out["hist"].shape == (20, 8) and out["liked"].shape == (4, 8)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_pooled_features_equal_the_pooled_collection_bitwise(pooling: str) -> None:
    opt = RowOptimizer(kind="rowwise_adagrad", lr=0.05)
    spec = CollectionSpec(optimizer=opt, pooling=pooling, backend="cpu", seed=1)
    tables = [TableConfig(name="a", rows=20, dim=8, features=["x", "y"])]
    seq_ec = SequenceEmbeddingCollection(tables, spec, sequence_features=[])
    ebc = EmbeddingBagCollection(tables, spec)
    for s in (1, 2):
        batch = JaggedFeatures.from_sequences({"x": [[1, 2, 2], [], [3]], "y": [[2], [5, 1], []]})
        batch.weights = torch.rand(batch.values.numel()) + 0.5
        g = torch.randn(3, 16, generator=torch.Generator().manual_seed(s))
        a, b = seq_ec(batch), ebc(batch)
        assert torch.equal(torch.cat([a[:24].view(3, 8), a[24:].view(3, 8)], 1), b)
        (a * torch.cat([g[:, :8].reshape(-1), g[:, 8:].reshape(-1)])).sum().backward()
        (b * g).sum().backward()
    assert torch.equal(seq_ec.weights, ebc.weights)
    assert torch.equal(seq_ec.momentum1, ebc.momentum1)


def test_collection_refuses_bad_ids_naming_key_and_position() -> None:
    ec = SequenceEmbeddingCollection(TABLES, CollectionSpec(), sequence_features=SEQ)
    batch = collection_batch(1)
    s = batch.sequence("hist")
    batch.values[int(s["offsets"][2]) + 1] = 30  # sample 2, position 1 of 'hist'
    with pytest.raises(SparseFeatureError, match=r"'hist' sample 2 position 1.*id 30"):
        ec.lookup(batch)


def test_jagged_features_validation_and_slicing() -> None:
    j = JaggedFeatures.from_sequences(
        {"h": [[1, 2, 3], [], [4]], "c": [[5], [6], [7]]},
        timestamps={"h": [[1, 2, 2], [], [9]], "c": [[3], [3], [3]]},
        actions={"h": [[0, 1, 0], [], [2]], "c": [[0], [0], [0]]},
    )
    j.validate({"h": 10, "c": 8})
    assert j.key_offsets() == [0, 4, 7]
    sub = j.select_samples(1, 3).select(["c", "h"])
    assert sub.values.tolist() == [6, 7, 4] and sub.timestamps.tolist() == [3, 3, 9]
    assert sub.actions.tolist() == [0, 0, 2] and sub.lengths.tolist() == [1, 1, 0, 1]
    bad = JaggedFeatures(
        j.keys, j.values, j.lengths, timestamps=torch.tensor([1, 3, 2, 9, 3, 3, 3])
    )
    with pytest.raises(SparseFeatureError, match=r"'h' sample 0 position 2: timestamp 2 is before"):
        bad.validate()
    with pytest.raises(SparseFeatureError, match="timestamps must be a tensor shaped like values"):
        JaggedFeatures(j.keys, j.values, j.lengths, timestamps=torch.tensor([1]))


def test_torchrec_round_trip() -> None:
    pytest.importorskip("torchrec")
    j = JaggedFeatures.from_sequences(
        {"h": [[1, 2], [3]], "c": [[4], [5]]},
        timestamps={"h": [[1, 2], [3]], "c": [[1], [1]]},
    )
    kjt = to_torchrec(j)
    assert kjt.keys() == ["h", "c", "h_ts", "c_ts"]
    back = from_torchrec(kjt)
    assert back.keys == j.keys and torch.equal(back.values, j.values)
    assert torch.equal(back.lengths, j.lengths) and torch.equal(back.timestamps, j.timestamps)
    assert back.actions is None
