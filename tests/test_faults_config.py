"""Fault campaign "config fuzz": every config field and ``--set`` form a user can get wrong.

The findings of issue 16 §4 one by one, then a mutation of every field of the default config
(wrong type, negative, zero, NaN, inf, huge, empty) through ``load_config(overrides=...)`` and
through the section's constructor, judged against ``SPEC`` below: the allowed values of each field,
written here independently of the code's rules. A value SPEC allows must load ("handled"; an error
is a "crash"); any other must be a one-line ``ConfigError`` naming the field. Seeded random
combinations put one bad value among valid ones (the error must name the bad field). Every
``configs/*.toml`` loads. A few CLI runs prove the one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import pytest
from faults import campaign, judge_cli, run_cli

from neorec.config import Config, ConfigError, load_config
from neorec.config.load import _parse_value
from neorec.config.run import STREAM_ONLY

C = campaign("config fuzz")
ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "embedding.num_tables=2",
    "embedding.rows=100",
    "embedding.dim=8",
    "model.bottom_mlp=[16, 8]",
    "model.top_mlp=[16, 1]",
    "data.batch_size=64",
    "data.train_samples=640",
    "data.eval_samples=128",
    "train.steps=3",
    "train.progress=false",
]

# ---- the findings ---------------------------------------------------------------------------
FINDINGS = [
    ("model.bottom_mlp=[0,16]", "model.bottom_mlp[0]"),
    ("model.top_mlp=[0,1]", "model.top_mlp[0]"),
    ("model=3", "model is a section"),
    ("data.eval_samples=0", "data.eval_samples"),
    ("embedding.pooling_factor=inf", "embedding.pooling_factor"),
    ("embedding.pooling_factor=nan", "embedding.pooling_factor"),
    ("data.zipf_alpha=nan", "data.zipf_alpha"),
    ("data.teacher_scale=nan", "data.teacher_scale"),
    ("train.threads=-1", "train.threads"),
    (f"embedding.rows={2**63 - 1}", "embedding.rows"),
    (f"embedding.tables=[{{name='a', rows={2**63 - 1}, dim=16}}]", "embedding.tables['a'].rows"),
    ("embedding.num_tables=100000000", "embedding.num_tables"),
    ("train.log_every=-1", "train.log_every"),
    ("train.eval_every=-1", "train.eval_every"),
    ("model.dcn_layers=-1", "model.dcn_layers"),
    ("model.dcn_low_rank=-1", "model.dcn_low_rank"),
    ("embedding.init_scale=-1", "embedding.init_scale"),
    ("checkpoint.full_every=-1", "checkpoint.full_every"),
    ("data.zipf_alpha=-1", "data.zipf_alpha"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s"),
    ("train.collective_timeout_s=-1", "train.collective_timeout_s"),
    ("checkpoint.adaptive_threshold=nan", "checkpoint.adaptive_threshold"),
    ("checkpoint.adaptive_threshold=-1", "checkpoint.adaptive_threshold"),
    ("sharding.default_type='diagonal'", "sharding.default_type"),
    ("sharding.types.nope='row_wise'", "unknown table 'nope'"),
    ("embedding.lr=-1", "embedding.lr"),
    ("embedding.lr=nan", "embedding.lr"),
    ("embedding.eps=0", "embedding.eps"),
    ("embedding.eps=1e-50", "embedding.eps"),
    ("train.dense_lr=0", "train.dense_lr"),
    ("train.dense_lr=inf", "train.dense_lr"),
    ("embedding.weight_decay=-0.1", "embedding.weight_decay"),
    ("foo", "--set expects section.key=value"),
    ("a.b.c=1", "unknown section 'a'"),
    ("train.steps.x=1", "train.steps is a value"),
    ("trian.steps=1", "did you mean 'train'"),
    ("train.setps=1", "did you mean 'steps'"),
    ("train.steps=[1]", "train.steps must be an integer"),
    ("train.steps='3'", "train.steps must be an integer"),
    ("model.bottom_mlp=16", "model.bottom_mlp must be a list"),
    ("train.progress=1", "train.progress must be true or false"),
    ("embedding.dim=17", "model.bottom_mlp must end with the embedding dim 17"),
]


def test_findings():
    for override, match in FINDINGS:
        C.expect_error(
            f"finding: --set {override}", lambda o=override: load_config(None, [o]), match
        )
    C.check()


TRAINABLE = [
    (["data.eval_samples=10"], "data.eval_samples 10 is less than one batch"),
    (["data.train_samples=100"], "data.train_samples 100 is less than one batch"),
    (["embedding.num_tables=100000"], "the dense part would have"),
    (["model.interaction='dcn'", "embedding.num_tables=100000"], "dcn interaction"),
    (["model.top_mlp=[65536, 65536, 1]"], "top MLP"),
    (
        [
            "model.interaction='dcn'",
            "embedding.tables=[{name='a', rows=3, dim=4}, {name='b', rows=3, dim=8}]",
        ],
        "one embedding dim",
    ),
]
"""Valid configs (``neorec plan`` takes them) that training must refuse before any work."""


def test_trainable():
    from neorec.config import check_trainable

    for over, match in TRAINABLE:
        cfg = load_config(None, over)
        C.expect_error(f"trainable: {over}", lambda c=cfg: check_trainable(c), match)
    C.record("trainable: default", "handled", "")
    check_trainable(load_config())
    C.check()


def test_config_files(tmp_path):
    cases = {
        "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe\x00", "not UTF-8 text"),
        "bad toml": (b"[train]\nsteps = 1\nsteps = 2\n", "line 3"),
        "unclosed": (b"[model]\nbottom_mlp = [64, 32\n", "invalid TOML"),
        "nul": (b"[train]\nsteps = 1\x00\n", "invalid TOML"),
        "section value": (b"model = 3\n", "model is a section"),
        "array of sections": (b"[[train]]\nsteps = 1\n", "train is a section"),
        "unknown section": (b"[trian]\nsteps = 1\n", "did you mean 'train'"),
        "unknown key": (b"[train]\nstpes = 1\n", "did you mean 'steps'"),
        "table without dim": (b"[[embedding.tables]]\nname = 'a'\nrows = 3\n", "needs 'dim'"),
        "table bad rows": (b"[[embedding.tables]]\nname='a'\nrows=-3\ndim=16\n", "'a'].rows"),
    }
    for name, (content, match) in cases.items():
        p = tmp_path / f"{name.replace(' ', '_')}.toml"
        p.write_bytes(content)
        C.expect_error(f"file: {name}", lambda p=p: load_config(p), (p.name, match))
    C.expect_error("file: missing", lambda: load_config(tmp_path / "no.toml"), "not found")
    C.expect_error("file: directory", lambda: load_config(tmp_path), "is a directory")
    for path in sorted((ROOT / "configs").glob("*.toml")):
        try:
            cfg = load_config(path)
            ok = bool(cfg.embedding.tables) and cfg.to_json() == load_config(path).to_json()
            C.record(f"shipped: {path.name}", "handled" if ok else "crash", "loads and validates")
        except Exception as e:  # noqa: BLE001 - a shipped config that fails is a crash
            C.record(f"shipped: {path.name}", "crash", f"{type(e).__name__}: {e}")
    C.check()


# ---- every field, mutated -------------------------------------------------------------------
# kind, then what is allowed: ("int", lo[, hi]) (hi: a generous cap, 2**30 or more; the "huge"
# mutations are over it) / ("float", lo, lo excluded, hi) / ("choice", values) / ("str", nonempty)
# / ("bool",) / ("ints",) MLP widths / ("fracs",) / ("dict",) of sharding types / ("anydict",)
# free-form (checked by its reader) / ("tables",).
SPEC: dict[str, tuple[Any, ...]] = {
    "model.num_dense": ("int", 1),
    "model.bottom_mlp": ("ints",),
    "model.top_mlp": ("ints",),
    "model.interaction": ("choice", ("dot", "dcn")),
    "model.dcn_layers": ("int", 0),
    "model.dcn_low_rank": ("int", 0),
    "model.dot_self": ("bool",),
    "embedding.tables": ("tables",),
    "embedding.num_tables": ("int", 1),
    "embedding.rows": ("int", 1),
    "embedding.dim": ("int", 1),
    "embedding.pooling_factor": ("float", 0, False, 1e5),
    "embedding.pooling": ("choice", ("sum", "mean")),
    "embedding.optimizer": ("choice", ("sgd", "rowwise_adagrad", "adam")),
    "embedding.lr": ("float", 0, True, 3.4e38),
    "embedding.eps": ("float", 0, True, 3.4e38),
    "embedding.weight_decay": ("float", 0, False, 3.4e38),
    "embedding.cowclip_ratio": ("float", 0, False, 3.4e38),
    "embedding.cowclip_bound": ("float", 0, False, 3.4e38),
    "embedding.backend": ("choice", ("auto", "reference", "cpu", "cuda", "triton")),
    "embedding.init_scale": ("float", 0, False, 3.4e38),
    "embedding.precision": ("choice", ("fp32", "fp16", "bf16", "fp8")),
    "embedding.rounding": ("choice", ("auto", "nearest", "stochastic")),
    "data.source": ("choice", ("synthetic", "criteo", "stream")),
    "data.path": ("str", False),
    "data.eval_path": ("str", False),
    "data.batch_size": ("int", 1),
    "data.train_samples": ("int", 1),
    "data.eval_samples": ("int", 1),
    "data.id_distribution": ("choice", ("locality", "zipf", "uniform")),
    "data.zipf_alpha": ("float", 0, False, 10),
    "data.fixed_pooling": ("bool",),
    "data.teacher_scale": ("float", 0, False, 1000),
    "data.teacher_groups": ("int", 0),
    "data.hash_categories": ("bool",),
    "data.bad_lines": ("choice", ("fail", "skip")),
    "data.bad_rows": ("choice", ("fail", "skip")),
    "data.max_bad_fraction": ("float", 0, False, 1),
    "data.seed": ("int", 0, 2**63 - 1),
    "data.shuffle": ("bool",),
    "data.shuffle_buffer": ("int", 1),
    "data.workers": ("int", 0),
    "data.prefetch": ("int", 1),
    "data.window": ("int", 0, 7),
    "data.windows": ("int", 1, 1_000_000),
    "data.drift": ("float", 0, False, 1),
    "data.id_churn": ("float", 0, False, 1),
    "data.window_samples": ("int", 1),
    "data.fm_logits": ("str", False),
    "data.fm_staleness": ("int", 0, 999_999),
    "data.vertical_bias": ("float", -10, False, 10),
    "data.vertical_shift": ("float", 0, False, 1),
    "data.id_shrink_visits": ("float", 0, False, 1e12),
    "data.id_weight": ("float", 0, False, 100),
    "data.schema": (
        "section",
    ),  # its own fields: tests/test_schema_tabular.py, test_faults_tabular.py
    "train.epochs": ("int", 1),
    "train.steps": ("int", 0),
    "train.dense_optimizer": ("choice", ("sgd", "adagrad", "adam")),
    "train.dense_lr": ("float", 0, True, 1e30),
    "train.eval_every": ("int", 0),
    "train.eval_fraction": ("float", 0, False, 1),
    "train.eval_batches": ("int", 0),
    "train.log_every": ("int", 0),
    "train.save_model": ("bool",),
    "train.tensorboard": ("choice", ("auto", "on", "off")),
    "train.runs_dir": ("str", True),
    "train.name": ("str", False),
    "train.run_dir": ("str", False),
    "train.seed": ("int", 0, 2**63 - 1),
    "train.threads": ("int", 0),
    "train.bf16_dense": ("bool",),
    "train.progress": ("bool",),
    "train.dense_blocks": ("int", 1),
    "train.collective_timeout_s": ("int", 1),
    "train.pipeline": ("choice", ("overlapped", "sequential")),
    "train.device": ("choice", ("cpu", "cuda")),
    "train.schedule": ("section",),  # its own fields: tests/test_schedule.py
    "train.qat": ("section",),  # its own fields: tests/test_qat.py
    "sequential.enabled": ("choice", (False,)),  # true alone is refused: it needs .path
    "sequential.path": ("str", False),
    "sequential.model": ("choice", ("sasrec",)),
    "sequential.dim": ("int", 1, 4096),
    "sequential.max_len": ("int", 1, 4096),
    "sequential.blocks": ("int", 1, 64),
    "sequential.heads": ("int", 1, 64),
    "sequential.dropout": ("float", 0, False, 0.99),
    "sequential.lr": ("float", 0, True, 10),
    "sequential.batch_size": ("int", 1, 1 << 20),
    "sequential.epochs": ("int", 1, 100_000),
    "sequential.loss": ("choice", ("full", "sampled")),
    "sequential.negatives": ("int", 1, 1 << 20),
    "sequential.exclude_seen": ("bool",),
    "train.lr_scaling": ("choice", ("none", "linear", "sqrt", "cowclip")),
    "train.reference_batch": ("int", 0, 2**24),  # > 0 only with lr_scaling (not mutated here)
    "sharding.plan": ("str", False),
    "sharding.default_type": ("choice", ("", "table_wise", "row_wise", "DP", "twrw")),
    "sharding.types": ("dict",),
    "planner.tables_file": ("str", False),
    "planner.batch_size": ("int", 0),
    "planner.weight_bytes": ("choice", (1, 2, 4, 8)),
    "planner.allow_host": ("bool",),
    "planner.allow_cached_tiers": ("bool",),
    "planner.cache_fractions": ("fracs",),
    "planner.max_cw_slices": ("int", 0),
    "planner.optimizer": ("choice", ("", "sgd", "rowwise_adagrad", "adam")),
    "planner.topology": ("anydict",),
    "planner.topology_file": ("str", False),
    "storage.dir": ("str", True),
    "storage.io_threads": ("int", 1),
    "storage.mapped_mb": ("int", 0),
    "storage.prefetch": ("bool",),
    "checkpoint.dir": ("str", False),
    "checkpoint.every_steps": ("int", 0),
    "checkpoint.policy": ("choice", ("full", "one_shot", "consecutive", "adaptive")),
    "checkpoint.bits": ("choice", (32, 8, 4, 3, 2)),
    "checkpoint.adaptive_range": ("bool",),
    "checkpoint.opt_bits": ("choice", (32, 16, 8, 0)),
    "checkpoint.keep_last": ("int", 1),
    "checkpoint.async_write": ("bool",),
    "checkpoint.adaptive_threshold": ("float", 0, True, 1e6),
    "checkpoint.full_every": ("int", 0),
    "checkpoint.chunk_rows": ("int", 1),
    "checkpoint.fsync": ("bool",),
    "checkpoint.resume": ("str", False),
    "comm.forward": ("choice", ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")),
    "comm.backward": ("choice", ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")),
    "comm.allreduce": ("choice", ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")),
    "comm.fp8_scaling": ("choice", ("row", "tensor")),
    "comm.loss_scale": ("float", 0, False, 3.4e38),
    "comm.transport": ("choice", ("auto", "shm", "gloo")),
    "lowp.mode": ("choice", ("off", "auto", "bf16", "fp16", "fp8")),
    "lowp.tolerance": ("float", 0, True, 1.0),
    "lowp.probe_steps": ("int", 1, 10_000),
    "lowp.reprobe_every": ("int", 0, 2**40),
    "lowp.drift": ("float", 1, True, 1e6),
    "lowp.keep_ends": ("bool",),
    "lowp.row_scale": ("bool",),
    "lowp.plan": ("str", False),
    "towers.count": ("int", 0),
    "towers.groups": ("tables",),  # only [] among the mutations: lists of lists of table names
    "towers.partitioner": ("choice", ("", "learned", "balanced", "random")),
    "towers.module": ("choice", ("identity", "mlp", "dot", "dcn")),
    "towers.out_vectors": ("int", 1),
    "towers.warmup_steps": ("int", 1),
    "towers.balance": ("float", 1, False, 1000),
    "towers.seed": ("int", 0, 2**63 - 1),
    # distill.enabled = true alone distills nothing (weight 0, no aux head): refused
    "distill.enabled": ("choice", (False,)),
    "distill.aux_head": ("bool",),
    "distill.aux_weight": ("float", 0, False, 1e6),
    "distill.adapter": ("bool",),
    "distill.adapter_size": ("int", 1, 4096),
    "distill.temperature": ("float", 0, True, 1e6),
    "distill.weight": ("float", 0, False, 1),
    "system.hugepages": ("bool",),
    "system.keep_heap": ("bool",),
    "system.native": ("bool",),
    "system.fail_at": ("choice", ("",)),  # RANK:STEP: no mutation is one
}
MUTATIONS = {
    "string": "'x'",
    "empty string": "''",
    "negative": "-1",
    "zero": "0",
    "negative float": "-0.5",
    "fraction": "0.5",
    "nan": "nan",
    "inf": "inf",
    "-inf": "-inf",
    "int64 max": str(2**63 - 1),
    "huge int": str(10**30),
    "huge float": "1e300",
    "true": "true",
    "empty list": "[]",
    "list": "[1, 2]",
    "table": "{a = 1}",
}
"""Override texts (TOML) every field is set to."""


def _field_names() -> list[str]:
    cfg = Config()
    return [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(cfg)
        for f in dataclasses.fields(getattr(cfg, s.name))
    ]


def allowed(spec: tuple[Any, ...], v: Any) -> bool:
    """Whether SPEC allows the parsed override value ``v`` (the mutations only)."""
    kind = spec[0]
    num = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "int":
        hi = spec[2] if len(spec) > 2 else 2**30
        return isinstance(v, int) and not isinstance(v, bool) and spec[1] <= v <= hi
    if kind == "float":
        if not num or not math.isfinite(v) or v > spec[3]:
            return False
        return v > spec[1] if spec[2] else v >= spec[1]
    if kind == "choice":
        return any(v == c and type(v) is type(c) for c in spec[1])
    if kind == "str":
        return isinstance(v, str) and (bool(v) or not spec[1])
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "ints":  # widths: no mutation ends with the dot interaction's 16 / the logit's 1
        return False
    if kind == "fracs":
        return isinstance(v, list) and bool(v) and all(num and 0 < x <= 1 for x in v)
    if kind == "dict":
        return isinstance(v, dict) and not v  # ({a = 1}: not a table name / not a type)
    if kind == "anydict":
        return isinstance(v, dict)
    if kind == "tables":
        return v == []
    if kind == "section":  # a value is never a section
        return False
    raise AssertionError(kind)


def _judge(name: str, key: str, fn: Any, ok: bool) -> None:
    if ok:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a valid value refused
            C.record(name, "crash", f"valid value refused: {type(e).__name__}: {e}")
        else:
            C.record(name, "handled", "loads")
    else:
        C.expect_error(name, fn, key)


def _context(key: str) -> list[str]:
    """Overrides a field needs to be read at all: the stream's fields need the stream source; a
    bound needs its ratio, a pinned plan its mode."""
    section, name = key.split(".")
    if section == "data" and name in STREAM_ONLY:
        return ["data.source='stream'"]
    needs = {"embedding.cowclip_bound": ["embedding.cowclip_ratio=0.1"],
             "lowp.plan": ["lowp.mode='auto'"]}  # fmt: skip
    return needs.get(key, [])


def test_every_field_mutated():
    assert sorted(SPEC) == sorted(_field_names()), "every config field needs a SPEC entry"
    for key, spec in SPEC.items():
        for mut, text in MUTATIONS.items():
            v = _parse_value(text)
            ok = allowed(spec, v)
            over = [*_context(key), f"{key}={text}"]
            fn = lambda o=over: load_config(None, o)  # noqa: E731
            _judge(f"--set {key}={text} ({mut})", key, fn, ok)
    C.check()


def test_every_field_constructed_in_code():
    """The same checks for a section built in code (Python values, not TOML)."""
    cfg = Config()
    sections = {f.name: type(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    values = {
        "nan": math.nan,
        "inf": math.inf,
        "bool": True,
        "negative": -1,
        "str": "x",
        "none": None,
    }
    for key, spec in SPEC.items():
        section, name = key.split(".")
        cls = sections[section]
        extra = {
            "embedding.cowclip_bound": {"cowclip_ratio": 0.1},
            "lowp.plan": {"mode": "auto"},
        }.get(key, {"source": "stream"} if _context(key) else {})
        for v in values.values():
            ok = allowed(spec, v) if v is not None else False
            fn = lambda c=cls, n=name, v=v, x=extra: c(**x, **{n: v})  # noqa: E731
            _judge(f"{cls.__name__}({name}={v!r})", key, fn, ok)
    C.check()


def test_random_combinations():
    """One bad value among valid ones: the error names the bad field, never another."""
    rng = random.Random(0)
    good = [
        "train.steps=5",
        "train.log_every=0",
        "embedding.pooling_factor=0",
        "data.zipf_alpha=0",
        "checkpoint.opt_bits=0",
        "sharding.default_type='RW'",
        "comm.forward='fp16'",
        "model.dcn_layers=0",
        "train.threads=1",
        "embedding.lr=1",
    ]
    bad = [(k, t) for k, spec in SPEC.items() for t in MUTATIONS.values()]
    bad = [(k, t) for k, t in bad if not allowed(SPEC[k], _parse_value(t))]
    for i in range(60):
        key, text = rng.choice(bad)
        others = [g for g in good if g.split("=")[0] != key]
        over = rng.sample(others, 3) + [f"{key}={text}"]
        rng.shuffle(over)
        C.expect_error(f"combo {i}: {over}", lambda o=over: load_config(None, o), key)
    C.check()


# ---- training: bad optimizer values and a diverged loss -----------------------------------
def test_diverged_and_optimizer_values(tmp_path):
    from neorec.train.trainer import Trainer

    for over, match in [
        ("train.dense_lr=1e30", "loss became"),
        ("embedding.lr=1e30", "loss became"),
    ]:
        cfg = load_config(None, [*TINY, f"train.run_dir='{tmp_path / 'r'}'", over])
        C.expect_error(f"train: {over}", lambda c=cfg: Trainer(c).fit(), match)
    C.check()


# ---- the command line: one line, exit 2 -----------------------------------------------------
@pytest.mark.parametrize(
    "name, argv, match",
    [
        ("--set model=3", ["train", "--set", "model=3"], "model is a section"),
        ("--set foo", ["train", "--set", "foo"], "--set expects section.key=value"),
        ("missing config", ["train", "--config", "nope.toml"], "config file not found"),
        ("binary config", ["train", "--config", "bin.toml"], "not UTF-8 text"),
        ("dir config", ["train", "--config", "."], "is a directory"),
        ("bad lr", ["train", "--set", "embedding.lr=-1"], "embedding.lr must be > 0"),
        ("nan dense_lr", ["train", "--set", "train.dense_lr=nan"], "train.dense_lr"),
        (
            "diverged",
            ["train", *(a for s in TINY for a in ("--set", s))]
            + ["--set", "embedding.lr=1e30", "--set", "train.run_dir='r'"],
            "loss became nan",
        ),
    ],
)
def test_cli_one_line(tmp_path, name, argv, match):
    (tmp_path / "bin.toml").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    r = run_cli(argv, cwd=str(tmp_path))
    outcome, detail = judge_cli(r, ("neorec: error:", match))
    if outcome == "clear error" and r.returncode != 2:
        outcome, detail = "crash", f"exit {r.returncode}, not 2: {detail}"
    C.record(f"cli: {name}", outcome, detail)
    C.check()


def test_config_error_is_a_neorec_error():
    from neorec.errors import ConfigError as Moved
    from neorec.errors import NeorecError

    assert ConfigError is Moved and issubclass(ConfigError, (NeorecError, ValueError))


def test_stream_settings_refused_with_another_source():
    """A stream-only field set away from its default with another source would be ignored:
    refused in one line naming it; with the stream source it loads."""
    for key in ("data.drift=0.5", "data.id_weight=2", "data.fm_logits='x'"):
        with pytest.raises(ConfigError, match=r"data\.\w+: setting\(s\) of the stream"):
            load_config(None, [key])
        assert load_config(None, ["data.source='stream'", key]).data.source == "stream"
    assert load_config(None, ["data.drift=0.2"]).data.drift == 0.2  # the default: fine
