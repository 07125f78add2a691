"""TensorBoard scalars of a run: ``<run folder>/tb/``, written by rank 0 beside events.jsonl.

Optional: ``torch.utils.tensorboard`` needs the ``tensorboard`` package (``pip install
'neorec[tb]'``). ``train.tensorboard``: ``auto`` writes when it is installed and is silent when it
is not, ``on`` refuses to start without it (one ``ConfigError``), ``off`` never writes.

Tags (each line of events.jsonl becomes the scalars it carries, at its step):
``train/loss``, ``train/samples_per_s``, ``train/lr`` (dense), ``train/embedding_lr``;
``comm/bytes_per_step``, ``comm/wait_ms_per_step`` (distributed runs); ``cache/hit_rate`` (a row
cache); ``eval/auc``, ``eval/ne``, ``eval/logloss``, ``eval/calibration`` (periodic evals, on
``train.eval_batches`` batches); ``final/...`` the same four for the final eval over the whole split;
``eval/teacher_ne``, ``eval/teacher_auc``, ``eval/teacher_logloss``: the synthetic teacher's (the
best achievable), written at the end of the run at every step an eval was written, so that the
"Custom Scalars" tab draws the model's NE, AUC and log loss with the teacher's as a reference line.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

from neorec.errors import ConfigError
from neorec.train.runs import RunFolderError

__all__ = ["TB_DIR", "TAGS", "tensorboard_wanted", "TBWriter"]

TB_DIR = "tb"
"""The folder of the event files inside the run folder."""

TAGS: dict[str, str] = {
    "loss": "train/loss",
    "samples_per_s": "train/samples_per_s",
    "lr": "train/lr",
    "embedding_lr": "train/embedding_lr",
    "comm_bytes_per_step": "comm/bytes_per_step",
    "comm_wait_ms_per_step": "comm/wait_ms_per_step",
    "cache_hit_rate": "cache/hit_rate",
    "eval_auc": "eval/auc",
    "eval_ne": "eval/ne",
    "eval_logloss": "eval/logloss",
    "eval_calibration": "eval/calibration",
}
"""events.jsonl key -> TensorBoard tag (the final eval's ``eval/`` tags become ``final/``)."""

_TEACHER = ("ne", "auc", "logloss")
_MISSING = "train.tensorboard = on needs tensorboard: pip install 'neorec[tb]'"


def _summary_writer() -> Any:
    """torch's SummaryWriter class, or None when tensorboard is not installed."""
    try:
        return importlib.import_module("torch.utils.tensorboard").SummaryWriter
    except ImportError:
        return None


def tensorboard_wanted(mode: str) -> bool:
    """Whether a run with ``train.tensorboard = mode`` writes TensorBoard scalars.

    ``on`` without tensorboard installed is a ``ConfigError`` (checked before training starts);
    ``auto`` without it is False, silently."""
    if mode == "off":
        return False
    if _summary_writer() is not None:
        return True
    if mode == "on":
        raise ConfigError(_MISSING)
    return False


class TBWriter:
    """Rank 0's TensorBoard writer: the scalars of each events.jsonl record, the teacher's."""

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        """Write into ``folder/tb``; ``purge_step``: a resumed run's first step (TensorBoard
        drops the interrupted session's scalars from that step on, as events.jsonl does)."""
        cls = _summary_writer()
        if cls is None:  # checked by tensorboard_wanted before; gone since = not installed
            raise ConfigError(_MISSING)
        self.path = folder / TB_DIR
        try:
            self.writer: Any = cls(log_dir=str(self.path), purge_step=purge_step, flush_secs=10)
        except OSError as e:
            raise RunFolderError(
                f"{self.path}: cannot write TensorBoard events there: {e.strerror or e}; "
                f"set train.tensorboard = off to train without them"
            ) from None
        self.eval_steps: list[int] = []
        self.writer.add_custom_scalars(
            {
                "neorec": {
                    f"eval {name} vs teacher": [
                        "Multiline",
                        [f"eval/{name}", f"eval/teacher_{name}"],
                    ]
                    for name in _TEACHER
                }
            }
        )

    def event(self, rec: dict[str, Any]) -> None:
        """The scalars of one events.jsonl record (its numbers; None and non-finite skipped)."""
        step = int(rec["step"])
        final = bool(rec.get("final"))
        for key, tag in TAGS.items():
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            if final and tag.startswith("eval/"):
                tag = "final/" + tag[len("eval/") :]
            self.writer.add_scalar(tag, float(v), step)
        if "eval_ne" in rec and step not in self.eval_steps:
            self.eval_steps.append(step)

    def reference(self, teacher: dict[str, float] | None) -> None:
        """The teacher's NE / AUC / log loss (when known) at every step an eval was written."""
        if not teacher:
            return
        for name in _TEACHER:
            v = teacher.get(name)
            if v is None:
                continue
            for step in self.eval_steps:
                self.writer.add_scalar(f"eval/teacher_{name}", float(v), step)

    def close(self) -> None:
        """Flush and close the event file (also after an error: what was written stays)."""
        self.writer.flush()
        self.writer.close()
