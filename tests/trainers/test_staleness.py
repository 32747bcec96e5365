"""``rollout.staleness`` through the commands: the schedule a run logs, a resume that is the
uninterrupted run, the correction that applies, PPO's critic on the stale batch, and a generator that
dies or hangs ending the run with the requeue status and no process left behind."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from grpo_support import grpo_config, grpo_main, read_jsonl
from multiproc import children
from ppo_support import checkpoint_dirs, load_safetensors_dir, prompt_texts, without_timing

from proximal.data.jsonl import write_jsonl
from proximal.train.command import EXIT_PREEMPTED

STEPS, CHECKPOINT = 5, 2


def _config(assets, tmp, name: str, staleness: int, **sections) -> dict:
    prompts = tmp / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])
    cfg = grpo_config(
        assets.policy("llama"),
        prompts,
        tmp / name,
        rollout={"group_size": 2, "staleness": staleness},
        grpo={"iterations": 2, "mini_batch_size": 2, "micro_batch_size": 1, "beta": 0.1},
        optim={"lr": 1e-2},
        train={"steps": STEPS, "save_every": CHECKPOINT, "keep_checkpoints": 5},
    )
    for name_, values in sections.items():
        cfg.setdefault(name_, {}).update(values)
    return cfg


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_stale_run_logs_its_schedule_and_the_decoupled_correction(assets, tmp_path, staleness):
    assert grpo_main(_config(assets, tmp_path, "run", staleness)) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [
        max(0, t - 1 - staleness) for t in range(1, STEPS + 1)
    ]
    assert [r["rollout/staleness"] for r in rows] == [
        min(t - 1, staleness) for t in range(1, STEPS + 1)
    ]
    # null correction at staleness >= 1 is tis: its weight and truncated share are logged, and
    # what each correction mode would clip or mask
    assert all("rollout/correction_weight_mean" in r for r in rows)
    for r in rows:
        assert r["rollout/tis_truncated_frac"] == r["rollout/correction_truncated_frac"]
        assert 0 <= r["rollout/token_mask_masked_frac"] <= 1
        assert 0 <= r["rollout/seq_mask_masked_seq_frac"] <= 1
    assert all(r["time/wait_s"] >= 0 for r in rows)
    # stale batches: the trainer's policy is not the sampler's, the mismatch is seen
    assert rows[-1]["rollout/mismatch_k3"] > 1e-6


def test_staleness_0_logs_what_it_logged_before(assets, tmp_path):
    assert grpo_main(_config(assets, tmp_path, "run", 0)) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert not any(k.startswith(("rollout/staleness", "rollout/version")) for r in rows for k in r)
    assert not any("rollout/correction_weight_mean" in r for r in rows)  # null is none here
    assert not any("rollout/tis_truncated_frac" in r for r in rows)


def test_correction_null_is_tis_at_staleness_1_and_off_is_none():
    from proximal.train.sections import RolloutSection

    assert RolloutSection().correction_mode == "none"
    assert RolloutSection(staleness=1).correction_mode == "tis"
    assert RolloutSection(staleness=2, correction="off").correction_mode == "none"
    assert RolloutSection(staleness=1, correction="token_mask").correction_mode == "token_mask"


@pytest.mark.parametrize(
    "staleness",
    [1, pytest.param(2, marks=pytest.mark.cluster)],  # 2: make test-cluster (40 s)
)
def test_a_stale_run_resumed_after_a_crash_is_the_uninterrupted_run(
    assets, tmp_path, monkeypatch, capsys, staleness
):
    """Killed right after the step-2 checkpoint (whose batches in flight it holds), then resumed:
    every metric and sample of every step and the final weights equal the uninterrupted run's."""
    from proximal.train import run

    assert grpo_main(_config(assets, tmp_path, "full", staleness)) == 0, capsys.readouterr().err
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == CHECKPOINT:
            raise SystemExit(f"killed after step {step}")
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 2"):
            grpo_main(_config(assets, tmp_path, "crashed", staleness))
    crashed = tmp_path / "crashed"
    assert grpo_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    full, resumed = (
        read_jsonl(tmp_path / "full" / "metrics.jsonl"),
        read_jsonl(crashed / "metrics.jsonl"),
    )
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full, resumed, strict=True):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    assert read_jsonl(tmp_path / "full" / "samples.jsonl") == read_jsonl(crashed / "samples.jsonl")
    a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / "policy")
    b = load_safetensors_dir(checkpoint_dirs(crashed)[-1] / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


def _generator_pids() -> list[int]:
    """This process's generator children (spawned: their command line names spawn_main)."""
    out = []
    for pid in children(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_generator_that_dies_or_hangs_ends_the_run_for_a_requeue(
    assets, tmp_path, monkeypatch, capsys, fault
):
    """The generator is killed (SIGKILL) or stopped (SIGSTOP: alive, answering nothing) before step 3
    is taken: the run says so in one line and exits 75, and no generator process is left."""
    from proximal.rollout.generator import StaleRollouts

    take = StaleRollouts.take

    def take_with_fault(self, step, device):
        if step == 3:
            os.kill(self.process.pid, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
        return take(self, step, device)

    monkeypatch.setattr(StaleRollouts, "take", take_with_fault)
    before = set(_generator_pids())
    cfg = _config(assets, tmp_path, "run", 1, rollout={"generator_timeout_s": 3.0})
    assert grpo_main(cfg) == EXIT_PREEMPTED
    err = capsys.readouterr().err.strip().splitlines()[-1]
    want = "was killed by SIGKILL" if fault == "crash" else "gave nothing for 3 s"
    assert err.startswith("proximal grpo: the rollout generator (pid ") and want in err, err
    assert "--resume auto" in err
    assert set(_generator_pids()) <= before
    # step 3 trains when its batch came before the fault; no step after it does
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")][:2] == [1, 2]
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) <= 3


def test_ppos_critic_scores_the_stale_batch_as_it_is_now(assets, tmp_path, monkeypatch):
    """PPO at staleness 1: the batch of step t (sampled by the policy of step t − 1) gets its values
    from the critic as it is at step t, after t − 1 updates — not from the critic of the sampling
    policy's time: each experience's critic weights are those the previous update left."""
    from ppo_support import ppo_main, tiny_config

    from proximal.trainers import ppo

    seen = []
    compute = ppo.compute_experience

    def spy(*args, **kwargs):
        critic = kwargs["critic"]
        seen.append(torch.cat([p.detach().flatten().clone() for p in critic.parameters()]))
        return compute(*args, **kwargs)

    monkeypatch.setattr(ppo, "compute_experience", spy)
    after = []
    update = ppo.ppo_update

    def update_spy(*args, **kwargs):
        out = update(*args, **kwargs)
        critic = kwargs["critic"].module
        after.append(torch.cat([p.detach().flatten().clone() for p in critic.parameters()]))
        return out

    monkeypatch.setattr(ppo, "ppo_update", update_spy)
    prompts = tmp_path / "prompts.jsonl"
    write_jsonl(prompts, [{"prompt": p} for p in prompt_texts(6)])
    cfg = tiny_config(
        assets.policy("llama"),
        prompts,
        tmp_path / "run",
        rollout={"staleness": 1},
        optim={"lr": 1e-2, "critic_lr": 1e-2, "warmup_steps": 0},
        train={"steps": 3},
    )
    assert ppo_main(cfg) == 0
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1]
    assert len(seen) == 3 and len(after) == 3
    for t in (1, 2):  # step t + 1's experience read the critic update t left
        assert torch.equal(seen[t], after[t - 1])
    # step 3's batch was sampled by version 1; its values are the critic's after update 2, which
    # moved it (update 1 did not: step 1's value loss is 0, every score and value being 0)
    assert rows[2]["rollout/version"] == 1 and not torch.equal(seen[2], seen[1])


def test_the_correction_at_staleness_1_is_decoupled_ppo_on_a_two_version_toy():
    """A policy of two versions over 5 tokens: the response was sampled by version 0 (μ), the
    trainer's policy is version 1 (π_old, recomputed; π_θ = π_old at the update's first step). The
    run's correction (rollout.correction null at staleness 1) weights each token's surrogate by
    min(π_old/μ, C), C = 2 — hand-computed here, one ratio above C — and the gradient of the loss
    with respect to π_θ's logits is −min(π_old/μ, C)·A·(e_y − softmax(z₁))/T at each token."""
    import dataclasses
    from types import SimpleNamespace

    from proximal.trainers.grpo import GRPOConfig, GRPOUpdate, correction_weights_of, policy_loss

    cfg = GRPOConfig()
    cfg.rollout.staleness = 1
    s = dataclasses.replace(GRPOUpdate.of(cfg, 3), beta=0.0, aggregation="token-mean")
    assert s.correction == "tis" and s.correction_cap == 2.0
    z0 = torch.tensor(
        [[0.0, 1.0, -1.0, 0.5, 0.0], [2.0, 0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
        dtype=torch.float64,
    )
    z1 = z0 + torch.tensor(
        [[0.3, 0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.4, 0.0, 0.0]],
        dtype=torch.float64,
    )
    y = torch.tensor([0, 1, 2])
    p0, p1 = z0.softmax(-1), z1.softmax(-1)
    ratio = [float(p1[t, y[t]] / p0[t, y[t]]) for t in range(3)]  # π_old / μ per token
    assert ratio[1] > 2 > ratio[0] > 1 > ratio[2]  # one truncated, one above 1, one below
    want_w = torch.tensor([[min(r, 2.0) for r in ratio]], dtype=torch.float64)
    mu = p0.log().gather(1, y[:, None]).T  # (1, 3)
    old = p1.log().gather(1, y[:, None]).T
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = correction_weights_of(s, old, mu, mask)
    torch.testing.assert_close(w, want_w, rtol=0, atol=1e-12)
    z = z1.clone().requires_grad_(True)
    logprobs = z.log_softmax(-1).gather(1, y[:, None]).T
    A = 0.7
    m = SimpleNamespace(ref_logprobs=None, advantages=torch.full((1,), A, dtype=torch.float64))
    loss, _ = policy_loss(s, logprobs, old, m, mask, None, w)
    loss.backward()
    onehot = torch.nn.functional.one_hot(y, 5).double()
    want = -want_w.T * A * (onehot - p1) / 3
    torch.testing.assert_close(z.grad, want, rtol=0, atol=1e-12)


def test_a_finished_stale_run_extended_samples_its_next_batches_with_its_last_weights(
    assets, tmp_path, capsys
):
    """A run of 3 steps at staleness 1 is resumed with train.steps 5: its checkpoint holds no
    batch in flight (none was requested past its end), so steps 4 and 5 are sampled by version 3,
    the only one there is (docs/async.md, Resume)."""
    cfg = _config(assets, tmp_path, "run", 1, train={"steps": 3, "save_every": 3})
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    run = tmp_path / "run"
    assert grpo_main(None, "--resume", str(run), "--train.steps", "5") == 0, capsys.readouterr().err
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1, 3, 3]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 0, 1]


def test_the_trainers_cores_and_threads_are_put_back_at_the_runs_end(assets, tmp_path):
    """A staleness run on CPU pins the trainer to its cores and threads while it runs (the
    generator has the others); a Python caller gets its process back as it was."""
    before = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
    assert grpo_main(_config(assets, tmp_path, "run", 1, train={"steps": 2})) == 0
    assert (sorted(os.sched_getaffinity(0)), torch.get_num_threads()) == before
