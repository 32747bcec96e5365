"""The real ``proximal ppo`` command, end to end on tiny models: three architectures, a reward model
with a different tokenizer, LoRA, and the run directory a user gets (metrics, samples, config,
checkpoints that plain ``transformers`` / ``peft`` load)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import yaml
from ppo_support import (
    ALPHABET,
    REQUIRED_METRICS,
    checkpoint_dirs,
    ppo_main,
    read_jsonl,
    tiny_config,
)

from proximal.data.chat import encode_prompt
from proximal.models.loading import load_tokenizer


def _assert_healthy_metrics(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, f"step {r['step']}: metrics missing {missing}"
        # explained variance may legitimately be NaN (constant returns), logged as null; nothing else may.
        bad = {
            k: r[k]
            for k in REQUIRED_METRICS
            if k != "value/explained_variance"
            and not (isinstance(r[k], (int, float)) and math.isfinite(r[k]))
        }
        assert not bad, f"step {r['step']}: non-finite metrics {bad}"
        assert 0 <= r["policy/clipfrac"] <= 1 and 0 <= r["value/clipfrac"] <= 1
        assert 0 <= r["response/eos_frac"] <= 1
        assert 1 <= r["response/length_mean"] <= 8  # rollout.max_new_tokens = 8
        assert r["policy/entropy"] > 0


# Each architecture's run also exercises a few rollout and data options end to end.
ARCH_OPTIONS = {
    # stop at the string "0" and at the token "h"; sample with temperature, top-k and top-p; a penalty
    # for responses that hit T; the reward function weighted 0.5; long prompts truncated on the left.
    "gpt2": [
        "--rollout.stop_strings",
        "0",
        "--rollout.stop_token_ids",
        "[{h}]",
        "--rollout.temperature",
        "0.8",
        "--rollout.top_k",
        "10",
        "--rollout.top_p",
        "0.9",
        "--rollout.missing_eos_penalty",
        "-1.0",
        "--model.reward_function_weights",
        "[0.5]",
        "--data.max_prompt_length",
        "5",
    ],
    # long prompts skipped instead; seq-mean-token-mean aggregation; an entropy bonus; 3 epochs of 2
    # mini-batches, stopped early by a tiny target KL as soon as the policy has moved.
    "qwen2": [
        "--data.max_prompt_length",
        "5",
        "--data.on_long_prompt",
        "skip",
        "--ppo.aggregation",
        "seq-mean-token-mean",
        "--ppo.entropy_coef",
        "0.01",
        "--ppo.epochs",
        "3",
        "--ppo.mini_batch_size",
        "2",
        "--ppo.target_kl",
        "1e-9",
    ],
}


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_cli_runs_ppo_steps(arch, assets, tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        assets.policy(arch),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.reward_model(arch)), "critic": "reward_model"},
    )
    h = assets.tokenizer.convert_tokens_to_ids("h")
    rc = ppo_main(cfg, *(a.format(h=h) for a in ARCH_OPTIONS[arch]))
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"run directory {run_dir}" in out
    rows = read_jsonl(run_dir / "metrics.jsonl")
    _assert_healthy_metrics(rows, steps=2)
    assert [p.name for p in checkpoint_dirs(run_dir)] == ["step_000002"]
    samples = read_jsonl(run_dir / "samples.jsonl")
    tok = load_tokenizer(str(assets.policy(arch)))
    n_long = sum(len(encode_prompt(r["prompt"], tok)) > 5 for r in read_jsonl(assets.prompts))
    assert n_long > 0
    for s in samples:
        assert len(encode_prompt(s["prompt"], tok)) <= 5
    if arch == "gpt2":
        for r in rows:
            assert r["data/prompts_truncated"] == n_long and r["data/prompts_skipped_too_long"] == 0
            # score = reward model + 0.5 · reward function − 1 for each response that did not stop
            expected = (
                r["score/reward_model"]
                + 0.5 * r["score/ppo_support:frac_a"]
                - (1 - r["response/eos_frac"])
            )
            assert r["score/mean"] == pytest.approx(expected, abs=1e-6)
        for s in samples:  # nothing after a stop string or a stop token reaches the response
            assert "0" not in s["response"][:-1] and "h" not in s["response"][:-1], s["response"]
    else:
        for r in rows:
            assert r["data/prompts_skipped_too_long"] == n_long and r["data/prompts_truncated"] == 0
            # the first mini-batch sees the rollout policy itself (KL 0); the second one stops the epochs
            assert r["policy/early_stopped"] == 1.0 and r["policy/epochs_run"] == 1


def test_cli_llama_run_directory(llama_run, assets):
    """metrics.jsonl with every metric of issue 3 item 8, samples.jsonl, the resolved config.yaml,
    checkpoints kept as configured."""
    assert llama_run.rc == 0
    d = llama_run.dir
    rows = read_jsonl(d / "metrics.jsonl")
    _assert_healthy_metrics(rows, steps=3)
    for r in rows:  # both score components are logged, and the total is their (weight 1) sum
        assert r["score/mean"] == pytest.approx(
            r["score/reward_model"] + r["score/ppo_support:frac_a"], abs=1e-6
        )

    samples = read_jsonl(d / "samples.jsonl")
    assert [s["step"] for s in samples] == [1, 1, 2, 2, 3, 3]  # output.samples_per_step = 2
    for s in samples:
        assert set(s) >= {
            "prompt",
            "response",
            "score",
            "score/reward_model",
            "score/ppo_support:frac_a",
        }
        assert s["prompt"] in assets.prompts.read_text()
        assert s["score/ppo_support:frac_a"] == pytest.approx(
            s["response"].count("a") / max(1, len(s["response"]))
        )

    saved = yaml.safe_load((d / "config.yaml").read_text())
    assert (
        saved["train"]["steps"] == 3 and saved["train"]["save_every"] == 2
    )  # command-line overrides applied
    assert saved["model"]["path"] == str(assets.policy("llama"))
    assert (
        saved["kl"]["controller"] == "fixed"
    )  # a default, written out: the file is the full config

    assert [p.name for p in checkpoint_dirs(d)] == ["step_000002", "step_000003"]
    assert (d / "checkpoints" / "latest").read_text().strip() == "step_000003"
    for ckpt in checkpoint_dirs(d):
        assert (ckpt / "policy" / "model.safetensors").is_file()
        assert (ckpt / "critic" / "model.safetensors").is_file()
        assert (ckpt / "trainer_state.pt").is_file()
    assert not list((d / "checkpoints").glob(".*")), "temporary checkpoint directories left behind"


def test_checkpoints_load_with_plain_transformers(llama_run):
    """The last checkpoint holds exactly the trained actor and critic, loadable without proximal."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    ckpt = checkpoint_dirs(llama_run.dir)[-1]
    m = llama_run.models
    policy = AutoModelForCausalLM.from_pretrained(ckpt / "policy")
    critic = AutoModelForSequenceClassification.from_pretrained(ckpt / "critic")
    assert critic.config.num_labels == 1
    for loaded, trained, name in ((policy, m.actor, "policy"), (critic, m.critic, "critic")):
        trained_state = trained.state_dict()
        for k, v in loaded.state_dict().items():
            assert torch.equal(v, trained_state[k]), (
                f"{name} checkpoint differs from the trained model at {k}"
            )
    for sub in ("policy", "critic"):
        tok = AutoTokenizer.from_pretrained(ckpt / sub)
        assert tok.get_vocab() == m.tokenizer.get_vocab()


def test_cli_reward_model_with_another_tokenizer(assets, tmp_path, capsys):
    """A GPT-2 reward model whose tokenizer shares no id with the Llama policy's: responses are
    re-tokenized for it, and the critic comes from the policy."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"reward_model": str(assets.other_tokenizer_reward_model), "reward_functions": []},
    )
    rc = ppo_main(cfg, "--model.critic", "policy")
    assert rc == 0, capsys.readouterr().err
    rows = read_jsonl(run_dir / "metrics.jsonl")
    _assert_healthy_metrics(rows, steps=2)
    assert all(r["score/mean"] == r["score/reward_model"] for r in rows)


def test_cli_critic_from_reward_model_with_another_tokenizer_is_an_error(assets, tmp_path, capsys):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"reward_model": str(assets.other_tokenizer_reward_model), "critic": "reward_model"},
    )
    rc = ppo_main(cfg)
    err = capsys.readouterr().err
    assert rc == 2
    assert "model.critic = reward_model" in err and "tokenizer" in err and "differs" in err
    assert str(assets.other_tokenizer_reward_model) in err
    assert "model.critic: policy" in err  # the message says what to do
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_lora_run_directory(lora_run, assets):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    assert lora_run.rc == 0
    d = lora_run.dir
    _assert_healthy_metrics(read_jsonl(d / "metrics.jsonl"), steps=2)
    assert len(read_jsonl(d / "samples.jsonl")) == 4
    assert yaml.safe_load((d / "config.yaml").read_text())["model"]["lora_r"] == 4
    assert (
        read_jsonl(d / "metrics.jsonl")[0]["kl/seq_mean"] == 0.0
    )  # LoRA B starts at 0: π_θ = π_ref exactly

    [ckpt] = checkpoint_dirs(d)
    for sub in ("policy", "critic"):  # adapters only: the base weights stay where they came from
        assert (ckpt / sub / "adapter_config.json").is_file()
        assert (ckpt / sub / "adapter_model.safetensors").is_file()
        assert not (ckpt / sub / "model.safetensors").exists()

    m = lora_run.models
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    policy = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(assets.policy("llama")), ckpt / "policy"
    )
    with torch.no_grad():
        assert torch.equal(policy(input_ids=ids).logits, m.actor(input_ids=ids).logits)
    critic = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(assets.reward_model("llama")),
        ckpt / "critic",
    )
    trained = m.critic.state_dict()
    for k, v in critic.state_dict().items():
        assert torch.equal(v, trained[k]), f"critic adapter checkpoint differs at {k}"


def test_cli_critic_from_a_path_with_another_tokenizer_is_an_error(assets, tmp_path, capsys):
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        tmp_path / "run",
        model={"critic": str(assets.other_tokenizer_reward_model)},
    )
    rc = ppo_main(cfg)
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        f"model.critic {str(assets.other_tokenizer_reward_model)!r}: its tokenizer differs" in err
    )


def test_cli_critic_from_a_path(assets, tmp_path, capsys):
    """model.critic = a checkpoint directory (here the reward model's, read by path, not by role)."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        assets.policy("llama"),
        assets.prompts,
        run_dir,
        model={"critic": str(assets.reward_model("llama"))},
        train={"steps": 1},
    )
    assert ppo_main(cfg) == 0, capsys.readouterr().err
    from transformers import AutoModelForSequenceClassification

    critic = AutoModelForSequenceClassification.from_pretrained(
        checkpoint_dirs(run_dir)[-1] / "critic"
    )
    initial = AutoModelForSequenceClassification.from_pretrained(assets.reward_model("llama"))
    assert not torch.equal(
        critic.score.weight, initial.score.weight
    )  # it trained, starting from that head


def test_cli_chat_messages_prompts(assets, tmp_path, capsys):
    """{"messages": [...]} prompts are rendered with the policy's chat template (generation prompt
    included) and sampled from; the reward function sees the rendered prompt."""
    from proximal.data.jsonl import write_jsonl
    from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm

    template = (
        "{% for m in messages %}{{ m['role'][0] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}a {% endif %}"
    )
    tok = build_char_tokenizer(list(ALPHABET + "usr"), chat_template=template)
    policy = build_tiny_causal_lm(tmp_path / "chat_policy", tok, arch="llama")
    prompts = tmp_path / "messages.jsonl"
    write_jsonl(
        prompts,
        [{"messages": [{"role": "user", "content": f"{i} {i + 1}"}]} for i in range(4)]
        + [{"messages": [{"role": "system", "content": "bb"}, {"role": "user", "content": "9"}]}],
    )
    run_dir = tmp_path / "run"
    assert ppo_main(tiny_config(policy, prompts, run_dir), "--train.steps", "1") == 0, (
        capsys.readouterr().err
    )
    rendered = {f"u {i} {i + 1} a " for i in range(4)} | {"s bb u 9 a "}
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and all(s["prompt"] in rendered for s in samples)


def test_cli_datasets_directory_without_the_package(assets, tmp_path, capsys, monkeypatch):
    """A prompts *directory* is read as a `datasets` dataset; without the package the message says so
    (the package is in the test extra: its absence is simulated, an import of it then fails)."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt": "ab 1"}]).save_to_disk(str(tmp_path / "ds"))
    monkeypatch.setitem(sys.modules, "datasets", None)
    rc = ppo_main(tiny_config(assets.policy("llama"), tmp_path / "ds", tmp_path / "run"))
    assert rc == 2
    assert "needs the `datasets` package" in capsys.readouterr().err


def test_models_json_counts_the_resident_models(llama_run, lora_run, assets):
    """PPO holds four models, or three with LoRA (the reference is the policy with adapters off);
    their parameter bytes are those of the live modules — here, of the checkpoints they came from."""
    import json

    from ppo_support import load_safetensors_dir

    def nbytes(path):
        return sum(t.numel() * t.element_size() for t in load_safetensors_dir(path).values())

    full = json.loads((llama_run.dir / "models.json").read_text())
    assert sorted(full) == ["actor", "critic", "reference", "reward_model"]
    policy, rm = nbytes(assets.policy("llama")), nbytes(assets.reward_model("llama"))
    assert full["actor"]["bytes"] == full["reference"]["bytes"] == policy
    assert full["critic"]["bytes"] == full["reward_model"]["bytes"] == rm
    assert full["reference"]["trainable"] == full["reward_model"]["trainable"] == 0
    assert full["actor"]["trainable"] == full["actor"]["parameters"]
    lora = json.loads((lora_run.dir / "models.json").read_text())
    assert sorted(lora) == ["actor", "critic", "reward_model"]
    assert (
        0 < lora["actor"]["trainable"] < lora["actor"]["parameters"]
        and lora["actor"]["bytes"] > policy
    )
