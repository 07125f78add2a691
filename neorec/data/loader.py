"""Per-rank reading of preprocessed Criteo shards: shuffled, prefetched, resumable.

The sample order of an epoch is a pure function of (seed, epoch) and the dataset, never of the
number of ranks or workers::

    shard order   = permutation(seed, epoch) of the shards       (shuffle = True)
    stream        = the shards' samples concatenated in that order
    window w      = stream[w*S : (w+1)*S], S = shuffle_buffer
    position p    = window p // S, permuted by permutation(seed, epoch, w)

Global batch i is positions ``[i*B, (i+1)*B)``; rank r of W reads only
``[i*B + r*g//W, i*B + (r+1)*g//W)`` of it (g = the batch's size; the last batch may be
smaller). Shards are memory-mapped ``.npy`` files, so reading a rank's part is a gather of its
own rows. Because the order does not depend on W, the position (epoch, next global batch) resumes
exactly on any number of ranks: nothing is seen twice or skipped.

Worker processes (a ``torch.utils.data.DataLoader`` over batch indices) build batches ahead
(``prefetch`` per worker); the position counts only batches handed to the caller.

The shards themselves (the manifest, the fixed-size and the jagged layouts) are ``shard_set``'s
and ``jagged``'s; ``open_shards`` picks the layout, and their names are re-exported here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neorec.config import DataConfig, TableConfig
from neorec.data.batch import Batch
from neorec.data.jagged import JaggedShardSet, check_jagged_tables
from neorec.data.shard_set import MANIFEST, ShardSet, is_preprocessed, read_manifest

__all__ = [
    "MANIFEST",
    "STATE_VERSION",
    "is_preprocessed",
    "read_manifest",
    "EpochOrder",
    "ShardSet",
    "SampleOrder",
    "ShardedReader",
    "open_shards",
]

STATE_VERSION = 1


def open_shards(path: str | Path, shards: Sequence[dict[str, Any]] | None = None) -> ShardSet:
    """The shards of a preprocessed directory: fixed-size bags (Criteo) or jagged (tabular)."""
    if read_manifest(path).get("layout") == "jagged":
        return JaggedShardSet(path, shards)
    return ShardSet(path, shards)


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


class EpochOrder:
    """Maps an epoch's sample positions to (shard, row): shard order + windowed shuffle."""

    def __init__(self, sizes: np.ndarray, seed: int, epoch: int, shuffle: bool, buffer: int):
        self.seed, self.epoch, self.shuffle, self.buffer = seed, epoch, shuffle, max(1, buffer)
        n = len(sizes)
        self.order = _rng(seed, epoch, 0).permutation(n) if shuffle else np.arange(n)
        self.ends = np.cumsum(sizes[self.order])  # stream offsets where each shard ends
        self.total = int(self.ends[-1]) if n else 0
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()

    def _window(self, w: int) -> np.ndarray:
        if w not in self._windows:
            size = min(self.buffer, self.total - w * self.buffer)
            self._windows[w] = _rng(self.seed, self.epoch, w + 1).permutation(size)
            if len(self._windows) > 3:  # a batch touches at most two windows
                self._windows.popitem(last=False)
        return self._windows[w]

    def locate(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, row) of positions ``start..end-1``."""
        pos = np.arange(start, end, dtype=np.int64)
        if self.shuffle:
            w = pos // self.buffer
            for wi in np.unique(w).tolist():
                sel = w == wi
                pos[sel] = wi * self.buffer + self._window(wi)[pos[sel] - wi * self.buffer]
        k = np.searchsorted(self.ends, pos, side="right")
        first = self.ends[k] - self.sizes_of(k)
        return self.order[k], pos - first

    def sizes_of(self, k: np.ndarray) -> np.ndarray:
        """Sizes of the k-th shards in epoch order."""
        prev = np.concatenate(([0], self.ends[:-1]))
        return self.ends[k] - prev[k]


class _BatchTask(torch.utils.data.Dataset):
    """Builds a rank's part of global batch (epoch, i); what the workers run."""

    def __init__(self, reader: ShardedReader):
        self.r = reader
        self._order: EpochOrder | None = None

    def __len__(self) -> int:
        return 1 << 62  # indexed by (epoch, batch) through the sampler

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, ...]:
        epoch, i = key
        r = self.r
        if self._order is None or self._order.epoch != epoch:
            self._order = EpochOrder(r.data.sizes, r.seed, epoch, r.shuffle, r.shuffle_buffer)
        a, b = r.local_range(i)
        return r.data.gather(*self._order.locate(a, b))


def _identity(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class SampleOrder:
    """The order of an epoch's samples (see the module's docstring): with ``shuffle``, the shards
    permuted and each window of ``shuffle_buffer`` positions shuffled by ``seed`` and the epoch;
    without, the shards' samples as they are stored."""

    seed: int = 0
    shuffle: bool = True
    shuffle_buffer: int = 1 << 18


class ShardedReader:
    """A rank's part of every global batch of preprocessed shards, with a resumable position."""

    def __init__(
        self,
        data: ShardSet | str | Path,
        batch_size: int,
        *,
        keys: Sequence[str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        order: SampleOrder = SampleOrder(),
        workers: int = 0,
        prefetch: int = 2,
        drop_last: bool = False,
    ) -> None:
        self.data = data if isinstance(data, ShardSet) else open_shards(data)
        if batch_size <= 0 or not 0 <= rank < world_size:
            raise ValueError(
                f"need batch_size > 0 and 0 <= rank < world_size, got "
                f"{batch_size}, {rank}, {world_size}"
            )
        self.batch_size, self.rank, self.world = batch_size, rank, world_size
        self.keys = list(keys or self.data.manifest["features"])
        if len(self.keys) != len(self.data.manifest["features"]):
            raise ValueError(
                f"{len(self.keys)} keys for {len(self.data.manifest['features'])} features"
            )
        self.seed, self.shuffle, self.shuffle_buffer = (
            order.seed,
            order.shuffle,
            order.shuffle_buffer,
        )
        self.workers, self.prefetch, self.drop_last = workers, prefetch, drop_last
        self.epoch = 0
        self.next_batch = 0  # the next global batch to hand out (the checkpointed position)
        self._loader: torch.utils.data.DataLoader | None = None

    def __len__(self) -> int:
        """Global batches per epoch."""
        n, b = self.data.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def local_range(self, i: int) -> tuple[int, int]:
        """Epoch positions of this rank's part of global batch ``i``."""
        start = i * self.batch_size
        g = min(self.batch_size, self.data.num_samples - start)
        return start + self.rank * g // self.world, start + (self.rank + 1) * g // self.world

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch (no-op if already positioned in it)."""
        if epoch != self.epoch:
            self.epoch, self.next_batch = epoch, 0

    def __iter__(self) -> Iterator[Batch]:
        """The rest of the current epoch from the saved position; then the next epoch begins."""
        epoch, start = self.epoch, self.next_batch
        for arrays in self._produce(epoch, start):
            self.next_batch += 1
            yield self._batch(*arrays)
        if self.epoch == epoch and self.next_batch >= len(self):
            self.epoch, self.next_batch = epoch + 1, 0

    def _produce(self, epoch: int, start: int) -> Iterator[tuple[np.ndarray, ...]]:
        keys = [(epoch, i) for i in range(start, len(self))]
        if self.workers == 0:
            task = _BatchTask(self)
            return (task[k] for k in keys)
        if self._loader is None:
            self._loader = torch.utils.data.DataLoader(
                _BatchTask(self),
                batch_size=None,
                sampler=_Keys(),
                num_workers=self.workers,
                prefetch_factor=self.prefetch,
                persistent_workers=True,
                collate_fn=_identity,
            )
        self._loader.sampler.keys = keys  # type: ignore[attr-defined]
        return iter(self._loader)

    def _batch(self, *arrays: np.ndarray) -> Batch:
        return self.data.make_batch(self.keys, arrays)

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, next global batch and sample) and what it is valid for."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "next_batch": self.next_batch,
            "next_sample": min(self.next_batch * self.batch_size, self.data.num_samples),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "fingerprint": self.data.fingerprint(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position (any number of ranks; same data, seed and shuffle)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"reader state version {state.get('version')} is not supported")
        for k in ("seed", "shuffle", "shuffle_buffer", "fingerprint"):
            mine = self.state_dict()[k]
            if state[k] != mine:
                raise ValueError(f"cannot resume: reader {k} was {state[k]!r}, now {mine!r}")
        sample = int(state["next_sample"])
        if sample % self.batch_size and sample < self.data.num_samples:
            raise ValueError(
                f"cannot resume at sample {sample} with batch size {self.batch_size}: "
                f"not a batch boundary (it was saved with batch size {state['batch_size']})"
            )
        self.epoch = int(state["epoch"])
        self.next_batch = -(-sample // self.batch_size)

    def close(self) -> None:
        """Stop the worker processes."""
        self._loader = None


class _Keys(torch.utils.data.Sampler):
    """The (epoch, batch) keys the next iteration visits (set before each ``iter``)."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self.keys))

    def __len__(self) -> int:
        return len(self.keys)


class PreprocessedSource:
    """The trainer's data source over a preprocessed directory; yields this rank's batches."""

    yields_local = True
    """Batches are already this rank's part: the trainer must not slice them again."""

    def __init__(
        self, d: DataConfig, tables: Sequence[TableConfig], out: Any = None, num_dense: int = 13
    ) -> None:
        import torch.distributed as dist

        from neorec.config import ConfigError

        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        train, evals = _split(d.path, d.eval_path)
        if train.manifest.get("layout") == "jagged":
            keys = list(train.manifest["features"])
            for part in (train, evals):
                check_jagged_tables(part, tables, d.schema, num_dense)
        else:
            keys = [t.features[0] for t in tables]
            _check_tables(train, tables)
            if evals.path != train.path:
                _check_tables(evals, tables)
        train.check_files()
        evals.check_files()
        common: dict[str, Any] = {"keys": keys, "rank": self.rank, "world_size": self.world}
        # Every rank needs a same-sized part (the sharded model's all-to-alls): a last global
        # batch that does not split evenly is dropped, and said so.
        self.train = ShardedReader(
            train,
            d.batch_size,
            order=SampleOrder(d.seed, d.shuffle, d.shuffle_buffer),
            workers=d.workers,
            prefetch=d.prefetch,
            drop_last=_uneven(train.num_samples, d.batch_size, self.world),
            **common,
        )
        self.eval = ShardedReader(
            evals,
            d.batch_size,
            order=SampleOrder(shuffle=False),
            drop_last=_uneven(evals.num_samples, d.batch_size, self.world),
            **common,
        )
        for name, r in (("train", self.train), ("eval", self.eval)):
            if len(r) == 0:
                raise ConfigError(
                    f"{r.data.path}: its {name} split has {r.data.num_samples} samples, too few "
                    f"for data.batch_size {d.batch_size} on {self.world} ranks; lower the batch "
                    "size or use more data"
                )
        for name, r in (("train", self.train), ("eval", self.eval)):
            left = r.data.num_samples - len(r) * r.batch_size
            if r.drop_last and left and self.rank == 0:
                print(
                    f"data: {name} drops its last {left} samples (not divisible by "
                    f"{self.world} ranks)",
                    file=out,
                    flush=True,
                )

    def set_epoch(self, epoch: int) -> None:
        """Which epoch train_batches reads (its shuffle order)."""
        self.train.set_epoch(epoch)

    def train_batches(self, start: int = 0) -> Iterator[Batch]:
        """This rank's part of the train batches of the current epoch, from global batch start."""
        self.train.next_batch = start
        return iter(self.train)

    def eval_batches(self) -> Iterator[Batch]:
        """This rank's part of the eval batches, in order."""
        self.eval.set_epoch(0)
        self.eval.next_batch = 0
        return iter(self.eval)

    def num_train_batches(self) -> int | None:
        """Global batches per epoch."""
        return len(self.train)

    def reference_metrics(self) -> dict[str, float] | None:
        """Not known for real data."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The train reader's position."""
        return self.train.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the train reader from a saved position."""
        self.train.load_state_dict(state)


def _uneven(n: int, batch: int, world: int) -> bool:
    return (n % batch) % world != 0


def _split(path: str, eval_path: str) -> tuple[ShardSet, ShardSet]:
    """(train, eval) shards. The train shards are the ``train`` split of ``path`` (all its shards
    if it has no split); the eval shards are those of ``eval_path`` if set, else the held-out
    split of ``path`` (``neorec data preprocess --eval-fraction``, or by default the last file);
    a directory written before splits were recorded holds out the shards of its last file."""
    from neorec.config import ConfigError

    m = read_manifest(path)
    shards = m["shards"]
    if any("split" in s for s in shards):
        train = [s for s in shards if s.get("split") != "eval"]
        held = [s for s in shards if s.get("split") == "eval"]
    else:  # older manifests: the last input file is the held-out split
        last = len(m["sources"]) - 1
        train = [s for s in shards if s["source"] != last] if last > 0 else shards
        held = [s for s in shards if s["source"] == last] if last > 0 else []
    if eval_path:
        return open_shards(path, train), open_shards(eval_path)
    if not held:
        raise ConfigError(
            f"{path} has no held-out split (made from one file, or with --eval-fraction 0); "
            "preprocess it again with --eval-fraction F (e.g. 0.1), or set data.eval_path to a "
            "preprocessed held-out directory"
        )
    if not train:
        raise ConfigError(f"{path}: every shard is in the held-out split; nothing to train on")
    return open_shards(path, train), open_shards(path, held)


def _check_tables(data: ShardSet, tables: Sequence[Any]) -> None:
    """The data's features must be the config's tables: as many, and each feature's rows must fit
    its table (a row id past the end is refused, not wrapped); hashed data must have been hashed
    modulo the table's rows (else the ids would not be the ones the model was sized for)."""
    from neorec.config import ConfigError

    m = data.manifest
    rows = m["rows"]
    if len(tables) != len(rows):
        raise ConfigError(
            f"{data.path} has {len(rows)} features, the config {len(tables)} tables; use a "
            "config with one table per feature (e.g. configs/criteo_kaggle.toml)"
        )
    hashed = m.get("options", {}).get("mode", "hash") == "hash"
    raw = m.get("options", {}).get("raw") or [False] * len(rows)
    raw = raw * len(rows) if len(raw) == 1 else raw
    for f, is_raw, t in zip(m["features"], raw, tables):
        dynamic = getattr(t, "kind", "fixed") == "dynamic"
        if bool(is_raw) != dynamic:
            what = "raw ids" if is_raw else "ids hashed into rows"
            want = "a dynamic" if is_raw else "a fixed"
            raise ConfigError(
                f"feature {f} of {data.path} holds {what}, table '{t.name}' is "
                f"{'dynamic' if dynamic else 'fixed'} ({what} need {want} table); preprocess "
                "with --config of this model"
            )
    for f, r, t, is_raw in zip(m["features"], rows, tables, raw):
        if is_raw:
            continue  # a dynamic table's raw ids: any 64-bit value, mapped by its id map
        if r > t.rows or (hashed and r != t.rows):
            what = f"was hashed modulo {r}" if hashed else f"has ids up to {r - 1}"
            raise ConfigError(
                f"feature {f} of {data.path} {what}, table '{t.name}' has {t.rows} rows "
                f"(preprocess with --config of this model, or set the table's rows to {r})"
            )
