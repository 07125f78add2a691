"""The builder: the one place where a validated ``Config`` becomes a run's objects.

Below this package, code receives its own config section or plain values, never the whole
``Config`` (``tests/test_layers.py``). ``model``: the collections' ``CollectionSpec``, the
embedding collection and the flat model (low precision, cached, dynamic, distributed); ``plan``:
the sharding plan; ``towers``: the DMT towers a config decides, the model flat or towered
(``build_dlrm``) and the SPTT model; ``run``: system settings, the data source, the dense
optimizer; ``schedule``: the lr scaling and schedule. The learned towers are decided by the
trainer (``neorec.train.towers_warmup``) and passed in.
"""

from neorec.builder.model import (
    build_collection,
    build_flat_dlrm,
    collection_spec,
    distributed_model,
    low_precision_collection,
    sharded_collection,
    store_settings,
)
from neorec.builder.plan import resolve_plan
from neorec.builder.run import (
    BuiltModel,
    apply_system,
    apply_threads,
    build_model,
    check_run,
    data_source,
    dense_optimizer,
)
from neorec.builder.schedule import lr_scale, lr_schedule, qat_schedule, scaling_line
from neorec.builder.towers import build_dlrm, tower_groups, towered_model

__all__ = [
    "build_collection",
    "build_dlrm",
    "build_flat_dlrm",
    "collection_spec",
    "store_settings",
    "distributed_model",
    "low_precision_collection",
    "sharded_collection",
    "resolve_plan",
    "apply_system",
    "apply_threads",
    "BuiltModel",
    "build_model",
    "check_run",
    "data_source",
    "dense_optimizer",
    "lr_scale",
    "lr_schedule",
    "qat_schedule",
    "scaling_line",
    "tower_groups",
    "towered_model",
]
