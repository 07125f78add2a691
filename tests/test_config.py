import numpy as np
import pytest

from neorec.config import ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(overrides=["train.steps=7", "embedding.rows=123", "model.interaction='dcn'"])
    assert cfg.train.steps == 7
    assert all(t.rows == 123 for t in cfg.embedding.tables)
    assert cfg.model.interaction == "dcn"
    assert len(cfg.embedding.tables) == cfg.embedding.num_tables


def test_toml_file_with_tables(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        """
[model]
bottom_mlp = [8, 4]
[[embedding.tables]]
name = "user"
rows = 10
dim = 4
[[embedding.tables]]
name = "item"
rows = 20
dim = 4
features = ["item", "item_hist"]
"""
    )
    cfg = load_config(p)
    assert [t.name for t in cfg.embedding.tables] == ["user", "item"]
    assert cfg.embedding.feature_names == ["user", "item", "item_hist"]


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.stepz=3", r"unknown key 'stepz' in \[train\] \(did you mean 'steps'\?\)"),
        ("train.steps='x'", r"train.steps must be an integer, got 'x'"),
        ("model.interaction=cat", r"model.interaction must be one of 'dot', 'dcn', got 'cat'"),
        ("embedding.rows=0", r"embedding.rows must be >= 1 \(allowed: \[1, "),
        ("model.bottom_mlp=[8, 3]", r"must end with the embedding dim 16"),
        ("data.source=parquet", r"data.source must be"),
        ("nonsense", r"--set expects section.key=value"),
    ],
)
def test_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_missing_file():
    with pytest.raises(ConfigError, match="config file not found"):
        load_config("/nonexistent/x.toml")


@pytest.mark.parametrize(
    "override, match",
    [
        ("model=3", r"--set model=3: model is a section, not a value"),
        ("a.b.c=1", r"unknown section 'a'"),
        ("train.steps.x=1", r"train.steps is a value, not a section"),
        ("trian.steps=1", r"unknown section 'trian' \(did you mean 'train'\?\)"),
        ("train.=1", r"has an empty part"),
        ("train.progress=1", r"train.progress must be true or false, got 1"),
        ("train.steps=true", r"train.steps must be an integer, got True"),
        ("embedding.lr=nan", r"embedding.lr must be a finite number, got nan"),
        ("embedding.lr=1e39", r"embedding.lr must be <= 3.4e\+38"),
        ("embedding.rows=9223372036854775807", r"embedding.rows must be <= 1,099,511,627,776"),
        ("embedding.num_tables=100000000", r"embedding.num_tables must be <= 100,000"),
        ("sharding.default_type=rows", r"sharding.default_type must be one of"),
        ("sharding.types.t9=row_wise", r"sharding.types names unknown table 't9'"),
        ("sharding.types.t0=row_wize", r"sharding.types.t0 .* \(did you mean 'row_wise'\?\)"),
        ("planner.cache_fractions=[0.5, 1.5]", r"planner.cache_fractions\[1\] must be <= 1"),
        ("checkpoint.adaptive_threshold=0", r"checkpoint.adaptive_threshold must be > 0"),
        ("embedding.tables=[{name='a', rows=10}]", r"embedding.tables\[0\] needs 'dim'"),
    ],
)
def test_more_errors_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides=[override])


def test_valid_values_load():
    cfg = load_config(
        overrides=[
            "embedding.pooling_factor=0",
            "data.zipf_alpha=0",
            "model.dcn_layers=0",
            "sharding.types.t1=RW",
            "sharding.default_type='data_parallel'",
            "planner.topology.device_memory_gb=80",
            "checkpoint.opt_bits=0",
            "embedding.lr=2",  # an int for a float field becomes a float
        ]
    )
    assert cfg.embedding.lr == 2.0 and isinstance(cfg.embedding.lr, float)
    assert cfg.sharding.types == {"t1": "RW"}
    assert cfg.planner.topology == {"device_memory_gb": 80}


def test_programmatic_construction_is_checked():
    from neorec.config import DataConfig, ModelConfig, TableConfig, TrainConfig

    with pytest.raises(ConfigError, match=r"embedding.tables\['a'\].rows must be an integer"):
        TableConfig(name="a", rows=True, dim=4)
    with pytest.raises(ConfigError, match=r"model.bottom_mlp\[0\] must be >= 1"):
        ModelConfig(bottom_mlp=[0, 16])
    with pytest.raises(ConfigError, match="data.teacher_scale must be a finite number"):
        DataConfig(teacher_scale=float("nan"))
    with pytest.raises(ConfigError, match="train.collective_timeout_s must be >= 1"):
        TrainConfig(collective_timeout_s=0)
    t = TableConfig(name="a", rows=np.int64(10), dim=4, pooling_factor=2)  # type: ignore[arg-type]
    assert type(t.rows) is int and type(t.pooling_factor) is float


def test_config_files(tmp_path):
    binary = tmp_path / "b.toml"
    binary.write_bytes(b"[train]\nsteps = 1\n\xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"b.toml: not UTF-8 text \(byte 0xff at line 3\)"):
        load_config(binary)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = 1\nsteps = 2\n")
    with pytest.raises(ConfigError, match=r"bad.toml: invalid TOML: .*line 3"):
        load_config(bad)
    sect = tmp_path / "s.toml"
    sect.write_text("model = 3\n")
    with pytest.raises(ConfigError, match=r"s.toml: model is a section"):
        load_config(sect)


def test_name_lists_agree_with_their_owners():
    from neorec.config import EMBEDDING_OPTIMIZERS, SHARDING_TYPES
    from neorec.ops.row_optim import OPTIMIZERS
    from neorec.sharding.types import ShardingType

    assert tuple(EMBEDDING_OPTIMIZERS) == tuple(OPTIMIZERS)
    assert SHARDING_TYPES == {s.value: s.short.lower() for s in ShardingType}


def test_tables_memory_checked_from_the_config():
    from neorec.modules.collection_parts import check_tables_memory

    cfg = load_config(overrides=["embedding.rows=1000000000000"])
    with pytest.raises(ConfigError, match="the tables need .* GiB of memory"):
        check_tables_memory(cfg.embedding.tables, cfg.embedding.optimizer)
    small = load_config()
    check_tables_memory(small.embedding.tables, small.embedding.optimizer)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.eval_samples=100"], r"data.eval_samples 100 is less than one batch"),
        (["data.train_samples=511"], r"data.train_samples 511 is less than one batch"),
        (["embedding.num_tables=100000"], r"the dense part would have .* at most 2,147,483,648"),
        (
            [
                "model.interaction='dcn'",
                "embedding.tables=[{name='a', rows=3, dim=4}, {name='b', rows=3, dim=8}]",
            ],
            r"training needs one embedding dim for all tables, got \[4, 8\]",
        ),
    ],
)
def test_check_trainable(overrides, match):
    from neorec.config import check_trainable

    cfg = load_config(overrides=overrides)  # a valid config (e.g. for neorec plan) ...
    with pytest.raises(ConfigError, match=match):
        check_trainable(cfg)  # ... that cannot train


def test_dense_params_match_the_model():
    from neorec.builder import build_dlrm
    from neorec.config import dense_params

    for over in ([], ["model.interaction='dcn'", "model.dcn_low_rank=8"], ["model.dot_self=true"]):
        cfg = load_config(overrides=[*over, "embedding.rows=10"])
        arch = build_dlrm(cfg).dense_arch
        assert sum(dense_params(cfg)) == sum(p.numel() for p in arch.parameters())
