"""Helpers of the ``--resume auto``, pre-emption and disk tests: tiny SFT / DPO command lines, the
metrics without their measurements, and the final weights of a run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from proximal.logging import read_metrics

#: Keys whose values are measurements of the machine (clock, memory, utilisation), not of the
#: computation: left out when a resumed run is compared with an uninterrupted one.
MEASUREMENTS = ("time/", "speed/", "perf/", "memory/")


def measured_out(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASUREMENTS)} for r in rows]


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(Path(run_dir) / "metrics.jsonl")


def write_rows(command: str, path: Path, n: int) -> str:
    """``n`` rows of a letter task: SFT pairs, or preference pairs for rm / dpo / simpo."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        x = rng.choice("abcdefgh")
        rows.append(
            {"prompt": f"{x}=", "response": x * 3}
            if command == "sft"
            else {"prompt": f"{x}=", "chosen": x * 2, "rejected": x + ("a" if x != "a" else "b")}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def fixed_argv(
    command: str, base: Path, data: str, out: Path, *extra: str, save_every: int = 1
) -> list[str]:
    """A tiny run of a fixed-data-set command: batches of 8 rows, two passes (``train.epochs``), a
    checkpoint every ``save_every`` steps (0: after the last only)."""
    return [
        command,
        "--model.path",
        str(base),
        "--data.train_file",
        data,
        "--data.max_length",
        "16",
        "--optim.lr",
        "3e-3",
        "--optim.warmup_steps",
        "1",
        "--optim.schedule",
        "linear",
        "--train.steps",
        "null",
        "--train.epochs",
        "2",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.save_every",
        str(save_every),
        "--train.keep_checkpoints",
        "2",
        "--train.device",
        "cpu",
        "--output.dir",
        str(out),
        "--output.progress",
        "false",
        *extra,
    ]


def weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no safetensors in {path}"
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs between {a} and {b}"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on shared cores: one intra-op thread (as tests/trainers/conftest.py does)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def grpo_config(policy: Path | str, prompts: Path | str, run_dir: Path | str, **sections) -> dict:
    """A few cheap GRPO steps (tests/trainers/grpo_support.py's config; that folder is not on the
    path of tests/train)."""
    cfg = {
        "model": {"path": str(policy), "reward_functions": ["ppo_support:frac_a"]},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg
