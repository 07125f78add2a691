"""The body of ``POST /predict`` checked and turned into a batcher ``Job``, before it joins a batch
(so one bad request never fails the others).

Two forms (one JSON object; ``batch_info: true`` in either adds where its rows ran)::

    {"rows": [{"dense": [13 numbers], "sparse": {"<feature>": [ids...] | {"ids": [...],
              "weights": [...]}}}, ...]}
    {"raw": ["<tab-separated Criteo row>" | [fields...], ...], "labels": false}

``raw`` rows go through the manifest's transforms (``Predictor.inputs_from_raw``). Every problem
raises ``BadRequest`` whose one-line message names the field (``rows[3].sparse.t1[2]: id 500
outside [0, 200) of table 't1'``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from neorec.serve.batcher import Bag, Job

__all__ = ["BadRequest", "ModelInputs", "parse_body"]

_NUMBER = (int, float)
_INT64 = (-(1 << 63), 1 << 63)
_FORMS = 'a JSON object {"rows": [...]} or {"raw": [...]}'


class BadRequest(ValueError):
    """A request the server refuses; ``status`` is its HTTP code, the message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ModelInputs:
    """What a request must hold for this model: dense width, features with their tables."""

    num_dense: int
    features: tuple[str, ...]
    rows: dict[str, int]
    """Feature -> its table's rows (ids must be below), or -1: a dynamic table (any int64 id)."""
    tables: dict[str, str]

    @classmethod
    def of(cls, predictor: Any) -> ModelInputs:
        """Read from a ``standalone.Predictor``'s manifest."""
        m = predictor.manifest
        tables = {str(t["name"]): t for t in m["tables"]}
        rows, names = {}, {}
        for f in m["features"]:
            t = tables[f["table"]]
            rows[str(f["name"])] = -1 if t.get("kind") == "dynamic" else int(t["rows"])
            names[str(f["name"])] = str(t["name"])
        return cls(int(m["num_dense"]), tuple(predictor.features), rows, names)


def _finite(v: float, bound: float) -> bool:
    """``v`` is finite and ``|v| <= bound`` (an int of any size too, without float overflow)."""
    return (math.isfinite(v) if isinstance(v, float) else True) and abs(v) <= bound


def _what(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _dense(row: Any, where: str, width: int) -> list[float]:
    if not isinstance(row, list):
        raise BadRequest(f"{where}: a list of {width} numbers, got {_what(row)}")
    if len(row) != width:
        raise BadRequest(f"{where}: {len(row)} values, the model reads {width}")
    for i, v in enumerate(row):
        if type(v) not in _NUMBER:  # bool is not a number here
            raise BadRequest(f"{where}[{i}]: {_what(v)} is not a number")
        if not _finite(v, 3.4028234663852886e38):
            raise BadRequest(f"{where}[{i}]: {_what(v)} is not a finite float32")
    return row


def _ids(v: Any, where: str, rows: int, table: str) -> list[int]:
    if not isinstance(v, list):
        raise BadRequest(f"{where}: a list of integer ids, got {_what(v)}")
    lo, hi = (0, rows) if rows >= 0 else _INT64
    for i, x in enumerate(v):
        if type(x) is not int:
            raise BadRequest(f"{where}[{i}]: {_what(x)} is not an integer id")
        if not lo <= x < hi:
            what = f"of table '{table}'" if rows >= 0 else "(int64)"
            raise BadRequest(f"{where}[{i}]: id {x} outside [{lo}, {hi}) {what}")
    return v


def _weights(v: Any, where: str, n: int) -> list[float]:
    if not isinstance(v, list) or len(v) != n:
        raise BadRequest(f"{where}: a list of {n} numbers (one per id), got {_what(v)}")
    for i, x in enumerate(v):
        if type(x) not in _NUMBER or not _finite(x, 3.4028234663852886e38):
            raise BadRequest(f"{where}[{i}]: {_what(x)} is not a finite number")
    return v


class _Bags:
    """One feature's bags over a request's rows, as Python lists until the end."""

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.ids: list[int] = []
        self.weights: list[float] | None = None

    def add(self, ids: list[int], weights: list[float] | None) -> None:
        if weights is not None and self.weights is None:
            self.weights = [1.0] * len(self.ids)
        if self.weights is not None:
            self.weights.extend(weights if weights is not None else [1.0] * len(ids))
        self.lengths.append(len(ids))
        self.ids.extend(ids)

    def bag(self) -> Bag:
        w = None if self.weights is None else np.asarray(self.weights, dtype=np.float32)
        return (
            np.asarray(self.lengths, dtype=np.int64),
            np.asarray(self.ids, dtype=np.int64),
            w,
        )


def _sparse_row(sp: Any, where: str, model: ModelInputs, bags: dict[str, _Bags]) -> None:
    if not isinstance(sp, dict):
        raise BadRequest(f"{where}: an object feature -> ids, got {_what(sp)}")
    reads = ", ".join(model.features)
    for f in sp:
        if f not in model.rows:
            raise BadRequest(f"{where}: unknown feature {_what(f)} (the model reads {reads})")
    for f in model.features:
        if f not in sp:
            raise BadRequest(f"{where}: missing feature '{f}' (the model reads {reads})")
        v, at = sp[f], f"{where}.{f}"
        weights = None
        if isinstance(v, dict):
            extra = sorted(set(v) - {"ids", "weights"})
            if extra or "ids" not in v:
                raise BadRequest(f'{at}: a list of ids or {{"ids": [...], "weights": [...]}}')
            ids = _ids(v["ids"], f"{at}.ids", model.rows[f], model.tables[f])
            if "weights" in v:
                weights = _weights(v["weights"], f"{at}.weights", len(ids))
        else:
            ids = _ids(v, at, model.rows[f], model.tables[f])
        bags[f].add(ids, weights)


def _rows(rows: Any, model: ModelInputs) -> Job:
    if not isinstance(rows, list):
        raise BadRequest(f"rows: a list of row objects, got {_what(rows)}")
    dense: list[list[float]] = []
    bags = {f: _Bags() for f in model.features}
    for i, row in enumerate(rows):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise BadRequest(f'{where}: an object {{"dense": [...], "sparse": {{...}}}}')
        extra = sorted(set(row) - {"dense", "sparse"})
        if extra:
            raise BadRequest(f"{where}: unknown field '{extra[0]}' (fields: dense, sparse)")
        for key in ("dense", "sparse"):
            if key not in row:
                raise BadRequest(f"{where}: missing field '{key}'")
        dense.append(_dense(row["dense"], f"{where}.dense", model.num_dense))
        _sparse_row(row["sparse"], f"{where}.sparse", model, bags)
    arr = np.asarray(dense, dtype=np.float64).astype(np.float32).reshape(len(rows), model.num_dense)
    return Job(arr, {f: b.bag() for f, b in bags.items()}, len(rows))


def _raw(body: dict[str, Any], predictor: Any) -> Job:
    raw, labels = body["raw"], body.get("labels", False)
    if not isinstance(raw, list):
        raise BadRequest(
            f"raw: a list of rows (tab-separated text or lists of fields), got {_what(raw)}"
        )
    if not isinstance(labels, bool):
        raise BadRequest(f"labels: true or false, got {_what(labels)}")
    try:
        dense, sparse = predictor.inputs_from_raw(raw, labels=labels)
    except ValueError as e:
        raise BadRequest(f"raw: {str(e).splitlines()[0]}") from None
    n = len(raw)
    bags = {
        f: (np.asarray(b[0], np.int64), np.asarray(b[1], np.int64), None) for f, b in sparse.items()
    }
    return Job(np.asarray(dense, np.float32).reshape(n, -1), bags, n)


def parse_body(body: bytes, model: ModelInputs, predictor: Any) -> tuple[Job, bool]:
    """The request's ``Job`` and whether it asked for ``batch_info``; ``BadRequest`` otherwise."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise BadRequest(f"body: not JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(obj, dict):
        raise BadRequest(f"body: {_FORMS}, got {type(obj).__name__}")
    extra = sorted(set(obj) - {"rows", "raw", "labels", "batch_info"})
    if extra:
        raise BadRequest(
            f"body: unknown field '{extra[0]}' (fields: rows | raw, labels, batch_info)"
        )
    if ("rows" in obj) == ("raw" in obj):
        raise BadRequest(f"body: {_FORMS}: exactly one of rows, raw")
    info = obj.get("batch_info", False)
    if not isinstance(info, bool):
        raise BadRequest(f"batch_info: true or false, got {_what(info)}")
    if "rows" in obj:
        if "labels" in obj:
            raise BadRequest("labels: only with raw rows")
        return _rows(obj["rows"], model), info
    return _raw(obj, predictor), info
