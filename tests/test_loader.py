"""ShardedReader: every sample once per epoch on any number of ranks; exact resume; training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_preprocess import make_lines, write

from neorec.config import Config, DataConfig, EmbeddingConfig, ModelConfig, TableConfig, TrainConfig
from neorec.data.loader import SampleOrder, ShardedReader
from neorec.data.preprocess import PreprocessOptions, preprocess

N = 1003  # not a multiple of the batch: the last global batch splits unevenly


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Samples whose C1 row is their line number (a unique id), in two files and 9 shards."""
    d = tmp_path_factory.mktemp("loader")
    lines = make_lines(N, 11)
    lines = [
        ln.split("\t", 14)[:14] + [f"{i:08x}", ln.split("\t", 15)[15]] for i, ln in enumerate(lines)
    ]
    text = ["\t".join(p) for p in lines]
    files = [write(d / "day_0.tsv", text[:600]), write(d / "day_1.tsv", text[600:])]
    opts = PreprocessOptions(rows=[2048] + [1000] * 25, shard_rows=128, workers=1)
    preprocess(files, d / "out", opts)
    return d / "out"


def ids(batch) -> list[int]:
    """The unique sample ids (C1 rows) of a batch."""
    return batch.sparse.values[: batch.size].tolist()


def epoch_ids(path: Path, world: int, batch: int = 60, **kw) -> list[list[int]]:
    """Each global batch's ids, rebuilt from the ranks' parts in rank order."""
    readers = [ShardedReader(path, batch, rank=r, world_size=world, **kw) for r in range(world)]
    return [sum((ids(p) for p in parts), []) for parts in zip(*readers, strict=True)]


@pytest.mark.parametrize("world", [2, 3])
def test_every_sample_once_per_epoch_on_any_ranks(data: Path, world: int) -> None:
    one = epoch_ids(data, 1, order=SampleOrder(seed=5, shuffle_buffer=300))
    assert sorted(sum(one, [])) == list(range(N))  # each sample exactly once
    assert [len(b) for b in one] == [60] * 16 + [43]
    assert (
        epoch_ids(data, world, order=SampleOrder(seed=5, shuffle_buffer=300)) == one
    )  # same global batches


def test_shuffle_per_epoch_and_deterministic(data: Path) -> None:
    r = ShardedReader(data, 100, order=SampleOrder(seed=1, shuffle_buffer=256))
    e0 = [i for b in r for i in ids(b)]
    e1 = [i for b in r for i in ids(b)]  # iterating again reads the next epoch
    assert sorted(e0) == sorted(e1) == list(range(N)) and e0 != e1
    again = ShardedReader(data, 100, order=SampleOrder(seed=1, shuffle_buffer=256))
    assert [i for b in again for i in ids(b)] == e0
    other = ShardedReader(data, 100, order=SampleOrder(seed=2, shuffle_buffer=256))
    assert [i for b in other for i in ids(b)] != e0
    plain = ShardedReader(data, 100, order=SampleOrder(shuffle=False))
    assert [i for b in plain for i in ids(b)] == list(range(N))


@pytest.mark.parametrize(("before", "after", "workers"), [(2, 3, 0), (3, 1, 2)])
def test_resume_mid_epoch_exact(data: Path, before: int, after: int, workers: int) -> None:
    kw = {"order": SampleOrder(seed=7, shuffle_buffer=200)}
    full = epoch_ids(data, 1, **kw)
    first = [
        ShardedReader(data, 60, rank=r, world_size=before, workers=workers, prefetch=3, **kw)
        for r in range(before)
    ]
    its = [iter(r) for r in first]
    seen = [sum((ids(next(it)) for it in its), []) for _ in range(5)]  # stop after 5 batches
    state = first[0].state_dict()
    assert all(r.state_dict() == state for r in first) and state["next_batch"] == 5
    for r in first:
        r.close()
    rest = [ShardedReader(data, 60, rank=r, world_size=after, **kw) for r in range(after)]
    for r in rest:
        r.load_state_dict(state)
    seen += [sum((ids(p) for p in parts), []) for parts in zip(*rest, strict=True)]
    assert seen == full  # nothing seen twice, nothing skipped
    assert rest[0].state_dict()["epoch"] == 1


def test_resume_refuses_other_data_or_seed(data: Path) -> None:
    r = ShardedReader(data, 60, order=SampleOrder(seed=1))
    next(iter(r))
    with pytest.raises(ValueError, match="seed"):
        ShardedReader(data, 60, order=SampleOrder(seed=2)).load_state_dict(r.state_dict())
    with pytest.raises(ValueError, match="not a batch boundary"):
        ShardedReader(data, 50, order=SampleOrder(seed=1)).load_state_dict(r.state_dict())
    r2 = ShardedReader(
        data, 30, order=SampleOrder(seed=1)
    )  # another batch size at a common boundary is fine
    r2.load_state_dict(r.state_dict())
    assert r2.next_batch == 2


def test_train_from_preprocessed_directory(data: Path, tmp_path: Path) -> None:
    from neorec.train.trainer import Trainer

    tables = [
        TableConfig(name=f"C{j + 1}", rows=2048 if j == 0 else 1000, dim=4) for j in range(26)
    ]
    cfg = Config(
        model=ModelConfig(bottom_mlp=[8, 4], top_mlp=[8, 1]),
        embedding=EmbeddingConfig(tables=tables, backend="reference"),
        data=DataConfig(source="criteo", path=str(data), batch_size=100, workers=1),
        train=TrainConfig(epochs=2, run_dir=str(tmp_path), progress=False),
    )
    t = Trainer(cfg)
    result = t.fit()
    # train = day_0's 600 samples (6 batches per epoch), eval = day_1's 403
    assert result["train"]["steps"] == 12 and result["train"]["samples"] == 1200
    assert 0.0 <= result["eval"]["auc"] <= 1.0
    assert t.source.state_dict()["epoch"] == 2
    assert torch.isfinite(torch.tensor(result["train"]["final_loss"]))


def test_split_from_manifest_and_legacy(data: Path, tmp_path: Path) -> None:
    import json
    import shutil

    from neorec.config import ConfigError
    from neorec.data.loader import _split

    train, evals = _split(str(data), "")
    assert (train.num_samples, evals.num_samples) == (600, 403)  # default: the last file
    legacy = tmp_path / "legacy"
    shutil.copytree(data, legacy)
    m = json.loads((legacy / "manifest.json").read_text())
    for s in m["shards"]:
        del s["split"]
    (legacy / "manifest.json").write_text(json.dumps(m))
    train, evals = _split(str(legacy), "")
    assert (train.num_samples, evals.num_samples) == (600, 403)
    m["sources"] = m["sources"][:1]
    for s in m["shards"]:
        s["source"] = 0
    (legacy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ConfigError, match="no held-out split"):
        _split(str(legacy), "")
