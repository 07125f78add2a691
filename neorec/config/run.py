"""Config sections of a run: data, training loop, sharding, planner, storage, checkpoints, wire."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from neorec.config.checks import (
    MAX_SEED,
    MAX_TABLES,
    SHARDING_TYPES,
    check_choice,
    check_fields,
    item_rule,
    rule,
    show,
)
from neorec.config.qat import QatConfig
from neorec.config.schedule import ScheduleConfig
from neorec.config.schema import SchemaConfig
from neorec.errors import ConfigError

__all__ = [
    "DataConfig",
    "TrainConfig",
    "ShardingConfig",
    "PlannerConfig",
    "StorageConfig",
    "CheckpointConfig",
    "CommConfig",
    "LowpConfig",
    "check_sharding_type",
    "check_run_name",
    "_COMM_CODECS",
]

_MAX_SAMPLES = 2**48
_MAX_BATCH = 2**24
_MAX_STEPS = 2**48
_MAX_THREADS = 4096
_MAX_WINDOWS = 1_000_000


@dataclass(kw_only=True)
class DataConfig:
    """Where batches come from."""

    source: str = field(
        default="synthetic", metadata=rule(choices=("synthetic", "criteo", "stream", "tabular"))
    )
    """``synthetic``, ``criteo`` (TSV files, or a directory from ``neorec data preprocess``),
    ``stream`` (synthetic windows of a drifting teacher, neorec.data.stream) or ``tabular``
    (Parquet / CSV / TSV files read as ``data.schema`` declares, or their preprocessed
    directory; docs/data.md)."""
    path: str = ""
    """Criteo: a file or directory of TSV (optionally .gz) files, or a preprocessed directory."""
    eval_path: str = ""
    """Criteo: held-out file(s); empty = the last file of ``path``."""
    batch_size: int = field(default=512, metadata=rule(1, _MAX_BATCH))
    """Global batch size."""
    train_samples: int = field(default=1_000_000, metadata=rule(1, _MAX_SAMPLES))
    """Synthetic: samples in the train split."""
    eval_samples: int = field(default=50_000, metadata=rule(1, _MAX_SAMPLES))
    """Synthetic: samples in the eval split."""
    id_distribution: str = field(
        default="locality", metadata=rule(choices=("locality", "zipf", "uniform"))
    )
    """Synthetic ids: ``locality`` (calibrated to production reuse), ``zipf``, ``uniform``."""
    zipf_alpha: float = field(default=1.05, metadata=rule(0, 10))
    """Zipf exponent when id_distribution = zipf (0 = uniform)."""
    fixed_pooling: bool = False
    """Synthetic: every bag has exactly pooling_factor ids (else Poisson-like variable)."""
    teacher_scale: float = field(default=1.0, metadata=rule(0, 1000))
    """Synthetic: logit scale of the hidden teacher (higher = more learnable signal)."""
    teacher_groups: int = field(default=0, metadata=rule(0, MAX_TABLES))
    """Synthetic: the teacher's sparse x sparse interactions only within this many groups of
    tables (a seeded permutation; for DMT towers); 0 = the ungrouped teacher."""
    hash_categories: bool = True
    """Criteo: hash hex categories into rows modulo the table size."""
    bad_lines: str = field(default="fail", metadata=rule(choices=("fail", "skip")))
    """Criteo malformed lines: ``fail`` (error with file:line) or ``skip`` (counted)."""
    bad_rows: str = field(default="fail", metadata=rule(choices=("fail", "skip")))
    """Tabular (Parquet / CSV / TSV) rows with a bad value: ``fail`` (one error naming the file,
    line or row and column) or ``skip`` (left out, counted in events.jsonl and the summary, listed
    in the run folder's ``bad_rows.jsonl``; docs/data.md)."""
    max_bad_fraction: float = field(default=0.01, metadata=rule(0, 1))
    """Tabular, ``bad_rows = "skip"``: a file whose bad rows exceed this fraction of its rows is
    an error (one line with the count and the file)."""
    seed: int = field(default=1234, metadata=rule(0, MAX_SEED))
    """Data seed (synthetic generation, shuffling)."""
    shuffle: bool = True
    """Criteo preprocessed: shuffle shard order and samples within ``shuffle_buffer`` per epoch."""
    shuffle_buffer: int = field(default=262_144, metadata=rule(1, _MAX_SAMPLES))
    """Criteo preprocessed: samples shuffled together (a window of the epoch's shard stream)."""
    workers: int = field(default=1, metadata=rule(0, 256))
    """Criteo preprocessed: reader worker processes per rank (0 = read in the training process)."""
    prefetch: int = field(default=4, metadata=rule(1, 1024))
    """Criteo preprocessed: batches each reader worker prepares ahead."""
    window: int = field(default=0, metadata=rule(0, _MAX_WINDOWS - 1))
    """Stream: the window ("day") this run trains on and evaluates (< data.windows)."""
    windows: int = field(default=8, metadata=rule(1, _MAX_WINDOWS))
    """Stream: number of windows of the stream."""
    drift: float = field(default=0.2, metadata=rule(0, 1))
    """Stream: teacher drift rate r per window (w_t = sqrt(1 - r^2) w_(t-1) + r fresh_t)."""
    id_churn: float = field(default=0.1, metadata=rule(0, 1))
    """Stream: fraction of each table's active ids that retire (and as many new ones that appear)
    per window."""
    window_samples: int = field(default=200_000, metadata=rule(1, _MAX_SAMPLES))
    """Stream: train samples per window (eval samples per window: data.eval_samples)."""
    fm_logits: str = ""
    """Stream: directory of DAS side files (``fm_w{window}_{split}.npy`` + ``.json``, written by
    neorec.data.stream.write_fm_logits) whose FM logits are attached to the batches; "" = none."""
    fm_staleness: int = field(default=0, metadata=rule(0, _MAX_WINDOWS - 1))
    """Stream: k, the FM logits of window w come from the FM trained on window w - k."""
    vertical_bias: float = field(default=0.0, metadata=rule(-10, 10))
    """Stream: this run's vertical (a VM's traffic) clicks with its logit offset by this much from
    the stream the FM learns from (the FM / VM distribution gap); features are the same."""
    vertical_shift: float = field(default=0.0, metadata=rule(0, 1))
    """Stream: this vertical's teacher dense weights are ``sqrt(1 - s^2) w + s u`` with u a fixed
    seeded direction (a feature-dependent FM / VM gap); 0 = the stream's own teacher."""
    id_shrink_visits: float = field(default=4000.0, metadata=rule(0, 1e12))
    """Stream: each id's teacher vector is shrunk by sqrt(v / (v + this)), v = the id's expected
    visits in 200,000 samples. 4000 = the synthetic teacher's (only ids seen thousands of times
    carry much of their own effect); lower = rarer ids carry theirs too, so exact per-id rows
    matter (``neorec bench dynamic`` uses 100); 0 = no shrinking."""
    id_weight: float = field(default=1.0, metadata=rule(0, 100))
    """Stream: each id's teacher vector is multiplied by this (after the shrink): the per-id
    terms of the label's logit grow against the dense ones (the within-group pair term by its
    square); 1 = the synthetic teacher's."""
    schema: SchemaConfig = field(default_factory=SchemaConfig)
    """Tabular: the label and feature columns and what each becomes (neorec.config.schema)."""

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.source != "stream":
            changed = [
                f.name
                for f in fields(self)
                if f.name in STREAM_ONLY and getattr(self, f.name) != f.default
            ]
            if changed:
                names = ", ".join(f"data.{n}" for n in changed)
                raise ConfigError(
                    f"{names}: setting(s) of the stream, but data.source is {self.source!r}: "
                    f"they would be ignored; set data.source = 'stream' or remove {names}"
                )
        if self.bad_rows != "fail" and self.source != "tabular":
            raise ConfigError(
                f"data.bad_rows = {self.bad_rows!r} is for tabular data, but data.source is "
                f"{self.source!r}; Criteo TSV lines: data.bad_lines"
            )
        if not isinstance(self.schema, SchemaConfig):
            raise ConfigError(
                f"data.schema must be a [data.schema] section, got {show(self.schema)}"
            )
        if self.schema.features and self.source != "tabular":
            raise ConfigError(
                f"data.schema.features are declared but data.source is {self.source!r}: set "
                "data.source = 'tabular' or remove [[data.schema.features]]"
            )
        if self.window >= self.windows:
            raise ConfigError(
                f"data.window {self.window:,} is not below data.windows {self.windows:,} (windows "
                "are numbered from 0); lower data.window or raise data.windows"
            )


STREAM_ONLY = frozenset(
    {
        "window",
        "windows",
        "drift",
        "id_churn",
        "window_samples",
        "fm_logits",
        "fm_staleness",
        "vertical_bias",
        "vertical_shift",
        "id_shrink_visits",
        "id_weight",
    }
)
"""``DataConfig`` fields only the stream reads: with another source, a value other than the
default is refused (it would be ignored)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Training loop."""

    epochs: int = field(default=1, metadata=rule(1, 1_000_000))
    """Passes over the train split (ignored when steps > 0)."""
    steps: int = field(default=0, metadata=rule(0, _MAX_STEPS))
    """Train steps; 0 = run ``epochs`` epochs."""
    dense_optimizer: str = field(
        default="adagrad", metadata=rule(choices=("sgd", "adagrad", "adam"))
    )
    """torch.optim optimizer for dense parameters: sgd, adagrad, adam."""
    dense_lr: float = field(default=0.05, metadata=rule(gt=0, hi=1e30))
    """Dense learning rate."""
    eval_every: int = field(default=0, metadata=rule(0, _MAX_STEPS))
    """Evaluate every N steps; 0 = every ``eval_fraction`` of the run."""
    eval_fraction: float = field(default=0.1, metadata=rule(0, 1))
    """With eval_every 0: evaluate every this share of the run's steps (0.1 = every 10%; the
    last one is the final eval); 0 = only at the end. Needs a known run length (train.steps, or
    a source that knows its batches)."""
    eval_batches: int = field(default=20, metadata=rule(0, _MAX_STEPS))
    """Periodic evals read the first N batches of the eval split (0 = all of it), so that they
    stay cheap; the final eval always reads the whole split."""
    log_every: int = field(default=50, metadata=rule(0, _MAX_STEPS))
    """Progress line (and events.jsonl line) every N steps (0 = every step)."""
    save_model: bool = True
    """Save the final model to ``<run folder>/model`` (``neorec eval | predict | export``)."""
    tensorboard: str = field(default="auto", metadata=rule(choices=("auto", "on", "off")))
    """TensorBoard scalars in ``<run folder>/tb/`` (rank 0): ``auto`` when tensorboard is
    installed (``pip install 'neorec[tb]'``), ``on`` (an error without it), ``off``."""
    runs_dir: str = field(default="runs", metadata=rule(nonempty=True))
    """Root of the run folders: each run writes ``<runs_dir>/<name>/`` and ``<runs_dir>/latest``
    links to the newest."""
    name: str = ""
    """Name of the run's folder under runs_dir; empty = the UTC start time (20261125-143012). A
    name already taken gets a suffix (-2, -3, ...) unless the run resumes it."""
    run_dir: str = ""
    """An exact folder for this run's files instead of ``<runs_dir>/<name>`` (no ``latest``
    link, not listed by ``neorec runs`` unless under runs_dir); empty = a run folder."""
    seed: int = field(default=0, metadata=rule(0, MAX_SEED))
    """Model init seed."""
    threads: int = field(default=0, metadata=rule(0, _MAX_THREADS))
    """torch intra-op threads per process; 0 = the cores this process may use (CPU affinity, the
    cgroup CPU quota), at most the host's idle ones, split among the ranks on this host
    (``neorec.machine.CpuShare``; ``OMP_NUM_THREADS``, when set, is used instead). The banner's
    ``threads`` line says how many and why. Docs: docs/running.md "Threads"."""
    bf16_dense: bool = False
    """Run the dense MLPs under bf16 autocast (CPU AMX); embeddings stay float32."""
    progress: bool = True
    """Print a progress line."""
    dense_blocks: int = field(default=2, metadata=rule(1, 65_536))
    """The dense part computes its gradient over this many equal blocks of the global batch and
    adds them in a fixed pairwise tree (``neorec.distributed.dense_blocks``), so 1 process and N
    ranks (N a power of two dividing it) train bitwise the same model; 1 = one GEMM per rank.
    A batch that does not split evenly runs as one block."""
    collective_timeout_s: int = field(default=300, metadata=rule(1, 7 * 86_400))
    """Distributed runs: a collective that waits longer than this fails (no hang)."""
    pipeline: str = field(default="overlapped", metadata=rule(choices=("overlapped", "sequential")))
    """``overlapped``: batch i+1 is loaded, copied and its input distribution started while batch
    i computes; ``sequential``: one batch at a time (the reference; same results, bitwise)."""
    device: str = field(default="cpu", metadata=rule(choices=("cpu", "cuda")))
    """Where the model, the tables, the communication buffers and the row cache live: ``cpu``
    (process groups on gloo) or ``cuda`` (this rank's GPU, ``LOCAL_RANK``; NCCL). Both run the
    same device-generic step; ``cuda`` without a CUDA device is refused before any work."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """``[train.schedule]``: warmup and decay of both optimizers' lr (neorec.config.schedule)."""
    qat: QatConfig = field(default_factory=QatConfig)
    """``[train.qat]``: quantization-aware training of the embedding rows (neorec.config.qat)."""
    lr_scaling: str = field(
        default="none", metadata=rule(choices=("none", "linear", "sqrt", "cowclip"))
    )
    """Scale ``dense_lr`` and ``embedding.lr`` by k = data.batch_size / ``reference_batch``
    (``linear``: x k, Goyal et al.; ``sqrt``: x sqrt(k)); ``cowclip``: CowClip's rule (Zheng et
    al. 2023): ``dense_lr`` x sqrt(k), ``embedding.lr`` unchanged, ``embedding.weight_decay`` x k;
    ``none``: the lrs as given."""
    reference_batch: int = field(default=0, metadata=rule(0, _MAX_BATCH))
    """The global batch the given lrs were tuned for (needed by ``lr_scaling``)."""

    def __post_init__(self) -> None:
        check_fields(self, "train")
        check_run_name(self.name)
        if not isinstance(self.schedule, ScheduleConfig):
            raise ConfigError(
                f"train.schedule must be a [train.schedule] section, got {show(self.schedule)}"
            )
        if not isinstance(self.qat, QatConfig):
            raise ConfigError(f"train.qat must be a [train.qat] section, got {show(self.qat)}")
        if self.lr_scaling == "none" and self.reference_batch:
            raise ConfigError(
                f"train.reference_batch {self.reference_batch:,} is set but train.lr_scaling is "
                "'none' (it would be ignored); set train.lr_scaling = 'linear' or 'sqrt', or "
                "remove train.reference_batch"
            )
        if self.lr_scaling != "none" and not self.reference_batch:
            raise ConfigError(
                f"train.lr_scaling = {self.lr_scaling!r} needs train.reference_batch (the global "
                "batch the given lrs were tuned for), got 0"
            )

    def check_device(self) -> None:
        """Refuse ``device = "cuda"`` on a machine where torch sees no CUDA device."""
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(
                    "train.device = 'cuda' but torch sees no CUDA device here (a CPU-only torch "
                    f"{torch.__version__}, or no GPU); set train.device = 'cpu' or run on a GPU host"
                )


_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")


def check_run_name(name: str) -> None:
    """Refuse a ``train.name`` that is not one plain folder name (or is ``latest``)."""
    if not name:
        return
    if name == "latest" or len(name) > 200 or not _NAME_OK.match(name):
        raise ConfigError(
            f"train.name {show(name)} is not a run folder name: use letters, digits and . _ + - "
            f"(not starting with . or -, at most 200 characters, not 'latest')"
        )


def check_sharding_type(name: str, v: str) -> None:
    """Refuse ``v`` unless it names a sharding type (value or abbreviation, any case)."""
    known = [*SHARDING_TYPES, *(s.upper() for s in SHARDING_TYPES.values())]
    t = v.strip().lower()
    if t not in SHARDING_TYPES and t not in SHARDING_TYPES.values():
        check_choice(name, v, known)


@dataclass(kw_only=True)
class ShardingConfig:
    """How tables are placed on ranks (distributed runs)."""

    plan: str = ""
    """Path of a ShardingPlan JSON; empty = the planner (or ``default_type``)."""
    default_type: str = ""
    """Shard every table this way (data_parallel, table_wise, row_wise, column_wise,
    table_row_wise, or DP, TW, RW, CW, TWRW); empty = use the planner."""
    types: dict[str, str] = field(default_factory=dict)
    """Per-table sharding type overrides {table: type}; the tables must exist."""

    def __post_init__(self) -> None:
        check_fields(self, "sharding")
        if self.default_type:
            check_sharding_type("sharding.default_type", self.default_type)
        for table, t in self.types.items():
            check_sharding_type(f"sharding.types.{table}", t)


@dataclass(kw_only=True)
class PlannerConfig:
    """Inputs of the sharding planner beyond the model (``neorec plan``, distributed training)."""

    tables_file: str = ""
    """CSV/JSON table list (relative to the config); replaces embedding.tables for planning."""
    batch_size: int = field(default=0, metadata=rule(0, _MAX_BATCH))
    """Global batch for the cost model; 0 = data.batch_size."""
    weight_bytes: int = field(default=4, metadata=rule(choices=(1, 2, 4, 8)))
    """Bytes per stored weight element."""
    allow_host: bool = True
    """Tables may live in host DRAM (UVM-like tier)."""
    allow_cached_tiers: bool = True
    """``neorec plan`` may place tables in the cached tiers: rows in host DRAM (``dram``) or on
    SSD (``ssd``, with ``topology.ssd_capacity_gb``) behind a row cache in device memory. Read by
    ``neorec plan`` only: the distributed runtime plans without cached tiers (it does not run
    cached tables)."""
    cache_fractions: list[float] = field(
        default_factory=lambda: [0.01, 0.05, 0.1, 0.25],
        metadata=rule(nonempty=True, item=item_rule(gt=0, hi=1)),
    )
    """Row cache sizes (share of a shard's rows) the planner tries for the cached tiers."""
    max_cw_slices: int = field(default=0, metadata=rule(0, 65_536))
    """Most column slices per table (0 = planner default)."""
    optimizer: str = field(
        default="", metadata=rule(choices=("", "sgd", "rowwise_adagrad", "adam"))
    )
    """Optimizer the cost model assumes (empty = embedding.optimizer)."""
    topology: dict[str, Any] = field(default_factory=dict)
    """Topology fields (see neorec.sharding.topology.Topology)."""
    topology_file: str = ""
    """A topology JSON (e.g. written by ``neorec plan --calibrate``)."""

    def __post_init__(self) -> None:
        check_fields(self, "planner")


@dataclass(kw_only=True)
class StorageConfig:
    """Memory hierarchy (tables with storage = dram | ssd): where store files go, prefetch."""

    dir: str = field(default="/tmp/neorec-store", metadata=rule(nonempty=True))
    """Directory of the SSD row store files (one ``<table>.rows`` per table, created anew)."""
    io_threads: int = field(default=2, metadata=rule(1, 256))
    """Threads copying records between an SSD store's mapping and the cache (the copies are
    latency bound: measured on 2 cores, 2 threads took a cached step from 75.7 to 65.0 ms)."""
    mapped_mb: int = field(default=0, metadata=rule(0, 2**40))
    """File-backed RSS (MiB) above which the SSD stores' mapped pages are dropped from the process
    (they stay in the page cache): bounds the RSS the stores add, whatever the files' size.
    0 = a quarter of physical memory."""
    prefetch: bool = True
    """Read the next batch's missing rows in the background while the current batch computes."""

    def __post_init__(self) -> None:
        check_fields(self, "storage")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Check-N-Run checkpoints (neorec.checkpoint): when, what, how precisely, where."""

    dir: str = ""
    """Root directory or fsspec URL (s3://, gs://, memory://); empty = <run folder>/checkpoints
    (the run's own: ``--resume latest`` then continues the latest run)."""
    every_steps: int = field(default=0, metadata=rule(0, _MAX_STEPS))
    """Checkpoint every N train steps (0 = never)."""
    policy: str = field(
        default="adaptive", metadata=rule(choices=("full", "one_shot", "consecutive", "adaptive"))
    )
    """``full``, ``one_shot`` (rows changed since the baseline), ``consecutive`` (since the previous
    checkpoint) or ``adaptive`` (consecutive; new baseline when the chain outweighs one)."""
    bits: int = field(default=8, metadata=rule(choices=(32, 8, 4, 3, 2)))
    """Stored precision of embedding rows: 32 (exact), 8, 4, 3 or 2 (row-wise integer codes)."""
    adaptive_range: bool = True
    """For bits <= 4: greedy per-row range search (min/max shrunk while the L2 error falls)."""
    opt_bits: int = field(default=32, metadata=rule(choices=(32, 16, 8, 0)))
    """Stored precision of fused optimizer state: 32, 16 (bfloat16), 8, or 0 (not stored).
    32 by measurement (neorec bench ckpt): dropping it costs NE, and row-wise Adagrad's one float
    per row is ~8% of an 8-bit checkpoint."""
    keep_last: int = field(default=2, metadata=rule(1, 1_000_000))
    """Baselines kept, each with the increments built on it."""
    async_write: bool = True
    """Encode and write in a background thread (training pauses only for the snapshot)."""
    adaptive_threshold: float = field(default=1.0, metadata=rule(gt=0, hi=1e6))
    """adaptive: new baseline when the chain to replay would exceed this x a baseline's bytes."""
    full_every: int = field(default=0, metadata=rule(0, _MAX_STEPS))
    """Also force a baseline after N increments (0 = only when the policy asks)."""
    chunk_rows: int = field(default=65536, metadata=rule(1, 2**31))
    """Rows per stored piece (pieces are cut at multiples of this global row index)."""
    fsync: bool = True
    """fsync local files before renaming them into place."""
    resume: str = ""
    """Resume from ``latest`` (under dir) or a checkpoint path; empty = start fresh."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")


_COMM_CODECS = ("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int8")
_CODEC = rule(choices=_COMM_CODECS)


@dataclass(kw_only=True)
class CommConfig:
    """Precision on the wire of distributed training (neorec.distributed.codecs)."""

    forward: str = field(default="fp32", metadata=_CODEC)
    """Codec of the forward all-to-all of pooled embeddings: fp32, fp16, bf16, fp8_e4m3,
    fp8_e5m2, int8 (row-wise)."""
    backward: str = field(default="fp32", metadata=_CODEC)
    """Codec of the backward all-to-all of the pooled embeddings' gradients."""
    allreduce: str = field(default="fp32", metadata=_CODEC)
    """Codec of the dense (DDP) gradient all-reduce, and of data-parallel embedding tables' row
    gradients (all-gathered as (id, row sum) pairs)."""
    fp8_scaling: str = field(default="row", metadata=rule(choices=("row", "tensor")))
    """fp8 scale: ``row`` (a power of two per row, 1 byte) or ``tensor`` (one per message)."""
    loss_scale: float = field(default=0.0, metadata=rule(0, 3.4e38))
    """fp16/fp8 gradients (backward, allreduce): 0 = a power-of-two scale per message from its
    largest value (cannot overflow); > 0 = this fixed factor (overflow is an error)."""
    transport: str = field(default="auto", metadata=rule(choices=("auto", "shm", "gloo")))
    """All-to-alls between ranks on CPU: ``auto`` = through shared memory when every rank is on
    one host (``neorec.distributed.shm``; same bytes as gloo, without its socket round trips),
    else gloo; ``shm`` = shared memory or an error at start; ``gloo`` = always the process group."""

    def __post_init__(self) -> None:
        check_fields(self, "comm")


@dataclass
class LowpConfig:
    """LoKA: low precision where the probe shows it is safe and the machine shows it is faster
    (``neorec.lowp``)."""

    mode: str = field(default="off", metadata=rule(choices=("off", "auto", "bf16", "fp16", "fp8")))
    """``off``; ``auto`` = per site, the fastest precision whose probed error is within
    ``tolerance`` and that is faster than fp32 here; ``bf16`` / ``fp16`` / ``fp8`` = forced on every
    GEMM site (the probe still runs and reports)."""
    tolerance: float = field(default=0.01, metadata=rule(hi=1.0, gt=0.0))
    """Largest relative error (95% upper bound over the probed steps) of a site's output and
    gradients vs fp32 that ``auto`` accepts."""
    probe_steps: int = field(default=4, metadata=rule(1, 10_000))
    """First steps probed (in fp32) before the first choice."""
    reprobe_every: int = field(default=500, metadata=rule(0, 2**40))
    """Probe again (and choose again) every this many steps; 0 = never."""
    drift: float = field(default=4.0, metadata=rule(hi=1e6, gt=1.0))
    """A low-precision site whose output amax grows past this factor of what it was after the
    choice (or is not finite) goes back to fp32 at once and is probed again."""
    keep_ends: bool = True
    """Mod: the first and the last Linear stay fp32."""
    row_scale: bool = True
    """Mod: the dot interaction divides each vector by a power of two before the cast (exact), so
    fp16 cannot overflow there."""
    plan: str = ""
    """A pinned plan for ``auto``: a JSON file of ``{site: precision}`` (or a run's ``lowp.json``,
    whose ``plan`` it takes) installed at the first choice instead of choosing; it must name every
    GEMM site of the model. The probe still runs and reports, and a site that drifts still falls
    back to fp32. Empty = choose."""

    def __post_init__(self) -> None:
        check_fields(self, "lowp")
        if self.plan and self.mode != "auto":
            raise ConfigError(
                f"lowp.plan = {self.plan!r} needs lowp.mode = 'auto' (a pinned plan is what auto "
                f"runs), got {self.mode!r}"
            )
