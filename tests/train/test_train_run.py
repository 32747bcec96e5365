"""A run's life outside the trainers (``proximal.train.run``): when periodic actions fall due, the
per-process divisibility checks, the run directory's overwrite guard, the device a run takes, and
the memory figures it logs.

The process count is set the way torchrun sets it (``WORLD_SIZE``, ``LOCAL_RANK``); CUDA is faked
through ``torch.cuda``'s two queries, so the device rules are checked on any machine.
"""

from __future__ import annotations

import mmap
import os

import pytest
import torch

from proximal.config import ConfigError
from proximal.train.records import resident_models
from proximal.train.run import (
    check_per_rank,
    due,
    earlier_run,
    peak_memory_bytes,
    resolve_device,
)


@pytest.fixture
def launched(monkeypatch):
    """``launched(world, local_rank)``: the environment torchrun gives one of its processes."""

    def set_env(world: int, local_rank: int = 0):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    return set_env


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: a machine with ``n`` CUDA devices, as ``torch.cuda`` reports them."""

    def set_count(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


# ----------------------------------------------------------------------------------------------
# due
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step, total, every, expected",
    [
        (2, 10, 2, True),
        (3, 10, 2, False),
        (9, 10, 3, True),
        (7, 10, 3, False),
        (10, 10, 3, True),  # the last step, though 3 does not divide it
        (10, 10, 0, True),  # every = 0: only after the last step
        (5, 10, 0, False),
        (1, 1, 0, True),
    ],
)
def test_due_every_n_steps_and_always_after_the_last(step, total, every, expected):
    assert due(step, total, every) is expected


# ----------------------------------------------------------------------------------------------
# check_per_rank
# ----------------------------------------------------------------------------------------------


def _check(*args) -> list[str]:
    errors: list[str] = []
    check_per_rank(errors, *args)
    return errors


def test_one_process_divides_everything(launched):
    assert _check("rollout.batch_size", 7) == []
    assert _check("rollout.batch_size", 8, "ppo.micro_batch_size", 8) == []


def test_a_total_the_processes_do_not_divide(launched):
    launched(4)
    assert _check("rollout.batch_size", 6) == [
        "rollout.batch_size = 6 is not divisible by the 4 processes (torchrun --nproc_per_node × nodes)"
    ]
    assert _check("rollout.batch_size", 8) == []


def test_a_rank_share_the_micro_batch_does_not_divide(launched):
    launched(2)
    assert _check("train.batch_size", 8, "train.micro_batch_size", 8) == [
        "train.batch_size = 8 over 2 processes is 4 rows each, not divisible by "
        "train.micro_batch_size = 8"
    ]
    assert _check("train.batch_size", 8, "train.micro_batch_size", 2) == []
    assert _check("train.batch_size", 8, "train.micro_batch_size", 4) == []
    # A total the micro-batch does not divide at all is the caller's own message, not a second one
    assert _check("train.batch_size", 8, "train.micro_batch_size", 3) == []


# ----------------------------------------------------------------------------------------------
# earlier_run: the run directory's guard
# ----------------------------------------------------------------------------------------------


def test_a_new_or_empty_directory_has_nothing_to_delete(tmp_path):
    assert earlier_run(tmp_path / "new", overwrite=False) == []
    (tmp_path / "empty").mkdir()
    assert earlier_run(tmp_path / "empty", overwrite=False) == []


@pytest.mark.parametrize("marker", ["config.yaml", "metrics.jsonl", "checkpoints"])
def test_a_run_is_refused_without_overwrite_and_listed_with_it(tmp_path, marker):
    run = tmp_path / "run"
    run.mkdir()
    (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("x")
    (run / "notes.txt").write_text("the user's")
    with pytest.raises(FileExistsError, match=f"continue it with --resume {run}"):
        earlier_run(run, overwrite=False)
    assert earlier_run(run, overwrite=True) == [run / marker, run / "notes.txt"]  # all, sorted


def test_a_directory_that_is_no_run_is_never_deleted(tmp_path):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="does not look like a run directory"):
            earlier_run(other, overwrite=overwrite)
    assert (other / "cat.jpg").exists()


def test_a_file_in_place_of_the_directory(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        earlier_run(tmp_path / "out", overwrite=True)


# ----------------------------------------------------------------------------------------------
# resolve_device
# ----------------------------------------------------------------------------------------------


def test_cpu_and_auto_without_cuda(launched, gpus):
    gpus(0)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="'cuda', but this machine has no CUDA devices"):
        resolve_device("cuda")


def test_one_process_takes_the_cuda_device_it_names(launched, gpus):
    gpus(2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="'cuda:2', but this machine has 2 CUDA devices"):
        resolve_device("cuda:2")


def test_under_torchrun_each_process_takes_its_local_rank(launched, gpus):
    gpus(2)
    launched(2, local_rank=1)
    assert resolve_device("cuda") == torch.device("cuda:1")
    assert resolve_device("auto") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match="under torchrun give 'cuda'"):
        resolve_device("cuda:0")
    launched(4, local_rank=3)  # more processes on the node than devices
    with pytest.raises(ConfigError, match="'cuda:3', but this machine has 2 CUDA devices"):
        resolve_device("cuda")


# ----------------------------------------------------------------------------------------------
# Memory: the peak resident set, and the models a run holds
# ----------------------------------------------------------------------------------------------


def _resident_bytes() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _can_reset_peak() -> bool:
    """Whether Linux lets this process reset its high-water mark (asked without resetting it)."""
    return os.access("/proc/self/clear_refs", os.W_OK)


def test_cpu_peak_is_the_resident_high_water_mark_since_the_last_call():
    mib = 1 << 20
    peak_memory_bytes(torch.device("cpu"))  # start a new interval
    before = _resident_bytes()
    # 96 MiB of fresh pages, every one written: mapped here, so no allocator can serve them from
    # memory already resident (torch's would, after earlier tests freed as much)
    block = mmap.mmap(-1, 96 * mib)
    for page in range(0, 96 * mib, mmap.PAGESIZE):
        block[page] = 1
    block.close()
    first = peak_memory_bytes(torch.device("cpu"))
    assert before + 92 * mib <= first <= before + 128 * mib  # the block, and little else
    if _can_reset_peak():  # Linux ≥ 4.0; elsewhere the peak is the process's, and only grows
        second = peak_memory_bytes(torch.device("cpu"))
        assert second < first - 64 * mib  # the 96 MiB were freed: no longer in this interval


def test_resident_models_counts_each_parameter_once():
    policy = torch.nn.Linear(3, 4)  # 12 + 4 parameters, float32
    policy.bias.requires_grad_(False)
    reward = torch.nn.Linear(2, 2, bias=False).to(torch.bfloat16)  # 4 parameters, 2 bytes each
    critic = torch.nn.Sequential(policy, torch.nn.Linear(4, 1))  # shares the policy's 16
    got = resident_models(policy=policy, reference=policy, reward=reward, critic=critic, ref2=None)
    assert got == {
        "policy": {"parameters": 16, "bytes": 64, "dtypes": ["float32"], "trainable": 12},
        "reward": {"parameters": 4, "bytes": 8, "dtypes": ["bfloat16"], "trainable": 4},
        "critic": {"parameters": 5, "bytes": 20, "dtypes": ["float32"], "trainable": 5},
    }  # the reference is the policy (LoRA's adapters off): counted once, under the first name


def test_resident_models_lists_every_dtype_of_a_mixed_model():
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1).to(torch.bfloat16))
    got = resident_models(m=mixed)["m"]
    assert got["dtypes"] == ["bfloat16", "float32"]
    assert (got["parameters"], got["bytes"]) == (9, 6 * 4 + 3 * 2)
