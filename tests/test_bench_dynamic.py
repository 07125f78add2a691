"""``neorec bench dynamic``: equal-memory accounting, the hashed tables' ids, flags, a tiny run."""

from __future__ import annotations

import json

import pytest
import torch

from neorec.bench import dynamic as bench
from neorec.bench import dynamic_quality as q
from neorec.config import ConfigError
from neorec.ops.id_map_size import map_bytes_per_slot, sketch_width
from neorec.sparse import SparseFeatures
from neorec.storage.admission import sketch_bytes


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


def test_hashed_adm_rows_fill_the_memory() -> None:
    row = 260
    for memory in (1250 * row, 2500 * row, 100 * row):
        r = q.hashed_adm_rows(memory, row)
        assert r * row + sketch_bytes(sketch_width(r)) <= memory or r == 1
        bigger = [x for x in range(r + 1, memory // row + 1)]
        assert all(x * row + sketch_bytes(sketch_width(x)) > memory for x in bigger)
    assert q.hashed_adm_rows(1250 * row, row) == 1024  # a sketch of 2,048 counters a row
    a = bench.parse([])
    assert q.sizes(a, 0.125, 0, "hashed_adm") == 1250  # threshold 0: the plain hashed table
    assert q.sizes(a, 0.125, 4, "hashed_adm") == 1024


def test_hashed_ids() -> None:
    ids = torch.tensor([0, 1, 1250, 2500, 7, 123_456_789_012], dtype=torch.int64)
    sp = SparseFeatures(["t0"], ids, torch.tensor([6]))
    mod = q.hash_ids(sp, 1250, "mod").values
    mix = q.hash_ids(sp, 1250, "mix").values
    assert mod.tolist() == [0, 1, 0, 0, 7, 123_456_789_012 % 1250]
    assert mix.dtype == torch.int64 and bool(((mix >= 0) & (mix < 1250)).all())
    assert torch.equal(mix, q.hash_ids(sp, 1250, "mix").values)  # a function of the id
    assert len(set(mix[[0, 2, 3]].tolist())) > 1  # a hash: ids 0, 1250, 2500 do not all collide


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--budgets", "0.5,2"], "--budgets"),
        (["--budgets", "x"], "--budgets"),
        (["--seeds", "1"], "--seeds"),
        (["--thresholds", "-1"], "--thresholds"),
        (["--thresholds", "x"], "--thresholds"),
        (["--streams", "default,other"], "--streams"),
        (["--seed-base", "1"], "--seed-base"),
        (["--rounds", "1"], "--rounds"),
        (["--window-samples", "100"], "--window-samples"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: list[str], what: str) -> None:
    with pytest.raises(ConfigError, match=what) as e:
        bench.main(flags)
    assert "\n" not in str(e.value)


def test_tiny_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--tables", "1", "--rows", "400", "--dim", "8", "--windows", "2", "--batch", "128"]
    argv += ["--window-samples", "1024", "--eval-samples", "512", "--seeds", "2"]
    argv += ["--seed-base", "1", "--dev-seeds", "1", "--thresholds", "0,2", "--budgets", "0.5"]
    argv += ["--rounds", "2", "--speed-steps", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert res["bench"] == "dynamic" and res["seeds"] == [1, 2] and res["dev_seeds"] == [0]
    assert set(res["streams"]) == {"default", "tuned"} and res["cpu"] is not None
    for st in res["streams"].values():
        (b,) = st["budgets"]
        assert b["hashed_rows"] == 200 and 0 < b["dynamic_slots"] < 200
        for k in ("hashed_adm", "dynamic"):
            assert b[f"threshold_{k}"] in (0, 2) and set(b["dev_ne"][k]) == {"0", "2"}
            # the threshold with the lower mean NE on the development seed
            assert b[f"threshold_{k}"] == int(min(b["dev_ne"][k], key=b["dev_ne"][k].get))
        if b["threshold_hashed_adm"] == 0:
            assert b["ne_hashed_adm_per_seed"] == b["ne_hashed_per_seed"]
        iv = b["ne_diff_dynamic_vs_hashed_adm"]
        assert set(iv) == {"value", "lo", "hi", "n"} and iv["n"] == 2 and iv["lo"] <= iv["hi"]
        d = [y - x for x, y in zip(b["ne_hashed_per_seed"], b["ne_dynamic_per_seed"])]
        assert b["ne_diff_dynamic_vs_hashed"]["value"] == pytest.approx(sum(d) / 2)
        assert 0 < st["ne_teacher_mean"] < st["ne_full"]["value"]
    (s,) = res["throughput"]
    assert set(s["steps_per_s"]) == {"plain", "hashed_adm", "dynamic"}
    assert s["ratio_dynamic_vs_plain"]["n"] == 2 and s["ratio_dynamic_vs_plain"]["value"] > 0
    assert res["map_ids_per_s"] > 0
