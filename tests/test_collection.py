"""Every embedding collection implements ``EmbeddingCollection``: the interface the trainer,
pipelines, summary and checkpoints use (no attribute probing). Each kind is built from a config
by the builder, trained a step, and asked the same questions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from neorec.builder import build_collection, sharded_collection
from neorec.config import (
    Config,
    EmbeddingConfig,
    ModelConfig,
    StorageConfig,
    TableConfig,
    TrainConfig,
)
from neorec.distributed.dynamic_sharded import ShardedDynamicEmbeddingBagCollection
from neorec.distributed.sharded import ShardedEmbeddingBagCollection
from neorec.modules.collection import STATE_NAMES, EmbeddingCollection
from neorec.modules.embedding import EmbeddingBagCollection
from neorec.modules.embedding_groups import GroupedEmbeddingBagCollection
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sparse import SparseFeatures
from neorec.storage.cached import CachedEmbeddingBagCollection
from neorec.storage.dynamic import DynamicEmbeddingBagCollection
from neorec.storage.dynamic_cached import DynamicCachedEmbeddingBagCollection
from neorec.storage.mixed import MixedEmbeddingBagCollection

B = 16

# kind -> (tables, the class the builder must choose)
KINDS: dict[str, tuple[list[dict[str, Any]], type]] = {
    "plain": ([{}, {}], EmbeddingBagCollection),
    "grouped": ([{"precision": "bf16"}, {}], GroupedEmbeddingBagCollection),
    "cached": ([{"storage": "dram", "cache_rows": 50}, {}], CachedEmbeddingBagCollection),
    "dynamic": ([{"kind": "dynamic", "capacity": 40}] * 2, DynamicEmbeddingBagCollection),
    "dynamic_cached": (
        [{"kind": "dynamic", "capacity": 40, "storage": "dram", "cache_rows": 40}] * 2,
        DynamicCachedEmbeddingBagCollection,
    ),
    "mixed": ([{"kind": "dynamic", "capacity": 40}, {}], MixedEmbeddingBagCollection),
}


def _cfg(tmp_path: Any, specs: list[dict[str, Any]], optimizer: str = "adam") -> Config:
    tables = [
        TableConfig(name=f"t{i}", rows=60, dim=4, features=[f"f{i}"], **s)
        for i, s in enumerate(specs)
    ]
    return Config(
        model=ModelConfig(bottom_mlp=[8, 4]),
        embedding=EmbeddingConfig(tables=tables, optimizer=optimizer, backend="reference"),
        train=TrainConfig(seed=3),
        storage=StorageConfig(dir=str(tmp_path / "stores")),
    )


def _batch(names: list[str], seed: int = 0) -> SparseFeatures:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(names) * B,), generator=g)
    values = torch.randint(0, 60, (int(lengths.sum()),), generator=g)
    return SparseFeatures(names, values, lengths)


def _exercise(ebc: EmbeddingCollection, optimizer: str) -> None:
    """The interface's answers, and one training step through it."""
    assert isinstance(ebc, EmbeddingCollection)
    names = list(ebc.feature_names)
    assert names == [f for t in ebc.tables for f in t.features]
    seen: list[int] = []
    ebc.add_update_hook(lambda layout, indices, offsets: seen.append(indices.numel()))
    batch = _batch(names)
    ebc.prefetch(batch)  # nothing or a row cache's reads: either way the same step follows
    ebc.stage_input_dist(batch, batch)
    out = ebc(batch)
    assert out.shape == (B, ebc.output_dim)
    out.sum().backward()
    assert seen, "the update hook was not called"
    assert ebc.fused_steps() == 1
    want = {"sgd": [], "rowwise_adagrad": ["momentum1"], "adam": ["exp_avg", "exp_avg_sq"]}
    assert sorted(ebc.state_names) == sorted(want[optimizer])
    assert set(ebc.state_names) <= set(STATE_NAMES)
    state = ebc.optimizer_state()
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    assert all(k.rsplit(".", 1)[-1].removeprefix("dp_") in ebc.state_names for k in state)
    for t in ebc.tables:
        assert ebc.table_weight(t.name).shape[1] == t.dim
    assert isinstance(ebc.stats(), dict)
    ebc.flush()
    ebc.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_collection_answers_the_interface(tmp_path: Any, kind: str) -> None:
    specs, cls = KINDS[kind]
    cfg = _cfg(tmp_path, specs)
    ebc = build_collection(cfg)
    assert type(ebc) is cls
    _exercise(ebc, "adam")


@pytest.mark.parametrize("dynamic", [False, True])
def test_sharded_collections_answer_the_interface(tmp_path: Any, dynamic: bool) -> None:
    """One rank: the sharded collection (and the row-wise-by-hash dynamic one) without a group."""
    specs = [{"kind": "dynamic", "capacity": 40}] * 2 if dynamic else [{}, {}]
    cfg = _cfg(tmp_path, specs, optimizer="rowwise_adagrad")
    plan = plan_by_type([t for t in cfg.embedding.tables if t.kind != "dynamic"], 1, 1)
    ebc = sharded_collection(cfg, plan)
    cls = ShardedDynamicEmbeddingBagCollection if dynamic else ShardedEmbeddingBagCollection
    assert type(ebc) is cls
    _exercise(ebc, "rowwise_adagrad")


def test_a_collection_must_implement_the_interface() -> None:
    """The interface is abstract: a class that leaves a part out cannot be built."""

    class Partial(EmbeddingCollection):
        def forward(self, sparse: SparseFeatures) -> torch.Tensor:
            return torch.zeros(0)

    with pytest.raises(TypeError, match="abstract"):
        Partial()  # type: ignore[abstract]
