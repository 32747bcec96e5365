"""``train.cpu_matmul`` and what a run says about its fast paths (``proximal.train.run``).

The config field is checked as a user meets it (YAML or ``--train.cpu_matmul``, a config built in
code, the environment's override); ``open_run`` applies it process-wide before any model loads and
prints it; ``models.json`` records, inside each model's entry, the CPU backend and, for the model the
rollout engine decodes, the decode path — its keys stay the models' names, so the readers that count
or sum them (the report, the comparison) read the same numbers as before.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from proximal.compare_report import collect_run
from proximal.config import ConfigError, check_valid, describe, load_config, save_config, section
from proximal.models import kernels
from proximal.rollout.engine import HFEngine
from proximal.train import run as run_module
from proximal.train.run import Run, open_run
from proximal.train.sections import TrainSection
from proximal.trainers.ppo import PPOConfig


@dataclasses.dataclass
class Config:
    train: TrainSection = section(TrainSection)

    def validate(self) -> list[str]:
        return self.train.problems()


@pytest.fixture
def backend(monkeypatch, tmp_path):
    """This process's CPU backend comes back after the test; ``PROXIMAL_CPU_MATMUL`` starts unset;
    "auto"'s measurement is in ``tmp_path`` and its rounds are given: oneDNN 1.0 s, BLAS 2.0 s."""
    monkeypatch.delenv(kernels.ENV, raising=False)
    for name in ("_BACKEND", "_OP", "_REORDER", "_PROBED"):
        monkeypatch.setattr(kernels, name, getattr(kernels, name))
    monkeypatch.setattr(kernels, "cache_path", lambda: tmp_path / "cache" / "cpu_matmul.json")
    monkeypatch.setattr(kernels, "probe_seconds", lambda: {"blas": [2.0] * 4, "onednn": [1.0] * 4})
    monkeypatch.setattr(kernels, "busy_load", lambda: None)  # a quiet machine: the result is kept
    monkeypatch.setattr(run_module, "busy_cpu_note", lambda *a, **k: None)  # and no busy note


def test_the_field_its_values_and_its_errors(tmp_path):
    assert Config().train.cpu_matmul == "auto"
    for value in ("auto", "onednn", "blas"):
        assert load_config(Config, overrides={"train.cpu_matmul": value}).train.cpu_matmul == value
    with pytest.raises(
        ConfigError, match=r"train\.cpu_matmul: 'mkl' is not one of 'auto', 'onednn', 'blas'"
    ):
        load_config(Config, overrides={"train.cpu_matmul": "mkl"})
    built = Config()
    built.train.cpu_matmul = "MKL"  # a config built in code skips the loader's check
    with pytest.raises(
        ConfigError, match=r"train\.cpu_matmul = 'MKL' is not one of auto, onednn, blas"
    ):
        check_valid(built)
    save_config(Config(), tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["cpu_matmul"] == "auto"
    (row,) = [r for r in describe(PPOConfig) if r[0] == "train.cpu_matmul"]  # every command's train
    assert (
        row[2] == "auto"
        and "PROXIMAL_CPU_MATMUL" in row[3]
        and "One of: auto, onednn, blas" in row[3]
    )


def _open(tmp_path, **kw) -> Run:
    return open_run(
        "test",
        output_dir=str(tmp_path / "run"),
        overwrite=False,
        seed=0,
        device="cpu",
        dist_timeout_s=60,
        **kw,
    )


def _said(capsys, run: Run, printed: bool = False) -> list[str]:
    """The cpu matmul line rank 0 writes to run.log when the run begins; on stdout too only where
    ``printed`` (the config's choice is not what runs; else only with output.verbose)."""
    capsys.readouterr()
    run.begin(Config(), start=0, total=1, counters={}, progress=False)
    run.finish()
    logged = [
        line for line in (run.dir / "run.log").read_text().splitlines() if "cpu matmul" in line
    ]
    out = [line for line in capsys.readouterr().out.splitlines() if "cpu matmul" in line]
    assert out == (logged if printed else [])
    return logged


def test_open_run_applies_the_choice_and_says_so(tmp_path, backend, monkeypatch, capsys):
    run = _open(tmp_path, cpu_matmul="blas")
    assert kernels.backend() == ("blas", "train.cpu_matmul = blas")
    assert run.cpu_matmul == {"backend": "blas", "why": "train.cpu_matmul = blas"}
    assert _said(capsys, run) == ["proximal test: cpu matmul: blas (train.cpu_matmul = blas)"]
    # the environment overrides the config, and the line says so
    monkeypatch.setenv(kernels.ENV, "onednn")
    run = _open(tmp_path / "b", cpu_matmul="blas")
    want = "onednn" if kernels._OP is not None else "blas"
    assert kernels.backend()[0] == run.cpu_matmul["backend"] == want
    (line,) = _said(capsys, run, printed=want != "onednn")  # printed where oneDNN is missing
    assert line.startswith(
        f"proximal test: cpu matmul: {want} (PROXIMAL_CPU_MATMUL=onednn overrides "
        "train.cpu_matmul = blas"
    )
    # the default is auto, measured (here: the fixture's rounds, oneDNN twice BLAS's rate), and the
    # measurement is recorded beside the choice; the next run reads it from the cache
    monkeypatch.delenv(kernels.ENV)
    flops = kernels.probe_flops()
    for c, how in (("c", "measured"), ("d", "cached measurement")):
        run = _open(tmp_path / c)
        if kernels._OP is None:
            assert run.cpu_matmul["backend"] == "blas" and "probe" not in run.cpu_matmul
            continue
        assert run.cpu_matmul["backend"] == "onednn"
        assert run.cpu_matmul["why"] == (
            f"train.cpu_matmul = auto: {how}, oneDNN {flops / 1e9:.0f}, BLAS {flops / 2e9:.0f} "
            f"GFLOP/s on {torch.get_num_threads()} threads (noise 0 %)"
        )
        probe = run.cpu_matmul["probe"]
        assert probe["rates"] == {"blas": flops / 2.0, "onednn": flops / 1.0}
        assert probe["cached"] is (c == "d") and probe["noise"] == 0.0
        assert probe["threads"] == torch.get_num_threads() and probe["key"] == kernels.machine_key()


def test_a_wrong_choice_stops_before_anything_is_written(tmp_path, backend, monkeypatch):
    with pytest.raises(ConfigError, match="train.cpu_matmul = 'fast'"):
        _open(tmp_path, cpu_matmul="fast")
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ConfigError, match="PROXIMAL_CPU_MATMUL='fast'"):
        _open(tmp_path)
    assert not (tmp_path / "run").exists()


def _lm(arch: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, vocab_size=64, **kw)
    return AutoModelForCausalLM.from_config(config).eval()


LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT2 = dict(n_embd=32, n_layer=1, n_head=2, n_positions=64)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_models_json_records_the_decode_path_and_the_backend(arch, tmp_path, backend, capsys):
    run = _open(tmp_path, cpu_matmul="blas")
    run.begin(Config(), start=0, total=1, counters={}, progress=False)
    actor = _lm(arch, **(LLAMA if arch == "llama" else GPT2))
    reference = _lm("gpt2", **GPT2)
    engine = HFEngine(actor, 0)
    capsys.readouterr()
    info = run.record_models(engine=engine, actor=actor, reference=reference)
    said = capsys.readouterr().out.splitlines()
    run.finish()

    models = json.loads((run.dir / "models.json").read_text())
    assert models == info and sorted(models) == ["actor", "reference"]
    matmul = {"backend": "blas", "why": "train.cpu_matmul = blas"}
    reason = (
        None
        if arch == "llama"
        else "GPT2LMHeadModel is not one of "
        + ", ".join(
            ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
        )
    )
    path = "lean" if arch == "llama" else "generate"
    assert models["actor"]["decode"] == {"path": path, "reason": reason}
    assert models["actor"]["cpu_matmul"] == models["reference"]["cpu_matmul"] == matmul
    assert "decode" not in models["reference"]
    for name, module in (("actor", actor), ("reference", reference)):  # the counts, as before
        params = list(module.parameters())
        assert models[name]["parameters"] == sum(p.numel() for p in params)
        assert models[name]["bytes"] == sum(p.numel() * p.element_size() for p in params)
    line = (
        "proximal test: decode: lean (proximal.rollout.decode's step; rollout.lean_decode)"
        if arch == "llama"
        else f"proximal test: decode: the model's own forward at every token (lean decode: {reason})"
    )
    assert said == [line]

    # The comparison's reader counts and sums the models as before.
    record = collect_run(
        run.dir,
        {"name": "r", "group": "g", "method": "ppo", "source": "s", "seed": 0},
        collapse_margin=0.05,
        stability_score="gold",
    )
    assert record["models"] == ["actor", "reference"] and record["models_resident"] == 2
    assert record["param_bytes"] == models["actor"]["bytes"] + models["reference"]["bytes"]


def test_off_the_cpu_no_backend_is_recorded_and_the_engine_must_be_given_its_model(tmp_path):
    run = Run("test", tmp_path / "run", torch.device("cpu"), None, [], [])  # cpu_matmul None
    actor, other = _lm("llama", **LLAMA), _lm("llama", **LLAMA)
    info = run.record_models(actor=actor)
    assert "cpu_matmul" not in info["actor"] and "decode" not in info["actor"]
    with pytest.raises(ValueError, match="the engine's model is not one of the models given"):
        run.record_models(engine=HFEngine(other, 0), actor=actor)


def test_the_backend_line_and_the_busy_note_go_to_run_log_unless_verbose(
    tmp_path, backend, monkeypatch, capfd
):
    """Issue 37: the CPU products' line (with "auto"'s probe) and a busy machine's note are written to
    run.log and models.json, and printed only with output.verbose."""
    busy = "the CPU is busy (load average 3.0 from other processes on 2 cores, and 1 torch threads here)"
    monkeypatch.setattr(run_module, "busy_cpu_note", lambda *a, **k: busy)
    for verbose in (False, True):
        run = _open(tmp_path / str(verbose), verbose=verbose)
        assert run.cpu_matmul["busy"] == busy  # models.json's record of each CPU model
        capfd.readouterr()
        run.begin(Config(), start=0, total=1, counters={}, progress=False)
        run.finish()
        out = capfd.readouterr().out
        log = (run.dir / "run.log").read_text().splitlines()
        matmul = f"proximal test: cpu matmul: {run.cpu_matmul['backend']} ({run.cpu_matmul['why']})"
        assert matmul in log and f"proximal test: {busy}" in log
        assert (matmul in out.splitlines()) is verbose
        assert (busy in out) is verbose
        if not verbose:
            assert "cpu matmul" not in out and "busy" not in out


def test_a_resumed_run_keeps_the_decode_path_it_recorded(tmp_path, backend, capsys):
    """Issue 37: where the run being resumed decoded with the model's own forward, a resume that could
    take the lean step decodes the model's own way too (models.json says why); where it took the lean
    step and this process cannot, one printed line says the numbers now differ."""
    llama = _lm("llama", **LLAMA)
    run = _open(tmp_path / "a", cpu_matmul="blas")
    run.recorded = {"actor": {"decode": {"path": "generate", "reason": "a lean step failed"}}}
    run.begin(Config(), start=0, total=1, counters={}, progress=False)
    engine = HFEngine(llama, 0)
    assert engine.decode_path()["path"] == "lean"  # a fresh run would take the lean step
    capsys.readouterr()
    info = run.record_models(engine=engine, actor=llama)
    run.finish()
    assert info["actor"]["decode"] == {
        "path": "generate",
        "reason": "the run being resumed decoded so (a lean step failed)",
    }
    assert "differ" not in capsys.readouterr().out

    gpt2 = _lm("gpt2", **GPT2)
    run = _open(tmp_path / "b", cpu_matmul="blas")
    run.recorded = {"actor": {"decode": {"path": "lean", "reason": None}}}
    run.begin(Config(), start=0, total=1, counters={}, progress=False)
    engine = HFEngine(gpt2, 0)
    capsys.readouterr()
    run.record_models(engine=engine, actor=gpt2)
    run.finish()
    (line,) = [s for s in capsys.readouterr().out.splitlines() if "run being resumed" in s]
    assert line.startswith(
        "proximal test: decode: the run being resumed took the lean step, which this process "
        "cannot (GPT2LMHeadModel is not one of"
    ) and line.endswith(
        "from here its numbers differ from an uninterrupted run's in the last digits"
    )


def test_a_backend_asked_for_and_missing_is_printed_all_the_same(
    tmp_path, backend, monkeypatch, capfd
):
    """``train.cpu_matmul: onednn`` where this torch has no oneDNN product runs BLAS: that changes the
    result the config asked for, so the line is printed without output.verbose."""
    monkeypatch.setattr(kernels, "_op_problems", lambda: ("no oneDNN here", "no oneDNN product"))
    run = _open(tmp_path, cpu_matmul="onednn")
    capfd.readouterr()
    run.begin(Config(), start=0, total=1, counters={}, progress=False)
    run.finish()
    line = (
        "proximal test: cpu matmul: blas (train.cpu_matmul = onednn; but no oneDNN here: torch's "
        "F.linear instead)"
    )
    assert line in capfd.readouterr().out.splitlines()
    assert line in (run.dir / "run.log").read_text().splitlines()
