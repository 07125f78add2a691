"""The overlapped pipeline trains bitwise the same model as the sequential one."""

from __future__ import annotations

import json

import pytest
import torch
from dist_util import run_ranks
from test_distributed import B, global_batch, make_cfg, plans

from neorec.builder import dense_optimizer, distributed_model
from neorec.config import CommConfig, load_config
from neorec.train.pipeline import make_pipeline
from neorec.train.trainer import Trainer, train_step

# Bitwise equalities: make test-isa reruns them under every other vector ISA of the CPU.
pytestmark = pytest.mark.bitwise

STEPS = 12
COMMS = [
    CommConfig(),
    CommConfig(forward="fp16", backward="bf16", allreduce="fp8_e4m3"),
    CommConfig(forward="int8", backward="fp8_e5m2", allreduce="fp16", fp8_scaling="tensor"),
]


def _train(kind: str, rank: int, world: int, comm: CommConfig, weighted: bool):
    cfg = make_cfg("rowwise_adagrad", pooling="mean" if weighted else "sum")
    cfg.comm = comm
    model = distributed_model(cfg, plans(world)["mixed"])
    opt = dense_optimizer(cfg.train, model.dense_parameters())
    b = B // world
    batches = (
        global_batch(200 + i, weighted).slice(rank * b, (rank + 1) * b) for i in range(STEPS)
    )
    pipe = make_pipeline(kind, model, opt, batches, train_step)
    losses = []
    while (out := pipe.progress(len(losses) + 1)) is not None:
        losses.append(out.loss)
    pipe.close()
    test = global_batch(999, weighted).slice(rank * b, (rank + 1) * b)
    with torch.no_grad():
        preds = model(test.dense, test.sparse)
    return torch.stack(losses), model.state_dict(), preds, dict(model.comm_stats.bytes_sent)


def _same(rank: int, world: int) -> None:
    for i, comm in enumerate(COMMS):
        weighted = i == 1
        seq = _train("sequential", rank, world, comm, weighted)
        ovl = _train("overlapped", rank, world, comm, weighted)
        where = f"rank {rank}/{world} comm {comm}"
        assert len(seq[0]) == STEPS, where
        assert torch.equal(seq[0], ovl[0]), f"{where}: losses differ"
        assert seq[1].keys() == ovl[1].keys()
        for k in seq[1]:
            assert torch.equal(seq[1][k], ovl[1][k]), f"{where}: {k} differs"
        assert torch.equal(seq[2], ovl[2]), f"{where}: predictions differ"
        assert seq[3] == ovl[3], f"{where}: bytes differ"


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_equals_sequential_bitwise(world):
    run_ranks(_same, world)


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    cfg = load_config(
        overrides=[
            "embedding.num_tables=3",
            "embedding.rows=200",
            "embedding.dim=8",
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=64",
            "data.train_samples=640",
            "data.eval_samples=320",
            f"train.run_dir='{tmp_path / name}'",
            "train.progress=false",
            *extra,
        ]
    )
    return Trainer(cfg)


@pytest.mark.parametrize("steps", [0, 1, 7, 25])
def test_trainer_pipelines_agree_on_metrics_and_position(tmp_path, steps):
    runs = {}
    for kind in ("sequential", "overlapped"):
        t = _trainer(tmp_path, kind, f"train.pipeline='{kind}'", f"train.steps={steps}")
        result = t.fit()
        runs[kind] = (
            t.step,
            t.state.epoch,
            t.state.next_batch,
            result["eval"],
            t.model.state_dict(),
        )
    s, o = runs["sequential"], runs["overlapped"]
    assert s[:4] == o[:4]
    assert s[0] == (steps or 10)
    assert all(torch.equal(s[4][k], o[4][k]) for k in s[4])
    m = json.loads((tmp_path / "overlapped" / "metrics.json").read_text())
    assert m["comm"]["pipeline"] == "overlapped" and m["comm"]["steps"] == s[0]


def test_loader_error_reaches_the_trainer():
    def bad():
        yield global_batch(1, False)
        raise OSError("disk gone")

    class Stages:  # the model's pipeline stages, doing nothing (the step ignores the model)
        def prefetch(self, sparse):
            pass

        def stage_input_dist(self, sparse, host):
            pass

    pipe = make_pipeline("overlapped", Stages(), None, bad(), lambda *a: torch.zeros(()))  # type: ignore[arg-type]
    with pytest.raises(OSError, match="disk gone"):  # at step 1: step 1 reads batch 2 ahead
        pipe.progress(1)
    pipe.close()


def _cached_trainer(tmp_path, name: str, storage: str, pipeline: str) -> Trainer:
    tables = "".join(
        f'[[embedding.tables]]\nname = "t{i}"\nrows = 300\ndim = 8\npooling_factor = 4.0\n'
        + (f'storage = "{storage}"\ncache_rows = 150\n' if storage != "memory" else "")
        for i in range(3)
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(tables)
    cfg = load_config(
        path,
        overrides=[
            "model.bottom_mlp=[16, 8]",
            "model.top_mlp=[16, 1]",
            "data.batch_size=64",
            "data.train_samples=640",
            "data.eval_samples=320",
            "train.steps=12",
            f"train.pipeline='{pipeline}'",
            f"train.run_dir='{tmp_path / name}'",
            f"storage.dir='{tmp_path / name / 'store'}'",
            "train.progress=false",
        ],
    )
    return Trainer(cfg)


def test_overlapped_pipeline_prefetches_cached_rows_and_trains_the_same(tmp_path):
    runs = {}
    for name, storage, pipeline in [
        ("memory", "memory", "overlapped"),
        ("ssd_seq", "ssd", "sequential"),
        ("ssd_ovl", "ssd", "overlapped"),
    ]:
        t = _cached_trainer(tmp_path, name, storage, pipeline)
        runs[name] = (t.fit(), t)
    ref = runs["memory"][0]["eval"]
    for name in ("ssd_seq", "ssd_ovl"):
        result, t = runs[name]
        assert result["eval"] == ref, name
        t.model.ebc.flush()
    staged = {n: int(runs[n][0]["storage"]["staged"]) for n in ("ssd_seq", "ssd_ovl")}
    assert staged["ssd_seq"] == 0  # the sequential pipeline is the plain reference
    assert staged["ssd_ovl"] > 0, "the overlapped pipeline never prefetched cached rows"
    ref_ebc = runs["memory"][1].model.ebc
    for name in ("ssd_seq", "ssd_ovl"):
        ebc = runs[name][1].model.ebc
        for i, tab in enumerate(ref_ebc.tables):
            got = ebc.read_table(tab.name)["weight"]
            want = ref_ebc.layout.table(ref_ebc.weights, i).view(tab.rows, tab.dim)
            assert torch.equal(got.view(tab.rows, tab.dim), want), f"{name}: table {tab.name}"


def test_step_times_take_constant_memory():
    from neorec.train.pipeline import SAMPLE_STEPS, PipelineTimes

    t = PipelineTimes()
    for i in range(3 * SAMPLE_STEPS):
        t.add(0.001 * (i % 7))  # 0..6 ms in turn: median 3 ms, mean 3 ms
    s = t.summary()
    assert len(t.sample) == SAMPLE_STEPS and s["steps"] == 3 * SAMPLE_STEPS
    assert abs(s["step_ms_mean"] - 3.0) < 1e-3 and s["step_ms_median"] == 3.0
    assert t.last_s == 0.001 * ((3 * SAMPLE_STEPS - 1) % 7)
