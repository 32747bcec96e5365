"""What the planner searches: the cheapest layout (GPUs and sharding strategy) that fits, and the
largest micro-batch that fits a given layout. Plain loops over :func:`proximal.memory.budget.plan`."""

from __future__ import annotations

from dataclasses import replace

from proximal.memory.budget import Plan, Setup, plan


def candidate_layouts(gpus_per_node: int, max_gpus: int = 8192):
    """(gpus per node, nodes, strategy) from cheapest up: fewer GPUs first (1, 2, 4, then whole nodes);
    at equal GPUs no sharding, then FSDP, then CPU optimizer offload alone, then FSDP with offload
    (offloading AdamW to the CPU costs the most step time)."""
    worlds = [w for w in (1, 2, 4) if w < gpus_per_node] + list(
        range(gpus_per_node, max_gpus + 1, gpus_per_node)
    )
    for world in worlds:
        gpus, nodes = (
            (world, 1) if world <= gpus_per_node else (gpus_per_node, world // gpus_per_node)
        )
        for strategy in (
            ("single", "offload") if world == 1 else ("single", "fsdp", "offload", "fsdp-offload")
        ):
            yield gpus, nodes, strategy


def cheapest_fit(setup: Setup, max_gpus: int = 8192, offload: bool = True) -> Plan | None:
    """The first plan in ``candidate_layouts`` order whose per-GPU peak fits ``setup.gpu_memory``.

    Nodes are taken to have ``--gpus`` GPUs when that is more than one, else 8. ``offload=False``
    skips the strategies that keep AdamW state in CPU memory.
    """
    per_node = setup.gpus if setup.gpus > 1 else 8
    for gpus, nodes, strategy in candidate_layouts(per_node, max_gpus):
        if not offload and strategy.endswith("offload"):
            continue
        try:
            p = plan(replace(setup, strategy=strategy, gpus=gpus, nodes=nodes))
        except ValueError:
            continue
        if p.fits:
            return p
    return None


def largest_micro_batch(setup: Setup) -> int | None:
    """The largest micro-batch (sequences, or pairs, on one GPU) at which ``setup`` fits, trying the
    divisors of each GPU's share of the batch from the largest down; None when even 1 does not fit."""
    share = max(1, setup.batch * (setup.group_size if setup.online else 1) // setup.world)
    for m in sorted((d for d in range(1, share + 1) if share % d == 0), reverse=True):
        if plan(replace(setup, micro_batch=m)).fits:
            return m
    return None
