"""The host's notes (proximal.train.host). The busy-CPU note: other processes' load, not this
process's own.

A process that trains several stages one after the other (``proximal demo``, ``compare``, a
notebook) raises the lagging 1-minute load average itself; the note subtracts its own recent CPU
use, measured as CPU seconds per wall second since the previous note."""

from __future__ import annotations

import os

import pytest

from proximal.train import host


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(host, "_LAST_NOTE", None)


def test_own_load_is_cpu_seconds_per_wall_second_since_the_previous_call():
    assert host.own_load(now=100.0, cpu=5.0) == 0.0  # the first call has nothing to compare with
    assert host.own_load(now=130.0, cpu=65.0) == 2.0  # 60 CPU s over 30 s: two busy threads
    assert host.own_load(now=130.5, cpu=66.0) == 0.0  # under a second: too short to tell
    assert host.own_load(now=140.0, cpu=66.0) == 0.0  # idle since


def test_the_note_counts_only_other_processes_load():
    cores = os.cpu_count() or 1
    threads = 2
    busy = cores + 1.0 - threads + 0.5  # half a core more than the note allows
    assert host.busy_cpu_note(threads, load=busy, own=0.0) is not None
    # the same load average, all of it this process's own previous stage: no note
    assert host.busy_cpu_note(threads, load=busy, own=busy) is None
    # own use never makes the others' load negative
    assert host.busy_cpu_note(threads, load=0.2, own=3.0) is None
    note = host.busy_cpu_note(threads, load=busy + 1.0, own=1.0)
    assert note.startswith(
        f"the CPU is busy (load average {busy:.1f} from other processes on {cores} cores"
    )


def test_the_bfloat16_note_is_for_bfloat16_on_a_cpu_without_its_products():
    note = host.bfloat16_note("cpu", "bf16-mixed", native=False)
    assert note.startswith("train.precision = bf16-mixed on a CPU without bfloat16 products")
    assert "bf16-true" in host.bfloat16_note("cpu", "bf16-true", native=False)
    assert host.bfloat16_note("cpu", "bf16-mixed", native=True) is None
    assert host.bfloat16_note("cpu", "32-true", native=False) is None
    assert host.bfloat16_note("cuda", "bf16-mixed", native=False) is None
    # a float32 run whose decode samples in bfloat16 (rollout.precision) emulates its decode
    note = host.bfloat16_note("cpu", "32-true", "bf16-mixed", native=False)
    assert note.startswith("rollout.precision = bf16-mixed on a CPU without bfloat16 products")
    assert note.endswith("use --rollout.precision null on this CPU")
    assert host.bfloat16_note("cpu", "32-true", None, native=False) is None
    assert host.bfloat16_note("cpu", "32-true", "bf16-true", native=True) is None


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="reads the CPU's flags from Linux")
def test_bfloat16_instructions_follow_the_cpus_flags():
    """oneDNN's bfloat16 path needs AVX-512 BW, VL and DQ, or AVX-NE-CONVERT (True on the Xeon with
    AVX-512 this suite ran on, False on the AVX2-only AMD EPYC)."""
    with open("/proc/cpuinfo") as fh:
        flags = set(next(line for line in fh if line.startswith("flags")).split(":")[1].split())
    want = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert host.bfloat16_instructions() is want
