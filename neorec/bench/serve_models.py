"""``neorec bench serve``'s models: trained, exported, their eval rows as requests, and the
latency of the model alone against the batch size (Park et al. 2018's characterization).

A model is trained by ``neorec train --config C`` in a subprocess (or given as ``--model RUN``),
exported by ``neorec export`` once per table format (``--quantize none | int8 | int4 ...``), and
its eval split's first rows become the requests (``{"dense": [...], "sparse": {feature: [ids]}}``).

``characterize`` times the standalone ``Predictor`` (no HTTP, no queue) on the same rows for each
batch size, splitting a call into

- ``embedding``: every feature's bags through the loader's own pooling (``Predictor._pool``: its
  ids checked, rows gathered, or decoded for quantized tables, and pooled, by the fused kernel
  when the loader uses one),
- ``dense``: the ``torch.export`` program (bottom MLP, interaction, top MLP),
- ``overhead``: the rest of ``Predictor.logits`` (the dense input converted and checked for
  shape and finiteness, the features checked and concatenated, the inference mode entered): the median whole call minus the
  medians of the two parts (a difference of medians: within noise of zero it can be negative).

Each is the median over ``repeats`` interleaved calls, under ``torch.inference_mode`` with the
intra-op threads given.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.errors import NeorecError

__all__ = [
    "resolve_config",
    "train_model",
    "export",
    "eval_inputs",
    "request_rows",
    "characterize",
]


def resolve_config(name: str) -> Path:
    """A config file: a path, or a name of the repository's ``configs/`` (``dlrm_benchmark``)."""
    p = Path(name)
    if p.is_file():
        return p
    repo = Path(__file__).resolve().parents[2] / "configs" / f"{name.removesuffix('.toml')}.toml"
    if repo.is_file():
        return repo
    raise NeorecError(f"bench serve: --configs {name}: no such file, and no {repo}")


def train_model(config: Path, run_dir: Path, sets: list[str], log: Path) -> Path:
    """Train ``config`` into ``run_dir`` in a fresh process (its output in ``log``)."""
    argv = [sys.executable, "-m", "neorec", "train", "--config", str(config)]
    for s in (
        f"train.run_dir={run_dir}",
        "train.progress=false",
        "train.tensorboard=off",
        *sets,
    ):
        argv += ["--set", s]
    with open(log, "ab") as fh:
        rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        raise NeorecError(f"bench serve: training {config} failed (exit {rc}): {tail}")
    return run_dir


def export(run_dir: Path, out: Path, quantize: str) -> Path:
    """The serving artifact of ``run_dir`` with tables ``quantize`` (``neorec export``)."""
    from neorec.serve.export import export_model

    if out.exists():  # an earlier export of this run (a kept --workdir)
        return out
    return export_model(run_dir, out, quantize)


def eval_inputs(
    run_dir: Path, n: int
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The first ``n`` rows of the model's eval split: dense [n, num_dense] float32 and, per
    feature, (lengths [n], ids) int64 — what ``Predictor`` takes."""
    from neorec.serve.evaluate import eval_data
    from neorec.serve.model import MODEL_FILE, config_from_dict, find_model_dir, read_model_info

    src = find_model_dir(run_dir)
    cfg = config_from_dict(read_model_info(src)["config"], str(src / MODEL_FILE))
    dense, sparse, got = [], dict[str, tuple[list[Any], list[Any]]](), 0
    for b in eval_data(cfg).batches():
        if b.sparse.weights is not None:
            raise NeorecError(
                "bench serve: the model's data carries per-id weights, which a /predict request "
                '({"dense": [...], "sparse": {feature: [ids]}}) does not; use a model without them'
            )
        dense.append(b.dense.numpy())
        for f in b.sparse.keys:
            values, lengths, _ = b.sparse.feature(f)
            ls, vs = sparse.setdefault(f, ([], []))
            ls.append(lengths.numpy())
            vs.append(values.numpy())
        got += b.dense.shape[0]
        if got >= n:
            break
    if got < n:
        raise NeorecError(f"bench serve: the model's eval split has {got} rows, fewer than {n}")
    d = np.concatenate(dense)[:n].astype(np.float32)
    out = {}
    for f, (ls, vs) in sparse.items():
        lens = np.concatenate(ls).astype(np.int64)[:n]
        out[f] = (lens, np.concatenate(vs).astype(np.int64)[: int(lens.sum())])
    return d, out


def request_rows(
    dense: np.ndarray, sparse: dict[str, tuple[np.ndarray, np.ndarray]]
) -> list[dict[str, Any]]:
    """Each row as a ``/predict`` row: ``{"dense": [...], "sparse": {feature: [ids]}}``."""
    starts = {f: np.concatenate([[0], np.cumsum(ln)]) for f, (ln, _) in sparse.items()}
    rows = []
    for i in range(dense.shape[0]):
        bags = {f: ids[starts[f][i] : starts[f][i + 1]].tolist() for f, (_, ids) in sparse.items()}
        rows.append({"dense": [float(x) for x in dense[i]], "sparse": bags})
    return rows


def _first(
    dense: np.ndarray, sparse: dict[str, tuple[np.ndarray, np.ndarray]], b: int
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The first ``b`` rows (cycled when there are fewer)."""
    n = dense.shape[0]
    idx = np.arange(b) % n
    out = {}
    for f, (ln, ids) in sparse.items():
        starts = np.concatenate([[0], np.cumsum(ln)])
        bags = [ids[starts[i] : starts[i + 1]] for i in idx]
        out[f] = (ln[idx].copy(), np.concatenate(bags).astype(np.int64))
    return dense[idx].copy(), out


def _lookup(pred: Any, sparse: dict[str, tuple[np.ndarray, np.ndarray]], b: int) -> torch.Tensor:
    """The pooled features [b, F*D] as ``Predictor.logits`` makes them: each feature through the
    loader's own ``_pool`` (its ids checked, rows gathered or decoded, pooled; the fused kernel
    when the loader uses one)."""
    return torch.cat([pred._pool(f, sparse[f], b) for f in pred.features], dim=1)


def _ms(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _one_batch(pred: Any, d: np.ndarray, s: dict[str, Any], b: int, repeats: int) -> dict[str, Any]:
    """The medians of one batch size (see ``characterize``)."""
    x = torch.from_numpy(d)
    pooled = _lookup(pred, s, b)
    pred.logits(d, s)  # warm-up
    total, emb, dns = [], [], []
    for _ in range(repeats):
        total.append(_ms(lambda: pred.logits(d, s)))
        emb.append(_ms(lambda: _lookup(pred, s, b)))
        dns.append(_ms(lambda: pred.program(x, pooled)))
    t, e, g = (statistics.median(v) for v in (total, emb, dns))
    return {
        "batch": b,
        "total_ms": round(t, 4),
        "embedding_ms": round(e, 4),
        "dense_ms": round(g, 4),
        "overhead_ms": round(t - e - g, 4),
        "us_per_row": round(t * 1e3 / b, 3),
    }


def characterize(
    artifact: Path,
    dense: np.ndarray,
    sparse: dict[str, tuple[np.ndarray, np.ndarray]],
    batches: list[int],
    repeats: int,
) -> list[dict[str, Any]]:
    """Per batch size: the median ms of the whole ``Predictor.logits`` call, of its embedding
    lookups and of its dense program, the overhead between them, and µs per row."""
    from neorec.serve.standalone import load

    pred = load(str(artifact), verify=False)
    with torch.inference_mode():
        return [_one_batch(pred, *_first(dense, sparse, b), b, repeats) for b in batches]
