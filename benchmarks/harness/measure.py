"""Running one side of a benchmark as a fresh child process and measuring it from outside.

The whole-process wall time is from spawn to exit (imports, loading, training, the end-of-run save).
The peak RSS is the child's own ``ru_maxrss`` from ``os.wait4`` on its pid: per process, so one run's
peak never leaks into the next (``getrusage(RUSAGE_CHILDREN)`` keeps the maximum over all children
ever waited for). Before each run the machine's load is sampled: ``/proc/loadavg`` and the CPU time
other processes used over one second (/proc/stat), so a loaded machine shows in the results.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import threading
import time
from pathlib import Path


def cpu_busy(seconds: float = 1.0) -> float:
    """Busy CPUs (0..cores) over ``seconds`` from /proc/stat: the load of everything else on the machine,
    read while the harness itself sleeps."""

    def snap():
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)
        return sum(v), idle

    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except OSError:
        return float("nan")
    total = t1 - t0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / total) if total else 0.0


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def run_measured(
    cmd: list[str], *, env: dict, log_path: Path, timeout_s: float, cwd: str | None = None
) -> dict:
    """Run ``cmd`` to the end; return its exit code, wall seconds and peak RSS (MiB), output to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        t0 = time.perf_counter()
        p = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
        )
        timer = threading.Timer(timeout_s, lambda: os.killpg(p.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return {
        "rc": p.returncode,
        "wall_s": wall,
        "peak_rss_mib": ru.ru_maxrss / 1024.0,
        "user_s": ru.ru_utime,
        "sys_s": ru.ru_stime,
        "timed_out": p.returncode == -signal.SIGKILL,
    }


def machine() -> dict:
    """What the results were measured on: CPU model, cores, memory, OS."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
                break
        flags = next((ln for ln in out.splitlines() if ln.startswith("Flags:")), "")
    except OSError:
        flags = ""
    mem = ""
    try:
        mem = (
            next(
                ln
                for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")
            )
            .split(":")[1]
            .strip()
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "memory": mem,
        "amx_bf16": "amx_bf16" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


BUSY_NOTE = "other processes share the cores; this run's times are not meaningful"
