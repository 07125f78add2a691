"""Loader of a neorec serving artifact (``neorec export``): imports only torch and numpy.

``neorec export`` copies this file into the artifact as ``serving.py``; use it from there::

    import sys; sys.path.insert(0, "DIR")
    import serving
    predict = serving.load("DIR")
    probs = predict(dense, {"t0": (lengths, ids), "t1": (lengths, ids, weights), ...})

``dense`` is [B, num_dense] (cast to float32); each sparse feature is a bag per sample:
``lengths`` [B] (ids per sample), ``ids`` [sum(lengths)] row ids of the feature's table (a
dynamic table: any raw int64 ids, read through its id -> row map; an id it does not hold reads
the shared default row, or with ``unadmitted = "zeros"`` is left out of its bag), and
optionally per-id ``weights`` [sum(lengths)]. Every feature of ``predict.features`` is required.
The result is float32 click probabilities [B] (``sigmoid`` of the model's logit; ``predict.logits``
gives the logits). Bad input raises ``ValueError`` naming the feature (a non-finite dense value:
its column and row).

``load(DIR)`` checks every file against the manifest before anything is used: the manifest's own
SHA-256 (``checksum``: an edited or damaged manifest), each file's size (always) and CRC-32 (the
``files`` table; ``load(DIR, verify=False)`` skips the CRC pass, which reads every byte once: about
0.5 s per GiB from the page cache on a 2-core development machine, disk speed otherwise). A damaged, missing or unreadable
file raises ``ArtifactError`` (a ``ValueError``) whose one-line message names the file. The
checksums are neorec's checkpoint checksums (``neorec.checkpoint.format``), computed here again
with the standard library.

Raw Criteo rows (a model trained on Criteo data): ``predict.predict_raw(rows)`` takes each row as
its tab-separated text or a sequence of its fields, ``I1..I13 C1..C26`` (39 fields), or with
``labels=True`` a log line ``label I1..I13 C1..C26`` (40; the label is not read): a row of any other
count is refused, never read shifted. It applies the training-side transforms the
manifest records (``transforms``): dense ``log(max(x, 0) + 1)`` (empty = 0), each category's hex
value mapped as training mapped it (``v % rows``; a dynamic table's raw id; a bounded index; the
multi-hot draws of preprocessed data), empty = 0. ``predict.inputs_from_raw(rows)`` gives the
``(dense, sparse)`` it feeds to ``predict``. A malformed row raises ``ValueError`` naming its row
and field; a model whose manifest has no transforms (synthetic data, vocabulary preprocessing)
raises one naming why.

The artifact: ``manifest.json`` (features -> tables, dims, pooling, quantization, files), the
dense part (bottom MLP, interaction, top MLP) as a ``torch.export`` program ``dense.pt2`` (or
TorchScript ``dense.ts``), and the tables as ``.npy``: fp32 or fp16 rows, or row-wise integer
codes (``int8`` / ``int4`` / ``int2``): uint8 rows of the codes (big-endian bits: int4's high nibble
first) followed by the row's float16 scale and offset in units of the table's ``scale_unit`` /
``offset_unit`` (row = codes * scale * scale_unit + offset * offset_unit), decoded only for the rows
a batch looks up; or a low-rank table's float32 factors ``u`` [rows, R] and ``v`` [R, dim]
(row = u[id] @ v). With neorec installed, fp16 and integer tables are pooled by its compiled
kernel (``neorec.ops.quant_lookup``, decode and pooling in one pass; ``load(DIR, fused=False)``:
this file's NumPy path, which is its specification).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zlib
from typing import Any

import numpy as np
import torch

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArtifactError",
    "manifest_checksum",
    "file_crc32",
    "Table",
    "Predictor",
    "load",
    "criteo_fields",
    "multi_hot_rows",
]

FORMAT = "neorec.serving"
FORMAT_VERSION = 2
"""2: the manifest carries its own SHA-256 and every file's size and CRC-32."""
MANIFEST = "manifest.json"
INT_BITS = {"int8": 8, "int4": 4, "int2": 2}
"""Row-wise integer table kinds and their bits per code."""
FUSED = ("fp16", *INT_BITS)
"""Table kinds pooled by neorec's kernel when it is there (``neorec.ops.quant_lookup``)."""
CHUNK = 16 << 20
"""Bytes read per call of the CRC pass."""


class ArtifactError(ValueError):
    """A file of the artifact is missing, damaged or unreadable; the message names it."""


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 (hex) of the manifest's canonical JSON without its ``checksum`` field (the same
    as ``neorec.checkpoint.format.manifest_checksum``)."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def file_crc32(path: str) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, read in chunks (``neorec.checkpoint.format``'s
    ``checksum`` of the same bytes)."""
    crc = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while True:
            n = fh.readinto(view)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:160]}" if lines else type(e).__name__


def read_manifest(root: str) -> dict[str, Any]:
    """The artifact's manifest, its format and its own checksum checked."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ArtifactError(
            f"{path}: cannot read ({e.strerror or e}); load() takes the directory "
            "`neorec export` wrote"
        ) from None
    try:
        m = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ArtifactError(
            f"{path}: unreadable ({_first_line(e)}): the artifact is damaged; export it again"
        ) from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not a {FORMAT} manifest")
    if m.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: format_version {m.get('format_version')!r}, this loader reads "
            f"{FORMAT_VERSION}; use the serving.py of that artifact, or export it again"
        )
    stored, got = m.get("checksum"), manifest_checksum(m)
    if stored != "sha256:" + got:
        raise ArtifactError(
            f"{path}: manifest checksum mismatch (sha256 {got[:16]}..., recorded "
            f"{str(stored)[7:23]}...): the manifest was edited or damaged; export it again"
        )
    return m


def check_files(root: str, manifest: dict[str, Any], verify: bool = True) -> None:
    """Every file of ``manifest["files"]``: present, of its size and (``verify``) its CRC-32."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{os.path.join(root, MANIFEST)}: lists no files")
    for rel, entry in files.items():
        path = _path(root, rel)
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise ArtifactError(
                f"{path}: listed in the manifest, cannot be read ({e.strerror or e})"
            ) from None
        if size != entry["bytes"]:
            raise ArtifactError(
                f"{path}: {size} bytes, the manifest says {entry['bytes']} (truncated or "
                "replaced); export it again"
            )
        if verify:
            try:
                crc = file_crc32(path)
            except OSError as e:
                raise ArtifactError(f"{path}: cannot be read ({e.strerror or e})") from None
            if crc != entry["crc32"]:
                raise ArtifactError(
                    f"{path}: checksum mismatch (crc32 {crc}, the manifest says "
                    f"{entry['crc32']}): the file is damaged; export it again"
                )


def _path(root: str, rel: Any) -> str:
    """``root/rel`` for a file the manifest names (never outside ``root``)."""
    rel = str(rel)
    norm = os.path.normpath(rel)
    if os.path.isabs(rel) or norm.startswith(".."):
        raise ArtifactError(f"{os.path.join(root, MANIFEST)}: file {rel!r} is outside the artifact")
    return os.path.join(root, norm)


def _listed(root: str, files: dict[str, Any], rel: Any) -> str:
    if str(rel) not in files:
        raise ArtifactError(f"{os.path.join(root, MANIFEST)}: {rel} is not in its files table")
    return _path(root, rel)


def _npy(path: str, mmap_mode: Any) -> np.ndarray:
    """A ``.npy`` file of the artifact; ``ArtifactError`` naming it when it cannot be read."""
    try:
        return np.asarray(np.load(path, mmap_mode=mmap_mode, allow_pickle=False))
    except Exception as e:  # noqa: BLE001 - any failure to parse the file is a damaged file
        raise ArtifactError(
            f"{path}: unreadable .npy ({_first_line(e)}); export it again"
        ) from None


_DEC = frozenset("0123456789")
_HEXD = frozenset("0123456789abcdefABCDEF")
_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def multi_hot_rows(
    rows_ids: np.ndarray, feature: int, size: int, rows: int, seed: int
) -> np.ndarray:
    """[n, size] bags of feature ``feature`` (0-based): the row itself, then ``size - 1`` rows of
    [0, rows) fixed per (seed, feature, row) by splitmix64 (``neorec data preprocess --multi-hot``,
    ``neorec.data.shards.multi_hot_extra``)."""
    out = np.empty((len(rows_ids), size), dtype=np.int64)
    out[:, 0] = rows_ids
    if size > 1:
        with np.errstate(over="ignore"):
            base = rows_ids.astype(np.uint64) * np.uint64(size) + np.uint64(
                ((seed * 26 + feature) << 40) & _M64
            )
            k = np.arange(1, size, dtype=np.uint64)
            out[:, 1:] = (_splitmix64(base[:, None] + k[None, :]) % np.uint64(rows)).astype(
                np.int64
            )
    return out


def criteo_fields(row: Any, index: int, labels: bool = False) -> list[str]:
    """The 39 fields ``I1..I13 C1..C26`` of a raw row: its tab-separated text (one trailing
    newline dropped) or a sequence of its fields; with ``labels`` the row has 40, a leading label
    (dropped). Any other count is refused: a row that lost or gained a field would be read with
    every field shifted."""
    if isinstance(row, bytes):
        try:
            row = row.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"row {index}: not UTF-8 text") from None
    if isinstance(row, str):
        fields = row.rstrip("\n").rstrip("\r").split("\t")
    elif isinstance(row, (list, tuple)):
        fields = ["" if f is None else str(f) for f in row]
    else:
        raise ValueError(f"row {index}: a str or a sequence of fields, got {type(row).__name__}")
    want = 40 if labels else 39
    if len(fields) != want:
        hint = (
            "label I1..I13 C1..C26 (labels=True)"
            if labels
            else "I1..I13 C1..C26; rows with a label first: labels=True"
        )
        raise ValueError(f"row {index}: {len(fields)} fields, want {want} ({hint})")
    return fields[1:] if labels else fields


def _dense_int(s: str, index: int, col: int) -> int:
    body = s[1:] if s.startswith("-") else s
    if not body or not set(body) <= _DEC or len(s) > 20 or not -(1 << 63) <= int(s) < 1 << 63:
        raise ValueError(f"row {index}: field I{col + 1}: {s[:40]!r} is not a 64-bit integer")
    return int(s)


def _category(s: str, index: int, j: int, spec: dict[str, Any]) -> int:
    if not s:
        return 0
    if not set(s) <= _HEXD or len(s) > 15:
        raise ValueError(f"row {index}: field C{j + 1}: {s[:40]!r} is not hex (<= 15 digits)")
    v = int(s, 16)
    how, rows = spec["map"], int(spec["rows"])
    if how == "modulo":
        return v % rows
    if how == "index" and v >= rows:
        raise ValueError(
            f"row {index}: field C{j + 1}: id {v} >= table rows {rows} (the model was trained "
            "on unhashed ids)"
        )
    return v


class Table:
    """One embedding table of the artifact (memory-mapped); ``rows(ids)`` gives fp32 rows."""

    def __init__(self, root: str, spec: dict[str, Any], listed: dict[str, Any]) -> None:
        self.name = str(spec["name"])
        self.num_rows, self.dim = int(spec["rows"]), int(spec["dim"])
        self.quantization = str(spec["quantization"])
        files = spec["files"]
        self.dynamic = spec.get("kind") == "dynamic"
        self.ids: np.ndarray | None = None
        self.default_row = spec.get("unadmitted") == "default_row"
        if self.dynamic:  # live raw ids, ascending: row j is ids[j]'s (+ the default row last)
            ids_path = _listed(root, listed, spec["ids_file"])
            self.ids = _npy(ids_path, None)
            n = self.num_rows - int(self.default_row)
            if self.ids.shape != (n,) or self.ids.dtype != np.int64:
                raise ArtifactError(
                    f"{ids_path}: table '{self.name}': ids are {self.ids.dtype} {self.ids.shape}, "
                    f"the manifest says int64 ({n},) (a damaged artifact)"
                )

        paths: dict[int, str] = {}

        def arr(key: str) -> np.ndarray:
            path = _listed(root, listed, files[key])
            a = _npy(path, "r")
            paths[id(a)] = path
            return a

        self.scale_unit = self.offset_unit = 1.0
        if self.quantization in ("none", "fp16"):
            self.weight = self.data = arr("weight")
            want: list[tuple[np.ndarray, tuple[int, ...], Any]] = [
                (self.weight, (self.num_rows, self.dim), np.float32 if self.quantization == "none"
                 else np.float16)
            ]  # fmt: skip
        elif self.quantization in INT_BITS:
            if "rows" not in files:
                raise ArtifactError(
                    f"table '{self.name}': separate codes / scale / offset files (an older export): "
                    "load it with its own serving.py, or export it again"
                )
            self.bits = INT_BITS[self.quantization]
            self.scale_unit = float(spec["scale_unit"])
            self.offset_unit = float(spec["offset_unit"])
            self.data = arr("rows")  # [codes | scale, offset float16] per row
            want = [(self.data, (self.num_rows, (self.dim * self.bits + 7) // 8 + 4), np.uint8)]
        elif self.quantization == "lowrank":
            want = self._low_rank_files(spec, arr)
        else:
            raise ArtifactError(f"table '{self.name}': unknown quantization {self.quantization!r}")
        for a, shape, dtype in want:
            if a.shape != shape or a.dtype != dtype:
                raise ArtifactError(
                    f"{paths[id(a)]}: table '{self.name}': {a.dtype} {a.shape}, the manifest "
                    f"says {np.dtype(dtype)} {shape} (a damaged artifact)"
                )

    def _low_rank_files(
        self, spec: dict[str, Any], arr: Any
    ) -> list[tuple[np.ndarray, tuple[int, ...], Any]]:
        """U [rows, R] and V [R, dim] (float32) of a low-rank table, with their wanted shapes."""
        self.rank = int(spec["rank"])
        self.u, self.v = arr("u"), arr("v")
        return [
            (self.u, (self.num_rows, self.rank), np.float32),
            (self.v, (self.rank, self.dim), np.float32),
        ]

    def row_of(self, ids: np.ndarray) -> np.ndarray:
        """Rows of raw ids of a dynamic table: their row, else the default row, else -1."""
        assert self.ids is not None
        n = self.ids.shape[0]
        pos = np.minimum(np.searchsorted(self.ids, ids), max(n - 1, 0))
        hit = (self.ids[pos] == ids) if n else np.zeros(ids.shape, dtype=bool)
        miss = n if self.default_row else -1
        return np.where(hit, pos, miss).astype(np.int64)

    def rows(self, ids: np.ndarray) -> torch.Tensor:
        """fp32 rows [len(ids), dim] of ``ids`` (int64, checked by the caller)."""
        if self.quantization == "none":
            return torch.from_numpy(np.ascontiguousarray(self.weight[ids]))
        if self.quantization == "lowrank":  # U[ids] @ V
            v = torch.from_numpy(np.array(self.v))  # [R, dim]: small
            return torch.from_numpy(np.ascontiguousarray(self.u[ids])) @ v
        if self.quantization == "fp16":
            return torch.from_numpy(self.weight[ids].astype(np.float32))
        raw = np.ascontiguousarray(self.data[ids])
        nb = raw.shape[1] - 4
        meta = raw[:, nb:].copy().view("<f2").astype(np.float32)  # [n, 2]: scale, offset
        scale = torch.from_numpy(meta[:, 0] * np.float32(self.scale_unit))
        offset = torch.from_numpy(meta[:, 1] * np.float32(self.offset_unit))
        packed = torch.from_numpy(raw[:, :nb]).to(torch.int32)
        if self.bits == 8:
            codes = packed
        else:  # big-endian bits: int4's high nibble first, int2's top two bits first
            shifts = torch.arange(8 - self.bits, -1, -self.bits, dtype=torch.int32)
            codes = (packed.unsqueeze(2) >> shifts) & ((1 << self.bits) - 1)
            codes = codes.reshape(len(ids), -1)[:, : self.dim]
        return codes.float() * scale.unsqueeze(1) + offset.unsqueeze(1)


class Predictor:
    """``predict(dense, sparse)`` of a serving artifact (see the module docstring)."""

    def __init__(self, root: str, verify: bool = True, fused: bool = True) -> None:
        m = read_manifest(root)
        self._fused = _fused_kernel() if fused else None
        try:
            check_files(root, m, verify)
            self.manifest = m
            self.num_dense = int(m["num_dense"])
            self.pooling = str(m["pooling"])
            self.tables = {t["name"]: Table(root, t, m["files"]) for t in m["tables"]}
            self.features = [str(f["name"]) for f in m["features"]]
            self._table_of = {str(f["name"]): self.tables[f["table"]] for f in m["features"]}
            dense = m["dense"]
            file = _listed(root, m["files"], dense["file"])
            fmt = dense["format"]
        except (KeyError, TypeError, AttributeError) as e:
            where = os.path.join(root, MANIFEST)
            raise ArtifactError(f"{where}: malformed ({_first_line(e)})") from None
        try:
            if fmt == "torch.export":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch's notes on weights
                    self.program = torch.export.load(file).module()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self.program = torch.jit.load(file)
        except Exception as e:  # noqa: BLE001 - any failure to load the program: a bad file
            raise ArtifactError(
                f"{file}: the dense program does not load ({_first_line(e)}); export it again"
            ) from None

    def _dense(self, dense: Any) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(dense, dtype=np.float32))
        if x.dim() != 2 or x.shape[1] != self.num_dense:
            raise ValueError(f"dense must be [batch, {self.num_dense}], got {list(x.shape)}")
        finite = torch.isfinite(x)
        if not bool(finite.all()):
            row, col = (int(i) for i in (~finite).nonzero()[0])
            raise ValueError(
                f"dense column {col} of row {row} is {float(x[row, col])} ({int((~finite).sum())} "
                "non-finite values in the batch): predict takes finite dense features"
            )
        return x

    def _pool(self, name: str, bag: Any, batch: int) -> torch.Tensor:
        table = self._table_of[name]
        if not isinstance(bag, (tuple, list)) or len(bag) not in (2, 3):
            raise ValueError(f"feature '{name}': expected (lengths, ids[, weights])")
        lengths = np.asarray(bag[0])
        ids = np.asarray(bag[1])
        where = f"feature '{name}' (table '{table.name}')"
        for label, a in (("lengths", lengths), ("ids", ids)):
            if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
                raise ValueError(f"{where}: {label} must be a 1-D integer array, got {a.dtype}")
        lengths, ids = lengths.astype(np.int64), ids.astype(np.int64)
        if lengths.shape[0] != batch:
            raise ValueError(f"{where}: {lengths.shape[0]} lengths for a batch of {batch}")
        if (lengths < 0).any() or int(lengths.sum()) != ids.shape[0]:
            raise ValueError(
                f"{where}: lengths must be >= 0 and sum to the {ids.shape[0]} ids, "
                f"got sum {int(lengths.sum())}"
            )
        keep = None
        if table.dynamic:  # raw ids -> rows; unadmitted ids: the default row, or dropped
            ids = table.row_of(ids)
            keep = ids >= 0
        else:
            bad = (ids < 0) | (ids >= table.num_rows)
            if bad.any():
                raise ValueError(f"{where}: id {int(ids[bad][0])} outside [0, {table.num_rows})")
        w = None
        if len(bag) == 3 and bag[2] is not None:
            w = torch.as_tensor(np.asarray(bag[2], dtype=np.float32))
            if tuple(w.shape) != (ids.shape[0],) or not bool(torch.isfinite(w).all()):
                raise ValueError(f"{where}: weights must be {ids.shape[0]} finite numbers")
        if keep is not None and not keep.all():
            seg_all = np.repeat(np.arange(batch), lengths)
            lengths = np.bincount(seg_all[keep], minlength=batch).astype(np.int64)
            ids = ids[keep]
            w = w[torch.from_numpy(keep)] if w is not None else None
        if self._fused is not None and table.quantization in FUSED:  # fp32: as it always was
            offsets = np.zeros(batch + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            return self._fused(table, ids, offsets, w, self.pooling == "mean")
        rows = table.rows(ids)
        if w is not None:
            rows = rows * w.unsqueeze(1)
        lens = torch.from_numpy(lengths)
        seg = torch.repeat_interleave(torch.arange(batch), lens)
        pooled = torch.zeros(batch, table.dim).index_add_(0, seg, rows)
        if self.pooling == "mean":
            pooled = pooled / lens.clamp(min=1).to(pooled.dtype).unsqueeze(1)
        return pooled

    def logits(self, dense: Any, sparse: dict[str, Any]) -> torch.Tensor:
        """Logits [B] (float32)."""
        x = self._dense(dense)
        batch = x.shape[0]
        if not isinstance(sparse, dict):
            raise ValueError(f"sparse must be a dict feature -> (lengths, ids), got {type(sparse)}")
        missing = [f for f in self.features if f not in sparse]
        unknown = [f for f in sparse if f not in self._table_of]
        if missing or unknown:
            raise ValueError(
                f"sparse features: missing {missing}, unknown {unknown}; the model reads "
                f"{self.features}"
            )
        if batch == 0:
            return torch.zeros(0)
        with torch.inference_mode():
            pooled = torch.cat([self._pool(f, sparse[f], batch) for f in self.features], dim=1)
            return self.program(x, pooled).float()

    def __call__(self, dense: Any, sparse: dict[str, Any]) -> np.ndarray:
        """Click probabilities float32 [B]."""
        return torch.sigmoid(self.logits(dense, sparse)).numpy()

    def inputs_from_raw(self, rows: Any, labels: bool = False) -> tuple[np.ndarray, dict[str, Any]]:
        """``(dense, sparse)`` of raw Criteo rows, through the manifest's ``transforms``
        (``labels``: each row starts with a label, which is not read)."""
        tf = self.manifest.get("transforms")
        if not isinstance(tf, dict) or tf.get("kind") != "criteo":
            why = tf.get("why") if isinstance(tf, dict) else "exported without transforms"
            raise ValueError(
                f"this artifact cannot read raw rows ({why}); use predict(dense, sparse)"
            )
        cats = tf["categorical"]
        fields = [criteo_fields(r, i, labels) for i, r in enumerate(rows)]
        n = len(fields)
        ints = np.zeros((n, 13), dtype=np.int64)
        ids = np.zeros((n, len(cats)), dtype=np.int64)
        for i, f in enumerate(fields):
            ints[i] = [_dense_int(s, i, c) if s else 0 for c, s in enumerate(f[:13])]
            ids[i] = [_category(s, i, j, cats[j]) for j, s in enumerate(f[13:])]
        # the public DLRM transform, in float64 then float32 (as neorec.data.criteo)
        dense = np.log1p(np.maximum(ints, 0).astype(np.float64)).astype(np.float32)
        seed = int(tf.get("multi_hot", {}).get("seed", 0))
        sparse: dict[str, Any] = {}
        for j, spec in enumerate(cats):
            size = int(spec.get("multi_hot", 1))
            bags = multi_hot_rows(ids[:, j], j, size, int(spec["rows"]), seed)
            sparse[str(spec["feature"])] = (np.full(n, size, dtype=np.int64), bags.reshape(-1))
        return dense, sparse

    def predict_raw(self, rows: Any, labels: bool = False) -> np.ndarray:
        """Click probabilities float32 [B] of raw Criteo rows (see the module docstring;
        ``labels``: each row is a log line with its label first)."""
        return self(*self.inputs_from_raw(rows, labels))


def _fused_kernel() -> Any:
    """neorec's compiled pooled lookup (``neorec.ops.quant_lookup.pooled``, the same sums as
    ``Table.rows`` + ``index_add_``) when neorec imports and its kernel builds; else None."""
    try:
        from neorec.ops import quant_lookup

        return quant_lookup.pooled if quant_lookup.native_lib() is not None else None
    except (ImportError, OSError, RuntimeError):
        return None


def load(path: str, verify: bool = True, fused: bool = True) -> Predictor:
    """The predictor of the artifact in directory ``path``; every file is checked against the
    manifest first (``verify=False``: sizes only, no CRC pass; ``fused=False``: every table
    pooled by this file's NumPy path, not neorec's kernel)."""
    return Predictor(str(path), verify, fused)
