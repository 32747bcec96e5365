"""The host process, set up once by the command line: the memory allocator, a warning when the
CPU is shared, and one when it would emulate bfloat16.

**Allocator.** glibc's malloc serves a large block (over its mmap threshold, at most 32 MiB) with a
fresh ``mmap`` and returns it to the system when freed, so the next tensor of that size faults in
every page again. A training step allocates and frees tensors of hundreds of MiB many times (the
vocabulary-sized logits and their gradient, each chunk of the log-softmax): measured on a 2-core
CPU, a 125 MiB ``sub`` + ``exp_`` + ``mul_`` took 280 ms from fresh pages and 54 ms from reused ones.
:func:`tune_allocator` raises the mmap and trim thresholds (``mallopt``) so such blocks come from the
heap and are kept for reuse: the process's resident set stays near its peak instead of shrinking
between steps, and the peak itself does not grow. The command line applies it; a library user can
call it, or not. ``PROXIMAL_MALLOC=system`` turns it off.

**Shared CPU.** Small models on a few cores are dominated by thread synchronisation; when other
processes compete for the cores, a step can be ten times slower. :func:`busy_cpu_note` says so.

**bfloat16 without the instructions.** ``train.precision`` (or a decode's ``rollout.precision``)
bf16-mixed or bf16-true on a CPU without bfloat16 products (AVX2-only CPUs such as AMD's Zen 3)
runs, but torch emulates every product: :func:`bfloat16_note` says so at the start, with what to use
instead. It asks torch whether the CPU has them (:func:`proximal.models.kernels.bfloat16_instructions`);
whether oneDNN's packed bfloat16 decode works is a separate, tried answer
(:func:`proximal.models.kernels.packs_bfloat16`).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_TUNED = False


def bfloat16_instructions() -> bool | None:
    """:func:`proximal.models.kernels.bfloat16_instructions`, imported when first asked: the command
    line imports this module, and ``proximal --help`` loads no torch."""
    # lazy: torch, which `proximal --help` never loads
    from proximal.models.kernels import bfloat16_instructions as ask

    return ask()


def tune_allocator(threshold: int = 1 << 30) -> bool:
    """Serve allocations below ``threshold`` bytes from glibc's heap and keep freed memory for reuse.
    Returns whether it applied (Linux with glibc, and not turned off by ``PROXIMAL_MALLOC=system``)."""
    global _TUNED
    if _TUNED:
        return True
    if os.environ.get("PROXIMAL_MALLOC", "").lower() == "system" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        # One arena: the intra-op worker threads' allocations come from the same heap, not from
        # per-thread heaps that cannot hold a block over 64 MiB and mmap it instead.
        ok = all(
            libc.mallopt(option, value) == 1
            for option, value in (
                (_M_MMAP_THRESHOLD, int(threshold)),
                (_M_TRIM_THRESHOLD, 2**31 - 1),
                (_M_ARENA_MAX, 1),
            )
        )
    except (OSError, AttributeError):  # musl, or no glibc
        return False
    _TUNED = ok
    return ok


_LAST_NOTE: tuple[float, float] | None = None  # (monotonic time, process CPU time) at the last note


def own_load(now: float | None = None, cpu: float | None = None) -> float:
    """This process's own share of the load average: its CPU seconds (all threads) per wall second
    since the previous call, 0 at the first. A process that runs several trainings one after the
    other (``proximal demo``, ``proximal compare``, a notebook) would otherwise read its own last
    stage in the lagging load average and call the machine busy."""
    global _LAST_NOTE
    now = time.monotonic() if now is None else now
    cpu = time.process_time() if cpu is None else cpu
    previous, _LAST_NOTE = _LAST_NOTE, (now, cpu)
    if previous is None or now - previous[0] < 1.0:
        return 0.0
    return max(0.0, (cpu - previous[1]) / (now - previous[0]))


def busy_cpu_note(
    threads: int, *, load: float | None = None, own: float | None = None
) -> str | None:
    """A one-line note when the cores are oversubscribed: the 1-minute load average less this
    process's own recent use (:func:`own_load`) — what other processes ask for; it lags, so a run
    that just ended still counts for a while — plus this process's ``threads`` exceed the cores by
    more than one core. ``load`` and ``own`` stand in for the measurements (tests)."""
    try:
        load = os.getloadavg()[0] if load is None else load
    except OSError:
        return None
    load = max(0.0, load - (own_load() if own is None else own))
    cores = os.cpu_count() or 1
    if load + threads <= cores + 1.0:
        return None
    return (
        f"the CPU is busy (load average {load:.1f} from other processes on {cores} cores, and {threads} "
        "torch threads here): steps "
        "will be slower than on an idle machine, up to 10x for small models; give this run the free cores "
        "(OMP_NUM_THREADS) or run it alone"
    )


def bfloat16_note(
    device, precision: str, rollout_precision: str | None = None, native: bool | None = None
) -> str | None:
    """A one-line note when a run computes in bfloat16 — ``precision`` (``train.precision``) or
    ``rollout.precision`` (the decode's own, where it differs) bf16-mixed or bf16-true — on a CPU
    whose products cannot (:func:`proximal.models.kernels.bfloat16_instructions`; ``native`` stands
    in for it in tests): torch then emulates them, many times slower than float32. None on other
    devices, in float32, where the CPU has them, or where torch cannot say."""
    field, value = (
        ("train.precision", precision)
        if precision.startswith("bf16")
        else ("rollout.precision", rollout_precision or "")
    )
    if getattr(device, "type", device) != "cpu" or not value.startswith("bf16"):
        return None
    if (bfloat16_instructions() if native is None else native) is not False:
        return None
    instead = (
        "--train.precision 32-true" if field == "train.precision" else "--rollout.precision null"
    )
    return (
        f"{field} = {value} on a CPU without bfloat16 products (oneDNN's bfloat16 path "
        "needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT): torch emulates them, and steps are many times "
        "slower than in float32 (measured on an AVX2-only AMD EPYC, a tiny PPO step: 81 s against "
        f"3.7 s); use {instead} on this CPU"
    )
