"""The planner counts the vllm rollout engine (issue 41, item 6): its copy of the policy's weights in
the engine's dtype and its KV-cache budget, a row of their own, resident the whole step; nothing of
it under the hf engine; ``proximal memory --run`` reads rollout.engine and rollout.kv_cache_gib, and
the flags --engine and --kv-cache-gib set them. Every byte count is derived by hand below."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from memory_support import KV, N_LM, B, H, L, P, T, V, tiny_arch
from memory_support import grpo_setup as grpo

from proximal import memory
from proximal.config import save_config
from proximal.memory.budget import DEFAULT_ENGINE_KV_CACHE, ENGINES, ModelSpec, Setup, plan
from proximal.memory.command import plan_run
from proximal.memory.runconfig import RunReadError, read_run
from proximal.models.tiny import tiny_config
from proximal.train.sections import RolloutSection
from proximal.trainers.grpo_config import GRPOConfig
from proximal.trainers.ppo_config import PPOConfig

KV_BUDGET = 2**28  # rollout.kv_cache_gib 0.25


@pytest.fixture(scope="module")
def arch():
    return tiny_arch()


def test_the_engine_row_and_the_rollout_phase_by_hand(arch):
    hf = plan(grpo(arch))
    vl = plan(grpo(arch, engine="vllm", engine_kv_cache=KV_BUDGET))
    row = vl.rows["vllm engine"]
    # float32 policy (32-true, rollout.precision null): the engine holds N * 4 bytes
    assert (row.n_params, row.parameters, row.kv_cache) == (N_LM, N_LM * 4, KV_BUDGET)
    assert (row.trainable, row.optimizer, row.gradients, row.activations) == (0, 0, 0, None)
    # both resident all step: in the static bytes, on top of what the hf plan holds
    assert vl.static - hf.static == N_LM * 4 + KV_BUDGET == 790_272 + 268_435_456
    # the trainer keeps no KV cache of its own: under hf it is B * s * 2 * L * kv * 4
    assert hf.rows["actor"].kv_cache == B * (P + T) * 2 * L * KV * 4 == 196_608
    assert vl.rows["actor"].kv_cache == 0
    # the rollout phase: the larger of the prefill's working set over B * P tokens in float32,
    # B * P * (2h + 3I) * 4 = 8 * 16 * 896 * 4, and the last token's float32 logits and
    # log-probabilities, B * V * 8 = 6,400
    assert vl.phases["rollout"] == 8 * 16 * (2 * 64 + 3 * 256) * 4 == 458_752
    assert {k: v for k, v in vl.phases.items() if k != "rollout"} == {
        k: v for k, v in hf.phases.items() if k != "rollout"
    }
    assert vl.peak == vl.static + max(vl.phases.values())


def test_the_decode_term_wins_with_a_short_prompt_and_a_wide_vocabulary():
    wide = memory.architecture_from_config(
        tiny_config("llama", 50_000, hidden=64, layers=1, heads=4, kv_heads=2).to_dict()
    )
    setup = grpo(wide, prompt_len=2, engine="vllm")
    # prefill 8 * 2 * 896 * 4 = 57,344 < logits 8 * 50,000 * 8 = 3,200,000
    assert plan(setup).phases["rollout"] == 8 * 50_000 * 8


@pytest.mark.parametrize(
    ("device", "gpu_memory", "tokens", "seqs"),
    [("cpu", 24, 4096, 256), ("cuda", 24, 8192, 256), ("cuda", 80, 16384, 1024)],
)
def test_an_engine_step_is_capped_at_vllms_batch_defaults(arch, device, gpu_memory, tokens, seqs):
    # 512 prompts x 4 responses = 2,048 sequences of P = 16: 32,768 prompt tokens, more than one
    # step takes; vLLM 0.32's LLM defaults cap a step at `tokens` tokens of `seqs` sequences
    big = grpo(arch, batch=512, group_size=4, engine="vllm", micro_batch=2)
    big = replace(big, device=device, gpu_memory=gpu_memory * 2**30)
    assert plan(big).phases["rollout"] == tokens * (2 * 64 + 3 * 256) * 4
    wide = memory.architecture_from_config(
        tiny_config("llama", 50_000, hidden=64, layers=1, heads=4, kv_heads=2).to_dict()
    )
    assert plan(replace(big, actor=ModelSpec.of(wide, "lm"))).phases["rollout"] == max(
        tokens * 896 * 4, seqs * 50_000 * 8
    )


@pytest.mark.parametrize(
    ("precision", "rollout_precision", "nbytes"),
    [
        ("32-true", None, 4),
        ("bf16-mixed", None, 4),  # the policy's float32 master weights
        ("bf16-true", None, 2),
        ("32-true", "bf16-mixed", 2),  # rollout.precision bf16-*: a bfloat16 engine
        ("32-true", "bf16-true", 2),
        (None, None, 2),  # the flags' --dtype bfloat16 budget: 2-byte weights
    ],
)
def test_the_engine_dtype(arch, precision, rollout_precision, nbytes):
    setup = grpo(arch, precision=precision, rollout_precision=rollout_precision, engine="vllm")
    assert plan(setup).rows["vllm engine"].parameters == N_LM * nbytes
    # no second "rollout copy" under vllm: the engine's copy is the bfloat16 one
    assert "rollout copy" not in plan(setup).rows
    assert ("rollout copy" in plan(replace(setup, engine="hf")).rows) == (
        rollout_precision == "bf16-true"
    )


def test_a_bfloat16_engine_prefills_in_bfloat16(arch):
    setup = grpo(arch, rollout_precision="bf16-true", engine="vllm")
    assert plan(setup).phases["rollout"] == 8 * 16 * (2 * 64 + 3 * 256) * 2


def test_the_plan_says_when_the_kv_budget_is_short_of_the_rollout(arch):
    per_token = 2 * L * KV * 4  # keys and values of one token in the float32 engine: 768 bytes
    assert not plan(grpo(arch, engine="vllm", engine_kv_cache=per_token * B * (P + T))).notes
    short = plan(grpo(arch, engine="vllm", engine_kv_cache=per_token * 100)).notes
    assert short == [
        "rollout.kv_cache_gib = 7.15256e-05 holds 100 tokens of keys and values, fewer than the "
        "rollout's 8 x 32: vLLM runs about 3 sequences at a time (slower, no more memory)"
    ]
    [none] = plan(grpo(arch, engine="vllm", engine_kv_cache=per_token * 31 + 767)).notes
    assert "holds 31 tokens of keys and values, fewer than one sequence's 32: vLLM will not" in none


def test_a_cpu_plan_holds_the_engines_runtime_in_host_memory(arch):
    cpu = grpo(arch, device="cpu", gpu_memory=24 * 2**30)
    assert plan(cpu).host == {"imports": 434 * 2**20}
    # measured: vllm's import, its start and first generation, and two more V x h matrices in the
    # engine's dtype: 2 * 100 * 64 * 4 bytes in float32, half in bfloat16
    assert plan(replace(cpu, engine="vllm")).host == {
        "imports": 434 * 2**20,
        "vllm runtime": 264 * 2**20 + 51_200,
    }
    bf16 = replace(cpu, engine="vllm", rollout_precision="bf16-true")
    assert plan(bf16).host["vllm runtime"] == 264 * 2**20 + 25_600
    shapeless = replace(cpu, engine="vllm", actor=ModelSpec(N_LM))
    assert plan(shapeless).host["vllm runtime"] == 264 * 2**20
    assert "vllm runtime" not in plan(replace(cpu, device="cuda", engine="vllm")).host


def test_lora_pushes_merged_weights_and_fsdp_keeps_a_whole_engine_per_gpu(arch):
    lora = plan(grpo(arch, engine="vllm", lora_rank=8))
    assert lora.rows["vllm engine"].n_params == N_LM  # merged: the base's count, no adapters
    sharded = plan(grpo(arch, engine="vllm", gpus=2, strategy="fsdp"))
    assert sharded.rows["vllm engine"].parameters == N_LM * 4  # tensor-parallel 1: whole
    assert sharded.rows["actor"].parameters == N_LM * 4 // 2


def test_the_hf_engine_has_no_engine_row_and_offline_methods_no_engine(arch):
    for method in ("ppo", "grpo", "rloo"):
        setup = grpo(arch, method=method, critic=ModelSpec.of(arch, "score"))
        assert "vllm engine" not in plan(setup).rows
        assert "vllm engine" in plan(replace(setup, engine="vllm")).rows
    with pytest.raises(ValueError, match="engine vllm samples rollouts; dpo has none"):
        Setup(actor=ModelSpec.of(arch, "lm"), method="dpo", engine="vllm")
    with pytest.raises(ValueError, match="engine 'sglang' is not one of hf, vllm"):
        grpo(arch, engine="sglang")
    with pytest.raises(ValueError, match="engine_kv_cache must be at least 1, got 0"):
        grpo(arch, engine="vllm", engine_kv_cache=0)


def test_the_defaults_are_the_configs():
    assert DEFAULT_ENGINE_KV_CACHE == int(RolloutSection().kv_cache_gib * 2**30)
    assert RolloutSection().engine == "hf" == Setup.__dataclass_fields__["engine"].default
    assert ENGINES == ("hf", "vllm")


@pytest.mark.parametrize("cls", [PPOConfig, GRPOConfig])
def test_the_config_refuses_a_kv_budget_that_is_no_size(cls):
    for value in (0.0, -1.0, float("nan"), float("inf")):
        cfg = cls()
        cfg.rollout.kv_cache_gib = value
        want = f"rollout.kv_cache_gib = {value} must be a positive number of GiB"
        assert want in cfg.validate(), cfg.validate()
    cfg = cls()
    cfg.rollout.kv_cache_gib = 0.25
    assert not [p for p in cfg.validate() if "kv_cache_gib" in p]


# ---- proximal memory --run and the flags ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    tiny_config("llama", V, hidden=H, layers=L, heads=4, kv_heads=2).save_pretrained(d)
    return d


def run_dir(tmp_path, cls, model_dir, **rollout):
    cfg = cls()
    cfg.model.path = str(model_dir)
    cfg.model.reward_model = str(model_dir)
    for k, v in rollout.items():
        setattr(cfg.rollout, k, v)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_config(cfg, tmp_path / "config.yaml")
    return tmp_path


@pytest.mark.parametrize("cls", [PPOConfig, GRPOConfig])
def test_run_reads_the_engine_and_its_kv_budget(tmp_path, model_dir, cls):
    hf, _ = plan_run(str(run_dir(tmp_path / "hf", cls, model_dir)))
    assert (hf.engine, hf.engine_kv_cache) == ("hf", DEFAULT_ENGINE_KV_CACHE)
    assert "vllm engine" not in plan(hf).rows
    d = run_dir(tmp_path / "vllm", cls, model_dir, engine="vllm", kv_cache_gib=0.5)
    setup, _ = plan_run(str(d))
    assert (setup.engine, setup.engine_kv_cache) == ("vllm", 2**29)
    row = plan(setup).rows["vllm engine"]
    assert (row.parameters, row.kv_cache) == (N_LM * 4, 2**29)  # train.precision 32-true
    # a flag overrides the config's budget
    flagged, _ = plan_run(str(d), kv_cache_gib=2**30)
    assert flagged.engine_kv_cache == 2**30


def test_run_refuses_a_bad_engine_or_budget_in_one_line(tmp_path, model_dir):
    for key, value, message in (
        ("engine", "sglang", "rollout.engine = 'sglang' is not one of hf, vllm"),
        ("kv_cache_gib", 0, "rollout.kv_cache_gib = 0 must be a positive number of GiB"),
        ("kv_cache_gib", "big", "rollout.kv_cache_gib = 'big' must be a value"),
    ):
        d = tmp_path / f"{key}-{value}"
        d.mkdir()
        (d / "run.yaml").write_text(
            f"model:\n  path: {model_dir}\ngrpo:\n  beta: 0.0\nrollout:\n  {key}: {value}\n"
        )
        with pytest.raises(RunReadError, match=message):
            read_run(d / "run.yaml")


def test_the_flags_set_the_engine(model_dir, capsys):
    memory.cli(
        ["--method", "grpo", "--config", str(model_dir), "--engine", "vllm"]
        + ["--kv-cache-gib", "0.5", "--precision", "32-true", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    row = out["bytes_per_gpu"]["vllm engine"]
    assert (row["parameters"], row["kv_cache"]) == (N_LM * 4, 2**29)
    memory.cli(["--method", "grpo", "--config", str(model_dir), "--engine", "vllm"])
    text = capsys.readouterr().out
    assert "vllm engine" in text and "+ the vllm engine's KV cache" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-gib", "2"], "--kv-cache-gib sizes the vllm engine's KV cache, and this plan"),
        (["--method", "dpo", "--engine", "vllm"], "--engine vllm: dpo samples no rollouts"),
        (["--engine", "vllm", "--kv-cache-gib", "0"], "'0': KV-cache memory must be positive"),
    ],
)
def test_the_flags_refuse_in_one_line(model_dir, capsys, argv, message):
    with pytest.raises(SystemExit) as stop:
        memory.cli(["--config", str(model_dir)] + argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
