"""Configs: small dataclasses, one per part, loaded from TOML with ``--set a.b=c`` overrides."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

__all__ = [
    "TableConfig",
    "ModelConfig",
    "EmbeddingConfig",
    "DataConfig",
    "TrainConfig",
    "ShardingConfig",
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
]


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range; the message names it."""


@dataclass(kw_only=True)
class TableConfig:
    """One embedding table."""

    name: str
    """Table name (unique)."""
    rows: int
    """Number of rows (distinct ids)."""
    dim: int
    """Embedding dimension."""
    pooling_factor: float = 1.0
    """Mean ids per sample of each feature reading this table (synthetic data, planner)."""
    features: list[str] = field(default_factory=list)
    """Features that read this table; default: one feature named like the table."""

    def __post_init__(self) -> None:
        if self.rows <= 0:
            raise ConfigError(f"table '{self.name}': rows must be > 0, got {self.rows}")
        if self.dim <= 0:
            raise ConfigError(f"table '{self.name}': dim must be > 0, got {self.dim}")
        if self.pooling_factor < 0:
            raise ConfigError(
                f"table '{self.name}': pooling_factor must be >= 0, got {self.pooling_factor}"
            )
        if not self.features:
            self.features = [self.name]


@dataclass(kw_only=True)
class ModelConfig:
    """DLRM shape."""

    num_dense: int = 13
    """Dense (continuous) input features."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 32, 16])
    """Bottom MLP widths; the last must equal the embedding dim for the dot interaction."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32, 1])
    """Top MLP widths; the last must be 1 (the logit)."""
    interaction: str = "dot"
    """``dot`` (DLRM pairwise dot products) or ``dcn`` (DCNv2 cross network)."""
    dcn_layers: int = 3
    """Cross layers for ``dcn``."""
    dcn_low_rank: int = 0
    """Low-rank factor of each cross layer (0 = full rank), as in MLPerf DLRMv2 (512)."""
    dot_self: bool = False
    """Include each feature's dot product with itself (dot interaction)."""

    def __post_init__(self) -> None:
        if self.interaction not in ("dot", "dcn"):
            raise ConfigError(f"model.interaction must be 'dot' or 'dcn', got '{self.interaction}'")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ConfigError(f"model.top_mlp must end with 1 (the logit), got {self.top_mlp}")
        if not self.bottom_mlp:
            raise ConfigError("model.bottom_mlp must have at least one layer")
        if self.num_dense <= 0:
            raise ConfigError(f"model.num_dense must be > 0, got {self.num_dense}")


@dataclass(kw_only=True)
class EmbeddingConfig:
    """Embedding tables and their fused optimizer."""

    tables: list[TableConfig] = field(default_factory=list)
    """Explicit tables; when empty, ``num_tables`` tables ``t0..`` of ``rows`` x ``dim``."""
    num_tables: int = 8
    """Generated table count (when ``tables`` is empty)."""
    rows: int = 10_000
    """Rows of each generated table."""
    dim: int = 16
    """Dim of each generated table."""
    pooling_factor: float = 4.0
    """Pooling factor of each generated table."""
    pooling: str = "sum"
    """``sum`` or ``mean``."""
    optimizer: str = "rowwise_adagrad"
    """Fused optimizer: sgd, rowwise_adagrad, adam."""
    lr: float = 0.05
    """Fused optimizer learning rate."""
    eps: float = 1e-8
    """Fused optimizer epsilon."""
    weight_decay: float = 0.0
    """Fused optimizer L2 penalty."""
    backend: str = "auto"
    """TBE backend: auto, reference, cpu, cuda."""
    init_scale: float = 0.0
    """Uniform init range +-init_scale; 0 = +-sqrt(1/rows) as in the reference DLRM."""

    def __post_init__(self) -> None:
        self.tables = [t if isinstance(t, TableConfig) else TableConfig(**t) for t in self.tables]
        if not self.tables:
            if self.num_tables <= 0:
                raise ConfigError(f"embedding.num_tables must be > 0, got {self.num_tables}")
            self.tables = [
                TableConfig(
                    name=f"t{i}", rows=self.rows, dim=self.dim, pooling_factor=self.pooling_factor
                )
                for i in range(self.num_tables)
            ]
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ConfigError(f"embedding table names must be unique: {names}")
        feats = [f for t in self.tables for f in t.features]
        if len(set(feats)) != len(feats):
            raise ConfigError(f"a feature may read only one table: {feats}")
        if self.pooling not in ("sum", "mean"):
            raise ConfigError(f"embedding.pooling must be 'sum' or 'mean', got '{self.pooling}'")

    @property
    def feature_names(self) -> list[str]:
        """All features in table order."""
        return [f for t in self.tables for f in t.features]


@dataclass(kw_only=True)
class DataConfig:
    """Where batches come from."""

    source: str = "synthetic"
    """``synthetic`` or ``criteo`` (TSV files)."""
    path: str = ""
    """Criteo: a file or directory of TSV (optionally .gz) files."""
    eval_path: str = ""
    """Criteo: held-out file(s); empty = the last file of ``path``."""
    batch_size: int = 512
    """Global batch size."""
    train_samples: int = 200_000
    """Synthetic: samples in the train split."""
    eval_samples: int = 50_000
    """Synthetic: samples in the eval split."""
    id_distribution: str = "locality"
    """Synthetic ids: ``locality`` (calibrated to production reuse), ``zipf``, ``uniform``."""
    zipf_alpha: float = 1.05
    """Zipf exponent when id_distribution = zipf."""
    fixed_pooling: bool = False
    """Synthetic: every bag has exactly pooling_factor ids (else Poisson-like variable)."""
    teacher_scale: float = 1.0
    """Synthetic: logit scale of the hidden teacher (higher = more learnable signal)."""
    hash_categories: bool = True
    """Criteo: hash hex categories into rows modulo the table size."""
    bad_lines: str = "fail"
    """Criteo malformed lines: ``fail`` (error with file:line) or ``skip`` (counted)."""
    seed: int = 1234
    """Data seed (synthetic generation, shuffling)."""

    def __post_init__(self) -> None:
        if self.source not in ("synthetic", "criteo"):
            raise ConfigError(f"data.source must be 'synthetic' or 'criteo', got '{self.source}'")
        if self.batch_size <= 0:
            raise ConfigError(f"data.batch_size must be > 0, got {self.batch_size}")
        if self.id_distribution not in ("locality", "zipf", "uniform"):
            raise ConfigError(
                f"data.id_distribution must be locality, zipf or uniform, got "
                f"'{self.id_distribution}'"
            )
        if self.bad_lines not in ("fail", "skip"):
            raise ConfigError(f"data.bad_lines must be 'fail' or 'skip', got '{self.bad_lines}'")


@dataclass(kw_only=True)
class TrainConfig:
    """Training loop."""

    epochs: int = 1
    """Passes over the train split (ignored when steps > 0)."""
    steps: int = 0
    """Train steps; 0 = run ``epochs`` epochs."""
    dense_optimizer: str = "adagrad"
    """torch.optim optimizer for dense parameters: sgd, adagrad, adam."""
    dense_lr: float = 0.05
    """Dense learning rate."""
    eval_every: int = 0
    """Evaluate every N steps (0 = only at the end)."""
    log_every: int = 50
    """Progress line every N steps."""
    run_dir: str = "runs/latest"
    """Where metrics.json (and checkpoints) go."""
    seed: int = 0
    """Model init seed."""
    threads: int = 0
    """torch intra-op threads (0 = leave PyTorch's default)."""
    bf16_dense: bool = False
    """Run the dense MLPs under bf16 autocast (CPU AMX); embeddings stay float32."""
    progress: bool = True
    """Print a progress line."""

    def __post_init__(self) -> None:
        if self.dense_optimizer not in ("sgd", "adagrad", "adam"):
            raise ConfigError(
                f"train.dense_optimizer must be sgd, adagrad or adam, got '{self.dense_optimizer}'"
            )
        if self.steps < 0 or self.epochs <= 0:
            raise ConfigError(
                f"train.steps must be >= 0 and train.epochs > 0, got {self.steps}, {self.epochs}"
            )


@dataclass(kw_only=True)
class ShardingConfig:
    """How tables are placed on ranks (distributed runs)."""

    plan: str = ""
    """Path of a ShardingPlan JSON; empty = the planner (or ``default_type``)."""
    default_type: str = ""
    """Shard every table this way (data_parallel, table_wise, row_wise, column_wise,
    table_row_wise); empty = use the planner."""
    types: dict[str, str] = field(default_factory=dict)
    """Per-table sharding type overrides {table: type}."""


@dataclass(kw_only=True)
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)

    def __post_init__(self) -> None:
        dims = {t.dim for t in self.embedding.tables}
        if self.model.interaction == "dot":
            if len(dims) != 1:
                raise ConfigError(f"the dot interaction needs one embedding dim, got {sorted(dims)}")
            (d,) = dims
            if self.model.bottom_mlp[-1] != d:
                raise ConfigError(
                    f"model.bottom_mlp must end with the embedding dim {d} for the dot "
                    f"interaction, got {self.model.bottom_mlp}"
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in [{where}]; known: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        typ = hints[k]
        if dataclasses.is_dataclass(typ) and isinstance(v, dict):
            kwargs[k] = _build(typ, v, f"{where}.{k}" if where else k)
        else:
            kwargs[k] = _coerce(typ, v, f"{where}.{k}" if where else k)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"[{where}]: {e}") from None


def _coerce(typ: Any, v: Any, where: str) -> Any:
    origin = get_origin(typ)
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if typ in (int, float, str, bool):
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ConfigError(f"{where} must be {typ.__name__}, got {v!r}")
        return v
    if origin is list:
        if not isinstance(v, list):
            raise ConfigError(f"{where} must be a list, got {v!r}")
        (inner,) = get_args(typ)
        if dataclasses.is_dataclass(inner):
            return [_build(inner, x, where) if isinstance(x, dict) else x for x in v]
        return [_coerce(inner, x, f"{where}[{i}]") for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise ConfigError(f"{where} must be a table/dict, got {v!r}")
        return dict(v)
    return v


def _parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, bools, lists, quoted strings), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a raw config dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects section.key=value, got '{item}'")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: '{p}' is not a section")
        node[parts[-1]] = _parse_value(text.strip())
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Config from a TOML file (or the defaults) plus ``--set`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: invalid TOML: {e}") from None
    apply_overrides(data, overrides or [])
    cfg: Config = _build(Config, data, "")
    return cfg
