"""The planner counts the generator process of ``rollout.staleness`` ≥ 1 (issue 43): a row of its
own, resident the whole step because it generates while the trainer trains — its whole copy of the
policy in the trainer's weight dtype and its decode's peak (hf), or its vLLM engine's weights and
KV cache — plus, for a sharded or LoRA policy, the plain shared copy it reads. ``proximal memory
--run`` reads rollout.staleness and ``--staleness`` sets it. Every byte count is derived by hand."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from memory_support import N_LM, H, L, V, tiny_arch
from memory_support import grpo_setup as grpo

from proximal import memory
from proximal.config import save_config
from proximal.memory.budget import IMPORTS_BYTES, ModelSpec, Setup, plan
from proximal.memory.command import plan_run
from proximal.models.tiny import tiny_config
from proximal.trainers.grpo_config import GRPOConfig

# The generator's decode peak in float32, by hand: the prefill's KV cache and one layer's working
# set over B * P tokens, B * P * (2 * L * KV * 4 + (2h + 3I) * 4) = 128 * (768 + 3584) = 557,056,
# larger than the last step's full cache, growth and logits, 196,608 + 32,768 + B * V * 8 = 235,776.
DECODE = 557_056


@pytest.fixture(scope="module")
def arch():
    return tiny_arch()


def test_the_generator_row_by_hand(arch):
    sync, stale = plan(grpo(arch)), plan(grpo(arch, staleness=1))
    assert "generator" not in sync.rows and "shared copy" not in stale.rows
    row = stale.rows["generator"]
    assert (row.n_params, row.parameters, row.kv_cache) == (N_LM, N_LM * 4, DECODE)
    assert (row.trainable, row.optimizer, row.gradients, row.activations) == (0, 0, 0, None)
    # resident all step: its weights and its decode on top of the synchronous plan, every phase
    assert stale.static - sync.static == 790_272 + DECODE
    assert stale.phases == sync.phases
    assert stale.peak - sync.peak == 790_272 + DECODE


def test_a_vllm_generator_holds_its_engine_and_a_sharded_or_lora_policy_a_shared_copy(arch):
    vl = plan(grpo(arch, staleness=2, engine="vllm", engine_kv_cache=2**28))
    assert (vl.rows["generator"].parameters, vl.rows["generator"].kv_cache) == (N_LM * 4, 2**28)
    # the trainer keeps its own engine (the held-out evaluation): two engines' KV caches
    assert vl.static - plan(grpo(arch, engine="vllm", engine_kv_cache=2**28)).static == (
        N_LM * 4 + 2**28
    )
    sharded = plan(grpo(arch, staleness=1, gpus=2, strategy="fsdp"))
    assert sharded.rows["generator"].parameters == N_LM * 4  # whole, on each GPU
    assert sharded.rows["shared copy"].parameters == N_LM * 4
    lora = plan(grpo(arch, staleness=1, lora_rank=8))
    assert lora.rows["generator"].n_params == N_LM  # merged: the base's count
    assert lora.rows["shared copy"].parameters == N_LM * 4
    # rollout.precision bf16-true: the generator's engine holds a bfloat16 copy too
    bf = plan(grpo(arch, staleness=1, rollout_precision="bf16-true"))
    assert bf.rows["generator"].parameters == N_LM * 4 + N_LM * 2


def test_a_cpu_plan_counts_the_generators_imports(arch):
    cpu = grpo(arch, device="cpu", gpu_memory=24 * 2**30, staleness=1)
    assert plan(cpu).host == {"imports": IMPORTS_BYTES, "imports (generator)": IMPORTS_BYTES}
    assert plan(replace(cpu, staleness=0)).host == {"imports": IMPORTS_BYTES}


def test_offline_methods_have_no_staleness(arch):
    with pytest.raises(ValueError, match="staleness: dpo samples no rollouts"):
        Setup(actor=ModelSpec.of(arch, "lm"), method="dpo", staleness=1)


def test_run_and_flags_read_the_staleness(tmp_path, capsys):
    tiny_config("llama", V, hidden=H, layers=L, heads=4, kv_heads=2).save_pretrained(tmp_path)
    cfg = GRPOConfig()
    cfg.model.path = str(tmp_path)
    cfg.rollout.staleness = 2
    save_config(cfg, tmp_path / "run.yaml")
    setup, _ = plan_run(str(tmp_path / "run.yaml"))
    assert setup.staleness == 2 and "generator" in plan(setup).rows
    memory.cli(["--method", "grpo", "--config", str(tmp_path), "--staleness", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_gpu"]["generator"]["parameters"] > 0
    with pytest.raises(SystemExit) as stop:
        memory.cli(["--method", "dpo", "--config", str(tmp_path), "--staleness", "1"])
    assert stop.value.code == 2
    assert "--staleness: dpo samples no rollouts" in capsys.readouterr().err
