"""The ranks 1..N-1 of a tensor-parallel replica, as Ray actors in the replica's placement
group (one bundle, one device each); rank 0 is the replica's own process
(``replicas.deployment``), which starts them, joins them, and stops them with itself.
"""

from __future__ import annotations

import socket

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from replicas.engine import follow_as_rank, load_share
from replicas.engine_config import EngineConfig
from replicas.tensor_parallel import join_group


class RankWorker:
    """One rank > 0: joins the group, loads its share of the model and follows rank 0."""

    def __init__(self, model: str, config: EngineConfig, rank: int, address: str, torch_threads: int | None):
        self.model, self.config, self.rank, self.address = model, config, rank, address
        if torch_threads:
            import torch

            torch.set_num_threads(torch_threads)

    def run(self) -> int:
        """Follow rank 0's forwards until it closes the channel; how many ran."""
        import torch

        tp = join_group(self.rank, self.config.tensor_parallel_size, self.address, torch.device(self.config.device),
                        self.config.expert_parallel_size)
        return follow_as_rank(load_share(self.model, self.config, tp), self.config)


def rendezvous_address() -> str:
    """host:port on this node for the group's rendezvous (rank 0 listens there)."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


def start_ranks(model: str, config: EngineConfig, address: str, num_cpus: float, num_gpus: float,
                torch_threads: int | None) -> tuple[list, list]:
    """Ranks 1..N-1 started in bundles 1..N-1 of the current placement group (the
    deployment's), each already running; their actors and their ``run`` results."""
    group = get_current_placement_group()
    workers, runs = [], []
    for rank in range(1, config.tensor_parallel_size):
        placement = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
        worker = ray.remote(RankWorker).options(
            num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=placement, name=None,
        ).remote(model, config, rank, address, torch_threads)
        workers.append(worker)
        runs.append(worker.run.remote())
    return workers, runs
