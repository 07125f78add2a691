"""The DLRM module against a plain per-table implementation (nn.EmbeddingBag + loops)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from neorec.config import ModelConfig, TableConfig
from neorec.modules.collection import CollectionSpec
from neorec.modules.dlrm import DLRM, CrossNet, DotInteraction
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.ops.row_optim import RowOptimizer
from neorec.sparse import SparseFeatureError, SparseFeatures

# Bitwise equalities: make test-isa reruns them under every other vector ISA of the CPU.
pytestmark = pytest.mark.bitwise

TABLES = [
    TableConfig(name="a", rows=11, dim=4),
    TableConfig(name="b", rows=7, dim=4, features=["b", "b2"]),
    TableConfig(name="c", rows=3, dim=4),
]


def random_batch(b: int, seed: int, weighted: bool = False):
    g = torch.Generator().manual_seed(seed)
    feats = {}
    for t in TABLES:
        for f in t.features:
            lens = torch.randint(0, 4, (b,), generator=g)
            feats[f] = [torch.randint(0, t.rows, (int(n),), generator=g).tolist() for n in lens]
    w = None
    if weighted:
        w = {
            f: [[float(x) for x in torch.rand(len(bag), generator=g)] for bag in bags]
            for f, bags in feats.items()
        }
    sparse = SparseFeatures.from_lists(feats, w)
    dense = torch.randn(b, 5, generator=g)
    labels = (torch.rand(b, generator=g) < 0.4).float()
    return dense, sparse, labels


def plain_pooled(model: DLRM, sparse: SparseFeatures, mode: str = "sum") -> torch.Tensor:
    outs = []
    for t in TABLES:
        bag = nn.EmbeddingBag(t.rows, t.dim, mode=mode)
        bag.weight.data.copy_(model.ebc.table_weight(t.name))
        for f in t.features:
            v, lens, w = sparse.feature(f)
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
            outs.append(bag(v, offs, per_sample_weights=w))
    return torch.stack(outs, dim=1)  # [B, F, D]


def plain_dot(x, emb):
    t = torch.cat([x.unsqueeze(1), emb], dim=1)
    pairs = [(t[:, i] * t[:, j]).sum(-1) for i in range(t.shape[1]) for j in range(i)]
    return torch.cat([x, torch.stack(pairs, dim=1)], dim=1)


@pytest.mark.parametrize("interaction", ["dot", "dcn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_dlrm_forward_equals_plain(interaction, weighted):
    cfg = ModelConfig(num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1], interaction=interaction)
    ebc = EmbeddingBagCollection(TABLES, CollectionSpec(backend="reference", seed=3))
    model = DLRM(cfg, ebc, seed=3)
    dense, sparse, _ = random_batch(6, seed=1, weighted=weighted)
    pooled = plain_pooled(model, sparse)
    x = model.dense_arch.bottom(dense)
    if interaction == "dot":
        z = plain_dot(x, pooled)
    else:
        cross = model.dense_arch.interaction
        x0 = torch.cat([x, pooled.flatten(1)], 1)
        z = x0
        for lin in cross.w:
            z = x0 * lin(z) + z
    expected = model.dense_arch.top(z).squeeze(1)
    torch.testing.assert_close(model(dense, sparse), expected, rtol=1e-5, atol=1e-6)


def test_dot_interaction_and_low_rank_cross_shapes():
    x, emb = torch.randn(3, 4), torch.randn(3, 5, 4)
    torch.testing.assert_close(DotInteraction(5, 4)(x, emb), plain_dot(x, emb))
    assert DotInteraction(5, 4, self_interaction=True).out_dim == 4 + 21
    assert CrossNet(24, 2, low_rank=3)(x, emb).shape == (3, 24)


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_training_steps_equal_plain_autograd(kind):
    """Fused embedding update + dense torch.optim == dense autograd grads + row optimizer math."""
    cfg = ModelConfig(num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1])
    opt = RowOptimizer(kind=kind, lr=0.1)
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, CollectionSpec(opt, backend="reference")))
    tables = {
        t.name: model.ebc.table_weight(t.name).clone().double().requires_grad_() for t in TABLES
    }
    state = {
        t.name: {
            "s": torch.zeros(t.rows, dtype=torch.float64),
            "m": torch.zeros(t.rows, t.dim, dtype=torch.float64),
            "v": torch.zeros(t.rows, t.dim, dtype=torch.float64),
        }
        for t in TABLES
    }
    dense_ref = copy.deepcopy(model.dense_arch).double()
    dopt = torch.optim.SGD(model.dense_parameters(), lr=0.05)
    dopt_ref = torch.optim.SGD(dense_ref.parameters(), lr=0.05)
    for step in range(1, 4):
        dense, sparse, labels = random_batch(8, seed=10 + step)
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        dopt.zero_grad()
        loss.backward()
        dopt.step()
        assert model.ebc.weights.grad is None
        # Reference: dense autograd on float64 copies, then the documented row math.
        pooled = []
        for t in TABLES:
            for f in t.features:
                v, lens, _ = sparse.feature(f)
                offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)[:-1]])
                pooled.append(F.embedding_bag(v, tables[t.name], offs, mode="sum"))
        logits = dense_ref(dense.double(), torch.cat(pooled, 1))
        ref_loss = F.binary_cross_entropy_with_logits(logits, labels.double())
        dopt_ref.zero_grad()
        grads = torch.autograd.grad(ref_loss, list(tables.values()), retain_graph=True)
        ref_loss.backward()
        dopt_ref.step()
        with torch.no_grad():
            for (name, w), g in zip(tables.items(), grads):
                rows = g.abs().sum(1) > 0
                st = state[name]
                if kind == "sgd":
                    w[rows] -= 0.1 * g[rows]
                elif kind == "rowwise_adagrad":
                    st["s"][rows] += (g[rows] ** 2).mean(1)
                    w[rows] -= 0.1 * g[rows] / (st["s"][rows].sqrt() + 1e-8).unsqueeze(1)
                else:
                    st["m"][rows] = 0.9 * st["m"][rows] + 0.1 * g[rows]
                    st["v"][rows] = 0.999 * st["v"][rows] + 0.001 * g[rows] ** 2
                    mh = st["m"][rows] / (1 - 0.9**step)
                    vh = st["v"][rows] / (1 - 0.999**step)
                    w[rows] -= 0.1 * mh / (vh.sqrt() + 1e-8)
    for name, w in tables.items():
        torch.testing.assert_close(model.ebc.table_weight(name).double(), w, rtol=1e-5, atol=1e-6)
    for p, q in zip(model.dense_parameters(), dense_ref.parameters()):
        torch.testing.assert_close(p.double(), q, rtol=1e-4, atol=1e-6)


def test_feature_order_and_errors():
    cfg = ModelConfig(num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1])
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, CollectionSpec(backend="reference")))
    dense, sparse, _ = random_batch(4, seed=5)
    out = model(dense, sparse)
    parts = {k: sparse.feature(k) for k in sparse.keys}
    rev = list(reversed(sparse.keys))
    shuffled = SparseFeatures(
        rev, torch.cat([parts[k][0] for k in rev]), torch.cat([parts[k][1] for k in rev])
    )
    torch.testing.assert_close(model(dense, shuffled), out)
    bad = SparseFeatures(["a", "b"], torch.tensor([1]), torch.tensor([1, 0]))
    with pytest.raises(SparseFeatureError, match=r"missing \['b2', 'c'\]"):
        model.ebc(bad)
    big = SparseFeatures(sparse.keys, sparse.values.clone(), sparse.lengths)
    big.values[0] = 1000
    with pytest.raises(SparseFeatureError, match=r"id 1000 >= table rows"):
        model.ebc(big)


def test_eval_no_grad_does_not_update():
    cfg = ModelConfig(num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1])
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, CollectionSpec(backend="reference")))
    before = model.ebc.weights.clone()
    dense, sparse, _ = random_batch(4, seed=6)
    with torch.no_grad():
        model(dense, sparse)
    assert torch.equal(before, model.ebc.weights) and int(model.ebc.step) == 0


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_zero_sample_batch_and_refused_backward_leave_the_step(backend):
    """Adam's bias correction counts steps: a zero-sample batch or a refused update is none."""
    from neorec.ops.tbe import NonFiniteGradientError

    ebc = EmbeddingBagCollection(TABLES, CollectionSpec(RowOptimizer(kind="adam"), backend=backend))
    keys = ebc.feature_names
    empty = SparseFeatures(
        keys, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    out = ebc(empty)
    assert out.shape == (0, ebc.output_dim)
    before = ebc.weights.clone()
    out.sum().backward()
    assert int(ebc.step) == 0 and torch.equal(before, ebc.weights)
    _, sparse, _ = random_batch(4, seed=7)
    with pytest.raises(NonFiniteGradientError, match="not updated"):
        (ebc(sparse) * float("nan")).sum().backward()
    assert int(ebc.step) == 0 and torch.equal(before, ebc.weights)
    assert all(not bool(s.ne(0).any()) for s in ebc.optimizer_state().values())
    ebc(sparse).sum().backward()
    assert int(ebc.step) == 1


def test_float64_and_nan_per_id_weights_are_refused():
    cfg = ModelConfig(num_dense=5, bottom_mlp=[8, 4], top_mlp=[6, 1])
    model = DLRM(cfg, EmbeddingBagCollection(TABLES, CollectionSpec(backend="reference")))
    dense, sparse, _ = random_batch(4, seed=8, weighted=True)
    assert sparse.weights is not None
    as64 = SparseFeatures(sparse.keys, sparse.values, sparse.lengths, sparse.weights.double())
    with pytest.raises(SparseFeatureError, match="float64"):
        model(dense, as64)
    sparse.weights[0] = float("inf")
    with pytest.raises(SparseFeatureError, match="not finite"):
        model(dense, sparse)
