"""Spawned gloo ranks for the CPU multi-process tests (test_parallel, test_verl).

A rank ends with ``os._exit(0)`` once its body has passed and its process group is destroyed.
Normal interpreter finalisation races torch's gloo worker threads: a worker thread can drop the
last reference to a finished collective's work object after the main thread has returned, and
that destructor takes the GIL to release the Python tensors it held. During finalisation the GIL
take ends the thread (``pthread_exit``) inside a ``noexcept`` destructor, so the process aborts
("terminate called without an active exception", SIGABRT) about once in 5-10 runs: a test that
passed fails. Skipping finalisation on the success path removes the race; a failing body still
raises through torch.multiprocessing, which reports its traceback.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, body: Callable[..., None], args: tuple) -> NoReturn:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    try:
        body(rank, world, *args)
    except BaseException:
        # the first failure is the one to read (the other ranks then fail in a collective)
        print(f"rank {rank}/{world} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(body: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``body(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group
    (``body`` a module-level function); a failure in any of them (an assertion included) fails
    the caller with its traceback."""
    os.environ["OMP_NUM_THREADS"] = "1"  # 2-4 processes on a 2-core CI machine
    mp.start_processes(
        _rank, args=(world, free_port(), body, args), nprocs=world, join=True, start_method="spawn"
    )
