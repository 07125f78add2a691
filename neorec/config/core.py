"""``Config``: every section of a run, and the checks that span sections."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from neorec.config.checks import show, suggest
from neorec.config.distill import DistillConfig
from neorec.config.model import EmbeddingConfig, ModelConfig
from neorec.config.run import (
    CheckpointConfig,
    CommConfig,
    DataConfig,
    LowpConfig,
    PlannerConfig,
    ShardingConfig,
    StorageConfig,
    TrainConfig,
)
from neorec.config.sequential import SequentialConfig
from neorec.config.system import SystemConfig
from neorec.config.towers import TowersConfig
from neorec.errors import ConfigError

__all__ = ["Config", "check_trainable", "dense_params", "MAX_DENSE_PARAMS", "MODEL_KEYS"]

MODEL_KEYS = ("num_dense", "bottom_mlp", "top_mlp", "interaction", "dcn_layers", "dcn_low_rank")
"""The model settings that shape the dense part (recorded, so a resume compares them early)."""


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
    lowp: LowpConfig = field(default_factory=LowpConfig)
    towers: TowersConfig = field(default_factory=TowersConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    sequential: SequentialConfig = field(default_factory=SequentialConfig)

    def describe_model(self) -> dict[str, Any]:
        """What the config says of the model's shape: tables, pooling, optimizers and the dense
        part's settings (checkpoints and saved models record it; a resume compares it before
        the model is built)."""
        emb = self.embedding
        return {
            "tables": {
                t.name: {"rows": int(t.rows), "dim": int(t.dim), "features": list(t.features)}
                for t in emb.tables
            },
            "pooling": str(emb.pooling),
            "embedding_optimizer": str(emb.optimizer),
            "dense_optimizer": str(self.train.dense_optimizer),
            "model_config": {k: getattr(self.model, k) for k in MODEL_KEYS},
        }

    def __post_init__(self) -> None:
        hints = get_type_hints(Config)
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), hints[f.name]):
                raise ConfigError(
                    f"{f.name} must be a [{f.name}] section ({hints[f.name].__name__}), got "
                    f"{show(getattr(self, f.name))}"
                )
        self._check_dims()
        self._check_sharding()
        self._check_towers()
        if self.embedding.cowclip_ratio and self.train.device != "cpu":
            raise ConfigError(
                "embedding.cowclip_ratio (CowClip) runs on the CPU backends only; set "
                f"train.device = 'cpu' (got {self.train.device!r}) or cowclip_ratio = 0"
            )
        if self.train.qat.active and (
            self.train.device != "cpu" or self.embedding.backend in ("cuda", "triton")
        ):
            raise ConfigError(
                "train.qat (quantization-aware training) runs in the CPU backends' row update "
                f"only; got train.device {self.train.device!r}, embedding.backend "
                f"{self.embedding.backend!r} (set train.device = 'cpu' and backend 'auto', "
                "'reference' or 'cpu')"
            )
        if self.data.source == "tabular":  # the schema's features against the tables
            self.data.schema.check_tables(self.embedding.tables, self.model.num_dense)

    def _check_dims(self) -> None:
        dims = {t.dim for t in self.embedding.tables}
        if self.model.interaction == "dot":
            if len(dims) != 1:
                raise ConfigError(
                    f"the dot interaction needs one embedding dim, got {sorted(dims)}; "
                    "use model.interaction = 'dcn' for tables of several dims"
                )
            (d,) = dims
            if self.model.bottom_mlp[-1] != d:
                raise ConfigError(
                    f"model.bottom_mlp must end with the embedding dim {d} for the dot "
                    f"interaction, got {self.model.bottom_mlp}"
                )

    def _check_sharding(self) -> None:
        if self.planner.tables_file:
            return  # the planner's tables come from that file, not from [embedding]
        names = [t.name for t in self.embedding.tables]
        known = set(names)
        for table in self.sharding.types:
            if table not in known:
                raise ConfigError(
                    f"sharding.types names unknown table '{table}'{suggest(table, names)}; "
                    f"the tables are {show(names)}"
                )

    def _check_towers(self) -> None:
        groups = getattr(self.data, "teacher_groups", 0)  # a DataConfig field (synthetic data)
        if self.data.source in ("synthetic", "stream") and groups > len(self.embedding.tables):
            raise ConfigError(
                f"data.teacher_groups {groups:,} is more than the {len(self.embedding.tables):,} "
                "tables (groups of tables); lower data.teacher_groups"
            )
        tw = self.towers
        if not tw.enabled or self.planner.tables_file:
            return  # towers of a planner tables file are checked against that file
        names = [t.name for t in self.embedding.tables]
        if tw.num_towers > len(names):
            raise ConfigError(
                f"towers.count {tw.num_towers:,} is more than the {len(names):,} tables (a tower "
                f"holds whole tables); lower towers.count to at most {len(names):,}"
            )
        if not tw.groups:
            return
        known = set(names)
        where: dict[str, int] = {}
        for i, g in enumerate(tw.groups):
            for name in g:
                if name not in known:
                    owner = next((t.name for t in self.embedding.tables if name in t.features), "")
                    if owner:
                        raise ConfigError(
                            f"towers.groups[{i}] names feature '{name}', which reads table "
                            f"'{owner}'; towers hold whole tables: list '{owner}' instead"
                        )
                    raise ConfigError(
                        f"towers.groups[{i}] names unknown table '{name}'{suggest(name, names)}; "
                        f"groups list TABLE names, the tables are {show(names)}"
                    )
                if name in where:
                    raise ConfigError(
                        f"towers.groups: table '{name}' is in tower {where[name]} and tower {i}; "
                        "each table goes in exactly one tower"
                    )
                where[name] = i
        missing = [n for n in names if n not in where]
        if missing:
            raise ConfigError(
                f"towers.groups leaves out table(s) {show(missing)}; every table must be in "
                "exactly one tower"
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-able)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """Canonical JSON (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)


MAX_DENSE_PARAMS = 2**31
"""Most dense parameters (bottom MLP + interaction + top MLP): 8 GiB of float32 weights."""


def _mlp_params(widths: list[int], n_in: int) -> int:
    total = 0
    for w in widths:
        total += n_in * w + w
        n_in = w
    return total


def dense_params(cfg: Config) -> tuple[int, int, int]:
    """Parameters of the bottom MLP, the interaction and the top MLP a config builds."""
    m = cfg.model
    feats = len(cfg.embedding.feature_names)
    dim = cfg.embedding.tables[0].dim
    if cfg.towers.enabled and cfg.towers.module != "identity":
        feats = cfg.towers.num_towers * cfg.towers.out_vectors  # the towers' output vectors
    bottom = _mlp_params(m.bottom_mlp, m.num_dense)
    if m.interaction == "dot":
        n = feats + 1
        inter, out = 0, dim + (n * (n + 1) // 2 if m.dot_self else n * (n - 1) // 2)
    else:
        emb = sum(t.dim * len(t.features) for t in cfg.embedding.tables)
        if cfg.towers.enabled and cfg.towers.module != "identity":
            emb = feats * dim
        out = m.bottom_mlp[-1] + emb
        per = 2 * out * m.dcn_low_rank + out if m.dcn_low_rank else out * out + out
        inter = m.dcn_layers * per
    return bottom, inter, _mlp_params(m.top_mlp, out)


def check_trainable(cfg: Config) -> None:
    """What training needs beyond a valid config (``neorec plan`` does not): one embedding dim for
    all tables, a dense part that can be built, and synthetic splits of at least one batch each
    (else training or eval finds no batch after the work before it). Pure arithmetic: run it
    before anything heavy."""
    dims = sorted({t.dim for t in cfg.embedding.tables})
    if len(dims) != 1:
        raise ConfigError(
            f"training needs one embedding dim for all tables, got {dims} (several dims are for "
            "planning only); give every table the same dim"
        )
    bottom, inter, top = dense_params(cfg)
    if bottom + inter + top > MAX_DENSE_PARAMS:
        raise ConfigError(
            f"the dense part would have {bottom + inter + top:,} parameters (bottom MLP {bottom:,}"
            f", {cfg.model.interaction} interaction {inter:,}, top MLP {top:,}), at most "
            f"{MAX_DENSE_PARAMS:,}; use fewer features, smaller model.top_mlp or dcn_low_rank"
        )
    if cfg.distill.enabled and not getattr(cfg.data, "fm_logits", ""):
        raise ConfigError(
            "distill.enabled needs the FM's logits with the data: set data.fm_logits = DIR (the "
            "side files of neorec.data.stream.write_fm_logits)"
        )
    d = cfg.data
    if d.source not in ("synthetic", "stream"):
        return
    splits = ("train_samples", "eval_samples") if d.source == "synthetic" else (
        "window_samples", "eval_samples")  # fmt: skip
    for split in splits:
        n = getattr(d, split)
        if n < d.batch_size:
            raise ConfigError(
                f"data.{split} {n:,} is less than one batch (data.batch_size {d.batch_size:,}): "
                f"the split would have no batch; raise data.{split} or lower data.batch_size"
            )
