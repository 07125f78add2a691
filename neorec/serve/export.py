"""``neorec export``: a serving artifact that loads without neorec (torch and numpy only).

::

    DIR/
      manifest.json     features -> tables, dims, pooling, quantization, the files
      dense.pt2         bottom MLP + interaction + top MLP: a torch.export program
                        (dense [B, num_dense], pooled [B, F*dim]) -> logits [B]
                        (dense.ts, TorchScript, where torch.export cannot)
      tables/<i>_<t>.npy  fp32 rows (fp16 for --quantize fp16); or <i>_<t>.rows.npy for int8 /
                        int4 / int2: uint8 rows of codes + float16 scale, offset in units of
                        the spec's scale_unit / offset_unit (neorec.ops.quant_lookup; <i>: the
                        table's index); or <i>_<t>.u.npy [rows, R] and .v.npy [R, dim] (float32)
                        for --low-rank R (``neorec.serve.lowrank``; tables of dim <= R stay fp32)
      serving.py        the loader (``neorec/serve/standalone.py``): load(DIR) -> predict

A model trained on Criteo data also carries its feature transforms (``transforms``: the dense
``log(max(x, 0) + 1)``, each category's hex parse and its map into rows: ``v % rows``, a raw id of
a dynamic table, a bounded index, plus the multi-hot draws' seed of preprocessed data), so that
``predict.raw(rows)`` serves raw Criteo fields exactly as training read them
(:func:`feature_transforms`).

The manifest is sealed like a checkpoint's (``neorec.checkpoint.format.seal_manifest``: a SHA-256
of its canonical JSON) and lists every other file with its size and CRC-32 (``files``); the loader
checks both before it reads anything (``neorec.serve.artifact.load_artifact`` in neorec).

The tables are read through ``ebc.table_weight`` (fp32 whatever the stored precision).
Quantization is row-wise asymmetric (``neorec.ops.quant``): int8 over each row's [min, max],
int4 and int2 with Check-N-Run's greedy range search; fp16 rounds each value to nearest.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from neorec.checkpoint.format import seal_manifest
from neorec.config import Config, ConfigError
from neorec.errors import DataError, NeorecError
from neorec.ops.quant_lookup import INT_KINDS, KINDS, quantize_rows
from neorec.serve import standalone
from neorec.serve.lowrank import DEFAULT_ITERS, OVERSAMPLE, als_factor, check_low_rank

__all__ = ["QUANTIZE", "export_model", "dense_program", "feature_transforms"]

QUANTIZE = KINDS
"""``--quantize`` choices and their bits (none: fp32)."""


def dense_program(model: Any, cfg: Config) -> tuple[nn.Module, int]:
    """A plain copy of the model's dense part (no dense blocks, eval mode) and its input width:
    the flat pooled features [B, F*D]; a towered model's program runs its tower modules on them
    first (``TowerServing``)."""
    from neorec.checkpoint.restore import dense_module
    from neorec.modules.dlrm import DenseArch, serving_state_dict
    from neorec.modules.towers import TowerDLRM

    part = dense_module(model)
    src: Any = getattr(part, "dense_arch", part)  # a towered model's part: towers + dense arch
    features, dim = int(src.num_features), int(src.emb_dim)
    plain = DenseArch(cfg.model, features, dim)
    plain.load_state_dict(serving_state_dict(src))  # no aux head / adapter
    if isinstance(model, TowerDLRM):
        return model.serving_program(plain).train(False), len(model.ebc.feature_names) * dim
    return plain.train(False), features * dim


def _export_dense(plain: nn.Module, num_dense: int, width: int, out: Path) -> dict[str, Any]:
    """``dense.pt2`` (torch.export, batch dimension dynamic), else ``dense.ts`` (TorchScript)."""
    example = (torch.zeros(2, num_dense), torch.zeros(2, width))
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(plain, example, dynamic_shapes=({0: batch}, {0: batch}))
    except Exception as e:  # noqa: BLE001 - an export failure falls back to TorchScript
        why = f"torch.export failed: {type(e).__name__}: {str(e).strip()[:200]}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is the fallback
            traced = torch.jit.trace(plain, example, check_trace=False)
        fmt, file = "torchscript", "dense.ts"
        buf = io.BytesIO()
        torch.jit.save(traced, buf)
    else:
        fmt, file, why = "torch.export", "dense.pt2", ""
        buf = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's notes on weight storage
            torch.export.save(program, buf)
    # Serialized in memory, written by Python: torch's zip writer on a full disk raises, then
    # aborts the process from its destructor.
    with _writing(out / file), open(out / file, "wb") as fh:
        fh.write(buf.getbuffer())
    return {
        "format": fmt,
        "file": file,
        **({"fallback": why} if why else {}),
        "inputs": [f"dense [B, {num_dense}] float32", f"pooled [B, {width}] float32"],
        "output": "logits [B] float32",
    }


class ExportWriteError(DataError):
    """A file of the export could not be written (a full disk, a read-only folder)."""


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Writing ``path``: an ``OSError`` becomes one ``ExportWriteError`` naming the file, the
    OS error and the space left."""
    try:
        yield
    except OSError as e:
        why = e.strerror or str(e)
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = -1
        if free >= 0 and e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            why += f"; {free:,} bytes free there"
        raise ExportWriteError(f"{path.name}: cannot write ({why})") from None


def _table_spec(w: Tensor, quantize: str, base: str, out: Path, name: str) -> dict[str, Any]:
    """The stored rows of ``w`` [rows, dim] as ``quantize`` (``neorec.ops.quant_lookup``): their
    file written, the spec's keys for it."""
    try:
        q = quantize_rows(w, quantize, name=name)
    except NeorecError as e:
        raise DataError(f"--quantize {quantize}: {e}") from None
    if quantize not in INT_KINDS:
        return {"files": {"weight": f"{base}.npy"}, "bytes": _save(out / f"{base}.npy", q.data)}
    return {
        "bits": QUANTIZE[quantize],
        "scale_unit": q.scale_unit,
        "offset_unit": q.offset_unit,
        "files": {"rows": f"{base}.rows.npy"},
        "bytes": _save(out / f"{base}.rows.npy", q.data),
    }


def _save(path: Path, a: np.ndarray) -> int:
    with _writing(path), open(path, "wb") as fh:
        np.save(fh, np.ascontiguousarray(a), allow_pickle=False)
    return path.stat().st_size


def _write_low_rank(w: Tensor, base: str, out: Path, low_rank: dict[str, int]) -> dict[str, Any]:
    """A table's spec entries for U and V (``--low-rank``), the files written."""
    lr = als_factor(
        w, low_rank["rank"], low_rank["iters"], low_rank["seed"], oversample=low_rank["oversample"]
    )
    files = {k: f"{base}.{k}.npy" for k in ("u", "v")}
    nbytes = sum(_save(out / files[k], a.numpy()) for k, a in (("u", lr.u), ("v", lr.v)))
    return {
        "quantization": "lowrank",
        "rank": low_rank["rank"],
        "relative_error": lr.relative_error,
        "files": files,
        "bytes": nbytes,
    }


def _write_tables(
    model: Any,
    quantize: str,
    out: Path,
    progress: Any = None,
    low_rank: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    from neorec.checkpoint.dynamic import dynamic_part

    (out / "tables").mkdir()
    specs = []
    dyn = dynamic_part(model.ebc)
    for i, t in enumerate(model.ebc.tables):
        base = f"tables/{i:03d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', t.name)}"  # a safe file name
        spec: dict[str, Any] = {"name": t.name, "rows": t.rows, "dim": t.dim}
        if t.kind == "dynamic":  # the live raw ids (ascending) -> their rows, + the default row
            st = dyn.export_table(t.name)
            w = st.rows
            if st.default_row is not None:
                w = torch.cat([w, st.default_row.reshape(1, -1)])
            spec.update(kind="dynamic", rows=int(w.shape[0]), unadmitted=t.unadmitted)
            spec["ids_file"] = f"{base}.ids.npy"
            spec["bytes_ids"] = _save(out / f"{base}.ids.npy", st.ids.numpy())
        else:
            w = model.ebc.table_weight(t.name).detach().float().cpu()
        spec["quantization"] = quantize
        if low_rank is not None and int(w.shape[1]) > low_rank["rank"]:
            spec.update(_write_low_rank(w, base, out, low_rank))
        else:
            spec.update(_table_spec(w, quantize, base, out, t.name))
        specs.append(spec)
        if progress is not None:
            progress(int(t.rows))  # the table's rows are written
    return specs


def _table_files(tables: list[dict[str, Any]]) -> list[str]:
    """Every file the tables' specs name."""
    out = []
    for t in tables:
        out += list(t["files"].values())
        if "ids_file" in t:
            out.append(t["ids_file"])
    return out


def _file_table(root: Path, rels: list[str]) -> dict[str, dict[str, Any]]:
    """``{file: {bytes, crc32}}`` of the artifact's files (the CRC is ``checkpoint.format``'s,
    computed in chunks by the loader's own ``file_crc32``)."""
    return {
        rel: {"bytes": (root / rel).stat().st_size, "crc32": standalone.file_crc32(str(root / rel))}
        for rel in rels
    }


def feature_transforms(cfg: Config) -> dict[str, Any]:
    """What turns a raw Criteo row into the model's inputs, as the training data read it
    (``neorec.data.criteo`` for TSV, the preprocessed directory's options otherwise); for other
    data, or a mapping the loader cannot repeat, ``{"kind": None, "why": ...}``."""
    from neorec.data.criteo import EMPTY_CATEGORY_ROW, MAX_HEX_DIGITS, NUM_DENSE, NUM_SPARSE
    from neorec.data.loader import is_preprocessed
    from neorec.data.loader import read_manifest as read_data_manifest

    d, tables = cfg.data, cfg.embedding.tables
    if d.source != "criteo":
        return {"kind": None, "why": f"trained on {d.source} data: its inputs are ids already"}
    raw = [t.kind == "dynamic" for t in tables]
    hashed, multi_hot, seed = d.hash_categories, [1] * NUM_SPARSE, 0
    source = "Criteo TSV"
    if d.path and is_preprocessed(d.path):
        opts = read_data_manifest(d.path).get("options", {})
        if opts.get("mode", "hash") != "hash":
            return {
                "kind": None,
                "why": f"trained on {d.path}, preprocessed in {opts.get('mode')} mode: its "
                "vocabulary is not in the artifact",
            }
        hashed, source = True, f"preprocessed ({d.path}, hash mode)"
        multi_hot, seed = list(opts.get("multi_hot", multi_hot)), int(opts.get("multi_hot_seed", 0))
        multi_hot = multi_hot * NUM_SPARSE if len(multi_hot) == 1 else multi_hot
    elif d.path and not Path(d.path).exists():
        return {
            "kind": None,
            "why": f"data.path {d.path!r} is not found from here: cannot tell whether (and how) "
            "it was preprocessed; export from where the model was trained",
        }
    categorical = []
    for j, t in enumerate(tables):
        if raw[j]:
            how = "raw"  # the hex value is the dynamic table's id
        elif hashed:
            how = "modulo"
        else:
            how = "index"  # the hex value must be < rows
        categorical.append(
            {"field": f"C{j + 1}", "feature": t.features[0], "map": how, "rows": int(t.rows)}
            | ({"multi_hot": multi_hot[j]} if multi_hot[j] > 1 else {})
        )
    return {
        "kind": "criteo",
        "source": source,
        "fields": "[label] I1..I13 C1..C26 (tab-separated text, or a sequence of fields)",
        "dense": {
            "fields": NUM_DENSE,
            "function": "log1p(max(x, 0))",
            "parse": "decimal integer (64-bit); empty = 0",
        },
        "categorical": categorical,
        "category_parse": f"hex (<= {MAX_HEX_DIGITS} digits); empty = {EMPTY_CATEGORY_ROW}",
        "hash": "int(hex, 16) % rows (no seed)",
        "multi_hot": {"hash": "splitmix64", "seed": seed},
    }


def _target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out}: exists and is not an empty directory; export into a new directory")
    if not out.parent.is_dir():
        raise DataError(f"{out.parent}: no such directory (for --out {out}); create it first")


def _low_rank_options(quantize: str, rank: int | None, iters: int) -> dict[str, int] | None:
    """``--low-rank`` / ``--low-rank-iters`` checked (one line each) before any work."""
    if rank is None:
        return None
    check_low_rank(rank, "--low-rank")
    check_low_rank(iters, "--low-rank-iters")
    if quantize != "none":
        raise ConfigError(
            f"--low-rank {rank} with --quantize {quantize}: low-rank factors are stored in fp32; "
            "choose one of the two"
        )
    return {"rank": rank, "iters": iters, "seed": 0, "oversample": OVERSAMPLE}


def export_model(
    model_path: str | Path,
    out_dir: str | Path,
    quantize: str = "none",
    progress: Any = None,
    low_rank: int | None = None,
    low_rank_iters: int = DEFAULT_ITERS,
) -> Path:
    """Write the serving artifact of a saved model (run folder or model dir) into ``out_dir``
    (new or empty; written under a temporary name, then renamed); ``progress(rows)`` after each
    table is written; ``low_rank``: tables of dim > R stored as U @ V (``neorec.serve.lowrank``).
    Returns ``out_dir``."""
    from neorec.serve.model import find_model_dir, load_model, read_model_info

    if quantize not in QUANTIZE:
        raise ConfigError(f"--quantize must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
    lowrank = _low_rank_options(quantize, low_rank, low_rank_iters)
    out = Path(out_dir)
    _target(out)
    src = find_model_dir(model_path)
    model, cfg = load_model(src, dense_blocks=False)
    step = int(read_model_info(src)["step"])
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with _writing(tmp):
            tmp.mkdir()
        plain, width = dense_program(model, cfg)
        dense = _export_dense(plain, cfg.model.num_dense, width, tmp)
        tables = _write_tables(model, quantize, tmp, progress, lowrank)
        ebc = model.ebc
        manifest = {
            "format": standalone.FORMAT,
            "format_version": standalone.FORMAT_VERSION,
            "num_dense": cfg.model.num_dense,
            "dim": int(ebc.tables[0].dim),
            "pooling": cfg.embedding.pooling,
            "features": [{"name": f, "table": t.name} for t in ebc.tables for f in t.features],
            "tables": tables,
            "quantization": quantize,
            **({"low_rank": lowrank} if lowrank else {}),
            "dense": dense,
            "transforms": feature_transforms(cfg),
            "output": "probabilities = sigmoid(logits); serving.load(DIR) returns them",
            "source": {"model": str(src.resolve()), "step": step},
            "config": cfg.to_dict(),  # how its data is read (neorec predict --model DIR)
            "torch": torch.__version__,
        }
        with _writing(tmp / "serving.py"), open(tmp / "serving.py", "wb") as fh:
            fh.write(Path(standalone.__file__).read_bytes())
        files = [dense["file"], *_table_files(tables), "serving.py"]
        manifest["files"] = _file_table(tmp, files)  # serving.py too: a damaged loader is named
        with _writing(tmp / "manifest.json"), open(tmp / "manifest.json", "wb") as fh:
            fh.write(seal_manifest(manifest))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except ExportWriteError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportWriteError(
            f"{out}: {e}; nothing was exported (the partial files are removed)"
        ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
