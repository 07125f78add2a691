"""The device-generic runtime (``train.device``): a CUDA request refused cleanly on this CPU machine,
the process group backend following the device, the deferred NaN guard, and no host sync inside a
training step: the sharded path (one process, and 2 gloo ranks table-wise / row-wise /
column-wise; data-parallel tables, fp16 / fp8 / bf16 / int8 wire codecs, fp8 tables), DMT towers
and the one-process model, with this machine's TBE backend and with the GPU backends; the padded
data-parallel exchange, column-wise tables under row-wise Adagrad (padded row blocks) and the
towers' staged input equal to the host path's (the kernel-level device paths: test_device_paths).

The host-sync check patches the methods that read a tensor back to the host (``item``, ``cpu``,
``tolist``, ``numpy``, ``__int__``, ``__bool__``, ``__float__``; and indexing with an integer
0-dim tensor, which ATen reads on the host) to raise when neorec's runtime calls them inside a
step (after a warm-up step). Calls from the TBE kernel layer (``neorec/ops``:
the CPU backends' host checks, not syncs there) are recorded, not refused, and must stay within
the known sites listed in ``OPS_SITES``: none for the GPU backends (cuda, triton), which run here
on CPU tensors (triton under its interpreter) with their device-side checks
(``tbe_checks.device_checks_on_cpu``). torch's own Python code is out of scope (its CPU-side
reads, e.g. optimizer step counters, are not device syncs on a GPU); so are the syncs ATen makes
inside an op whose output size depends on the data (``nonzero``, ``unique``, masking), which no
Python patch can see: the GPU backends' per-step path has none (its sizes are shapes).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import DEVICE, run_ranks

import neorec
from neorec.builder import build_dlrm, dense_optimizer, distributed_model
from neorec.checkpoint.tracker import DirtyRowTracker
from neorec.config import (
    CommConfig,
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
from neorec.ops.cuda import CudaBackend
from neorec.ops.tbe_checks import device_checks_on_cpu
from neorec.sharding.fixed_plan import plan_by_type
from neorec.sparse import SparseFeatures
from neorec.train.pipeline import make_pipeline
from neorec.train.steps import LossGuard, TrainingDiverged, train_step

NO_CUDA = not torch.cuda.is_available()
# triton under its interpreter on the CPU, as in test_triton_tbe: TRITON_INTERPRET=1 when triton
# is first imported (here, before anything builds a torch optimizer: that imports triton too,
# through torch._dynamo) and while kernels launch (``gpu_path``).
triton_tbe: Any = None
if importlib.util.find_spec("triton") is not None and DEVICE != "cpu":
    from neorec.ops import triton_tbe
elif importlib.util.find_spec("triton") is not None:
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        from neorec.ops import triton_tbe
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old
INTERPRETED = triton_tbe is not None and triton_tbe.INTERPRET
_HAS_TRITON = INTERPRETED or (triton_tbe is not None and DEVICE != "cpu")
PKG = Path(neorec.__file__).resolve().parent
OPS = PKG / "ops"
TABLES = [
    TableConfig(name="a", rows=37, dim=4),
    TableConfig(name="b", rows=9, dim=4, features=["b", "b2"]),
    TableConfig(name="c", rows=50, dim=4),
]
B = 8
_PATCHED = ("item", "cpu", "tolist", "numpy", "__int__", "__bool__", "__float__")
_INDEXING = ("__getitem__", "__setitem__")
_INT = (torch.int8, torch.int16, torch.int32, torch.int64)


class HostSync(AssertionError):
    """A tensor was read back to the host inside a step."""


@contextlib.contextmanager
def no_host_sync(ops_sites: set[str], known: frozenset[str] = frozenset()) -> Iterator[None]:
    """Make neorec's runtime code raise ``HostSync`` on any read of a tensor to the host; reads in
    ``neorec/ops`` or at a ``known`` site ("path:function") are added to ``ops_sites`` instead."""
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def guard(name: str):  # noqa: ANN202
        orig = saved[name]

        def patched(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            check(name, sys._getframe(1))
            return orig(self, *a, **k)

        return patched

    def index_guard(name: str):  # noqa: ANN202
        orig = saved[name]

        def patched(self, index, *a):  # noqa: ANN001, ANN002, ANN202
            # An integer 0-dim tensor as an index is read on the host (ATen's select).
            items = index if isinstance(index, tuple) else (index,)
            if any(isinstance(i, torch.Tensor) and i.dim() == 0 and i.dtype in _INT for i in items):
                check(name, sys._getframe(1))
            return orig(self, index, *a)

        return patched

    def check(name: str, caller) -> None:  # noqa: ANN001
        path = Path(caller.f_code.co_filename).resolve()
        if path.is_relative_to(PKG):
            where = f"{path.relative_to(PKG.parent)}:{caller.f_code.co_name}"
            if not path.is_relative_to(OPS) and where not in known:
                raise HostSync(f"Tensor.{name} at {where} line {caller.f_lineno}")
            ops_sites.add(where)

    saved.update({name: getattr(torch.Tensor, name) for name in _INDEXING})
    for name in _PATCHED:
        setattr(torch.Tensor, name, guard(name))
    for name in _INDEXING:
        setattr(torch.Tensor, name, index_guard(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


# The kernel layer's host reads (neorec/ops, not this runtime's), per backend. The CPU backends
# read on the host (not a sync there): the offsets' first and last entries (cpu), per-feature
# bounds and id checks (reference, when the C kernel cannot be built here). The GPU backends
# read nothing (their checks are device asserts); listed so that a new read is noticed.
OPS_SITES: dict[str, set[str]] = {
    "cpu": {
        "neorec/ops/cpu.py:_prepare",  # int(offsets[0]), int(offsets[-1])
        "neorec/ops/tbe_checks.py:check_grad_output",  # (the one-process model's update)
    },
    "reference": {
        "neorec/ops/tbe_checks.py:check_grad_output",
        "neorec/ops/tbe.py:forward",  # per-feature bounds
        "neorec/ops/tbe.py:row_grads",
        "neorec/ops/tbe_checks.py:check_ids",
        "neorec/ops/tbe_checks.py:check_offsets",
    },
    "cuda": set(),
    "triton": set(),
}
# Data-parallel tables: the GPU backends read nothing (padded blocks with device counts,
# ``row_grads_padded``); the cpu backend's host path reads its row sums' counts (not syncs).
DP_SITES = {
    "cpu": {
        "neorec/ops/cpu.py:<genexpr>",
        "neorec/ops/cpu.py:<listcomp>",
        "neorec/ops/cpu.py:backward_update",
        "neorec/ops/row_optim.py:__post_init__",
    },
}
# Host reads left in the one-process model's step (``build_dlrm``): none. Its step counter is a
# host mirror; the pipeline checks the batch's host copy before the step (as the sharded path
# before its input distribution) and marks the copy the tables read as checked.
DLRM_SITES: frozenset[str] = frozenset()
# DMT towers, staged by the pipeline: the ids exchange started at staging (over the host gloo
# group, from the batch's host copy) is received during the step's forward, and the tower batch
# is checked and staged there: reads of host memory (the received lengths and ids), never of the
# device.
TOWER_STAGED_SITES: frozenset[str] = frozenset(
    {
        "neorec/distributed/towers.py:ids_phase",  # the lengths received
        "neorec/distributed/comm.py:unit_major_order",  # the tower batch built from them
        "neorec/sparse.py:validate",  # the tower batch checked
        "neorec/distributed/input_dist.py:input_dist",  # and staged in the tower collection
        "neorec/distributed/input_dist.py:_split_by_unit",
        "neorec/distributed/input_dist.py:<listcomp>",
    }
)
GPU_BACKENDS = ["cuda", pytest.param("triton", marks=pytest.mark.skipif(
    not _HAS_TRITON, reason="triton is not installed (or was imported without its interpreter)"
))]  # fmt: skip
# The same on CPU tensors (whatever the test device): triton needs its interpreter.
CPU_GPU_BACKENDS = ["cuda", pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETED, reason="triton is not installed (or not under its interpreter)"
))]  # fmt: skip


def gpu_backend(name: str) -> Any:
    """The cuda or triton TBE backend, for CPU tensors (triton: under its interpreter)."""
    return CudaBackend() if name == "cuda" else triton_tbe.TritonBackend()


@contextlib.contextmanager
def gpu_path(on: object, device_checks: bool = True) -> Iterator[None]:
    """When ``on``: the device-side checks on CPU tensors (the GPU backends', the codecs'; unless
    not ``device_checks``: the host path), and triton's interpreter on (when the kernels were
    built for it)."""
    if not on:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    if INTERPRETED:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        with device_checks_on_cpu() if device_checks else contextlib.nullcontext():
            yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def _cfg(opt: str, comm: dict[str, str] | None = None, precision: str = "fp32") -> Config:
    return Config(
        comm=CommConfig(**(comm or {})),
        model=ModelConfig(num_dense=3, bottom_mlp=[4, 4], top_mlp=[4, 1]),
        embedding=EmbeddingConfig(
            tables=[TableConfig(**vars(t)) for t in TABLES],
            optimizer=opt,
            lr=0.1,
            precision=precision,
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


def _train_without_sync(
    rank: int,
    world: int,
    kind: str,
    opt: str,
    pipeline: str,
    backend: str | None = None,
    comm: dict[str, str] | None = None,
) -> Any:
    """Four steps, the last three with host reads refused (returns the model); ``kind`` "dlrm":
    the one-process model (``build_dlrm``), "towers": DMT towers (2 ranks), else a sharding type
    ("+dp": table "b" data-parallel; "@fp8" etc.: low-precision tables); ``backend``: a GPU
    backend swapped in (under the low-precision rows too); ``comm``: wire codecs
    (``CommConfig``). Either runs the device-side checks (``gpu_path``)."""
    kind, _, precision = kind.partition("@")
    cfg = _cfg(opt, comm, precision or "fp32")
    if kind == "dlrm":
        model: Any = build_dlrm(cfg, DEVICE)
    elif kind == "towers":
        model = _tower_model(cfg)
    else:  # "<type>+dp": table "b" data-parallel
        kind, _, dp = kind.partition("+")
        types = {"b": "data_parallel"} if dp else None
        plan = plan_by_type(cfg.embedding.tables, world, world, kind, types)
        model = distributed_model(cfg, plan)
    if backend is not None and precision:  # (the low-precision rows' inner kernel)
        model.ebc.backend.inner = gpu_backend(backend)
    elif backend is not None:
        model.ebc.backend = gpu_backend(backend)
    dense_opt = dense_optimizer(cfg.train, model.dense_parameters())
    guard, sites, patched_steps = LossGuard(), set(), []
    tracker = DirtyRowTracker(model.ebc)  # checkpoints' dirty rows: marked inside the step

    def step_fn(m, o, batch, step, bf16):  # noqa: ANN001, ANN202
        if step == 1:  # warm-up: first reads of host mirrors (the tables' step counters)
            return train_step(m, o, batch, step, bf16, guard=guard)
        known = {"dlrm": DLRM_SITES, "towers": TOWER_STAGED_SITES}.get(kind, frozenset())
        with no_host_sync(sites, known):
            loss = train_step(m, o, batch, step, bf16, guard=guard)
        patched_steps.append(step)
        return loss

    batches = [_batch(s, world, rank) for s in range(4)]
    pipe = make_pipeline(pipeline, model, dense_opt, batches, step_fn, device=rank_device(DEVICE))
    try:
        with gpu_path(backend or comm):
            step = 1
            while pipe.progress(step) is not None:
                step += 1
    finally:
        pipe.close()
    guard.check()
    assert patched_steps == [2, 3, 4]
    name = model.ebc.backend.name
    unknown = sites - OPS_SITES.get(name, set()) - DLRM_SITES - TOWER_STAGED_SITES
    if getattr(model.ebc, "dp", None) is not None:
        unknown -= DP_SITES.get(name, set())
    assert not unknown, f"new host reads in the kernel layer: {sorted(unknown)}"
    assert int(model.ebc.step) == 4  # the host mirror of the step counter kept it exact
    assert int(tracker.take()["mp"].sum()) > 0
    return model


def _tower_model(cfg: Config) -> Any:
    """DMT towers (SPTT) on 2 ranks (2 hosts of 1): tables a, c on tower 0, b on tower 1,
    identity tower modules."""
    from torch import nn

    from neorec.builder import towered_model
    from neorec.distributed.towers import tower_features
    from neorec.modules.dlrm import DenseArch

    groups = [["a", "c"], ["b"]]
    feats = tower_features(cfg.embedding.tables, groups)

    class Identity(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.out_vectors = n

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    def build_dense():  # noqa: ANN202
        towers = nn.ModuleList(Identity(len(f)) for f in feats)
        return towers, DenseArch(cfg.model, sum(len(f) for f in feats), 4)

    return towered_model(cfg, groups, build_dense)


def _towers_staged_equals_unstaged(rank: int, world: int) -> None:
    """DMT towers: the step reads nothing back when the pipeline staged the batch (the ids
    exchange to the towers and the tower collection's input distribution on the host), and
    trains bitwise as the unstaged forward (which exchanges the ids on the device)."""
    staged = _train_without_sync(rank, world, "towers", "adam", "overlapped")
    cfg = _cfg("adam")
    model = _tower_model(cfg)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    for step in range(1, 5):
        train_step(model, opt, _batch(step - 1, world, rank), step)
    assert torch.equal(model.ebc.weights, staged.ebc.weights)
    assert all(torch.equal(p, q) for p, q in zip(model.dense_parameters(),
                                                 staged.dense_parameters()))  # fmt: skip


@pytest.mark.parametrize("pipeline", ["sequential", "overlapped"])
def test_no_host_sync_one_process(pipeline):
    _train_without_sync(0, 1, "table_wise", "rowwise_adagrad", pipeline)


def _two_ranks(rank: int, world: int) -> None:
    for kind, opt, backend in [
        ("table_wise", "adam", None),
        ("row_wise", "rowwise_adagrad", None),
        ("column_wise", "sgd", None),
    ]:
        _train_without_sync(rank, world, kind, opt, "overlapped", backend)
    # A data-parallel table (its counts exchanged as host ints), and fp16 / fp8 / bf16 wire codecs
    # with their device-side finite checks: pooled all-to-all, DP row gradients, dense all-reduce.
    codecs = {"forward": "fp16", "backward": "fp8_e4m3", "allreduce": "bf16"}
    _train_without_sync(rank, world, "row_wise+dp", "adam", "overlapped", "cuda", codecs)
    _dp_padded_equals_host_path(rank, world)
    _cw_rowwise_padded_equals_host_path(rank, world)
    _towers_staged_equals_unstaged(rank, world)


def _without_feature(batch: Batch, name: str) -> Batch:
    """``batch`` with every bag of feature ``name`` emptied."""
    sp, b = batch.sparse, batch.sparse.batch_size
    f = sp.keys.index(name)
    off = sp.offsets()
    lo, hi = int(off[f * b]), int(off[(f + 1) * b])
    lengths = sp.lengths.clone()
    lengths[f * b : (f + 1) * b] = 0
    sparse = SparseFeatures(sp.keys, torch.cat([sp.values[:lo], sp.values[hi:]]), lengths)
    return Batch(batch.dense, sparse, batch.labels)


def _dp_padded_equals_host_path(rank: int, world: int) -> None:
    """Data-parallel tables on the device path (padded blocks, device counts, no host read)
    update the replicas bitwise as the host path's exchange (distinct rows as host counts): the
    same backend (cuda, on CPU tensors) on both, so only the exchange differs. Two DP tables, one
    of which rank 1 sends nothing of at step 2, neither any rank at step 3; float32 rows and the int8 wire codec (the
    padding's zero rows leave its scales as they are)."""
    types = {"b": "data_parallel", "c": "data_parallel"}
    for comm, opt in [(None, "adam"), ({"allreduce": "int8"}, "rowwise_adagrad")]:
        res = []
        for device_path in (False, True):
            cfg = _cfg(opt, comm)
            model = distributed_model(
                cfg, plan_by_type(cfg.embedding.tables, world, world, "table_wise", types)
            )
            ebc = model.ebc
            ebc.backend = gpu_backend("cuda")
            dense_opt = dense_optimizer(cfg.train, model.dense_parameters())
            tracker, guard = DirtyRowTracker(ebc), LossGuard()
            start = ebc.dp_weights.detach().clone()
            with gpu_path(device_path):
                for step in (1, 2, 3):
                    batch = _batch(step, world, rank)
                    if step == 2 and rank == 1:
                        batch = _without_feature(batch, "c")
                    for f in ("b", "b2", "c") if step == 3 else ():  # no DP row on any rank
                        batch = _without_feature(batch, f)
                    model.stage_input_dist(batch.sparse, batch.sparse)
                    # (step 1: the first read of the step counters' host mirrors)
                    patched = device_path and step > 1
                    with no_host_sync(set()) if patched else contextlib.nullcontext():
                        train_step(model, dense_opt, batch, step, guard=guard)
            guard.check()
            state = {k: v.detach().clone() for k, v in ebc._state("dp_").items()}
            res.append((ebc.dp_weights.detach().clone(), state, tracker.take()["dp"]))
        (w0, st0, dirty0), (w1, st1, dirty1) = res
        assert not torch.equal(w0, start)
        assert torch.equal(w0, w1), f"{comm}: the replicas differ"
        assert all(torch.equal(st0[k], st1[k]) for k in st0)
        assert torch.equal(dirty0, dirty1) and bool(dirty0.any())


def _cw_rowwise_padded_equals_host_path(rank: int, world: int) -> None:
    """Column-wise tables under row-wise Adagrad on the device path (row blocks bounded by the id
    counts, padded sums of squares all-reduced, masked writes: no host read, none in neorec/ops)
    update bitwise as the host path (distinct rows, a host read) with the same backend (cuda, on
    CPU tensors), and as this machine's backend up to float reassociation. Tables a, b
    column-wise (sharing one owner group), c table-wise on rank 0 (beside the slices); weight
    decay; rank 1 sends no id of "a" at step 2, no rank at step 3 (an empty block)."""
    res = []
    for backend, device_path in (("cuda", False), ("cuda", True), (None, False)):
        cfg = _cfg("rowwise_adagrad")
        cfg.embedding.weight_decay = 0.01
        plan = plan_by_type(cfg.embedding.tables, world, world, "column_wise", {"c": "table_wise"})
        model = distributed_model(cfg, plan)
        ebc = model.ebc
        if backend is not None:
            ebc.backend = gpu_backend(backend)
        dense_opt = dense_optimizer(cfg.train, model.dense_parameters())
        sites: set[str] = set()
        guard, start = LossGuard(), ebc.weights.detach().clone()
        with gpu_path(backend, device_checks=device_path):
            for step in (1, 2, 3):
                batch = _batch(step, world, rank)
                if step == 3 or (step == 2 and rank == 1):
                    batch = _without_feature(batch, "a")
                model.stage_input_dist(batch.sparse, batch.sparse)
                patched = device_path and step > 1  # (step 1: the step counters' first read)
                with no_host_sync(sites) if patched else contextlib.nullcontext():
                    train_step(model, dense_opt, batch, step, guard=guard)
        guard.check()
        assert not sites, f"host reads in the kernel layer: {sorted(sites)}"
        res.append((ebc.weights.detach().clone(), ebc.momentum1.detach().clone()))
    (w0, s0), (w1, s1), (w2, s2) = res
    assert not torch.equal(w0, start)
    assert torch.equal(w0, w1) and torch.equal(s0, s1), "device path differs from the host path"
    torch.testing.assert_close(w2, w0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, s0, rtol=1e-6, atol=1e-6)


def test_no_host_sync_two_ranks():
    # One spawn for all the cases (spawning dominates the time).
    run_ranks(_two_ranks, 2)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("kind", ["dlrm", "table_wise+dp", "table_wise@fp8"])
def test_no_host_sync_gpu_backends(kind, backend):
    """The GPU backends on the per-step path: no host read at all (none in neorec/ops either)."""
    _train_without_sync(0, 1, kind, "adam" if backend == "cuda" else "rowwise_adagrad",
                        "overlapped", backend)  # fmt: skip


def test_no_host_sync_one_process_dlrm():
    """The one-process model (``build_dlrm``) with this machine's TBE backend."""
    _train_without_sync(0, 1, "dlrm", "adam", "sequential")


def test_host_sync_check_can_fail():
    # The patch does catch a read from neorec's runtime (here: the eager NaN guard, no LossGuard).
    cfg = _cfg("sgd")
    model = distributed_model(cfg, plan_by_type(cfg.embedding.tables, 1, 1, "table_wise"))
    opt = dense_optimizer(cfg.train, model.dense_parameters())
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
    from neorec.launch.worker import init_rank_group

    with pytest.raises(ConfigError, match="no CUDA device"):
        init_rank_group("cuda", 5)


def test_one_process_step_counter_host_mirror_follows_writes():
    """The one-process collection counts steps on the host after one read; a write to the
    buffer (a restore, a reset) or a new buffer (a move) is read again."""
    from neorec.modules.collection import CollectionSpec
    from neorec.modules.embedding import EmbeddingBagCollection
    from neorec.ops.row_optim import RowOptimizer

    ebc = EmbeddingBagCollection(
        TABLES, CollectionSpec(RowOptimizer(kind="adam"), backend="reference")
    )
    batch = _batch(0, 1, 0)

    def step() -> int:
        ebc(batch.sparse).sum().backward()
        return int(ebc.step)

    assert [step(), step()] == [1, 2]
    ebc.load_state_dict({**ebc.state_dict(), "step": torch.tensor(6)})
    assert step() == 7
    ebc.reset_parameters()
    assert step() == 1
    ebc.step = torch.tensor(40)  # a new buffer (as ``.to(device)`` makes)
    assert step() == 41


@pytest.mark.parametrize("pipeline", ["sequential", "overlapped"])
def test_one_process_batch_checked_on_the_host_before_the_step(pipeline):
    """The pipeline checks the host copy (the step does not read the device): a bad id is still
    one clear error naming the table, raised before any update."""
    from neorec.sparse import SparseFeatureError

    cfg = _cfg("sgd")
    model = build_dlrm(cfg, DEVICE)
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    good, bad = _batch(0, 1, 0), _batch(1, 1, 0)
    bad.sparse.values[0] = 10_000  # table "a" has 37 rows
    before = model.ebc.weights.detach().clone()
    steps: list[int] = []

    def step_fn(m, o, batch, step, bf16):  # noqa: ANN001, ANN202
        assert getattr(batch.sparse, "checked_for", None) is m.ebc
        steps.append(step)
        return train_step(m, o, batch, step, bf16)

    pipe = make_pipeline(pipeline, model, opt, [good, bad], step_fn, device=rank_device(DEVICE))
    try:  # (the overlapped pipeline stages batch 2 before it runs step 1: refused there)
        with pytest.raises(SparseFeatureError, match=r"table 'a'\): id 10000 >= table rows"):
            for step in (1, 2):
                pipe.progress(step)
    finally:
        pipe.close()
    assert steps == ([1] if pipeline == "sequential" else [])
    assert not steps or not torch.equal(model.ebc.weights, before)
