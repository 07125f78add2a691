"""Data sources a run reads: the synthetic generator, its drifting stream (windows, with FM
logits attached by DAS), Criteo TSV files, preprocessed shards (``make_source`` picks one from the
data section, the tables and the dense width)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from neorec.config import ConfigError, DataConfig, TableConfig
from neorec.data.batch import Batch

__all__ = ["DataSource", "SyntheticSource", "StreamSource", "CriteoSource", "make_source"]


class DataSource(Protocol):
    """Global batches for training and eval."""

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Train batches (one epoch), starting at batch ``start``."""
        ...

    def eval_batches(self) -> Iterator[Batch]:
        """The held-out split."""
        ...

    def num_train_batches(self) -> int | None:
        """Batches in one epoch, if known."""
        ...

    def reference_metrics(self) -> dict[str, float] | None:
        """Best achievable eval metrics (synthetic teacher), if known."""
        ...


class SyntheticSource:
    """Synthetic click data with a hidden teacher."""

    def __init__(self, d: DataConfig, tables: Sequence[TableConfig], num_dense: int) -> None:
        from neorec.data.synthetic import SyntheticClickData

        self.bs = d.batch_size
        self.data = SyntheticClickData(d, list(tables), num_dense)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Train split, from batch ``start``."""
        for i in range(start, self.data.num_batches("train", self.bs)):
            yield self.data.batch("train", i, self.bs)

    def eval_batches(self) -> Iterator[Batch]:
        """Eval split."""
        return self.data.batches("eval", self.bs)

    def num_train_batches(self) -> int | None:
        """Batches per epoch."""
        return int(self.data.num_batches("train", self.bs))

    def reference_metrics(self) -> dict[str, float] | None:
        """The teacher's metrics on the eval split."""
        return dict(self.data.teacher_metrics("eval", self.bs))


class StreamSource(SyntheticSource):
    """Window ``data.window`` of the drifting synthetic stream; with ``data.fm_logits`` every
    batch carries the FM logits of its samples (``Batch.fm_logits``) from the FM of window
    ``data.window - data.fm_staleness`` (train: required; eval: when its side file exists)."""

    def __init__(self, d: DataConfig, tables: Sequence[TableConfig], num_dense: int) -> None:
        import numpy as np

        from neorec.data.stream import DriftingClickData, read_fm_logits

        for key in ("window_samples", "eval_samples"):
            n = getattr(d, key)
            if n < d.batch_size:
                raise ConfigError(
                    f"data.{key} {n:,} is less than one batch (data.batch_size "
                    f"{d.batch_size:,}): the split would have no batch; raise data.{key} or "
                    "lower data.batch_size"
                )
        self.bs = d.batch_size
        self.window = d.window
        self.fm: dict[str, np.ndarray] = {}
        if d.fm_logits:  # checked before the generator (and the model) are built
            for split, required in (("train", True), ("eval", False)):
                arr = read_fm_logits(d, tables, num_dense, split, required)
                if arr is not None:
                    self.fm[split] = arr
        self.data = DriftingClickData(d, list(tables), num_dense)

    def _batch(self, split: str, i: int) -> Batch:
        import torch

        b = self.data.batch(split, i, self.bs)
        arr = self.fm.get(split)
        if arr is None:
            return b
        fm = torch.from_numpy(arr[i * self.bs : (i + 1) * self.bs].copy())
        return Batch(b.dense, b.sparse, b.labels, fm)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """This window's train split, from batch ``start``."""
        for i in range(start, self.data.num_batches("train", self.bs)):
            yield self._batch("train", i)

    def eval_batches(self) -> Iterator[Batch]:
        """This window's eval split."""
        for i in range(self.data.num_batches("eval", self.bs)):
            yield self._batch("eval", i)


class CriteoSource:
    """Criteo Kaggle/Terabyte TSV files."""

    def __init__(self, d: DataConfig, tables: Sequence[TableConfig]) -> None:
        from neorec.data.criteo import CriteoTSVDataset, criteo_files

        if not d.path:
            raise ConfigError("data.source = 'criteo' needs data.path (a TSV file or directory)")
        files = [str(p) for p in criteo_files(d.path)]
        if d.eval_path:
            train_files, eval_files = files, [str(p) for p in criteo_files(d.eval_path)]
        elif len(files) > 1:
            train_files, eval_files = files[:-1], files[-1:]
        else:
            raise ConfigError(
                f"data.path has one file ({files[0]}) and no held-out split: set data.eval_path, "
                "or preprocess it (`neorec data preprocess --input FILE --output DIR` holds out "
                "its last 1/7) and set data.path to DIR"
            )

        def make(paths: list[str]) -> Any:
            return CriteoTSVDataset(
                paths,
                list(tables),
                d.batch_size,
                bad_lines=d.bad_lines,
                hash_categories=d.hash_categories,
            )

        self.train_set, self.eval_set = make(train_files), make(eval_files)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """Train files in order, skipping ``start`` batches."""
        for i, b in enumerate(self.train_set):
            if i >= start:
                yield b
        report_skipped("train", self.train_set)

    def eval_batches(self) -> Iterator[Batch]:
        """Eval files."""
        yield from self.eval_set
        report_skipped("eval", self.eval_set)

    def num_train_batches(self) -> int | None:
        """Unknown without a pass over the files."""
        return None

    def reference_metrics(self) -> dict[str, float] | None:
        """Not known for real data."""
        return None


def report_skipped(split: str, data: Any) -> None:
    """One line after a pass that skipped bad lines (data.bad_lines = "skip"): how many, and the
    first one (rank 0 only)."""
    import torch.distributed as dist

    st = data.stats
    if st.bad_lines and (not dist.is_initialized() or dist.get_rank() == 0):
        print(
            f"data: skipped {st.bad_lines:,} bad lines of {st.lines:,} in the {split} files "
            f"(first: {st.examples[0]})",
            flush=True,
        )


def make_source(d: DataConfig, tables: Sequence[TableConfig], num_dense: int) -> DataSource:
    """The data source ``d`` names, for ``tables`` and ``num_dense`` dense features. Cheap checks
    only (paths, manifests, splits, table sizes), so that bad data is refused before the tables
    are built."""
    if d.fm_logits and d.source != "stream":
        raise ConfigError(
            f"data.fm_logits is set but data.source is '{d.source}': FM logits (DAS) are "
            'attached to the stream only; set data.source = "stream" or data.fm_logits = ""'
        )
    if d.source == "synthetic":
        return SyntheticSource(d, tables, num_dense)
    if d.source == "stream":
        return StreamSource(d, tables, num_dense)
    from pathlib import Path

    from neorec.data.loader import MANIFEST, PreprocessedSource, is_preprocessed
    from neorec.errors import DataError

    if not d.path:
        raise ConfigError(
            f"data.source = '{d.source}' needs data.path (a TSV file, a directory of them, or a "
            "directory from `neorec data preprocess`); set it with --set data.path=..."
        )
    for key, path in (("data.path", d.path), ("data.eval_path", d.eval_path)):
        if path and not Path(path).exists():
            raise DataError(f"{path}: no such file or directory ({key}); check the path")
    if is_preprocessed(d.path):  # written by `neorec data preprocess`
        from neorec.data.loader import read_manifest

        jagged = read_manifest(d.path).get("layout") == "jagged"
        if jagged != (d.source == "tabular"):
            what = "tabular (Parquet / CSV)" if jagged else "Criteo"
            raise ConfigError(
                f"{d.path} was preprocessed from {what} data but data.source is '{d.source}'; "
                f"set data.source = '{'tabular' if jagged else 'criteo'}'"
            )
        return PreprocessedSource(d, tables, num_dense=num_dense)
    if d.source == "tabular":
        from neorec.data.tabular_source import TabularSource

        return TabularSource(d, tables)
    if (Path(d.path) / "shards").is_dir():
        raise DataError(
            f"{d.path}: a preprocessed directory without {MANIFEST} (preprocessing did not "
            "finish); run `neorec data preprocess` into it again"
        )
    return CriteoSource(d, tables)
