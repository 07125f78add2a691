"""The builder: the one place where a validated ``Config`` becomes a run's objects.

Below this package, code receives its own config section or plain values, never the whole
``Config`` (``tests/test_layers.py``). ``model``: the embedding collection and the model (flat,
low precision, cached, dynamic, towered, distributed); ``plan``: the sharding plan; ``towers``:
the DMT towers a config decides and the SPTT model; ``run``: system settings, the data source, the dense
optimizer; ``schedule``: the lr scaling and schedule.
"""

from neorec.build.model import (
    build_collection,
    build_dlrm,
    build_flat_dlrm,
    distributed_model,
    low_precision_collection,
    sharded_collection,
)
from neorec.build.plan import resolve_plan
from neorec.build.run import (
    BuiltModel,
    apply_system,
    build_model,
    check_run,
    data_source,
    dense_optimizer,
)
from neorec.build.schedule import lr_scale, lr_schedule, scaling_line
from neorec.build.towers import tower_groups, towered_model

__all__ = [
    "build_collection",
    "build_dlrm",
    "build_flat_dlrm",
    "distributed_model",
    "low_precision_collection",
    "sharded_collection",
    "resolve_plan",
    "apply_system",
    "BuiltModel",
    "build_model",
    "check_run",
    "data_source",
    "dense_optimizer",
    "lr_scale",
    "lr_schedule",
    "scaling_line",
    "tower_groups",
    "towered_model",
]
