"""The real ``proximal distill`` command end to end on tiny models: a healthy run; the teacher equal
to the student gives exactly zero advantages, loss and gradient; a verifier's reward in the
advantage; a teacher with another tokenizer in one line, exit 2, before training; resume equals the
uninterrupted run bitwise."""

from __future__ import annotations

import math

import pytest
import torch
from ppo_support import (
    checkpoint_dirs,
    command_main,
    load_safetensors_dir,
    prompt_texts,
    read_jsonl,
    without_timing,
)

from proximal.data.jsonl import write_jsonl


@pytest.fixture(scope="module")
def teacher(assets, tmp_path_factory):
    """A tiny Llama with the student's tokenizer and other weights."""
    from proximal.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(
        tmp_path_factory.mktemp("teacher") / "t", assets.tokenizer, arch="llama", seed=7
    )


def distill_config(student, teacher, prompts, run_dir, **sections) -> dict:
    cfg = {
        "model": {"path": str(student), "teacher": str(teacher)},
        "data": {"prompts": str(prompts), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 8},
        "distill": {"micro_batch_size": 2},
        "optim": {"lr": 1e-3},
        "train": {"steps": 2, "seed": 0, "device": "cpu"},
        "output": {"dir": str(run_dir), "progress": False, "samples_per_step": 2},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def distill_main(config: dict | None, *args: str) -> int:
    return command_main("distill", config, *args)


HEALTHY = (
    "distill/reverse_kl",
    "response/length_mean",
    "response/eos_frac",
    "policy/entropy",
    "policy/clipfrac",
    "loss/policy",
    "advantage/token_mean",
    "grad_norm/actor",
    "speed/gen_tokens_per_s",
    "time/wall_s",
)


def test_a_two_step_run_is_healthy(assets, teacher, tmp_path, capsys):
    cfg = distill_config(assets.policy("llama"), teacher, assets.prompts, tmp_path / "run")
    assert distill_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        bad = {k: r.get(k) for k in HEALTHY if r.get(k) is None or not math.isfinite(r[k])}
        assert not bad, f"step {r['step']}: missing or non-finite {bad}"
        assert r["grad_norm/actor"] > 0 and r["policy/optimizer_steps"] == 1
        assert "kl/ref_k3" not in r and r["loss/kl"] == 0.0  # no KL term: the teacher is the signal
        assert "score/mean" not in r  # no reward source
        # one optimiser step on the batch: the ratio is 1, the loss is −mean(Â) over the tokens,
        # and the mean advantage is minus the sampled reverse KL
        assert r["loss/policy"] == pytest.approx(-r["advantage/token_mean"], abs=1e-6)
        assert r["advantage/token_mean"] == pytest.approx(-r["distill/reverse_kl"], abs=1e-5)
    assert (tmp_path / "run" / "model.safetensors").is_file() or any(
        (tmp_path / "run").glob("*.safetensors")
    )


def test_teacher_equal_to_the_student_gives_zero_advantages_loss_and_gradient(
    assets, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import grpo

    grads = []
    step = grpo.clip_and_step

    def record_then_step(model, opt, sched, max_norm, **kw):
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        return step(model, opt, sched, max_norm, **kw)

    monkeypatch.setattr(grpo, "clip_and_step", record_then_step)
    policy = assets.policy("llama")
    cfg = distill_config(policy, policy, assets.prompts, tmp_path / "same")
    assert distill_main(cfg) == 0, capsys.readouterr().err
    for r in read_jsonl(tmp_path / "same" / "metrics.jsonl"):
        assert r["distill/reverse_kl"] == 0.0
        assert r["advantage/token_mean"] == 0.0
        assert r["advantage/max"] == 0.0 and r["advantage/min"] == 0.0
        assert r["loss/policy"] == 0.0 and r["grad_norm/actor"] == 0.0
    assert len(grads) == 2 and all(torch.count_nonzero(g) == 0 for gs in grads for g in gs)


def test_the_jsd_loss_runs_and_equals_the_divergence_of_the_two_models(
    assets, teacher, tmp_path, monkeypatch, capsys
):
    """distill.loss jsd: a healthy run whose first loss is JSD(β) over the vocabulary, a mean over
    the batch's tokens, recomputed here from both models' full logits (core.generalized_jsd)."""
    from proximal.core import generalized_jsd
    from proximal.models.heads import lm_logits
    from proximal.models.loading import load_causal_lm
    from proximal.trainers import distill

    seen = []
    update = distill.jsd_update

    def spy(exp, *args, **kw):
        seen.append(exp)
        return update(exp, *args, **kw)

    monkeypatch.setattr(distill, "jsd_update", spy)
    student = assets.policy("llama")
    cfg = distill_config(
        student,
        teacher,
        assets.prompts,
        tmp_path / "jsd",
        distill={"loss": "jsd", "beta": 0.3, "micro_batch_size": 1},
        rollout={"temperature": 0.8},
    )
    assert distill_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(tmp_path / "jsd" / "metrics.jsonl")
    for r in rows:
        assert r["distill/jsd"] > 0 and r["grad_norm/actor"] > 0
        assert r["loss/total"] == pytest.approx(r["distill/jsd"], rel=1e-5)
    exp = seen[0]  # step 1: the student is still model.path
    ro = exp.rollout
    P, L = ro.prompt_ids.shape[1], ro.input_ids.shape[1]
    with torch.no_grad():
        zs = lm_logits(load_causal_lm(str(student)), ro.input_ids, ro.attention_mask, P - 1, L - 1)
        zt = lm_logits(load_causal_lm(str(teacher)), ro.input_ids, ro.attention_mask, P - 1, L - 1)
    want, _ = generalized_jsd(zs.double(), zt.double(), exp.mask, 0.3, 0.8)
    assert rows[0]["distill/jsd"] == pytest.approx(want.item(), rel=1e-5)


def test_the_jsd_loss_is_exactly_zero_when_the_teacher_is_the_student(
    assets, tmp_path, monkeypatch, capsys
):
    from proximal.trainers import grpo

    grads = []
    step = grpo.clip_and_step

    def record_then_step(model, opt, sched, max_norm, **kw):
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        return step(model, opt, sched, max_norm, **kw)

    from proximal.trainers import distill

    monkeypatch.setattr(distill, "clip_and_step", record_then_step)
    policy = assets.policy("llama")
    cfg = distill_config(policy, policy, assets.prompts, tmp_path / "same", distill={"loss": "jsd"})
    assert distill_main(cfg) == 0, capsys.readouterr().err
    for r in read_jsonl(tmp_path / "same" / "metrics.jsonl"):
        assert r["distill/jsd"] == 0.0 and r["loss/total"] == 0.0 and r["grad_norm/actor"] == 0.0
    assert len(grads) == 2 and all(torch.count_nonzero(g) == 0 for gs in grads for g in gs)


def test_jsd_needs_the_same_output_rows_and_reverse_kl_does_not(assets, tmp_path, capsys):
    """A teacher with the student's tokenizer but 8 padded output rows (as model families pad their
    vocabulary): distill.loss jsd refuses it in one line before training; reverse_kl, which reads
    the sampled tokens only, trains."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = assets.policy("llama")
    padded = tmp_path / "padded"
    model = AutoModelForCausalLM.from_pretrained(student)
    model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
    model.save_pretrained(padded)
    AutoTokenizer.from_pretrained(student).save_pretrained(padded)
    capsys.readouterr()  # transformers' own progress lines
    cfg = distill_config(student, padded, assets.prompts, tmp_path / "j", distill={"loss": "jsd"})
    assert distill_main(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "output layer has" in err[0] and "rows" in err[0], err
    assert not (tmp_path / "j" / "metrics.jsonl").exists()
    cfg = distill_config(student, padded, assets.prompts, tmp_path / "r", train={"steps": 1})
    assert distill_main(cfg) == 0, capsys.readouterr().err


def test_jsd_takes_no_reward_and_no_discount(assets, teacher, tmp_path, capsys):
    cfg = distill_config(
        assets.policy("llama"),
        teacher,
        assets.prompts,
        tmp_path / "bad_jsd",
        model={"reward_functions": ["ppo_support:frac_a"]},
        distill={"loss": "jsd", "discount": 0.5},
    )
    assert distill_main(cfg) == 2
    err = capsys.readouterr().err
    assert "distill.loss jsd takes no reward" in err and "distill.discount = 0.5" in err


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_a_lora_student_trains(assets, teacher, tmp_path, loss, capsys):
    cfg = distill_config(
        assets.policy("llama"),
        teacher,
        assets.prompts,
        tmp_path / loss,
        model={"lora_r": 4, "lora_alpha": 8.0},
        distill={"loss": loss},
    )
    assert distill_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(tmp_path / loss / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm/actor"] > 0 for r in rows)
    assert (tmp_path / loss / "model.safetensors").is_file()  # merged (output.merge_lora)


def _with_completions(tmp_path, n: int = 6):
    path = tmp_path / "written.jsonl"
    write_jsonl(
        path, [{"prompt": p, "completion": "ab" * (i + 1)} for i, p in enumerate(prompt_texts(n))]
    )
    return path


def test_lam_one_trains_on_the_teacher_written_completions(assets, teacher, tmp_path, capsys):
    prompts = _with_completions(tmp_path)
    cfg = distill_config(
        assets.policy("llama"),
        teacher,
        prompts,
        tmp_path / "lam1",
        distill={"loss": "jsd", "lam": 1.0},
        output={"samples_per_step": 4},
    )
    assert distill_main(cfg) == 0, capsys.readouterr().err
    rows = read_jsonl(tmp_path / "lam1" / "metrics.jsonl")
    assert all(r["distill/teacher_written_frac"] == 1.0 and r["distill/jsd"] > 0 for r in rows)
    # no student rows: the sampled reverse KL has nothing to average
    assert all(r["distill/reverse_kl"] == 0.0 for r in rows)
    want = {r["prompt"]: r["completion"] for r in read_jsonl(prompts)}
    samples = read_jsonl(tmp_path / "lam1" / "samples.jsonl")
    assert samples and all(x["teacher_written"] for x in samples)
    for x in samples:  # the completion and the EOS, cut at rollout.max_new_tokens = 8
        assert x["response"] == want[x["prompt"]][:8], x


def test_lam_draws_each_row_alike_on_every_run(assets, teacher, tmp_path, capsys):

    prompts = _with_completions(tmp_path)
    for name in ("a", "b"):
        cfg = distill_config(
            assets.policy("llama"),
            teacher,
            prompts,
            tmp_path / name,
            distill={"loss": "jsd", "lam": 0.5},
            output={"samples_per_step": 4},
        )
        assert distill_main(cfg) == 0, capsys.readouterr().err
    a = [x["teacher_written"] for x in read_jsonl(tmp_path / "a" / "samples.jsonl")]
    b = [x["teacher_written"] for x in read_jsonl(tmp_path / "b" / "samples.jsonl")]
    assert a == b and any(a) and not all(a)
    fracs = [
        r["distill/teacher_written_frac"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")
    ]
    assert all(0.0 <= f <= 1.0 for f in fracs)


def test_lam_needs_jsd_and_the_column(assets, teacher, tmp_path, capsys):
    cfg = distill_config(
        assets.policy("llama"), teacher, assets.prompts, tmp_path / "x", distill={"lam": 0.5}
    )
    assert distill_main(cfg) == 2
    assert "distill.lam = 0.5 mixes in teacher-written completions" in capsys.readouterr().err
    cfg = distill_config(
        assets.policy("llama"),
        teacher,
        assets.prompts,
        tmp_path / "y",
        distill={"lam": 0.5, "loss": "jsd"},
    )
    assert distill_main(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "distill.completion_column = 'completion'" in err[0], err


def test_a_verifier_reward_is_added_with_its_weight(assets, tmp_path, monkeypatch, capsys):
    from proximal.trainers import distill

    seen = []
    update = distill.grpo_update

    def spy(exp, *args, **kw):
        seen.append(exp)
        return update(exp, *args, **kw)

    monkeypatch.setattr(distill, "grpo_update", spy)
    policy = assets.policy("llama")
    cfg = distill_config(
        policy,
        policy,  # the teacher is the student: the advantage is the reward's alone
        assets.prompts,
        tmp_path / "verify",
        model={"reward_functions": ["ppo_support:frac_a"]},
        rollout={"group_size": 4},
        distill={"reward_weight": 2.0},
        train={"steps": 1},
    )
    assert distill_main(cfg) == 0, capsys.readouterr().err
    (r,) = read_jsonl(tmp_path / "verify" / "metrics.jsonl")
    assert "score/mean" in r and "score/ppo_support:frac_a" in r
    assert r["distill/reverse_kl"] == 0.0
    (exp,) = seen
    s = exp.scores.double().view(2, 4)  # two prompts, four responses each
    want = (2.0 * (s - s.mean(1, keepdim=True))).view(8, 1).expand(8, exp.mask.shape[1])
    want = torch.where(exp.mask, want, 0.0)
    assert s.std() > 0  # the responses score differently: the reward is not a constant
    torch.testing.assert_close(exp.advantages.double(), want, rtol=0, atol=1e-6)


def test_a_teacher_with_another_tokenizer_is_one_line_before_training(assets, tmp_path, capsys):
    from proximal.models.tiny import build_tiny_causal_lm

    other = build_tiny_causal_lm(tmp_path / "other", assets.other_tokenizer, arch="gpt2", seed=3)
    cfg = distill_config(assets.policy("llama"), other, assets.prompts, tmp_path / "bad")
    assert distill_main(cfg) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "model.teacher" in err[0] and "share the student's tokenizer" in err[0], err[0]
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_a_reward_needs_a_group_to_be_its_baseline(assets, teacher, tmp_path, capsys):
    cfg = distill_config(
        assets.policy("llama"),
        teacher,
        assets.prompts,
        tmp_path / "g1",
        model={"reward_functions": ["ppo_support:frac_a"]},
        rollout={"group_size": 1},
        distill={"micro_batch_size": 1},
    )
    assert distill_main(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout.group_size = 1 must be ≥ 2" in err and "distill.reward_weight" in err


def test_a_missing_teacher_is_one_line(assets, tmp_path, capsys):
    cfg = distill_config(assets.policy("llama"), "", assets.prompts, tmp_path / "none")
    assert distill_main(cfg) == 2
    assert "model.teacher is required" in capsys.readouterr().err


@pytest.mark.parametrize("loss", [{}, {"loss": "jsd", "lam": 0.5}], ids=["reverse_kl", "jsd+lam"])
def test_resume_reproduces_the_uninterrupted_run(
    assets, teacher, tmp_path, monkeypatch, capsys, loss
):
    """6 prompts, 2 per step: the checkpoint after step 2 falls mid-pass; AdamW's moments and a
    warm-up that spans it; with jsd+lam the teacher-written draws of the steps after it."""
    from proximal.train import run

    prompts = _with_completions(tmp_path)

    def config(name):
        return distill_config(
            assets.policy("llama"),
            teacher,
            prompts,
            tmp_path / name,
            distill={"iterations": 2, "mini_batch_size": 2, "micro_batch_size": 1, **loss},
            optim={"warmup_steps": 6, "lr": 1e-2},
            train={"steps": 4, "save_every": 2, "keep_checkpoints": 3},
        )

    assert distill_main(config("full")) == 0, capsys.readouterr().err
    save = run.save_checkpoint

    def save_then_die(root, step, **kwargs):
        out = save(root, step, **kwargs)
        if step == 2:
            raise SystemExit("killed after step 2")
        return out

    with monkeypatch.context() as mp:
        mp.setattr(run, "save_checkpoint", save_then_die)
        with pytest.raises(SystemExit, match="killed after step 2"):
            distill_main(config("crashed"))
    crashed = tmp_path / "crashed"
    assert distill_main(None, "--resume", str(crashed)) == 0, capsys.readouterr().err
    full = read_jsonl(tmp_path / "full" / "metrics.jsonl")
    resumed = read_jsonl(crashed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(full, resumed, strict=True):
        a, b = without_timing(a), without_timing(b)
        diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert not diff, f"step {a['step']}: resumed metrics differ: {diff}"
    a = load_safetensors_dir(checkpoint_dirs(tmp_path / "full")[-1] / "policy")
    b = load_safetensors_dir(checkpoint_dirs(crashed)[-1] / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("loss", ["reverse_kl", "jsd"])
def test_a_bf16_run_holds_the_teacher_in_bfloat16_and_trains(
    assets, teacher, tmp_path, capsys, precision, loss
):
    """train.precision bf16-*: the teacher is loaded in the frozen dtype, bfloat16 (half the
    float32 bytes in models.json), and a step trains with finite metrics, either loss."""
    import json

    runs = {}
    for p in ("32-true", precision):
        run_dir = tmp_path / p
        cfg = distill_config(
            assets.policy("llama"),
            teacher,
            assets.prompts,
            run_dir,
            distill={"loss": loss},
            train={"precision": p, "steps": 1},
        )
        assert distill_main(cfg) == 0, capsys.readouterr().err
        runs[p] = json.loads((run_dir / "models.json").read_text())
        (r,) = read_jsonl(run_dir / "metrics.jsonl")
        key = "distill/jsd" if loss == "jsd" else "distill/reverse_kl"
        # (the sampled reverse KL of 4 short responses may be below 0; the JSD never is)
        assert math.isfinite(r[key]) and r["grad_norm/actor"] > 0, r
        assert loss != "jsd" or r[key] > 0
    assert runs[precision]["teacher"]["bytes"] * 2 == runs["32-true"]["teacher"]["bytes"]
