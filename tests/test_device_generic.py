"""The device-generic runtime (``train.device``): a CUDA request refused cleanly on this CPU machine,
the process group backend following the device, the deferred NaN guard, and no host sync inside a
training step of the sharded path (one process, and 2 gloo ranks table-wise / row-wise).

The host-sync check patches the methods that read a tensor back to the host (``item``, ``cpu``,
``tolist``, ``numpy``, ``__int__``, ``__bool__``, ``__float__``) to raise when neorec's runtime
calls them inside a step (after a warm-up step). Calls from the TBE kernel layer (``neorec/ops``,
owned elsewhere: per-feature bounds and input checks of each backend) are recorded, not refused,
and must stay within the known sites listed in ``OPS_SITES``; torch's own Python code is out of
scope (its CPU-side reads, e.g. optimizer step counters, are not device syncs on a GPU).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dist_util import DEVICE, run_ranks

import neorec
from neorec.checkpoint.tracker import DirtyRowTracker
from neorec.config import (
    Config,
    ConfigError,
    DataConfig,
    EmbeddingConfig,
    ModelConfig,
    TableConfig,
    TrainConfig,
)
from neorec.config.load import load_config
from neorec.data.batch import Batch
from neorec.distributed.comm import process_group_backend, rank_device
from neorec.distributed.model_parallel import DistributedModel
from neorec.sharding.types import plan_by_type
from neorec.sparse import SparseFeatures
from neorec.train.pipeline import make_pipeline
from neorec.train.steps import LossGuard, TrainingDiverged, make_dense_optimizer, train_step

NO_CUDA = not torch.cuda.is_available()
PKG = Path(neorec.__file__).resolve().parent
OPS = PKG / "ops"
TABLES = [
    TableConfig(name="a", rows=37, dim=4),
    TableConfig(name="b", rows=9, dim=4, features=["b", "b2"]),
    TableConfig(name="c", rows=50, dim=4),
]
B = 8
_PATCHED = ("item", "cpu", "tolist", "numpy", "__int__", "__bool__", "__float__")


class HostSync(AssertionError):
    """A tensor was read back to the host inside a step."""


@contextlib.contextmanager
def no_host_sync(ops_sites: set[str]) -> Iterator[None]:
    """Make neorec's runtime code raise ``HostSync`` on any read of a tensor to the host."""
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def guard(name: str):  # noqa: ANN202
        orig = saved[name]

        def patched(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            if path.is_relative_to(PKG):
                where = f"{path.relative_to(PKG.parent)}:{caller.f_code.co_name}"
                if not path.is_relative_to(OPS):
                    raise HostSync(f"Tensor.{name} at {where} line {caller.f_lineno}")
                ops_sites.add(where)
            return orig(self, *a, **k)

        return patched

    for name in _PATCHED:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


# The kernel layer's host reads (neorec/ops, not this runtime's), per backend: the offsets' first
# and last entries (cpu), per-feature bounds and id checks (reference; the cuda and triton
# backends read the same bounds). Listed so that a new one is noticed; removing them (bounds
# passed in from the host plan, checks done there) is the kernel layer's part of issue 22.
OPS_SITES = {
    "cpu": {"neorec/ops/cpu.py:_prepare"},  # int(offsets[0]), int(offsets[-1])
    "reference": {  # (when the C kernel cannot be built here)
        "neorec/ops/tbe.py:forward",  # per-feature bounds
        "neorec/ops/tbe.py:row_grads",
        "neorec/ops/tbe_checks.py:check_ids",
        "neorec/ops/tbe_checks.py:check_offsets",
    },
    # Read from the code (no GPU here): NEOREC_TEST_DEVICE=cuda runs this file on a GPU host.
    "cuda": {"neorec/ops/cuda.py:_bounds", "neorec/ops/cuda.py:_check_ids"},
    "triton": {"neorec/ops/triton_tbe.py:__init__", "neorec/ops/triton_tbe.py:row_grads"},
}


def _cfg(opt: str) -> Config:
    return Config(
        model=ModelConfig(num_dense=3, bottom_mlp=[4, 4], top_mlp=[4, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in TABLES], optimizer=opt, lr=0.1
        ),
        data=DataConfig(batch_size=B),
        train=TrainConfig(dense_optimizer="sgd", dense_lr=0.1, seed=3, device=DEVICE),
    )


def _batch(seed: int, world: int, rank: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for t in TABLES:
        for _ in t.features:
            lens = torch.randint(0, 4, (B,), generator=g)
            lengths.append(lens)
            values.append(torch.randint(0, t.rows, (int(lens.sum()),), generator=g))
    feats = [f for t in TABLES for f in t.features]
    sparse = SparseFeatures(feats, torch.cat(values), torch.cat(lengths))
    full = Batch(torch.randn(B, 3, generator=g), sparse, (torch.rand(B, generator=g) < 0.5).float())
    b = B // world
    return full.slice(rank * b, (rank + 1) * b)


def _train_without_sync(rank: int, world: int, kind: str, opt: str, pipeline: str) -> None:
    cfg = _cfg(opt)
    plan = plan_by_type(cfg.embedding.tables, world, world, kind)
    model = DistributedModel(cfg, plan)
    dense_opt = make_dense_optimizer(cfg, model.dense_parameters())
    guard, sites, patched_steps = LossGuard(), set(), []
    tracker = DirtyRowTracker(model.ebc)  # checkpoints' dirty rows: marked inside the step

    def step_fn(m, o, batch, step, bf16):  # noqa: ANN001, ANN202
        if step == 1:  # warm-up: first reads of host mirrors (the tables' step counters)
            return train_step(m, o, batch, step, bf16, guard=guard)
        with no_host_sync(sites):
            loss = train_step(m, o, batch, step, bf16, guard=guard)
        patched_steps.append(step)
        return loss

    batches = [_batch(s, world, rank) for s in range(4)]
    pipe = make_pipeline(pipeline, model, dense_opt, batches, step_fn, device=rank_device(DEVICE))
    try:
        step = 1
        while pipe.progress(step) is not None:
            step += 1
    finally:
        pipe.close()
    guard.check()
    assert patched_steps == [2, 3, 4]
    unknown = sites - OPS_SITES.get(model.ebc.backend.name, set())
    assert not unknown, f"new host reads in the kernel layer: {sorted(unknown)}"
    assert int(model.ebc.step) == 4  # the host mirror of the step counter kept it exact
    assert int(tracker.take()["mp"].sum()) > 0


@pytest.mark.parametrize("pipeline", ["sequential", "overlapped"])
def test_no_host_sync_one_process(pipeline):
    _train_without_sync(0, 1, "table_wise", "rowwise_adagrad", pipeline)


def _two_ranks(rank: int, world: int) -> None:
    for kind, opt in [
        ("table_wise", "adam"),
        ("row_wise", "rowwise_adagrad"),
        ("column_wise", "sgd"),
    ]:
        _train_without_sync(rank, world, kind, opt, "overlapped")


def test_no_host_sync_two_ranks():
    # One spawn for the three sharding types (spawning dominates the time).
    run_ranks(_two_ranks, 2)


def test_host_sync_check_can_fail():
    # The patch does catch a read from neorec's runtime (here: the eager NaN guard, no LossGuard).
    cfg = _cfg("sgd")
    model = DistributedModel(cfg, plan_by_type(cfg.embedding.tables, 1, 1, "table_wise"))
    opt = make_dense_optimizer(cfg, model.dense_parameters())
    batch = _batch(0, 1, 0)
    model.stage_input_dist(batch.sparse, batch.sparse)
    with no_host_sync(set()), pytest.raises(HostSync, match="neorec/train/steps.py:train_step"):
        train_step(model, opt, batch, 1)


def test_loss_guard_names_the_first_bad_step():
    g = LossGuard()
    g.check()  # nothing recorded
    for step, v in [(1, 0.5), (2, float("nan")), (3, float("inf"))]:
        g.record(torch.tensor(v), step)
    with pytest.raises(TrainingDiverged, match="loss became nan at step 2"):
        g.check()


def test_device_field_and_backend():
    assert TrainConfig().device == "cpu"
    assert process_group_backend("cpu") == "gloo" and process_group_backend("cuda") == "nccl"
    assert rank_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device must be one of"):
        load_config(None, ["train.device='tpu'"])


@pytest.mark.skipif(not NO_CUDA, reason="a CUDA device is present")
def test_cuda_refused_without_a_gpu(tmp_path):
    cfg = load_config(None, ["train.device='cuda'", f"train.run_dir='{tmp_path / 'r'}'"])
    with pytest.raises(ConfigError, match=r"train.device = 'cuda' but torch sees no CUDA device"):
        cfg.train.check_device()
    from neorec.train.trainer import Trainer

    with pytest.raises(ConfigError, match="train.device = 'cuda'"):
        Trainer(cfg)
    assert not (tmp_path / "r").exists()  # refused before the run folder was made
    from neorec.launch import init_rank_group

    with pytest.raises(ConfigError, match="no CUDA device"):
        init_rank_group("cuda", 5)
