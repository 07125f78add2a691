"""``neorec bench dynamic``: equal-memory accounting, the hashed table's ids, flags, a tiny run."""

from __future__ import annotations

import json

import pytest
import torch

from neorec.bench import dynamic as bench
from neorec.config import ConfigError
from neorec.ops.id_map_size import map_bytes_per_slot
from neorec.sparse import SparseFeatures


@pytest.mark.parametrize(
    ("admission", "eviction"), [("always", "lru"), ("threshold", "lru"), ("threshold", "lfu")]
)
def test_dynamic_slots_fill_the_memory(admission: str, eviction: str) -> None:
    row, memory = 260, 1250 * 260
    cap = bench.dynamic_slots(memory, row, admission, eviction)

    def cost(c: int) -> float:
        return c * (row + map_bytes_per_slot(c, admission, eviction))

    assert cost(cap) <= memory < cost(cap + 8)  # fits, and (nearly) nothing is left over
    # the threshold sketch costs memory: fewer slots than admitting every id; lfu keeps no list
    if admission == "threshold":
        assert cap < bench.dynamic_slots(memory, row, "always", eviction)
    if eviction == "lfu":
        assert cap > bench.dynamic_slots(memory, row, admission, "lru")


def test_hashed_ids() -> None:
    ids = torch.tensor([0, 1, 1250, 2500, 7, 123_456_789_012], dtype=torch.int64)
    sp = SparseFeatures(["t0"], ids, torch.tensor([6]))
    mod = bench._hash_ids(sp, 1250, "mod").values
    mix = bench._hash_ids(sp, 1250, "mix").values
    assert mod.tolist() == [0, 1, 0, 0, 7, 123_456_789_012 % 1250]
    assert mix.dtype == torch.int64 and bool(((mix >= 0) & (mix < 1250)).all())
    assert torch.equal(mix, bench._hash_ids(sp, 1250, "mix").values)  # a function of the id
    assert len(set(mix[[0, 2, 3]].tolist())) > 1  # a hash: ids 0, 1250, 2500 do not all collide


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--budgets", "0.5,2"], "--budgets"),
        (["--budgets", "x"], "--budgets"),
        (["--seeds", "0"], "--seeds"),
        (["--admit-threshold", "-1"], "--admit-threshold"),
        (["--window-samples", "100"], "--window-samples"),
        (["--id-shrink-visits", "-1"], "id_shrink_visits"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: list[str], what: str) -> None:
    with pytest.raises(ConfigError, match=what) as e:
        bench.main(flags)
    assert "\n" not in str(e.value)


def test_tiny_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tables", "1", "--rows", "400", "--dim", "8", "--windows", "2", "--batch", "128"]
    argv += ["--window-samples", "1024", "--eval-samples", "512", "--seeds", "2"]
    argv += ["--admit-threshold", "2", "--budgets", "0.25,0.5"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert res["bench"] == "dynamic" and res["settings"]["admit_threshold"] == 2
    assert [b["hashed_rows"] for b in res["budgets"]] == [100, 200]
    for b in res["budgets"]:
        assert 0 < b["dynamic_slots"] < b["hashed_rows"]  # the map's bytes cost slots
        assert len(b["ne_gap_rel_per_seed"]) == 2 and b["throughput_ratio"] > 0
        assert 0 < b["dynamic_unadmitted_share"] < 1  # threshold 2: first sightings wait
        assert 0 < b["ne_hashed_mean"] < 2 and 0 < b["ne_dynamic_mean"] < 2
    assert 0 < res["ne_teacher_mean"] < res["ne_full_mean"] and res["map_ids_per_s"] > 0
    assert any("per seed (paired)" in line for line in out)
