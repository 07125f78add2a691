"""Check-N-Run checkpoints: dirty-row tracking, quantized pieces, async writer, manifest, restore."""

from neorec.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    NoCheckpointError,
)
from neorec.checkpoint.manager import (
    CheckpointManager,
    list_checkpoints,
    load_chain,
    resolve_checkpoint,
    verify_checkpoint,
)
from neorec.checkpoint.storage import open_storage
from neorec.checkpoint.tracker import DirtyRowTracker, local_blocks

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "NoCheckpointError",
    "CheckpointManager",
    "DirtyRowTracker",
    "list_checkpoints",
    "load_chain",
    "local_blocks",
    "open_storage",
    "resolve_checkpoint",
    "verify_checkpoint",
]
