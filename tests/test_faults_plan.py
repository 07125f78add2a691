"""Fault campaign "plan json": a seeded fuzz over a valid sharding plan file for a small model.

Every field deleted and retyped, out-of-range values, extra / missing / duplicate tables,
overlapping and gapped shards, empty files, binary garbage and truncated JSON must each be a
one-line ``PlanValidationError`` naming the file (and the table, where there is one). A variant
that loads must be the same plan (key order, whitespace, a BOM, short type names, defaults spelled
out): "handled"; any other plan that loads is "silently accepted".
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

from faults import campaign, run_cli

from neorec.config import TableConfig
from neorec.errors import NeorecError
from neorec.sharding.plan_checks import validate_plan
from neorec.sharding.plan_json import load_plan, parse_plan_dict, parse_plan_text
from neorec.sharding.types import (
    PlanValidationError,
    ShardingPlan,
    column_wise,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)

C = campaign("plan json")
TABLES = [
    TableConfig(name="rw", rows=10, dim=4),
    TableConfig(name="tw", rows=6, dim=4),
    TableConfig(name="cw", rows=8, dim=6),
    TableConfig(name="dp", rows=5, dim=4),
    TableConfig(name="twrw", rows=7, dim=4),
]
WORLD = 4
RETYPED = ("text", 0.5, 2.0, True, None, [], {}, [1, 2, 3], -1, 10**30)
"""Values of every JSON type (and a few numbers) that each field is replaced with."""


def base_plan() -> ShardingPlan:
    """A valid plan of every sharding type for ``TABLES`` on 4 ranks (2 hosts)."""
    rw, tw, cw, dp, twrw = TABLES
    plan = ShardingPlan(
        WORLD,
        2,
        [
            row_wise(rw, [0, 1, 2, 3]),
            table_wise(tw, 1, storage="host"),
            column_wise(cw, [2, 3]),
            data_parallel(dp, WORLD),
            table_row_wise(twrw, 1, 2),
        ],
        {"source": "test"},
    )
    validate_plan(plan)
    return plan


def same_placement(a: ShardingPlan, b: ShardingPlan) -> bool:
    """Equal plans, free-form ``meta`` aside."""
    return (a.world_size, a.ranks_per_host, a.tables) == (b.world_size, b.ranks_per_host, b.tables)


def try_plan(
    name: str,
    path: Path,
    content: str | bytes,
    must_name: tuple[str | tuple[str, ...], ...] = (),
    expect: ShardingPlan | None = None,
) -> str:
    """Write ``content`` to ``path``, load it for ``TABLES`` on ``WORLD`` ranks, classify: an
    error must name the file and each of ``must_name`` (a tuple: one of its alternatives); a plan
    that loads must equal ``expect`` (default: the base plan)."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    base = expect or base_plan()
    try:
        plan = load_plan(path, tables=TABLES, world_size=WORLD)
    except PlanValidationError as e:
        msg = str(e)
        wanted = (str(path), *must_name)
        named = all(any(a in msg for a in ((w,) if isinstance(w, str) else w)) for w in wanted)
        if "\n" in msg or not named:
            return C.record(name, "crash", f"message lacks {wanted} or is multi-line: {msg!r}")
        return C.record(name, "clear error", msg)
    except Exception as e:  # noqa: BLE001 - counted
        return C.record(name, "crash", f"{type(e).__name__}: {e}")
    if same_placement(plan, base):
        return C.record(name, "handled", "loads as the same plan")
    return C.record(name, "silently accepted", f"loaded a different plan: {plan.to_dict()}")


def _fields(d: dict[str, Any]) -> list[tuple[tuple[Any, ...], tuple[str, ...]]]:
    """Every (path, what the error must name: one of) of a field in the plan dict: top level,
    tables, shards. A table's errors name it (or ``tables[i]`` when its name is what is wrong)."""
    out: list[tuple[tuple[Any, ...], tuple[str, ...]]] = [((k,), (k, "no entry")) for k in d]
    for i, t in enumerate(d["tables"]):
        out += [(("tables", i, k), (t["name"], f"tables[{i}]")) for k in t]
        for j, s in enumerate(t["shards"]):
            out += [(("tables", i, "shards", j, k), (t["name"],)) for k in s]
    return out


def _default_when_deleted(fpath: tuple[Any, ...]) -> ShardingPlan | None:
    """The plan a deleted optional field stands for (its documented default), else None."""
    plan = base_plan()
    if fpath in (("format_version",), ("meta",)):
        return plan
    if fpath == ("ranks_per_host",):  # one host
        plan.ranks_per_host = plan.world_size
        return plan
    if len(fpath) == 3 and fpath[2] == "storage":
        plan.tables[fpath[1]].storage = "device"
        return plan
    return None


def _parent(d: Any, path: tuple[Any, ...]) -> Any:
    for k in path[:-1]:
        d = d[k]
    return d


def test_plan_json_fields_deleted_and_retyped(tmp_path: Path) -> None:
    base = base_plan().to_dict()
    path = tmp_path / "plan.json"
    for fpath, what in _fields(base):
        label = "/".join(map(str, fpath))
        d = copy.deepcopy(base)
        del _parent(d, fpath)[fpath[-1]]
        try_plan(f"delete {label}", path, json.dumps(d), (what,), _default_when_deleted(fpath))
        for v in RETYPED:
            d = copy.deepcopy(base)
            _parent(d, fpath)[fpath[-1]] = v
            try_plan(f"{label} = {v!r}"[:80], path, json.dumps(d), (what,))
    C.check()


def test_plan_json_out_of_range_and_tables(tmp_path: Path) -> None:
    base = base_plan().to_dict()
    path = tmp_path / "plan.json"
    tables = {t["name"]: i for i, t in enumerate(base["tables"])}
    rw, tw, cw = tables["rw"], tables["tw"], tables["cw"]

    def case(name: str, edit: Any, must: tuple[str, ...] = ()) -> None:
        d = copy.deepcopy(base)
        edit(d)
        try_plan(name, path, json.dumps(d), must)

    def shard(t: int, j: int, key: str, value: Any) -> Any:
        return lambda d: d["tables"][t]["shards"][j].__setitem__(key, value)

    case("rank = world_size", shard(tw, 0, "rank", WORLD), ("tw", "rank 4"))
    case("rank < 0", shard(tw, 0, "rank", -1), ("tw", "rank"))
    case("rows past the table", shard(tw, 0, "rows", [0, 7]), ("tw", "rows"))
    case("rows reversed", shard(tw, 0, "rows", [6, 0]), ("tw", "rows"))
    case("empty row range", shard(rw, 0, "rows", [0, 0]), ("rw", "rows"))
    case("cols past the dim", shard(cw, 1, "cols", [2, 7]), ("cw", "cols"))
    case("overlapping row shards", shard(rw, 0, "rows", [0, 4]), ("rw", "more than once"))
    case("gap between row shards", shard(rw, 1, "rows", [4, 5]), ("rw", "not covered"))
    case("gap between col slices", shard(cw, 0, "cols", [0, 2]), ("cw", "not covered"))
    case("TWRW across hosts", shard(tables["twrw"], 0, "rank", 0), ("twrw", "one host"))
    case("DP misses a rank", lambda d: d["tables"][tables["dp"]]["shards"].pop(), ("dp",))
    case("table without shards", lambda d: d["tables"][tw].__setitem__("shards", []), ("tw",))
    case("rows differ from model", lambda d: d["tables"][tw].__setitem__("rows", 7), ("tw",))
    case("dim differs from model", lambda d: d["tables"][tw].__setitem__("dim", 8), ("tw",))
    case("world_size 0", lambda d: d.__setitem__("world_size", 0), ("world_size",))
    case("world_size 8 (model runs 4)", lambda d: d.__setitem__("world_size", 8), ("world_size",))
    case("ranks_per_host 3", lambda d: d.__setitem__("ranks_per_host", 3), ("ranks_per_host",))
    case("format_version 99", lambda d: d.__setitem__("format_version", 99), ("format_version",))
    case("unknown storage", lambda d: d["tables"][tw].__setitem__("storage", "tape"), ("tw",))
    case("unknown type", lambda d: d["tables"][tw].__setitem__("type", "diagonal"), ("tw",))
    case("typo'd field", lambda d: d["tables"][tw].__setitem__("storge", "ssd"), ("storge",))
    case("unknown top-level field", lambda d: d.__setitem__("world", 4), ("world",))
    extra = copy.deepcopy(base["tables"][tw]) | {"name": "ghost"}
    case("extra table", lambda d: d["tables"].append(extra), ("ghost", "not in the model"))
    case("missing table", lambda d: d["tables"].pop(tw), ("tw", "no entry"))
    dup = copy.deepcopy(base["tables"][tw])
    case("duplicate table", lambda d: d["tables"].append(dup), ("tw", "more than once"))
    case("no tables", lambda d: d.__setitem__("tables", []), ("no entry",))
    text = json.dumps(base)
    nan = text.replace('"storage": "host"', '"storage": "host", "cache_fraction": NaN')
    try_plan("cache_fraction NaN", path, nan, ("tw", "cache_fraction"))
    inf = text.replace('"rows": 6,', '"rows": Infinity,')
    try_plan("rows Infinity", path, inf, ("tw", "rows"))
    C.check()


def test_plan_json_garbage_and_truncation(tmp_path: Path) -> None:
    rng = random.Random(16)
    path = tmp_path / "plan.json"
    text = base_plan().to_json()
    try_plan("empty file", path, "")
    try_plan("whitespace only", path, " \n\t\n")
    try_plan("a JSON list", path, "[]")
    try_plan("a JSON number", path, "4")
    try_plan("null", path, "null")
    try_plan("a JSON string", path, '"plan"')
    try_plan("duplicate key", path, '{"world_size": 4, "world_size": 2, "tables": []}')
    try_plan("nested too deeply", path, "[" * 100_000 + "]" * 100_000)
    try_plan("latin-1 byte", path, text.replace('"rw"', '"r\xe9"').encode("latin-1"))
    for i in range(12):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
        try_plan(f"binary garbage {i}", path, junk)
    for _ in range(25):
        cut = rng.randrange(1, len(text) - 1)
        try_plan(f"truncated at {cut}", path, text[:cut])
    for _ in range(8):  # one byte replaced by another printable character
        pos = rng.randrange(len(text))
        ch = rng.choice('{}[]:,"0x- ')
        mutated = text[:pos] + ch + text[pos + 1 :]
        try_plan(f"byte {pos} -> {ch!r}", path, mutated)
    missing = tmp_path / "missing.json"
    try:
        load_plan(missing)
        C.record("missing file", "silently accepted")
    except PlanValidationError as e:
        C.record("missing file", "clear error" if str(missing) in str(e) else "crash", str(e))
    try:
        load_plan(tmp_path)
        C.record("a directory", "silently accepted")
    except PlanValidationError as e:
        C.record("a directory", "clear error" if str(tmp_path) in str(e) else "crash", str(e))
    C.check()


def test_plan_json_valid_variants(tmp_path: Path) -> None:
    rng = random.Random(7)
    path = tmp_path / "plan.json"
    base = base_plan().to_dict()

    def ok(name: str, p: Path, content: str) -> None:
        assert try_plan(name, p, content) == "handled", C.cases[-1]

    ok("as saved", path, base_plan().to_json())
    ok("compact", path, json.dumps(base, separators=(",", ":")))
    ok("wide indent, CRLF", path, json.dumps(base, indent=8).replace("\n", "\r\n"))
    ok("UTF-8 BOM", path, "\ufeff" + json.dumps(base))
    for i in range(5):
        d = copy.deepcopy(base)
        items = list(d.items())
        rng.shuffle(items)
        for t in d["tables"]:
            keys = list(t)
            rng.shuffle(keys)
            t_sh = {k: t[k] for k in keys}
            t.clear()
            t.update(t_sh)
        ok(f"field order shuffled {i}", path, json.dumps(dict(items)))
    d = copy.deepcopy(base)
    for t in d["tables"]:
        t["type"] = {"row_wise": "RW", "table_wise": "tw", "column_wise": "CW"}.get(
            t["type"], t["type"]
        )
    ok("short type names", path, json.dumps(d))
    d = copy.deepcopy(base)
    del d["format_version"], d["meta"]
    for t in d["tables"]:
        if t["storage"] == "device":
            del t["storage"]
    ok("defaults left out", path, json.dumps(d))
    d = copy.deepcopy(base)
    d["meta"] = {"note": "hand-edited", "cost": [1, 2]}
    ok("other meta", path, json.dumps(d))
    C.check()


def test_plan_from_dict_and_json_name_no_file_but_stay_one_line() -> None:
    base = base_plan().to_dict()
    for name, fn in [
        ("from_dict of a list", lambda: parse_plan_dict([])),  # type: ignore[arg-type]
        ("from_json garbage", lambda: parse_plan_text("{nope")),
        ("from_dict rank 0.5", lambda: parse_plan_dict(_set_rank(base, 0.5))),
    ]:
        C.expect_error(name, fn, match="invalid sharding plan")
    C.check()


def _set_rank(base: dict[str, Any], v: Any) -> dict[str, Any]:
    d = copy.deepcopy(base)
    d["tables"][0]["shards"][0]["rank"] = v
    return d


# ---- through the command line ---------------------------------------------------------------
CLI_TRAIN = ["train", "--set", "train.steps=1", "--set", "data.train_samples=2048"]
CLI_TRAIN += ["--set", "data.eval_samples=512", "--set", "data.batch_size=512"]


def _default_plan(world: int) -> dict[str, Any]:
    """A valid plan for the default config's tables (t0..t7, 10000 x 16) on ``world`` ranks."""
    tables = [TableConfig(name=f"t{i}", rows=10000, dim=16) for i in range(8)]
    plan = ShardingPlan(world, world, [table_wise(t, i % world) for i, t in enumerate(tables)])
    return plan.to_dict()


def test_plan_cli_one_process_train(tmp_path: Path) -> None:
    """A one-process ``neorec train`` checks ``sharding.plan`` as a distributed run does: the file,
    the model's tables and world size 1 (a plan for N ranks is an error naming --nproc)."""
    cases: list[tuple[str, str | bytes, tuple[str, ...]]] = [
        ("empty plan file", "", ("plan.json", "empty")),
        ("truncated plan", json.dumps(_default_plan(1))[:50], ("plan.json", "JSON")),
        ("binary plan", bytes(range(256)), ("plan.json",)),
        ("plan for 2 ranks", json.dumps(_default_plan(2)), ("plan.json", "world_size 2")),
        ("plan table not in the model", _with_extra(_default_plan(1)), ("plan.json", "ghost")),
        ("plan rank 0.5", json.dumps(_set_rank(_default_plan(1), 0.5)), ("plan.json", "rank")),
        ("plan tables as object", '{"world_size": 1, "tables": {}}', ("plan.json", "tables")),
    ]
    for name, content, match in cases:
        path = tmp_path / "plan.json"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        C.expect_cli_error(
            name, [*CLI_TRAIN, "--set", f"sharding.plan={path}"], match=match, cwd=str(tmp_path)
        )
    C.check()


def _with_extra(d: dict[str, Any]) -> str:
    d = copy.deepcopy(d)
    d["tables"].append(copy.deepcopy(d["tables"][0]) | {"name": "ghost"})
    return json.dumps(d)


def test_plan_cli_plan_out_round_trips(tmp_path: Path) -> None:
    """``neorec plan --out`` writes a plan that loads strictly against the config's model."""
    from neorec.config import load_config

    out = tmp_path / "plan.json"
    cfg_path = Path(__file__).resolve().parents[1] / "configs" / "default.toml"
    argv = ["plan", "--config", str(cfg_path), "--world-size", "2", "--no-cached-tiers"]
    r = run_cli([*argv, "--out", str(out)], cwd=str(tmp_path))
    if r.returncode != 0 or not out.exists():
        C.record("neorec plan --out", "crash", r.stderr[-400:])
    else:
        cfg = load_config(cfg_path)
        try:
            load_plan(out, tables=cfg.embedding.tables, world_size=2)
            C.record("neorec plan --out round trip", "handled", "loads against the model")
        except NeorecError as e:
            C.record("neorec plan --out round trip", "crash", str(e))
    C.check()
