"""Distribution on PyTorch's own engine: torchrun's environment, one process group, and the helpers
through which every global quantity and every decision crosses ranks.

``torchrun --nproc_per_node N proximal <command> ...`` starts N processes with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and ``MASTER_ADDR``/``MASTER_PORT`` set (multi-node: the usual
``--nnodes`` / ``--rdzv-*`` flags). :func:`init` joins them into one process group — NCCL on CUDA,
gloo on CPU — with a short timeout, so a rank that died ends the job instead of leaving the others
waiting for half an hour. Without those variables (one process) every helper here is the identity
and costs nothing.

Rules the trainers follow (each is a way to hang or to compute the wrong thing otherwise):

- every rank runs the same number of forward/backward passes and collectives: rows are masked,
  never dropped on one rank only; decisions (early stop, skip) go through :func:`any_rank`;
- every global statistic (means, counts, maxima for logging and for loss normalisers) goes through
  :func:`all_reduce_sum` / :func:`all_reduce_max`;
- every rank takes part in saving (sharded state and the gathered full export).

See ``docs/distributed.md`` for the whole picture.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import uuid

import torch
import torch.distributed as dist

#: Environment variables torchrun (and other launchers) set for each process.
ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_world_size() -> int:
    """``WORLD_SIZE`` from the environment (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_rank() -> int:
    """``RANK`` from the environment (0 when not launched by torchrun); valid before :func:`init`."""
    return int(os.environ.get("RANK", "0"))


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def init(device: torch.device, timeout_s: float) -> None:
    """Join the process group torchrun set up (no-op for one process or when already joined).

    The backend follows the device: NCCL for CUDA (each process on ``cuda:LOCAL_RANK``), gloo on CPU.
    ``timeout_s`` bounds every collective: a rank that waits longer for a peer (because the peer
    raised, was killed, or is stuck) fails with a timeout instead of hanging.
    """
    if launched_world_size() <= 1 or is_distributed():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own = {}
    if restartable():
        own = {"store": attempt_store(timeout_s), "rank": launched_rank()}
        own["world_size"] = launched_world_size()
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        **own,
    )


def restartable() -> bool:
    """Whether torchrun may start this job's processes again in the same store: ``--max-restarts``
    above 0 with the store its agent shares between attempts (the default of the c10d rendezvous
    and ``--standalone``; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a new one)."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    )


def attempt_store(timeout_s: float) -> dist.Store:
    """The agent's store under a prefix that only this attempt's processes use.

    torchrun's agent keeps one store for every attempt of a job (torch 2.13), and the process group
    publishes each rank's address in it under fixed keys: after a restart, a rank that reads rank 0's
    address before the new rank 0 has written it connects to the dead one and fails ("Gloo
    connectFullMesh failed ... Connection refused"; NCCL alike, pytorch/pytorch#135712 and #167288),
    which took one restart in four here. ``TORCHELASTIC_RESTART_COUNT`` cannot name the attempt: each
    agent counts its own restarts. So the processes agree on a fresh prefix by a handshake that no key
    of a dead attempt can complete: rank 0 publishes a random prefix; every other rank publishes a
    random token and waits until it finds its token acknowledged under the published prefix — which
    only the live rank 0 can have written, since the token is new — then marks itself ready there;
    rank 0 acknowledges whatever tokens it reads until every rank is ready. Stale prefixes and tokens
    are simply read again. RuntimeError "timed out" after ``timeout_s`` (a peer that never came)."""
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    me, world = launched_rank(), launched_world_size()
    deadline = time.monotonic() + timeout_s
    if me == 0:
        prefix = f"proximal/attempt/{uuid.uuid4().hex}"
        base.set("proximal/prefix", prefix)
        waiting = set(range(1, world))
    else:
        token = uuid.uuid4().hex
        base.set(f"proximal/hello/{me}", token)
    while True:
        if me == 0:
            for peer in sorted(waiting):
                if base.check([f"{prefix}/ready/{peer}"]):
                    waiting.discard(peer)
                elif base.check([f"proximal/hello/{peer}"]):
                    base.set(f"{prefix}/ack/{peer}", base.get(f"proximal/hello/{peer}"))
            if not waiting:
                break
        else:
            prefix = base.get("proximal/prefix").decode()  # waits for the first rank 0 ever
            ack = f"{prefix}/ack/{me}"
            if base.check([ack]) and base.get(ack).decode() == token:
                base.set(f"{prefix}/ready/{me}", "1")
                break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank {me}: timed out after {timeout_s:g} s agreeing on this attempt's store with "
                "the other processes of the job"
            )
        time.sleep(0.05)
    return dist.PrefixStore(prefix, base)


def shutdown_and_exit(code: int) -> None:
    """Leave the process group, flush, and end the process with ``code``.

    FSDP2 jobs on gloo sometimes abort at interpreter shutdown after all work is done ("terminate
    called without an active exception": a gloo worker thread released during finalisation, an open
    upstream bug). Destroying the group and leaving through ``os._exit`` skips that finalisation.
    """
    if is_distributed():
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - nothing useful to do while exiting
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all data-parallel ranks (a copy; the input is not modified)."""
    if not is_distributed():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Elementwise maximum of ``t`` over ranks (a copy)."""
    if not is_distributed():
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out


def global_sum(value: float | int | torch.Tensor, device: torch.device | str = "cpu") -> float:
    """Σ of a number over ranks, as a Python float."""
    t = (
        value.detach().double().reshape(())
        if isinstance(value, torch.Tensor)
        else torch.tensor(float(value), dtype=torch.float64)
    )
    return float(all_reduce_sum(t.to(device)))


def global_mean(values: torch.Tensor, weights: torch.Tensor | None = None) -> float:
    """Mean of ``values`` (optionally weighted) over every element on every rank; NaN for no weight."""
    values = values.detach().double().flatten()
    w = (
        torch.ones_like(values)
        if weights is None
        else weights.detach().double().flatten().to(values.device)
    )
    s = all_reduce_sum(torch.stack([torch.where(w > 0, values * w, 0.0).sum(), w.sum()]))
    return (s[0] / s[1]).item() if s[1] > 0 else float("nan")


def any_rank(flag: bool, device: torch.device | str = "cpu") -> bool:
    """True on every rank if ``flag`` is True on any: one decision for all (early stop, abort)."""
    if not is_distributed():
        return bool(flag)
    return bool(all_reduce_max(torch.tensor([int(bool(flag))], device=device))[0])


def all_gather_object(obj):
    """``[obj of rank 0, obj of rank 1, ...]`` (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_cat(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped tensors of every rank along dim 0, in rank order."""
    if not is_distributed():
        return t
    send = t.to(torch.uint8) if t.dtype == torch.bool else t  # gloo has no bool collectives
    parts = [torch.empty_like(send) for _ in range(world_size())]
    dist.all_gather(parts, send.contiguous())
    out = torch.cat(parts, dim=0)
    return out.bool() if t.dtype == torch.bool else out
