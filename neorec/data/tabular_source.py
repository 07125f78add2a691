"""Training on Parquet / CSV / TSV files directly (no preprocessing): global batches in file
order, streamed block by block.

The train files are ``data.path``'s, the eval files ``data.eval_path``'s, or else the last file
of ``data.path`` when it has several (the Criteo rule); what the schema asks to learn
(``standardize`` statistics, vocabularies) comes from one pass over the train files before
training. Batches are global (the trainer gives each rank its slice); a last batch that does not
split over the ranks is dropped, and said so. A resumed run skips the batches it had read:
the order is the files' order, so the position is exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from neorec.config import ConfigError, DataConfig, TableConfig
from neorec.data.bad_rows import BadRowPolicy, BadRows
from neorec.data.batch import Batch
from neorec.data.encode import (
    Encoded,
    concat_encoded,
    encode,
    jagged_batch,
    sample_offsets,
    slice_encoded,
)
from neorec.data.tabular import count_rows, read_blocks, tabular_files
from neorec.data.tabular_pre import fit

__all__ = ["TabularSource"]


class TabularSource:
    """Global batches of tabular files, as ``data.schema`` declares them."""

    def __init__(self, d: DataConfig, tables: Sequence[TableConfig], out: Any = None) -> None:
        import torch.distributed as dist

        self.schema, self.tables, self.bs = d.schema, list(tables), d.batch_size
        files = tabular_files(d.path)
        if d.eval_path:
            self.train_files, self.eval_files = files, tabular_files(d.eval_path)
        elif len(files) > 1:
            self.train_files, self.eval_files = files[:-1], files[-1:]
        else:
            raise ConfigError(
                f"data.path has one file ({files[0]}) and no held-out split: set data.eval_path, "
                "or preprocess it (`neorec data preprocess --config C --input FILE --output DIR` "
                "holds out its last 1/7) and set data.path to DIR"
            )
        self.policy = BadRowPolicy(d.bad_rows, d.max_bad_fraction)
        for p in (self.train_files[0], self.eval_files[0]):
            bad = BadRows(self.policy) if self.policy.skip else None
            next(read_blocks(p, self.schema, 1, bad), None)  # the columns and their types, cheaply
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Skipping: a pass counts the good rows and records the bad ones (the same every pass).
        self.bad_rows = BadRows(self.policy) if self.policy.skip else None
        self.counts = {
            s: sum(count_rows(p, self.schema, self.bad_rows) for p in fs)
            for s, fs in (("train", self.train_files), ("eval", self.eval_files))
        }
        for split, n in self.counts.items():
            if n < self.bs:
                raise ConfigError(
                    f"the {split} files hold {n} samples, less than one batch (data.batch_size "
                    f"{self.bs}); lower the batch size or use more data"
                )
        self.fitted = fit(self.train_files, self.schema, self.tables, None, self.policy)
        self.keys = [f.name for f in self.schema.sparse]

    @classmethod
    def reading(
        cls, files: Sequence[Path], d: DataConfig, tables: Sequence[TableConfig], fitted: Any
    ) -> TabularSource:
        """A source whose eval split is every row of ``files``, encoded with ``fitted`` (a
        trained model's statistics and vocabularies: ``neorec eval | predict --data``)."""
        self = cls.__new__(cls)
        self.schema, self.tables, self.bs = d.schema, list(tables), d.batch_size
        self.train_files, self.eval_files, self.world = [], list(files), 1
        self.policy = BadRowPolicy(d.bad_rows, d.max_bad_fraction)  # the run's, on these files
        bad = BadRows(self.policy) if self.policy.skip else None
        next(read_blocks(self.eval_files[0], self.schema, 1, bad), None)  # columns and types
        self.bad_rows = BadRows(self.policy) if self.policy.skip else None
        self.counts = {
            "train": 0,
            "eval": sum(count_rows(p, self.schema, self.bad_rows) for p in files),
        }
        self.fitted, self.keys = fitted, [f.name for f in self.schema.sparse]
        return self

    def _batches(self, files: Sequence[Path], start: int) -> Iterator[Batch]:
        pending: list[Encoded] = []
        have, index = 0, 0
        for p in files:
            bad = BadRows(self.policy) if self.policy.skip else None  # (recorded above)
            for block in read_blocks(p, self.schema, bad=bad):
                pending.append(encode(block, self.schema, self.tables, self.fitted))
                have += block.n
                if have < self.bs:
                    continue
                e = concat_encoded(pending)
                off = sample_offsets(e)  # once per block, not once per batch
                cut = 0
                while have - cut >= self.bs:
                    if index >= start:
                        yield self._batch(slice_encoded(e, cut, cut + self.bs, off))
                    index += 1
                    cut += self.bs
                pending, have = [slice_encoded(e, cut, have, off)], have - cut
        if have and have % self.world == 0 and index >= start:
            yield self._batch(concat_encoded(pending))

    def _batch(self, e: Encoded) -> Batch:
        return jagged_batch(self.keys, e.labels, e.dense, e.lengths, e.values, e.weights)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """The train files' batches in order, from batch ``start``."""
        return self._batches(self.train_files, start)

    def eval_batches(self) -> Iterator[Batch]:
        """The eval files' batches."""
        return self._batches(self.eval_files, 0)

    def num_train_batches(self) -> int | None:
        """Global batches per epoch (a last one that does not split over the ranks dropped)."""
        n = self.counts["train"]
        last = n % self.bs
        return n // self.bs + (1 if last and last % self.world == 0 else 0)

    def reference_metrics(self) -> dict[str, float] | None:
        """Not known for real data."""
        return None
