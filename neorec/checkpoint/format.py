"""On-storage format: embedding pieces, the manifest, checksums.

A checkpoint is a directory ``<root>/ckpt-<step>-<run>/``::

    manifest.json                      written last: a checkpoint without it does not exist
    dense.pt                           dense weights, dense optimizer, trainer state (rank 0)
    emb/<table>/r<a>-<b>.c<c>-<d>.bin  one piece: rows [a, b), columns [c, d) of a table

Pieces are cut at global row boundaries (multiples of ``chunk_rows``) and by the column ranges of
the shards that wrote them, never by rank, so any plan can find the rows it needs. A baseline piece
holds every row of its range; an incremental piece the rows modified since its parent, listed as a
bitmap or as int32 offsets (whichever is smaller).

A piece file is ``MAGIC | u32 header length | JSON header | arrays``; no pickle, so reading a
checkpoint never runs code. The manifest lists each file with its size and CRC-32, and carries
a SHA-256 of its own canonical JSON (``checksum``), so an edited field is detected too.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from neorec.errors import NeorecError
from neorec.ops.quant import IntRows, int_rowwise_dequantize, int_rowwise_quantize

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointCorruptError",
    "NoCheckpointError",
    "CheckpointMismatchError",
    "manifest_checksum",
    "one_line",
    "seal_manifest",
    "check_manifest_checksum",
    "Piece",
    "encode_piece",
    "decode_piece",
    "checksum",
    "verify_bytes",
    "WEIGHT_BITS",
    "STATE_BITS",
    "row_bytes",
]

FORMAT = "neorec.checkpoint"
FORMAT_VERSION = 2
"""Bumped on any incompatible change; readers refuse other versions (2: manifest checksum,
lineage and write sequence, model description)."""
MANIFEST = "manifest.json"
MAGIC = b"NRCP"
WEIGHT_BITS = (32, 8, 4, 3, 2)
"""Stored precision of embedding rows: float32 or row-wise integer codes."""
STATE_BITS = (32, 16, 8, 0)
"""Stored precision of fused optimizer state: float32, bfloat16, 8-bit codes, or not stored."""
ROW_STATE = ("momentum1",)
"""Optimizer state with one value per row (the rest has one value per element)."""


class CheckpointError(NeorecError, RuntimeError):
    """A checkpoint cannot be found, read or applied; the message says which and why."""


class CheckpointCorruptError(CheckpointError):
    """A stored file does not match the size or checksum its manifest recorded."""


class NoCheckpointError(CheckpointError):
    """There is no complete checkpoint under a root (nothing to resume or inspect)."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint describes another model than the one it is being restored into."""


def one_line(e: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message, shortened (for one-line errors)."""
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:limit]


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 (hex) of the manifest's canonical JSON without its ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json``: the manifest with its ``checksum`` field set."""
    manifest["checksum"] = "sha256:" + manifest_checksum(manifest)
    return json.dumps(manifest, indent=1).encode()


def check_manifest_checksum(manifest: dict[str, Any], where: str) -> None:
    """Raise ``CheckpointCorruptError`` unless ``manifest`` carries its own correct checksum."""
    stored = manifest.get("checksum")
    if not isinstance(stored, str) or not stored.startswith("sha256:"):
        raise CheckpointCorruptError(
            f"{where}: the manifest has no checksum (edited, or written by an older neorec); "
            f"it cannot be trusted: restore another checkpoint or start a new run"
        )
    got = manifest_checksum(manifest)
    if stored != "sha256:" + got:
        raise CheckpointCorruptError(
            f"{where}: manifest checksum mismatch (sha256 {got[:16]}..., recorded "
            f"{stored[7:23]}...): the manifest was edited or corrupted"
        )


def checksum(data: bytes) -> str:
    """CRC-32 of ``data`` as 8 hex digits."""
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def verify_bytes(data: bytes, entry: dict[str, Any], where: str) -> None:
    """Raise ``CheckpointCorruptError`` unless ``data`` has the manifest's size and CRC-32."""
    if len(data) != entry["bytes"]:
        raise CheckpointCorruptError(
            f"{where}: {len(data)} bytes, manifest says {entry['bytes']} (truncated or replaced)"
        )
    got = checksum(data)
    if got != entry["crc32"]:
        raise CheckpointCorruptError(
            f"{where}: checksum mismatch (crc32 {got}, manifest says {entry['crc32']}): "
            f"the file is corrupted"
        )


def row_bytes(cols: int, bits: int, state_elems: int, state_rows: int, opt_bits: int) -> float:
    """Estimated stored bytes of one row (weights + optimizer state), before row ids."""
    w = cols * 4 if bits == 32 else (cols * bits + 7) // 8 + 4
    elem = {32: 4.0 * cols, 16: 2.0 * cols, 8: cols + 4.0, 0: 0.0}[opt_bits]
    per_row = {32: 4.0, 16: 2.0, 8: 2.0, 0: 0.0}[opt_bits]
    return w + state_elems * elem + state_rows * per_row


@dataclass
class Piece:
    """Decoded rows of one piece: ``ids`` (offsets in its row range; None = every row)."""

    ids: Tensor | None
    weight: Tensor  # float32 [n, cols]
    state: dict[str, Tensor]  # float32 [n] (per-row) or [n, cols]


# ---- arrays <-> bytes ------------------------------------------------------------------------
_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,  # raw ids of dynamic tables
}


class _Writer:
    def __init__(self) -> None:
        self.arrays: list[list[Any]] = []
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, name: str, t: Tensor) -> None:
        t = t.detach().contiguous().cpu()
        dtype = str(t.dtype).removeprefix("torch.")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        self.arrays.append([name, dtype, list(t.shape), self.size, len(raw)])
        self.chunks.append(raw)
        self.size += len(raw)


def _read_arrays(header: dict[str, Any], payload: memoryview) -> dict[str, Tensor]:
    out = {}
    for name, dtype, shape, off, n in header["arrays"]:
        buf = bytearray(payload[off : off + n])
        t = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(_DTYPES[dtype]).reshape(shape)
    return out


# ---- codecs of one tensor ----------------------------------------------------------------------
def _put_rows(w: _Writer, meta: dict[str, Any], name: str, x: Tensor, bits: int, adaptive: bool):
    """Store rows [n, c] at ``bits`` (32 float, 16 bfloat16, <= 8 integer codes)."""
    if bits == 32:
        meta[name] = {"codec": "f32"}
        w.add(name, x.float())
    elif bits == 16:
        meta[name] = {"codec": "bf16"}
        w.add(name, x.to(torch.bfloat16).view(torch.int16).view(torch.uint8))
    else:
        q = int_rowwise_quantize(x, bits, adaptive_range=adaptive)
        meta[name] = {
            "codec": "int",
            "bits": bits,
            "dim": q.dim,
            "scale_unit": q.scale_unit,
            "offset_unit": q.offset_unit,
        }
        w.add(name + ".codes", q.packed)
        w.add(name + ".scale", q.scale)
        w.add(name + ".offset", q.offset)


def _get_rows(arrays: dict[str, Tensor], meta: dict[str, Any], name: str) -> Tensor:
    m = meta[name]
    if m["codec"] == "f32":
        return arrays[name].float()
    if m["codec"] == "bf16":
        a = arrays[name]
        return a.view(torch.bfloat16).reshape(a.shape[0], -1).float()
    q = IntRows(
        arrays[name + ".codes"],
        arrays[name + ".scale"],
        arrays[name + ".offset"],
        m["scale_unit"],
        m["offset_unit"],
        m["bits"],
        m["dim"],
    )
    return int_rowwise_dequantize(q)


def _encode_ids(w: _Writer, ids: Tensor | None, span: int) -> str:
    if ids is None:
        return "all"
    if ids.numel() * 32 <= span:
        w.add("ids", ids.to(torch.int32))
        return "int32"
    mask = torch.zeros((span + 7) // 8 * 8, dtype=torch.bool)
    mask[ids] = True
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    w.add("ids", (mask.view(-1, 8).to(torch.uint8) * weights).sum(1).to(torch.uint8))
    return "bitmap"


def _decode_ids(arrays: dict[str, Tensor], how: str, span: int) -> Tensor | None:
    if how == "all":
        return None
    if how == "int32":
        return arrays["ids"].to(torch.int64)
    bits = (arrays["ids"].unsqueeze(1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
    return bits.flatten()[:span].nonzero().squeeze(1)


# ---- pieces --------------------------------------------------------------------------------------
def encode_piece(
    weight: Tensor,
    state: dict[str, Tensor],
    ids: Tensor | None,
    span: int,
    bits: int,
    opt_bits: int,
    adaptive_range: bool,
) -> bytes:
    """Bytes of one piece: rows ``weight`` [n, c] (+ their optimizer state) of a ``span``-row range.

    ``ids`` are the rows' offsets in the range (sorted), or None when every row is present.
    """
    if bits not in WEIGHT_BITS:
        raise ValueError(f"checkpoint bits must be one of {WEIGHT_BITS}, got {bits}")
    if opt_bits not in STATE_BITS:
        raise ValueError(f"checkpoint opt_bits must be one of {STATE_BITS}, got {opt_bits}")
    w = _Writer()
    meta: dict[str, Any] = {}
    header: dict[str, Any] = {"n": int(weight.shape[0]), "cols": int(weight.shape[1])}
    header["span"] = span
    header["ids"] = _encode_ids(w, ids, span)
    _put_rows(w, meta, "weight", weight, bits, adaptive_range)
    for k, v in state.items():
        if opt_bits == 0:
            continue
        if k in ROW_STATE:  # one scalar per row: 8-bit codes would cost as much as bfloat16
            _put_rows(w, meta, k, v.reshape(-1, 1), 32 if opt_bits == 32 else 16, False)
        else:
            _put_rows(w, meta, k, v, opt_bits, False)
    header["meta"] = meta
    header["arrays"] = w.arrays
    head = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<I", len(head)), head, *w.chunks])


def decode_piece(data: bytes, where: str = "piece") -> Piece:
    """Inverse of ``encode_piece`` (float32 tensors); CheckpointCorruptError on malformed bytes."""
    if data[:4] != MAGIC:
        raise CheckpointCorruptError(f"{where}: not a neorec checkpoint piece (bad magic)")
    try:
        return _decode_piece(data)
    except Exception as e:  # any malformed header or array: the file is not what was written
        raise CheckpointCorruptError(
            f"{where}: malformed piece ({type(e).__name__}: {one_line(e)})"
        ) from None


def _decode_piece(data: bytes) -> Piece:
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than a piece header")
    (hlen,) = struct.unpack("<I", data[4:8])
    header = json.loads(data[8 : 8 + hlen])
    arrays = _read_arrays(header, memoryview(data)[8 + hlen :])
    meta = header["meta"]
    ids = _decode_ids(arrays, header["ids"], header["span"])
    weight = _get_rows(arrays, meta, "weight")
    state = {}
    for k in meta:
        if k == "weight":
            continue
        v = _get_rows(arrays, meta, k)
        state[k] = v.reshape(-1) if k in ROW_STATE else v
    return Piece(ids, weight, state)
