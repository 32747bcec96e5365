"""What a cluster does to a run, through real ``torchrun`` launches (marker ``cluster``: tens of
seconds each, run by ``make test-cluster``, left out of ``make test``).

- Two "nodes" on one host — two torchrun launches, one process each, joined by one rendezvous
  (c10d: ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint localhost:PORT --rdzv-id ID``; static:
  ``--nnodes 2 --node-rank 0/1 --master-addr localhost --master-port PORT``) — compute the
  single-node two-process run: the same metrics and the same final weights. (``--node-rank`` is
  for the static form only: with c10d torchrun ignores it, with a warning.)
- Elastic restart: ``torchrun --max-restarts 1 ... --resume auto`` with rank 1 killed (SIGKILL) in the
  middle of step 3; torchrun restarts the group, which resumes from step 2's checkpoint by itself
  and ends with the uninterrupted run's metrics and weights.

The reference is the same config run by ``train()`` on two forked processes (``multiproc``): the
same code, the same rank layout and the same reductions in the same order, so the comparison is
exact (bitwise; measured so). Should another launcher ever change a summation order, the bound to
fall back on is the 1-vs-2-process tolerance of ``test_run_invariance``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cluster_support import KILL_VAR, MARK_VAR, free_port, torchrun, torchrun_env
from multiproc import launch, run_launched, run_ranks
from ppo_support import load_safetensors_dir, read_jsonl, tiny_config, without_timing, write_yaml

pytestmark = pytest.mark.cluster

STEPS, SAVE_EVERY = 4, 2
EXPORT = f"checkpoints/step_{STEPS:06d}/policy"


def _config(assets, run_dir: Path) -> dict:
    return tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={
            "reward_model": str(assets.reward_model("llama")),
            "critic": "reward_model",
            "reward_functions": ["cluster_support:frac_a_or_die"],
        },
        rollout={"batch_size": 4, "max_new_tokens": 6},
        ppo={"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 1},
        kl={"controller": "adaptive", "target": 0.05, "beta": 0.1},
        train={"steps": STEPS, "save_every": SAVE_EVERY, "dist_timeout_s": 60},
    )


def _ppo_in_rank(config: str) -> None:
    from proximal.config import load_config
    from proximal.trainers import ppo

    ppo.train(load_config(ppo.PPOConfig, config))


def _result(run_dir: Path) -> tuple[list[dict], dict]:
    return read_jsonl(run_dir / "metrics.jsonl"), load_safetensors_dir(run_dir / EXPORT)


@pytest.fixture(scope="module")
def reference(assets, tmp_path_factory):
    """The uninterrupted single-node two-process run: (metrics, final policy weights)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    config = write_yaml(run_dir.with_suffix(".yaml"), _config(assets, run_dir))
    run_ranks(2, _ppo_in_rank, str(config), timeout_s=300)
    return _result(run_dir)


def _assert_same_run(got: tuple[list[dict], dict], want: tuple[list[dict], dict]) -> None:
    (rows, weights), (ref_rows, ref_weights) = got, want
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [without_timing(r) for r in rows] == [without_timing(r) for r in ref_rows]
    assert weights.keys() == ref_weights.keys()
    for k in weights:
        assert weights[k].equal(ref_weights[k]), k
    assert len({r["kl/beta"] for r in rows}) > 1  # the controller's state moved (and was restored)


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """Wait for every launch (killing all of them, workers included, past ``timeout``); their
    (status, output)."""
    deadline = time.monotonic() + timeout
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            text, _ = p.communicate()
            text += f"\n[test] killed after {timeout} s"
        out.append((p.returncode, text))
    return out


def _node_flags(form: str, node: int, port: int) -> list[str]:
    """The rendezvous flags of one "node" as docs/operations.md shows them (PORT: a free port)."""
    if form == "c10d":  # the same line on every node; ranks are assigned as the nodes join
        return [
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes",
        ]  # fmt: skip
    return [  # static: a fixed address and each node's own --node-rank
        "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
        "--master-addr", "localhost", "--master-port", str(port),
    ]  # fmt: skip


@pytest.mark.parametrize("form", ["c10d", "static"])
def test_two_nodes_on_one_host_reproduce_the_two_process_run(assets, tmp_path, reference, form):
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "ppo.yaml", _config(assets, run_dir))
    port = free_port()
    with contextlib.ExitStack() as launched:  # both nodes killed, workers included, however it ends
        procs = [
            launched.enter_context(
                launch(
                    torchrun(*_node_flags(form, node, port)) + ["ppo", "--config", str(config)],
                    cwd=tmp_path,
                    env=torchrun_env(),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
            for node in (0, 1)
        ]
        done = _finish(procs, timeout=300)
    for node, (code, text) in enumerate(done):
        assert code == 0, f"node {node}:\n{text[-3000:]}"
    assert sum(text.count("proximal ppo: done") for _, text in done) == 1  # rank 0, on one node
    shards = list((run_dir / EXPORT).parent.joinpath("state").glob("*.distcp"))
    assert len(shards) == 2  # one per node's process, in the one shared run directory
    _assert_same_run(_result(run_dir), reference)


def test_elastic_restart_resumes_by_itself_after_a_rank_is_killed(assets, tmp_path, reference):
    """``torchrun --max-restarts 1 ... --resume auto``: rank 1 kills itself (SIGKILL) in the middle
    of step 3 of the first attempt; torchrun stops rank 0 and starts the group again with the same
    command line, which finds step 2's checkpoint and finishes the run as if nothing had happened."""
    run_dir = tmp_path / "run"
    config = write_yaml(tmp_path / "ppo.yaml", _config(assets, run_dir))
    command = torchrun("--standalone", "--nproc-per-node", "2", "--max-restarts", "1")
    done = run_launched(
        command + ["ppo", "--config", str(config), "--resume", "auto"],
        timeout=300,
        cwd=tmp_path,
        env=torchrun_env(**{KILL_VAR: "1:3", MARK_VAR: str(tmp_path / "killed")}),
    )
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert (tmp_path / "killed").read_text() == "rank 1 killed at step 3\n"
    assert text.count("--resume auto: continuing from step_000002") == 1, text[-4000:]  # rank 0
    assert not list((run_dir / "checkpoints").glob(".step_*"))  # nothing half-written is left
    _assert_same_run(_result(run_dir), reference)
