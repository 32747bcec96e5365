"""The memory planner (``proximal memory``): hand-derived figures, exact parameter counts, the CLI, and
one measured PPO step within +-25% of the prediction."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from proximal import memory
from proximal.cli import main
from proximal.memory import Architecture, ModelSpec, Setup, plan

ROOT = Path(__file__).resolve().parents[1]
N70 = 70 * 10**9

# Llama-3-70B's published shape: 80 layers, hidden 8192, 64 heads of 128, 8 KV heads, SwiGLU 28672,
# vocabulary 128256, untied head.
LLAMA3_70B = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def seventy_b(**kw) -> Setup:
    return Setup(actor=ModelSpec(N70), critic=ModelSpec(N70), reward=ModelSpec(N70), **kw)


# ---- the budget table for 70B --------------------------------------------------------------------


def test_70b_rows_are_the_usual_per_component_figures():
    # The usual mixed-precision AdamW budget, N = 70e9, bf16: actor and critic 2N weights, 12N AdamW
    # (fp32 master + 2 moments), 2N grads;
    # reference and reward 2N weights only. In bytes: 2N = 140 GB, 12N = 840 GB.
    p = plan(seventy_b())
    for role in ("actor", "critic"):
        r = p.rows[role]
        assert (r.parameters, r.optimizer, r.gradients) == (140 * 10**9, 840 * 10**9, 140 * 10**9)
    for role in ("reference", "reward"):
        r = p.rows[role]
        assert (r.parameters, r.optimizer, r.gradients) == (140 * 10**9, 0, 0)
    # 16N + 16N + 2N + 2N = 36N = 2.52 TB: "a 70B PPO run needs over 800 GB" holds, by a factor
    # of 3.15.
    assert p.all_at_once == 2_520 * 10**9
    assert p.all_at_once > 800 * 10**9
    # Phase-aware: weights 8N + AdamW 24N always resident; one model's gradients (2N) at a time.
    assert p.static == 2_240 * 10**9
    assert p.peak == 2_380 * 10**9
    assert not p.sized and not p.fits


def test_float32_is_4_4_8_bytes_per_trainable_parameter():
    r = plan(seventy_b(dtype="float32")).rows
    assert (r["actor"].parameters, r["actor"].gradients, r["actor"].optimizer) == (
        4 * N70,
        4 * N70,
        8 * N70,
    )
    assert r["reward"].parameters == 4 * N70


def test_fsdp_divides_weights_gradients_and_optimizer_by_world_size():
    single, sharded = plan(seventy_b()), plan(seventy_b(strategy="fsdp", gpus=8, nodes=2))
    for role in memory.ROLES:
        for col in ("parameters", "optimizer", "gradients"):
            assert getattr(sharded.rows[role], col) == getattr(single.rows[role], col) // 16
    assert sharded.peak == 2_380 * 10**9 // 16


def test_offload_moves_adamw_state_to_cpu():
    p = plan(seventy_b(strategy="offload"))
    assert p.rows["actor"].optimizer == p.rows["critic"].optimizer == 0
    assert p.cpu_optimizer == 2 * 12 * N70
    assert (
        p.peak == 8 * 2 * N70 // 2 + 2 * N70
    )  # four bf16 copies (8N) + one model's gradients (2N)


def test_cheapest_fit_for_70b_by_hand():
    # Per GPU over W GPUs: FSDP (8N + 24N + 2N)/W = 2380 GB/W <= 80 GiB = 85.90 GB -> W >= 27.7 -> 32
    # (whole nodes of 8); FSDP + offload (8N + 2N)/W = 700 GB/W -> W >= 8.15 -> 16.
    s = seventy_b()
    best = memory.cheapest_fit(s)
    assert (best.setup.strategy, best.setup.world) == ("fsdp-offload", 16)
    on_gpu = memory.cheapest_fit(s, offload=False)
    assert (on_gpu.setup.strategy, on_gpu.setup.world) == ("fsdp", 32)
    assert on_gpu.peak == 2_380 * 10**9 // 32


# ---- parameter counts from a config --------------------------------------------------------------


def test_llama3_70b_parameter_count_by_hand():
    a = memory.architecture_from_config(LLAMA3_70B)
    # per layer: q 8192*8192 + k,v 8192*1024 each + o 8192*8192 + MLP 3*8192*28672 + 2 norms of 8192
    layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert a.layer_params() == layer == 855_654_400
    # embedding + 80 layers + final norm + untied head
    assert a.params("lm") == 2 * 128256 * 8192 + 80 * layer + 8192 == 70_553_706_496


def test_tiny_llama_count_by_hand_equals_transformers():
    from transformers import AutoModelForCausalLM

    from proximal.models.tiny import tiny_config

    cfg = tiny_config(
        "llama", 100, hidden=64, layers=3, heads=4, kv_heads=2
    )  # head_dim 16, kv width 32, I = 256
    # embed 100*64 + 3 * (q 64*64 + k 64*32 + v 64*32 + o 64*64 + MLP 3*64*256 + norms 2*64) + norm 64 + head 100*64
    by_hand = 6400 + 3 * (4096 + 2048 + 2048 + 4096 + 49152 + 128) + 64 + 6400
    assert by_hand == 197_568
    assert memory.architecture_from_config(cfg.to_dict()).params("lm") == by_hand
    assert sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) == by_hand


@pytest.mark.parametrize(
    "arch,kw", [("llama", {"kv_heads": 1}), ("qwen2", {"kv_heads": 2}), ("gpt2", {})]
)
def test_param_count_equals_transformers(arch, kw, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from proximal.models.tiny import tiny_config

    cfg = tiny_config(arch, 97, hidden=48, layers=2, heads=4, num_labels=1, **kw)
    cfg.save_pretrained(tmp_path)  # through config.json, as a user's checkpoint
    a = memory.load_architecture(tmp_path)
    assert a.params("lm") == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()
    )
    assert a.params("score") == sum(
        p.numel() for p in AutoModelForSequenceClassification.from_config(cfg).parameters()
    )


@pytest.mark.parametrize("model_type", ["qwen3", "mistral"])
def test_param_count_equals_transformers_with_explicit_head_dim(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        vocab_size=100,
    )
    a = memory.architecture_from_config(cfg.to_dict())
    assert a.q_dim == 96 and a.kv_dim == 48  # head_dim 24 != hidden / heads
    assert a.params("lm") == sum(
        p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()
    )


def test_tied_embeddings_are_counted_once():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt2",
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=50,
        n_positions=40,
        bos_token_id=0,
        eos_token_id=0,
    )
    a = memory.architecture_from_config(cfg.to_dict())
    assert a.tie_word_embeddings
    assert (
        a.params("lm")
        == a.backbone_params()
        == sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    )


# ---- LoRA ----------------------------------------------------------------------------------------


def _tiny_llama_arch() -> Architecture:
    from proximal.models.tiny import tiny_config

    return memory.architecture_from_config(
        tiny_config("llama", 100, hidden=64, layers=3, heads=4, kv_heads=2).to_dict()
    )


def test_lora_adapter_count_by_hand_and_equals_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from proximal.models.tiny import tiny_config

    a = _tiny_llama_arch()
    # rank 8, per layer: r * (in + out) over q (64+64), k (64+32), v (64+32), o (64+64),
    # gate, up (64+256), down (256+64)
    assert a.lora_params(8) == 3 * 8 * (128 + 96 + 96 + 128 + 320 + 320 + 320) == 33_792
    model = get_peft_model(
        AutoModelForCausalLM.from_config(
            tiny_config("llama", 100, hidden=64, layers=3, heads=4, kv_heads=2)
        ),
        LoraConfig(r=8, target_modules="all-linear"),
    )
    assert model.get_nb_trainable_parameters()[0] == 33_792


def test_lora_only_adapters_train_and_the_reference_is_shared():
    a = _tiny_llama_arch()
    actor, critic = ModelSpec.of(a, "lm"), ModelSpec.of(a, "score")
    p = plan(Setup(actor=actor, critic=critic, reward=critic, lora_rank=8))  # bf16
    adapters = 33_792
    r = p.rows["actor"]
    assert r.trainable == adapters
    assert r.parameters == 2 * actor.n_params + 2 * adapters  # frozen base + adapters, 2 bytes each
    assert (r.gradients, r.optimizer) == (2 * adapters, 12 * adapters)
    assert p.rows["critic"].trainable == adapters + 64  # + the value head, trained fully
    ref = p.rows["reference"]
    assert (ref.parameters, ref.optimizer, ref.gradients) == (
        0,
        0,
        0,
    )  # the actor's base, adapters off
    assert p.rows["reward"].parameters == 2 * critic.n_params


# ---- activations and KV cache --------------------------------------------------------------------


def test_activation_and_kv_formulas_by_hand():
    a = _tiny_llama_arch()  # h 64, q 64, kv 32, I 256, L 3, V 100
    assert a.saved_elements_per_token_layer() == 6 * 64 + 3 * 64 + 2 * 32 + 4 * 256 == 1664
    assert a.activation_bytes_per_token_layer(4) == 4 * 1664
    assert (
        a.activation_bytes_per_token_layer(2) == 2 * 1664 + 2 * 2 * 64
    )  # RMSNorm keeps x in float32
    assert a.kv_bytes_per_token(2) == 2 * 3 * 32 * 2
    s = Setup(
        actor=ModelSpec.of(a, "lm"),
        critic=ModelSpec.of(a, "score"),
        reward=ModelSpec.of(a, "score"),
        dtype="float32",
        batch=8,
        micro_batch=2,
        prompt_len=10,
        response_len=6,
    )
    m_s = 2 * 16  # micro-batch x (P + T) tokens
    layers = m_s * 3 * 4 * 1664  # m * s * L * a
    final_norm = m_s * 3 * 64 * 4  # x, normed x, output
    cache = m_s * 2 * 3 * 32 * 4  # transformers' use_cache=True: K and V of every layer
    logits = 2 * 100 * (16 + 2 * 6) * 4  # m * V * (s + 2T) * 4
    assert memory.training_activation_bytes(a, s, "lm") == layers + final_norm + cache + logits
    assert (
        memory.training_activation_bytes(a, replace(s, forward_cache=False), "lm")
        == layers + final_norm + logits
    )
    # checkpointing: layer inputs m * s * L * h * 4 + final norm + max(head, one recomputed layer); no cache
    ckpt = replace(s, activation_checkpointing=True)
    assert memory.training_activation_bytes(a, ckpt, "lm") == m_s * 3 * 64 * 4 + final_norm + max(
        logits, m_s * 4 * 1664
    )
    p = plan(s)
    assert p.rows["actor"].kv_cache == 8 * 16 * 2 * 3 * 32 * 4
    # FSDP over 4 GPUs splits the rollout batch: 2 sequences' KV cache per GPU
    assert (
        plan(replace(s, strategy="fsdp", gpus=4)).rows["actor"].kv_cache == 2 * 16 * 2 * 3 * 32 * 4
    )
    # rollout: the larger of the prefill (prompt cache + one layer's working set, (2h + 3I) * 4 per token)
    # and the last decoding step (full cache + the larger of 1/(2L) of it while it grows and 1/L of the
    # prompt's cache while the lean decoder copies it + last-token logits and probs)
    full = 8 * 16 * 2 * 3 * 32 * 4
    prefill = 8 * 10 * (2 * 3 * 32 * 4 + (2 * 64 + 3 * 256) * 4)
    decode = full + 8 * 10 * 2 * 3 * 32 * 4 // 3 + 8 * 100 * 8
    assert memory.rollout_bytes(a, s) == max(prefill, decode) == prefill
    long = replace(s, prompt_len=2, response_len=62)  # s = 64: now the last decoding step dominates
    full = 8 * 64 * 2 * 3 * 32 * 4
    assert memory.rollout_bytes(a, long) == full + full // 6 + 8 * 100 * 8
    # A model whose KV cache outweighs a layer's working set (8 layers, narrow MLP), the prompt over
    # half the sequence: the lean decoder's copy of one prompt layer (1/L of B·P tokens) is the larger
    # extra, not the growing layer (1/(2L) of B·s).
    kv_heavy = replace(a, num_layers=8, num_kv_heads=a.num_heads, intermediate_size=64)
    per_token = 2 * 8 * 64 * 4
    wide_prompt = replace(s, actor=ModelSpec.of(kv_heavy, "lm"), prompt_len=10, response_len=6)
    decode = 8 * 16 * per_token + 8 * 10 * per_token // 8 + 8 * 100 * 8
    prefill = 8 * 10 * (per_token + (2 * 64 + 3 * 64) * 4)
    assert 8 * 10 * per_token // 8 > 8 * 16 * per_token // 16 and decode > prefill
    assert memory.rollout_bytes(kv_heavy, wide_prompt) == decode


def test_scoring_holds_the_actors_activations_when_the_first_pass_is_shared():
    """ppo.reuse_first_pass: on one device with one micro-batch of the whole batch, the actor's first-epoch
    forward (with its activations) runs before the scoring forwards; otherwise scoring is forwards only."""
    a = _tiny_llama_arch()
    s = Setup(
        actor=ModelSpec.of(a, "lm"),
        critic=ModelSpec.of(a, "score"),
        reward=ModelSpec.of(a, "score"),
        dtype="float32",
        batch=4,
        micro_batch=4,
        prompt_len=10,
        response_len=6,
    )
    forwards = max(memory.forward_only_bytes(a, s, "lm"), memory.forward_only_bytes(a, s, "score"))
    shared = plan(s)
    assert shared.phases["scoring"] == forwards + memory.training_activation_bytes(a, s, "lm")
    assert shared.phases["scoring"] == forwards + shared.rows["actor"].activations
    assert plan(replace(s, micro_batch=2)).phases["scoring"] == max(
        memory.forward_only_bytes(a, replace(s, micro_batch=2), k) for k in ("lm", "score")
    )
    sharded = plan(
        replace(s, strategy="fsdp", gpus=2)
    )  # two processes: the update's rows differ, no sharing
    assert sharded.phases["scoring"] < sharded.rows["actor"].activations + forwards
    assert any("reuse_first_pass" in n for n in shared.notes)
    assert not any(
        "reuse_first_pass" in n for n in sharded.notes + plan(replace(s, micro_batch=2)).notes
    )


# ---- the CLI -------------------------------------------------------------------------------------


def test_cli_70b_prints_the_budget_table_and_verdict(capsys):
    assert main(["memory", "--params", "70e9", "--units", "GB"]) == 0
    out = capsys.readouterr().out
    assert "140.0 GB" in out and "840.0 GB" in out and "1,120.0 GB" in out and "2,520.0 GB" in out
    assert "DOES NOT FIT in 85.9 GB" in out
    assert "cheapest strategy that fits: fsdp-offload on 16 GPUs" in out


def test_cli_json_parses(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    assert (
        main(
            [
                "memory",
                "--config",
                str(tmp_path),
                "--strategy",
                "fsdp",
                "--gpus",
                "8",
                "--nodes",
                "8",
                "--activation-checkpointing",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["bytes_per_gpu"]["actor"]["n_params"] == 70_553_706_496
    assert d["activations_sized"] and isinstance(d["fits"], bool)
    assert d["peak_bytes_per_gpu"] == d["static_bytes"] + max(d["phase_bytes"].values())


def test_cli_fits_verdict_for_a_tiny_model(capsys, tmp_path):
    from proximal.models.tiny import tiny_config

    tiny_config("llama", 100, hidden=64, layers=3, heads=4).save_pretrained(tmp_path)
    assert (
        main(
            [
                "memory",
                "--model",
                str(tmp_path),
                "--dtype",
                "float32",
                "--batch",
                "8",
                "--micro-batch",
                "2",
                "--prompt-len",
                "16",
                "--response-len",
                "16",
                "--units",
                "MiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "verdict: FITS in 81,920.0 MiB" in out
        and "cheapest strategy that fits: single on 1 GPU" in out
    )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--params", "-5"], "must be positive"),
        (["--params", "lots"], "is not a parameter count"),
        (["--params", "7B", "--batch", "0"], "must be at least 1"),
        (["--params", "7B", "--gpu-memory", "-80"], "GPU memory must be positive"),
        (["--params", "7B", "--lora-rank", "8"], "--lora-rank needs the model shapes"),
        (
            ["--params", "7B", "--batch", "4", "--micro-batch", "8"],
            "--micro-batch 8 is larger than --batch 4",
        ),
        (["--config", "/nonexistent/model"], "/nonexistent/model: no such file"),
        ([], "one of the arguments --params --config"),
    ],
)
def test_cli_errors_name_the_problem(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        memory.cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "proximal memory" in err and message in err


def test_cli_error_for_directory_without_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        memory.cli(["--config", str(tmp_path)])
    assert f"no config.json in directory {tmp_path}" in capsys.readouterr().err


# ---- checked against reality ---------------------------------------------------------------------


@pytest.mark.slow
def test_measured_ppo_step_within_25_percent_of_prediction():
    """One real PPO step (float32, CPU; benchmarks/memory_check.py, configuration 'test'): the peak of
    PyTorch's allocator lies within +-25% of the planner's per-GPU peak, and so does every phase."""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "memory_check.py"),
            "--configs",
            "test",
            "--method",
            "allocator",
            "--out",
            "-",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(proc.stdout)
    assert 0.75 <= r["ratio"] <= 1.25, r
    assert 0.75 <= r["static"] / r["predicted_static"] <= 1.25
    for phase, measured in r["phase_peak"].items():
        assert 0.75 <= measured / (r["predicted_static"] + r["predicted_phases"][phase]) <= 1.25, (
            phase,
            r,
        )
        # and what the phase adds above weights and AdamW state (activations, logits, KV cache) alone
        assert 0.75 <= (measured - r["static"]) / r["predicted_phases"][phase] <= 1.25, (phase, r)


def test_setup_validates_its_fields():
    with pytest.raises(ValueError, match="strategy 'zero3' is not one of"):
        seventy_b(strategy="zero3")
    with pytest.raises(ValueError, match="micro_batch must be at least 1, got 0"):
        seventy_b(micro_batch=0)


def test_bf16_true_sampling_holds_a_bfloat16_copy_of_the_policy():
    """rollout.precision: bf16-true — the engine's copy of the whole policy (base and adapters),
    2 bytes a parameter, resident for the whole step; nothing else changes."""
    a = _tiny_llama_arch()
    actor = ModelSpec.of(a, "lm")
    for lora, adapters in ((0, 0), (8, 33_792)):
        kw = dict(actor=actor, method="grpo", dtype="float32", lora_rank=lora)
        base, copy = plan(Setup(**kw)), plan(Setup(**kw, rollout_precision="bf16-true"))
        row = copy.rows["rollout copy"]
        assert (row.n_params, row.parameters) == (
            actor.n_params + adapters,
            2 * actor.n_params + 2 * adapters,
        )
        assert (row.optimizer, row.gradients, row.trainable) == (0, 0, 0)
        assert copy.static - base.static == row.parameters
        assert copy.phases == base.phases and "rollout copy" not in base.rows
    assert (
        "rollout copy"
        not in plan(Setup(actor=actor, method="grpo", rollout_precision="bf16-mixed")).rows
    )
