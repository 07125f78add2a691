"""``[data.schema]``: the columns of a Parquet / CSV / TSV table and what each becomes.

A schema names the label column and a list of features (``[[data.schema.features]]``), each a
column of the table:

- ``type = "dense"``: a number; ``transform`` ``none``, ``log1p`` (DLRM's ``log(max(x, 0) + 1)``)
  or ``standardize`` (``(x - mean) / std`` with the train split's statistics, computed by
  preprocessing or, reading the files directly, by a pass before training); a missing value
  becomes ``fill`` (the value the model sees, after the transform).
- ``type = "id"`` (one id per sample, a missing one = an empty bag) or ``type = "list"`` (a bag of
  ids of any length: multi-hot): ``ids = "hash"`` maps an id to ``hash(seed, id) % rows`` of its
  table; ``ids = "vocab"`` maps the ids seen at least ``min_count`` times in the train split to
  rows 1.. (most frequent first, at most ``rows - 1`` of them) and every other id to row 0 (the
  out-of-vocabulary row). ``dtype`` says whether ids are integers or strings; ``weights`` names
  a column of per-id weights (a number per id: a list of the same length for a list feature).
  The feature reads the table whose ``features`` list its ``name`` (default: the column's name);
  ``table``, when given, must be that table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from neorec.config.checks import MAX_SEED, check_fields, rule, show, suggest
from neorec.errors import ConfigError

__all__ = ["FeatureSpec", "SchemaConfig", "FEATURE_TYPES", "TRANSFORMS"]

FEATURE_TYPES = ("dense", "id", "list")
TRANSFORMS = ("none", "log1p", "standardize")
FORMATS = ("auto", "parquet", "csv", "tsv")


@dataclass(kw_only=True)
class FeatureSpec:
    """One column of the table and what it becomes."""

    column: str = field(metadata=rule(nonempty=True))
    """The column's name in the file (its header, or the Parquet field)."""
    type: str = field(metadata=rule(choices=FEATURE_TYPES))
    """``dense`` (a number), ``id`` (one id) or ``list`` (a bag of ids of any length)."""
    name: str = ""
    """The feature's name (the key the model's tables list); empty = the column's name."""
    transform: str = field(default="none", metadata=rule(choices=TRANSFORMS))
    """Dense: ``none``, ``log1p`` (log(max(x, 0) + 1)) or ``standardize`` (train statistics)."""
    fill: float = 0.0
    """Dense: what a missing value becomes (after the transform)."""
    ids: str = field(default="hash", metadata=rule(choices=("hash", "vocab")))
    """Sparse: ``hash`` (seeded hash % the table's rows) or ``vocab`` (built in preprocessing)."""
    dtype: str = field(default="int", metadata=rule(choices=("int", "str")))
    """Sparse: ids are 64-bit integers (``int``) or strings (``str``, hashed from UTF-8)."""
    min_count: int = field(default=1, metadata=rule(1, 2**62))
    """Vocab: occurrences in the train split an id needs to get its own row."""
    weights: str = ""
    """Sparse: a column of per-id weights; empty = none (weight 1)."""
    table: str = ""
    """Sparse: the table this feature reads (checked against the tables' ``features``)."""

    def __post_init__(self) -> None:
        where = f"data.schema.features[{self.column!r}]"
        check_fields(self, where)
        self.name = self.name or self.column
        if self.type == "dense":
            for k, default in (("ids", "hash"), ("dtype", "int"), ("min_count", 1)):
                if getattr(self, k) != default:
                    raise ConfigError(f"{where}.{k} is for id and list features, not dense")
            if self.weights or self.table:
                raise ConfigError(f"{where}: weights / table are for id and list features")
        else:
            if self.transform != "none" or self.fill != 0.0:
                raise ConfigError(f"{where}: transform / fill are for dense features")
            if self.min_count != 1 and self.ids != "vocab":
                raise ConfigError(f"{where}.min_count needs ids = 'vocab'")


@dataclass(kw_only=True)
class SchemaConfig:
    """The columns of a tabular data set (data.source = "tabular")."""

    label: str = "label"
    """The label column: 0 or 1 (a number equal to either)."""
    format: str = field(default="auto", metadata=rule(choices=FORMATS))
    """``parquet``, ``csv``, ``tsv``, or ``auto`` (from each file's extension)."""
    delimiter: str = ""
    """CSV/TSV field separator; empty = ``,`` for csv, a tab for tsv."""
    list_sep: str = field(default="|", metadata=rule(nonempty=True))
    """CSV/TSV: the separator of ids (and weights) inside a list field (``3|17|5``)."""
    hash_seed: int = field(default=0, metadata=rule(0, MAX_SEED))
    """Seed of the id hash (``ids = "hash"``)."""
    max_field_bytes: int = field(default=65536, metadata=rule(16, 1 << 30))
    """The longest field a row may hold, in bytes (a string id, a CSV field): a longer one is
    refused naming its file, row and column (memory stays bounded whatever the input)."""
    max_ids_per_field: int = field(default=65536, metadata=rule(1, 1 << 30))
    """The most ids one row's list feature may hold; more are refused like a long field."""
    features: list[FeatureSpec] = field(default_factory=list)
    """The features, in order: dense ones give the dense input's columns in this order."""

    def __post_init__(self) -> None:
        check_fields(self, "data.schema")
        if len(self.delimiter) > 1 or self.delimiter in ("\n", "\r", '"'):
            raise ConfigError(
                f"data.schema.delimiter must be one character, got {show(self.delimiter)}"
            )
        out = []
        for i, f in enumerate(self.features):
            if isinstance(f, dict):
                f = FeatureSpec(**_kwargs(f, i))
            elif not isinstance(f, FeatureSpec):
                raise ConfigError(f"data.schema.features[{i}] must be a table, got {show(f)}")
            out.append(f)
        self.features = out
        cols = [self.label, *(c for f in out for c in (f.column, f.weights) if c)]
        dup = sorted({c for c in cols if cols.count(c) > 1})
        if dup:
            raise ConfigError(f"data.schema: column(s) {dup} used twice (label, features, weights)")
        names = [f.name for f in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"data.schema: feature name(s) {dup} repeat")

    @property
    def dense(self) -> list[FeatureSpec]:
        """The dense features, in order."""
        return [f for f in self.features if f.type == "dense"]

    @property
    def sparse(self) -> list[FeatureSpec]:
        """The id and list features, in order."""
        return [f for f in self.features if f.type != "dense"]

    @property
    def columns(self) -> list[str]:
        """Every column the schema reads (label first)."""
        return [self.label, *(c for f in self.features for c in (f.column, f.weights) if c)]

    def check_tables(self, tables: list[Any], num_dense: int) -> None:
        """Refuse a schema that does not fit the model: every sparse feature read by a table
        (``table`` agreeing), every table's feature given, as many dense columns as
        model.num_dense."""
        if not self.sparse:
            raise ConfigError("data.schema declares no id or list feature; the model needs one")
        owner = {f: t for t in tables for f in t.features}
        for f in self.sparse:
            t = owner.get(f.name)
            where = f"data.schema.features[{f.column!r}]"
            if t is None:
                raise ConfigError(
                    f"{where}: feature '{f.name}' is read by no table{suggest(f.name, list(owner))}"
                    "; name it in a table's features (embedding.tables[].features)"
                )
            if f.table and f.table != t.name:
                raise ConfigError(
                    f"{where}.table = '{f.table}', but feature '{f.name}' is read by table "
                    f"'{t.name}' (embedding.tables[].features)"
                )
            if getattr(t, "kind", "fixed") == "dynamic":
                raise ConfigError(
                    f"{where}: table '{t.name}' is dynamic; tabular data needs fixed tables"
                )
        mine = {f.name for f in self.sparse}
        missing = [f for f in owner if f not in mine]
        if missing:
            raise ConfigError(
                f"tables read feature(s) {missing} that data.schema does not declare; add them "
                "to [[data.schema.features]] or drop them from the tables"
            )
        if len(self.dense) != num_dense:
            raise ConfigError(
                f"data.schema has {len(self.dense)} dense feature(s), model.num_dense is "
                f"{num_dense}; make them equal"
            )


def _kwargs(d: dict[str, Any], i: int) -> dict[str, Any]:
    known = list(FeatureSpec.__dataclass_fields__)
    for k in d:
        if k not in known:
            raise ConfigError(
                f"unknown key '{k}' in data.schema.features[{i}]{suggest(str(k), known)}; "
                f"known: {known}"
            )
    for k in ("column", "type"):
        if k not in d:
            raise ConfigError(f"data.schema.features[{i}] needs '{k}'")
    return d
