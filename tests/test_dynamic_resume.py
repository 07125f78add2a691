"""Resume of dynamic tables with threshold admission (issue 40): each rank's admission sketch is
its own (it counts the sightings of the ids the rank owns), so a resume on the same world size
gives every rank back its own sketch, counts and totals, and the run equals the uninterrupted one
bitwise (2 gloo ranks, and one process). On another world size each rank gets the sketches of the
saved ranks whose id-hash ranges overlap its own (never one rank's counts in every rank), and the
resume says in one line that it is not bitwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_util import run_ranks

from neorec.distributed.dynamic_reshard import (
    TableShard,
    merge_table_shards,
    owner_of,
    rank_sketch,
    sketch_sources,
)
from neorec.storage.dynamic_state import DynamicTableState

STEPS = 8  # the uninterrupted run; the interrupted one stops at STEPS // 2 and resumes
EVERY = 2


def _cfg(run_dir: Path, *extra: str) -> Any:
    from neorec.config import load_config

    return load_config(
        overrides=[
            "embedding.tables=[{name='x', rows=50, dim=4}, {name='d', rows=20000, dim=4, "
            "kind='dynamic', capacity=120, eviction='lfu', admission='threshold', "
            "admit_threshold=2, unadmitted='default_row', pooling_factor=4}]",
            "model.bottom_mlp=[8, 4]",
            "model.top_mlp=[8, 1]",
            "data.batch_size=64",
            "data.train_samples=1024",
            "data.eval_samples=128",
            "data.id_distribution='uniform'",
            # row-wise: each rank's step counter moves (a rank without a model-parallel shard
            # keeps 0 in a run and gets the step from a restore; it is never read)
            "sharding.types.x='row_wise'",
            f"train.run_dir='{run_dir}'",
            "train.progress=false",
            "train.threads=1",
            "train.eval_every=4",
            "checkpoint.fsync=false",
            "checkpoint.bits=32",
            "checkpoint.opt_bits=32",
            "checkpoint.policy=consecutive",
            f"checkpoint.every_steps={EVERY}",
            *extra,
        ]
    )


def _fit(run: Path, steps: int, resume: bool) -> dict[str, Any]:
    from neorec.train.trainer import Trainer

    extra = [f"train.steps={steps}"] + (["checkpoint.resume=latest"] if resume else [])
    tr = Trainer(_cfg(run, *extra))
    result = tr.fit()
    ebc = tr.model.ebc
    dyn = ebc.dynamic if hasattr(ebc, "dynamic") else ebc
    return {
        "d": dyn.export_table("d").to_dict(),
        "fixed": {k: v.clone() for k, v in ebc.fixed.state_dict().items()},
        "dense": {k: v.clone() for k, v in tr.model.dense_arch.state_dict().items()},
        "eval": result["eval"],
        "loss": result["train"]["final_loss"],
    }


def _phases(rank: int, world: int, out: str) -> None:
    root = Path(out)
    got = {
        "straight": _fit(root / "straight", STEPS, False),
        "first": _fit(root / "ckpt", STEPS // 2, False),
        "resumed": _fit(root / "ckpt", STEPS, True),
    }
    torch.save(got, root / f"rank{rank}.pt")


def _same(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    sa, sb = DynamicTableState.from_dict(a["d"]), DynamicTableState.from_dict(b["d"])
    for k in ("ids", "rows", "uses", "last_use", "sketch"):
        assert torch.equal(getattr(sa, k), getattr(sb, k)), f"{what}: {k}"
    for k in sa.states:
        assert torch.equal(sa.states[k], sb.states[k]), f"{what}: state {k}"
    assert (sa.step, sa.sketch_total, sa.totals) == (sb.step, sb.sketch_total, sb.totals), what
    assert sa.default_row is not None and sb.default_row is not None
    assert torch.equal(sa.default_row, sb.default_row), what
    for part in ("fixed", "dense"):
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), f"{what}: {part} {k}"
    assert (a["eval"], a["loss"]) == (b["eval"], b["loss"]), what


def test_two_ranks_resume_is_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_ranks(_phases, 2, str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        first = DynamicTableState.from_dict(got["first"]["d"])
        assert int(first.sketch.count_nonzero()) > 100, "the sketch was used"
        assert first.totals["unadmitted"] > 0 and first.totals["admitted"] > 0
        _same(got["resumed"], got["straight"], f"rank {rank}")

    # the 2-rank checkpoint (step STEPS) in one process: the ranks' sketches summed, once; the
    # resume says in one line that it is not bitwise
    from neorec.train.trainer import Trainer

    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["resumed"] for r in (0, 1)]
    saved = merge_table_shards(
        [TableShard(r, 2, DynamicTableState.from_dict(x["d"])) for r, x in enumerate(ranks)]
    )
    tr = Trainer(_cfg(tmp_path / "ckpt", f"train.steps={STEPS + 2}", "checkpoint.resume=latest"))
    assert tr.ckpt is not None
    capsys.readouterr()
    tr.ckpt.manager.restore_from(*tr.ckpt.manager.locate("latest"))
    note = [x for x in capsys.readouterr().err.splitlines() if x.startswith("note:")]
    assert len(note) == 1 and "saved by 2 rank(s) and resume on 1" in note[0], note
    assert "bitwise on 2 rank(s) only" in note[0]
    got = tr.model.ebc.dynamic.export_table("d")
    assert torch.equal(got.sketch, saved.sketch) and got.sketch_total == saved.sketch_total
    assert torch.equal(got.ids, saved.ids) and got.totals == saved.totals
    s0, s1 = (DynamicTableState.from_dict(x["d"]) for x in ranks)
    assert torch.equal(got.sketch.long(), s0.sketch.long() + s1.sketch.long())


def test_one_process_resume_is_bitwise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    straight = _fit(tmp_path / "straight", STEPS, False)
    _fit(tmp_path / "ckpt", STEPS // 2, False)
    _same(_fit(tmp_path / "ckpt", STEPS, True), straight, "one process")
    assert "note:" not in capsys.readouterr().err  # the same world size: nothing to say


# ---- another world size: the sketch goes to the ranks whose hash ranges overlap ------------------
def _shard(rank: int, world: int, fill: int, ids: torch.Tensor) -> TableShard:
    mine = ids[owner_of(ids, world) == rank]
    n = mine.numel()
    sk = torch.full((4, 1024), fill, dtype=torch.int32)
    st = DynamicTableState(
        ids=mine, rows=torch.zeros(n, 2), states={}, uses=torch.ones(n, dtype=torch.int64),
        last_use=torch.zeros(n, dtype=torch.int64), step=7, sketch=sk, sketch_total=10 * fill,
        totals={"admitted": n, "evicted": 0, "unadmitted": fill, "lookups": 1},
    )  # fmt: skip
    return TableShard(rank, world, st)


@pytest.mark.parametrize(
    ("saved", "world", "want"),
    [
        (2, 2, [[0], [1]]),  # the same world: each rank its own
        (2, 1, [[0, 1]]),  # merged: every saved rank once
        (4, 2, [[0, 1], [2, 3]]),  # merged: every saved rank once
        (2, 4, [[0], [0], [1], [1]]),  # split: a saved rank's counts to each part of its range
        (2, 3, [[0], [0, 1], [1]]),  # neither: the middle rank's range overlaps both
        (1, 3, [[0], [0], [0]]),
    ],
)
def test_sketch_sources_on_another_world(saved: int, world: int, want: list[list[int]]) -> None:
    assert [sketch_sources(r, world, saved) for r in range(world)] == want
    ids = torch.arange(-500, 500, dtype=torch.int64) * 7919
    shards = [_shard(r, saved, 1 + r, ids) for r in range(saved)]
    for r in range(world):
        sk, total, totals = rank_sketch(shards, r, world)
        src = want[r]
        assert torch.equal(sk, torch.full((4, 1024), sum(1 + q for q in src), dtype=torch.int32))
        assert total == sum(10 * (1 + q) for q in src)
        if saved == world:
            assert totals == shards[r].state.totals
        else:  # the running counts once, on rank 0
            whole = merge_table_shards(shards).totals
            assert totals == (whole if r == 0 else {k: 0 for k in whole})
    if world == 1:  # the whole table: the same sums
        assert torch.equal(merge_table_shards(shards).sketch, rank_sketch(shards, 0, 1)[0])
