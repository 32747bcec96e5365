"""The denominator of MFU and the per-step bookkeeping (proximal.train.perf): the datasheet table
looked up by device name, the CPU probe and its record in the run directory, the step's metrics and
an online step's FLOPs by hand."""

from __future__ import annotations

import json
import math

import pytest
import torch

from proximal.config import ConfigError
from proximal.models import kernels
from proximal.models.flops import ModelShape, Tokens
from proximal.train import perf


@pytest.mark.parametrize(
    "name, dtype, peak",
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 989.5e12),  # SXM
        ("NVIDIA H100 PCIe", "bfloat16", 756.5e12),
        ("NVIDIA H100 NVL", "float16", 835.5e12),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5e12),
        ("NVIDIA H100 80GB HBM3", "float32", 67e12),
        ("NVIDIA H200", "bfloat16", 989.5e12),
        ("NVIDIA H200 NVL", "bfloat16", 835.5e12),
        ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
        ("NVIDIA A100 80GB PCIe", "float32", 19.5e12),
        ("NVIDIA L40S", "bfloat16", 362.05e12),
        ("NVIDIA A10G", "bfloat16", 125e12),  # an A10G is not taken for an A100
        ("NVIDIA A10", "tf32", 62.5e12),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2e12),
        ("AMD Instinct MI300X", "bfloat16", 1307.4e12),
    ],
)
def test_datasheet_peaks(name, dtype, peak):
    found, source = perf.gpu_peak(name, dtype)
    assert found == peak
    assert source


def test_an_unknown_gpu_has_no_table_entry():
    assert perf.gpu_peak("Tesla T4", "bfloat16") is None


def test_the_probe_is_positive_finite_and_short():
    rate, how = perf.probe(torch.device("cpu"), torch.float32, budget_s=0.4)
    assert math.isfinite(rate) and rate > 0
    assert how["products"] and how["threads"] == torch.get_num_threads()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test its own per-machine cache (never the user's ``~/.cache/proximal``), and a machine
    whose load lets a probe be kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(kernels, "busy_load", lambda: None)


def test_the_peak_is_the_best_probe_this_machine_has_made(tmp_path):
    path = tmp_path / "peaks.json"
    m = "cpu: Some CPU | float32 | torch 2.x | 2 threads | blas"

    def best(peak, busy=False, machine=m):
        return perf.best_probe(machine, peak, f"probe at {peak:g}", busy=busy, path=path)

    assert best(50e9) == (
        50e9,
        f"probe at 5e+10 (the best of 1 probe of this machine kept in {path})",
    )
    # a slower moment: the kept best stands, and the source says so
    assert best(40e9) == (
        50e9,
        f"the best of 2 probes of this machine kept in {path}: probe at 5e+10; this run's probe "
        "40.0 GFLOP/s",
    )
    assert best(60e9) == (
        60e9,
        f"probe at 6e+10 (the best of 3 probes of this machine kept in {path})",
    )
    # a busy machine's probe is used where it beats the best, never kept
    assert best(70e9, busy=True)[0] == 70e9
    assert "busy machine, not kept" in best(70e9, busy=True)[1]
    assert best(30e9, busy=True) == (
        60e9,
        f"the best of 3 probes of this machine kept in {path}: probe at 6e+10; this run's probe "
        "30.0 GFLOP/s (busy machine, not kept)",
    )
    kept = json.loads(path.read_text())
    assert kept == {m: {"peak_flops_per_s": 60e9, "source": "probe at 6e+10", "probes": 3}}
    # another machine (here: other threads) has its own entry; a foreign entry is measured afresh
    other = m.replace("2 threads", "1 threads")
    assert best(20e9, machine=other)[0] == 20e9
    path.write_text(json.dumps({m: {"peak_flops_per_s": "fast"}, other: kept[m]}))
    assert best(10e9) == (
        10e9,
        f"probe at 1e+10 (the best of 1 probe of this machine kept in {path})",
    )
    assert best(10e9, machine=other)[0] == 60e9
    # an unreadable or unwritable cache: this probe alone
    path.write_text("{not json")
    assert best(5e9)[0] == 5e9
    blocked = tmp_path / "file"
    blocked.write_text("")
    got = perf.best_probe(m, 5e9, "p", path=blocked / "peaks.json")
    assert got[0] == 5e9


def test_a_new_run_divides_by_the_best_probe_not_its_own(tmp_path, monkeypatch):
    rates = iter([50e9, 40e9])
    monkeypatch.setattr(perf, "probe", lambda *a, **kw: (next(rates), {"products": {}}))
    monkeypatch.setattr(perf, "_MEASURED", {})
    first = perf.measure_peak(torch.device("cpu"), "32-true", tmp_path / "run1")
    monkeypatch.setattr(perf, "_MEASURED", {})  # another process
    second = perf.measure_peak(torch.device("cpu"), "32-true", tmp_path / "run2")
    assert first["peak_flops_per_s"] == second["peak_flops_per_s"] == 50e9
    assert "this run's probe 40.0 GFLOP/s" in second["source"]
    cache = kernels.cache_path(perf.PEAK_CACHE_NAME)
    assert cache.is_relative_to(tmp_path / "xdg")
    ((key, entry),) = json.loads(cache.read_text()).items()
    assert key == (
        f"cpu: {kernels.cpu_name()} | float32 | torch {torch.__version__} | "
        f"{torch.get_num_threads()} threads | {kernels.backend()[0]}"
    )
    assert (entry["peak_flops_per_s"], entry["probes"]) == (50e9, 2)


def test_a_cpu_peak_is_probed_once_and_recorded_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(perf, "_MEASURED", {})
    calls = []
    real = perf.probe

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, budget_s=0.4)

    monkeypatch.setattr(perf, "probe", counting)
    record = perf.measure_peak(torch.device("cpu"), "bf16-mixed", tmp_path)
    written = json.loads((tmp_path / "perf.json").read_text())
    assert written == record
    assert record["device"].startswith("cpu: ") and record["dtype"] == "bfloat16"
    assert record["method"] == "probe" and record["threads"] == torch.get_num_threads()
    assert record["processes"] == 1
    assert record["total_peak_flops_per_s"] == record["peak_flops_per_s"] > 0
    assert calls[0][1] == torch.bfloat16
    # a resumed run reads its record back; another process of the same run does not probe again
    assert perf.measure_peak(torch.device("cpu"), "bf16-mixed", tmp_path) == record
    assert perf.measure_peak(torch.device("cpu"), "bf16-mixed", tmp_path / "other") == record
    assert len(calls) == 1
    # another dtype is another measurement, and replaces the record
    assert perf.measure_peak(torch.device("cpu"), "32-true", tmp_path)["dtype"] == "float32"
    assert len(calls) == 2
    assert json.loads((tmp_path / "perf.json").read_text())["dtype"] == "float32"


def test_a_gpu_in_the_table_is_looked_up_not_probed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(perf, "probe", lambda *a, **kw: pytest.fail("probed a GPU in the table"))
    monkeypatch.setattr(perf, "_MEASURED", {})
    cuda = torch.device("cuda")
    record = perf.measure_peak(cuda, "bf16-true", tmp_path)
    assert (record["dtype"], record["method"], record["peak_flops_per_s"]) == (
        "bfloat16",
        "datasheet",
        756.5e12,
    )
    assert record["threads"] is None
    assert "H100 PCIe" in record["source"]
    # float32 products: the CUDA cores' rate, or the tensor cores' when TF32 is allowed
    assert perf.measure_peak(cuda, "32-true")["peak_flops_per_s"] == 51e12
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert perf.measure_peak(cuda, "32-true")["dtype"] == "tf32"
        assert perf.measure_peak(cuda, "32-true")["peak_flops_per_s"] == 378e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_step_metrics():
    m = perf.step_metrics(flops=6e12, tokens=3000, seconds=2.0, peak=1e13)
    assert m == {"perf/tokens_per_s": 1500.0, "perf/flops_per_s": 3e12, "perf/mfu": 0.3}


def test_online_step_flops_by_hand():
    """Two rows: prompts of 2 and 3 real tokens, responses of 2 and 1. The actor decodes them, the
    reference scores them, a reward model that is not held is skipped, and the actor trains on
    them (given as every process's tokens)."""
    actor = ModelShape(
        body=100, head=10, body_trained=100, head_trained=10, layers=1, attention_width=2
    )
    ref = ModelShape(body=100, head=10, body_trained=0, head_trained=0, layers=1, attention_width=2)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    response_mask = torch.tensor([[True, True], [True, False]])
    trained = Tokens(body=8, squares=16 + 16, head=3)
    got = perf.online_step_flops(
        {"actor": actor, "reference": ref, "reward_model": None},
        prompt_mask=prompt_mask,
        response_mask=response_mask,
        policy="actor",
        forward=("reference", "reward_model"),
        trained={"actor": trained},
    )
    # decode: row 1 — prompt 2 (2·100·2 + 2·10 + 4·1·2·4 = 452), then one token seeing 3 positions
    # (2·100 + 2·10 + 4·1·2·3 = 244); row 2 — prompt 3 only (2·100·3 + 2·10 + 4·1·2·9 = 692)
    decode = 452 + 244 + 692
    # the reference's forward over 4 + 4 tokens, its head on 3: 2·100·8 + 2·10·3 + 4·1·2·(16 + 16)
    score = 1600 + 60 + 256
    # the actor's training: 6·100·8 + 6·10·3 + 12·1·2·32
    train = 4800 + 180 + 768
    assert got == decode + score + train
    with pytest.raises(KeyError, match="critic"):
        perf.online_step_flops(
            {"actor": actor},
            prompt_mask=prompt_mask,
            response_mask=response_mask,
            policy="actor",
            forward=("critic",),
            trained={},
        )


@pytest.fixture(autouse=True)
def _no_given_peak(monkeypatch):
    """The suite's conftest gives every run a peak; these tests are about finding one."""
    monkeypatch.delenv(perf.PEAK_ENV, raising=False)


def test_a_given_peak_is_used_and_recorded_not_probed(tmp_path, monkeypatch):
    monkeypatch.setenv(perf.PEAK_ENV, "2.5e12")
    monkeypatch.setattr(perf, "probe", lambda *a, **kw: pytest.fail("probed despite a given peak"))
    record = perf.measure_peak(torch.device("cpu"), "32-true", tmp_path)
    assert (record["method"], record["peak_flops_per_s"]) == ("given", 2.5e12)
    assert (
        json.loads((tmp_path / "perf.json").read_text())["source"] == "PROXIMAL_PEAK_FLOPS=2.5e12"
    )


@pytest.mark.parametrize("text", ["fast", "0", "-1e12", "inf", "nan"])
def test_a_given_peak_that_is_not_a_positive_number_is_refused(tmp_path, monkeypatch, text):
    monkeypatch.setenv(perf.PEAK_ENV, text)
    with pytest.raises(ConfigError, match="PROXIMAL_PEAK_FLOPS"):
        perf.measure_peak(torch.device("cpu"), "32-true", tmp_path)
