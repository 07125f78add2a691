"""Spawn process groups for tests (small tables): gloo on the CPU, the default; NCCL when
``NEOREC_TEST_DEVICE=cuda`` (a GPU host: the backend follows the device, as in a run)."""

from __future__ import annotations

import gc
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neorec.distributed.comm import (
    close_host_transports,
    init_host_transport,
    process_group_backend,
)

DEVICE = os.environ.get("NEOREC_TEST_DEVICE", "cpu")
"""``train.device`` of the distributed tests' process groups."""
TRANSPORT = os.environ.get("NEOREC_TEST_TRANSPORT", "gloo")
"""All-to-alls of the default group: ``gloo``, or ``shm`` (``neorec.distributed.shm``) to run
the distributed tests over shared memory (``make test-shm``)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = process_group_backend(DEVICE)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    if backend == "gloo" and TRANSPORT != "gloo":
        init_host_transport(TRANSPORT, timeout_s=60.0)
    try:
        fn(rank, world, *args)
        # Every rank done (its collectives and their threads finished) before any group goes.
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        gc.collect()
        close_host_transports()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; raise if any rank fails."""
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)
