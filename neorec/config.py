"""Configs: small dataclasses, one per part, loaded from TOML with ``--set a.b=c`` overrides."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from neorec.errors import NeorecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = [
    "TableConfig",
    "ModelConfig",
    "EmbeddingConfig",
    "DataConfig",
    "TrainConfig",
    "ShardingConfig",
    "PlannerConfig",
    "CheckpointConfig",
    "StorageConfig",
    "CommConfig",
    "Config",
    "ConfigError",
    "load_config",
    "apply_overrides",
]


class ConfigError(NeorecError, ValueError):
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
    storage: str = "memory"
    """Where rows live: ``memory`` (all in the fast tier), or ``dram`` / ``ssd`` behind a row cache."""
    cache_rows: int = 0
    """Rows of the row cache (dram/ssd storage); 0 = use cache_fraction."""
    cache_fraction: float = 0.0
    """Cache size as a share of rows (dram/ssd storage); 0 with cache_rows 0 = 10%."""
    cache_policy: str = "lru"
    """Row cache eviction policy: ``lru`` or ``lfu``."""

    def __post_init__(self) -> None:
        if self.storage not in ("memory", "dram", "ssd"):
            raise ConfigError(
                f"table '{self.name}': storage must be memory, dram or ssd, got '{self.storage}'"
            )
        if self.cache_rows < 0 or not 0.0 <= self.cache_fraction <= 1.0:
            raise ConfigError(
                f"table '{self.name}': cache_rows must be >= 0 and cache_fraction in [0, 1], "
                f"got {self.cache_rows}, {self.cache_fraction}"
            )
        if self.cache_rows and self.cache_fraction:
            raise ConfigError(f"table '{self.name}': set cache_rows or cache_fraction, not both")
        if self.cache_policy not in ("lru", "lfu"):
            raise ConfigError(
                f"table '{self.name}': cache_policy must be lru or lfu, got '{self.cache_policy}'"
            )
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
    """``synthetic`` or ``criteo`` (TSV files, or a directory from ``neorec data preprocess``)."""
    path: str = ""
    """Criteo: a file or directory of TSV (optionally .gz) files, or a preprocessed directory."""
    eval_path: str = ""
    """Criteo: held-out file(s); empty = the last file of ``path``."""
    batch_size: int = 512
    """Global batch size."""
    train_samples: int = 1_000_000
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
    shuffle: bool = True
    """Criteo preprocessed: shuffle shard order and samples within ``shuffle_buffer`` per epoch."""
    shuffle_buffer: int = 262_144
    """Criteo preprocessed: samples shuffled together (a window of the epoch's shard stream)."""
    workers: int = 1
    """Criteo preprocessed: reader worker processes per rank (0 = read in the training process)."""
    prefetch: int = 4
    """Criteo preprocessed: batches each reader worker prepares ahead."""

    def __post_init__(self) -> None:
        if self.shuffle_buffer <= 0 or self.workers < 0 or self.prefetch <= 0:
            raise ConfigError(
                f"data.shuffle_buffer > 0, data.workers >= 0 and data.prefetch > 0 needed, got "
                f"{self.shuffle_buffer}, {self.workers}, {self.prefetch}"
            )
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
    dense_blocks: int = 2
    """The dense part computes its gradient over this many equal blocks of the global batch and
    adds them in a fixed pairwise tree (``neorec.distributed.dense_blocks``), so 1 process and N
    ranks (N a power of two dividing it) train bitwise the same model; 1 = one GEMM per rank.
    A batch that does not split evenly runs as one block."""
    collective_timeout_s: int = 300
    """Distributed runs: a collective that waits longer than this fails (no hang)."""
    pipeline: str = "overlapped"
    """``overlapped``: batch i+1 is loaded, copied and its input distribution started while batch
    i computes; ``sequential``: one batch at a time (the reference; same results, bitwise)."""

    def __post_init__(self) -> None:
        if self.pipeline not in ("overlapped", "sequential"):
            raise ConfigError(
                f"train.pipeline must be 'overlapped' or 'sequential', got '{self.pipeline}'"
            )
        if self.dense_optimizer not in ("sgd", "adagrad", "adam"):
            raise ConfigError(
                f"train.dense_optimizer must be sgd, adagrad or adam, got '{self.dense_optimizer}'"
            )
        if self.dense_blocks < 1:
            raise ConfigError(f"train.dense_blocks must be >= 1, got {self.dense_blocks}")
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
class PlannerConfig:
    """Inputs of the sharding planner beyond the model (``neorec plan``, distributed training)."""

    tables_file: str = ""
    """CSV/JSON table list (relative to the config); replaces embedding.tables for planning."""
    batch_size: int = 0
    """Global batch for the cost model; 0 = data.batch_size."""
    weight_bytes: int = 4
    """Bytes per stored weight element."""
    allow_host: bool = True
    """Tables may live in host DRAM (UVM-like tier)."""
    allow_cached_tiers: bool = True
    """``neorec plan`` may place tables in the cached tiers: rows in host DRAM (``dram``) or on
    SSD (``ssd``, with ``topology.ssd_capacity_gb``) behind a row cache in device memory. Read by
    ``neorec plan`` only: the distributed runtime plans without cached tiers (it does not run
    cached tables)."""
    cache_fractions: list[float] = field(default_factory=lambda: [0.01, 0.05, 0.1, 0.25])
    """Row cache sizes (share of a shard's rows) the planner tries for the cached tiers."""
    max_cw_slices: int = 0
    """Most column slices per table (0 = planner default)."""
    optimizer: str = ""
    """Optimizer the cost model assumes (empty = embedding.optimizer)."""
    topology: dict[str, Any] = field(default_factory=dict)
    """Topology fields (see neorec.sharding.topology.Topology)."""
    topology_file: str = ""
    """A topology JSON (e.g. written by ``neorec plan --calibrate``)."""


@dataclass(kw_only=True)
class StorageConfig:
    """Memory hierarchy (tables with storage = dram | ssd): where store files go, prefetch."""

    dir: str = "/tmp/neorec-store"
    """Directory of the SSD row store files (one ``<table>.rows`` per table, created anew)."""
    io_threads: int = 2
    """Threads copying records between an SSD store's mapping and the cache (the copies are
    latency bound: measured on 2 cores, 2 threads took a cached step from 75.7 to 65.0 ms)."""
    mapped_mb: int = 0
    """File-backed RSS (MiB) above which the SSD stores' mapped pages are dropped from the process
    (they stay in the page cache): bounds the RSS the stores add, whatever the files' size.
    0 = a quarter of physical memory."""
    prefetch: bool = True
    """Read the next batch's missing rows in the background while the current batch computes."""

    def __post_init__(self) -> None:
        if self.io_threads < 1 or self.mapped_mb < 0:
            raise ConfigError(
                f"storage.io_threads must be >= 1 and storage.mapped_mb >= 0, got "
                f"{self.io_threads}, {self.mapped_mb}"
            )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Check-N-Run checkpoints (neorec.checkpoint): when, what, how precisely, where."""

    dir: str = ""
    """Root directory or fsspec URL (s3://, gs://, memory://); empty = <train.run_dir>/checkpoints."""
    every_steps: int = 0
    """Checkpoint every N train steps (0 = never)."""
    policy: str = "adaptive"
    """``full``, ``one_shot`` (rows changed since the baseline), ``consecutive`` (since the previous
    checkpoint) or ``adaptive`` (consecutive; new baseline when the chain outweighs one)."""
    bits: int = 8
    """Stored precision of embedding rows: 32 (exact), 8, 4, 3 or 2 (row-wise integer codes)."""
    adaptive_range: bool = True
    """For bits <= 4: greedy per-row range search (min/max shrunk while the L2 error falls)."""
    opt_bits: int = 32
    """Stored precision of fused optimizer state: 32, 16 (bfloat16), 8, or 0 (not stored).
    32 by measurement (neorec bench ckpt): dropping it costs NE, and row-wise Adagrad's one float
    per row is ~8% of an 8-bit checkpoint."""
    keep_last: int = 2
    """Baselines kept, each with the increments built on it."""
    async_write: bool = True
    """Encode and write in a background thread (training pauses only for the snapshot)."""
    adaptive_threshold: float = 1.0
    """adaptive: new baseline when the chain to replay would exceed this x a baseline's bytes."""
    full_every: int = 0
    """Also force a baseline after N increments (0 = only when the policy asks)."""
    chunk_rows: int = 65536
    """Rows per stored piece (pieces are cut at multiples of this global row index)."""
    fsync: bool = True
    """fsync local files before renaming them into place."""
    resume: str = ""
    """Resume from ``latest`` (under dir) or a checkpoint path; empty = start fresh."""

    def __post_init__(self) -> None:
        if self.policy not in ("full", "one_shot", "consecutive", "adaptive"):
            raise ConfigError(
                f"checkpoint.policy must be full, one_shot, consecutive or adaptive, "
                f"got '{self.policy}'"
            )
        if self.bits not in (32, 8, 4, 3, 2):
            raise ConfigError(f"checkpoint.bits must be 32, 8, 4, 3 or 2, got {self.bits}")
        if self.opt_bits not in (32, 16, 8, 0):
            raise ConfigError(f"checkpoint.opt_bits must be 32, 16, 8 or 0, got {self.opt_bits}")
        if self.every_steps < 0 or self.keep_last < 1 or self.chunk_rows < 1:
            raise ConfigError(
                f"checkpoint: every_steps >= 0, keep_last >= 1, chunk_rows >= 1 needed, got "
                f"{self.every_steps}, {self.keep_last}, {self.chunk_rows}"
            )


_COMM_CODECS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")


@dataclass(kw_only=True)
class CommConfig:
    """Precision on the wire of distributed training (neorec.distributed.codecs)."""

    forward: str = "fp32"
    """Codec of the forward all-to-all of pooled embeddings: fp32, fp16, bf16, fp8_e4m3,
    fp8_e5m2, int8 (row-wise)."""
    backward: str = "fp32"
    """Codec of the backward all-to-all of the pooled embeddings' gradients."""
    allreduce: str = "fp32"
    """Codec of the dense (DDP) gradient all-reduce, and of data-parallel embedding tables' row
    gradients (all-gathered as (id, row sum) pairs)."""
    fp8_scaling: str = "row"
    """fp8 scale: ``row`` (a power of two per row, 1 byte) or ``tensor`` (one per message)."""
    loss_scale: float = 0.0
    """fp16/fp8 gradients (backward, allreduce): 0 = a power-of-two scale per message from its
    largest value (cannot overflow); > 0 = this fixed factor (overflow is an error)."""

    def __post_init__(self) -> None:
        for key in ("forward", "backward", "allreduce"):
            if getattr(self, key) not in _COMM_CODECS:
                raise ConfigError(
                    f"comm.{key} must be one of {', '.join(_COMM_CODECS)}, got "
                    f"'{getattr(self, key)}'"
                )
        if self.fp8_scaling not in ("row", "tensor"):
            raise ConfigError(f"comm.fp8_scaling must be row or tensor, got '{self.fp8_scaling}'")
        if not 0.0 <= self.loss_scale < float("inf"):
            raise ConfigError(f"comm.loss_scale must be finite and >= 0, got {self.loss_scale}")


@dataclass(kw_only=True)
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    embedding: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    comm: CommConfig = field(default_factory=lambda: CommConfig())

    def __post_init__(self) -> None:
        dims = {t.dim for t in self.embedding.tables}
        if self.model.interaction == "dot":
            if len(dims) != 1:
                raise ConfigError(
                    f"the dot interaction needs one embedding dim, got {sorted(dims)}"
                )
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


def _build(cls: Any, data: dict[str, Any], where: str) -> Any:
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
