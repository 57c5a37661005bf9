"""Run a function on N CPU ranks on this machine joined by gloo, each in a process of its own
(spawned): the tensor-parallel benches and tests, without Ray."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from replicas.models.parallel import TensorParallel


def _rank_main(rank: int, size: int, rendezvous: str, out_dir: str, work, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)
    result = work(TensorParallel(rank, size, dist.group.WORLD), *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank leaves while another still talks to it
    dist.destroy_process_group()
    # skip the interpreter's teardown: gloo's threads being destroyed with it once aborted a
    # rank ("terminate called without an active exception") after its work was done and saved
    os._exit(0)


def on_ranks(size: int, work, *args) -> list:
    """``work(tp, *args)`` on ``size`` gloo ranks (``work`` a module-level function); the
    list of what each rank returned, by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        rendezvous = os.path.join(out_dir, "rendezvous")
        mp.start_processes(_rank_main, args=(size, rendezvous, out_dir, work, args), nprocs=size,
                           start_method="spawn")
        return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(size)]
