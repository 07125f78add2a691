"""Training and evaluating a sequential recommender (SASRec) on leave-one-out sequences.

A small loop of its own (Adam on every parameter, the item table included): one example per user
(:func:`neorec.data.seq_batches.train_arrays`), users shuffled each epoch, the loss over the item
table chosen by ``loss``: ``full`` (softmax over all V items) or ``sampled`` (``negatives`` items
drawn per batch from the train targets' popularity, logQ-corrected). Evaluation ranks every
evaluable user's target against the full corpus (:mod:`neorec.metrics_rank`). It receives plain
settings (:class:`SeqSettings`); ``run_sequential`` is ``neorec train``'s sequential path (a run
folder with ``config.toml``, ``metrics.json`` and the saved model, :mod:`neorec.serve.sequential`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.builder.sequential import LOSSES, SeqSettings, make_model, seq_settings
from neorec.config import Config, ConfigError
from neorec.data.seq_batches import item_counts, train_arrays
from neorec.data.sequential import SeqData
from neorec.modules.sasrec import SASRec, full_softmax_loss, sampled_softmax_loss
from neorec.serve.sequential import evaluate, metrics_line, ranks_of, save_model

__all__ = ["SeqSettings", "fit", "ranks_of", "run_sequential"]


def _log_q(data: SeqData) -> torch.Tensor:
    """log of the sampling distribution over item indices (popularity + 1; index 0 never)."""
    c = item_counts(data).astype(np.float64) + 1.0
    c[0] = 0.0
    q = c / c.sum()
    with np.errstate(divide="ignore"):
        return torch.from_numpy(np.log(q)).float()


def _step_loss(model: SASRec, st: SeqSettings, x: torch.Tensor, y: torch.Tensor,
               log_q: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # fmt: skip
    h = model(x)  # [B, L, D]
    keep = y > 0
    h, t = h[keep], y[keep]  # [N, D], [N]
    table = model.items.weight
    if st.loss == "full":
        return full_softmax_loss(h, t, table)
    neg = torch.multinomial(log_q.exp(), st.negatives, replacement=True, generator=gen)
    return sampled_softmax_loss(h, t, table, neg, log_q)


def fit(
    data: SeqData,
    st: SeqSettings,
    seed: int,
    on_epoch: Callable[[int, SASRec], None] | None = None,
) -> SASRec:
    """Train SASRec on ``data``'s train part for ``st.epochs``; ``on_epoch(epoch, model)`` after
    each (1-based; the model in train mode again after it returns)."""
    if st.loss not in LOSSES:
        raise ValueError(f"loss {st.loss!r}: want one of {', '.join(LOSSES)}")
    model = make_model(data.num_items, st, seed)
    opt = torch.optim.Adam(model.parameters(), lr=st.lr, betas=(0.9, 0.98))
    inputs, targets = (torch.from_numpy(a) for a in train_arrays(data, st.max_len))
    gen = torch.Generator().manual_seed(seed)
    log_q = _log_q(data)
    for epoch in range(1, st.epochs + 1):
        model.train()
        perm = torch.randperm(len(inputs), generator=gen)
        for i in range(0, len(perm), st.batch_size):
            idx = perm[i : i + st.batch_size]
            loss = _step_loss(model, st, inputs[idx], targets[idx], log_q, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if on_epoch is not None:
            on_epoch(epoch, model)
    return model


def run_sequential(cfg: Config, run_dir: Path, out: Any) -> dict[str, Any]:
    """Train ``cfg``'s sequential model, evaluate it (valid, test), save it and ``metrics.json``
    into ``run_dir``; the metrics."""
    from neorec.data.sequential import load_sequential
    from neorec.train.runs import dump_toml

    sc = cfg.sequential
    if not sc.enabled:
        raise ConfigError("sequential.enabled is false: this config trains a DLRM")
    data = load_sequential(sc.path)
    st = seq_settings(sc)

    def say(epoch: int, model: SASRec) -> None:
        print(f"epoch {epoch}/{st.epochs}", file=out, flush=True)

    model = fit(data, st, cfg.train.seed, say)
    res = evaluate(model, data, sc.exclude_seen)
    save_model(run_dir, model, sc)
    (run_dir / "config.toml").write_text(dump_toml(cfg.to_dict(), "neorec train: the run's config"))
    (run_dir / "metrics.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    for split in ("valid", "test"):
        print(
            metrics_line(split, res[split], data.num_items, sc.exclude_seen), file=out, flush=True
        )
    return res
