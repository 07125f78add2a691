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
        ("train.stepz=3", r"unknown key\(s\) \['stepz'\] in \[train\]"),
        ("train.steps='x'", r"train.steps must be int, got 'x'"),
        ("model.interaction=cat", r"model.interaction must be 'dot' or 'dcn'"),
        ("embedding.rows=0", r"rows must be > 0"),
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
