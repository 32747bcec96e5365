"""How close a step runs to the machine's arithmetic peak: ``perf/tokens_per_s``, ``perf/flops_per_s``
and ``perf/mfu`` in every method's ``metrics.jsonl`` (docs/performance.md).

The step's model FLOPs come from :mod:`proximal.models.flops` (what each pass of each model costs);
this module adds the denominator and the per-method bookkeeping:

- **The peak**, once per run, when it starts (:func:`measure_peak`, recorded in the run directory as
  ``perf.json`` and read back on ``--resume`` when the machine is the same): on a GPU in
  :data:`GPU_PEAKS`, its vendor's datasheet figure for dense products in the run's dtype; on a CPU,
  or a GPU the table lacks, the best rate of square matrix products measured for a second or two in
  that dtype, through the same kernels and threads the run's products use (:func:`probe`). Under
  torchrun the job's peak is the sum over processes.
- **An online step** (PPO, GRPO, RLOO): :func:`online_step_flops` — the policy's decode, the
  forward passes that score the rollout without gradients, and the training passes.
- :func:`step_metrics`: the three ``perf/`` numbers of a step from its FLOPs, trained tokens and
  wall time.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from proximal import dist
from proximal.config import ConfigError
from proximal.models import kernels
from proximal.models.flops import (
    ModelShape,
    Tokens,
    forward_flops,
    generate_flops,
    train_flops,
)

#: Dense (not 2:4-sparse) peak FLOP/s of known accelerators, from their vendors' datasheets: the
#: first row whose pattern is in ``torch.cuda.get_device_name()`` (case-insensitive) is the device's.
#: "fp32" is the non-tensor-core rate (float32 products under ``torch.get_float32_matmul_precision()
#: == "highest"``, PyTorch's default), "tf32" the tensor cores' rate when float32 products may use
#: TF32. NVIDIA's datasheets print the tensor-core figures with sparsity and say dense is half.
GPU_PEAKS: tuple[tuple[str, dict[str, float], str], ...] = (
    (
        "H100 NVL",
        {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
        "NVIDIA H100 datasheet, H100 NVL: BF16/FP16 1,671, TF32 835 TFLOPS with sparsity; FP32 60",
    ),
    (
        "H100 PCIe",
        {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51e12},
        "NVIDIA H100 datasheet, H100 PCIe: BF16/FP16 1,513, TF32 756 TFLOPS with sparsity; FP32 51",
    ),
    (
        "H100",
        {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
        "NVIDIA H100 datasheet, H100 SXM: BF16/FP16 1,979, TF32 989 TFLOPS with sparsity; FP32 67",
    ),
    (
        "H200 NVL",
        {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
        "NVIDIA H200 datasheet, H200 NVL: BF16/FP16 1,671, TF32 835 TFLOPS with sparsity; FP32 60",
    ),
    (
        "H200",
        {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.5e12, "fp32": 67e12},
        "NVIDIA H200 datasheet, H200 SXM: BF16/FP16 1,979, TF32 989 TFLOPS with sparsity; FP32 67",
    ),
    (
        "A100",
        {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
        "NVIDIA A100 datasheet (40 and 80 GB, SXM and PCIe): BF16/FP16 312, TF32 156, FP32 19.5",
    ),
    (
        "L40S",
        {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12},
        "NVIDIA L40S datasheet: BF16/FP16 362.05, TF32 183, FP32 91.6 TFLOPS (dense)",
    ),
    (
        "A10G",
        {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
        "NVIDIA publishes no A10G datasheet: the A10's (BF16/FP16 125, TF32 62.5, FP32 31.2); "
        "AWS's A10G runs at lower clocks, so its MFU reads low",
    ),
    (
        "A10",
        {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},
        "NVIDIA A10 datasheet: BF16/FP16 125, TF32 62.5 TFLOPS (dense); FP32 31.2",
    ),
    (
        "RTX 4090",
        {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
        "NVIDIA Ada GPU architecture whitepaper, GeForce RTX 4090: BF16/FP16 tensor with FP32 "
        "accumulate 165.2, TF32 82.6, FP32 82.6 TFLOPS (dense)",
    ),
    (
        "MI300X",
        {"bf16": 1307.4e12, "fp16": 1307.4e12, "tf32": 653.7e12, "fp32": 163.4e12},
        "AMD Instinct MI300X datasheet: BF16/FP16 1,307.4, TF32 653.7, FP32 matrix 163.4 TFLOPS",
    ),
)

#: The probe's square products: the first size, the largest, and its time budget in seconds.
PROBE_FIRST, PROBE_LARGEST, PROBE_BUDGET_S = 256, 8192, 1.0
#: ``train.precision`` → the dtype its products run in.
PRECISION_DTYPES = {"32-true": "float32", "bf16-mixed": "bfloat16", "bf16-true": "bfloat16"}


def gpu_peak(name: str, dtype: str) -> tuple[float, str] | None:
    """``(FLOP/s, source)`` of the device named ``name`` (``torch.cuda.get_device_name``) for products
    in ``dtype`` ("bfloat16", "float16", "tf32", "float32"), or None for a device not in
    :data:`GPU_PEAKS`."""
    key = {"bfloat16": "bf16", "float16": "fp16", "tf32": "tf32", "float32": "fp32"}[dtype]
    for pattern, peaks, source in GPU_PEAKS:
        if pattern.lower() in name.lower():
            return peaks[key], source
    return None


def probe(
    device: torch.device,
    dtype: torch.dtype,
    *,
    first: int = PROBE_FIRST,
    largest: int = PROBE_LARGEST,
    budget_s: float = PROBE_BUDGET_S,
) -> tuple[float, dict]:
    """The best rate, in FLOP/s, of ``n × n`` matrix products (2n³ FLOPs each) on ``device`` in
    ``dtype``: n doubles from ``first`` while the rate still grows by 5 % and one product takes under
    a sixteenth of ``budget_s`` (a many-core CPU needs large products to reach its peak, a small one
    is there at n ≈ 1024); each size is timed after a warm-up, for at most a quarter of the budget
    and 5 products, and its fastest product counts. Products go through
    :func:`proximal.models.kernels.linear`, the path a model's linear layers take on a CPU (oneDNN or
    torch's BLAS, as ``train.cpu_matmul`` chose), on the threads the process has. Returns the rate
    and ``{"products": {n: rate}, "threads"}``."""
    gen = torch.Generator().manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates: dict[int, float] = {}
    n = first
    while n <= largest:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        with torch.no_grad():
            kernels.linear(a, b)  # warm-up: packing, thread pools, caches
            sync()
            fastest, spent, reps = math.inf, 0.0, 0
            while reps < 5 and spent < budget_s / 4:
                t0 = time.perf_counter()
                kernels.linear(a, b)
                sync()
                took = time.perf_counter() - t0
                fastest, spent, reps = min(fastest, took), spent + took, reps + 1
        rates[n] = 2 * n**3 / fastest
        grew = len(rates) == 1 or rates[n] > 1.05 * rates[n // 2]
        if not grew or fastest > budget_s / 16:
            break
        n *= 2
    how = {
        "products": {n: f"{r / 1e9:.1f} GFLOP/s" for n, r in rates.items()},
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
    }
    return max(rates.values()), how


cpu_name = kernels.cpu_name  # the CPU's model name, as the matmul probe's cache keys it

#: Where each machine's best probe is kept (:func:`best_probe`), beside ``cpu_matmul.json``.
PEAK_CACHE_NAME = "peak_flops.json"


def best_probe(
    machine: str, peak: float, source: str, *, busy: bool = False, path: Path | None = None
) -> tuple[float, str]:
    """The machine's peak: the higher of this probe's ``peak`` (FLOP/s, described by ``source``) and
    the best earlier probe of the same ``machine`` (device, dtype, torch, a CPU's threads and product
    backend) kept in ``path`` (:func:`proximal.models.kernels.cache_path` of
    :data:`PEAK_CACHE_NAME`). Returns ``(FLOP/s, source)``, the source naming the probes it is the
    best of.

    One probe of a second catches the machine in a fast or a slow moment: on a 2-core VM identical
    steps read ±20 % in MFU against their own runs' probes. The best of every probe is the machine's
    rate, the same denominator for every run, so ``perf/mfu`` compares runs by their steps alone.
    A probe taken while other processes kept the cores ``busy`` measures the load: it is used for
    this run where it beats the kept one but not kept. Delete the file to measure afresh (after a
    BIOS, power or VM change)."""
    path = kernels.cache_path(PEAK_CACHE_NAME) if path is None else path
    entries = kernels.read_cache(path)
    kept = entries.get(machine)
    if not (
        isinstance(kept, dict)
        and isinstance(kept.get("peak_flops_per_s"), (int, float))
        and 0 < kept["peak_flops_per_s"] < math.inf
        and isinstance(kept.get("probes"), int)
        and kept["probes"] >= 1
        and isinstance(kept.get("source"), str)
    ):
        kept = None  # none kept, or an entry this code did not write: measured afresh
    best, n = (float(kept["peak_flops_per_s"]), kept["probes"]) if kept else (0.0, 0)
    if not busy:
        entries[machine] = (
            {"peak_flops_per_s": peak, "source": source}
            if peak > best
            else {"peak_flops_per_s": best, "source": kept["source"]}
        ) | {"probes": n + 1}
        kernels.write_cache(path, entries)
        n += 1
    here = f"{n} probe{'s' if n != 1 else ''} of this machine kept in {path}"
    if kept is not None and best >= peak:
        return best, (
            f"the best of {here}: {kept['source']}; this run's probe {peak / 1e9:.1f} GFLOP/s"
            + (" (busy machine, not kept)" if busy else "")
        )
    if busy:
        return peak, f"{source} (busy machine, not kept; {here})"
    return peak, f"{source} (the best of {here})"


def measure_peak(device: torch.device, precision: str, run_dir: Path | None = None) -> dict:
    """The run's peak FLOP/s, as recorded in ``perf.json``: ``device``, ``dtype``, ``processes``,
    ``threads`` (a CPU's), ``method`` ("datasheet" or "probe"), ``source`` (the datasheet's figure,
    or the probe's rates by size), ``peak_flops_per_s`` (one process's) and
    ``total_peak_flops_per_s`` (summed over the processes: what MFU divides by).

    A ``perf.json`` already in ``run_dir`` that describes the same device, dtype, processes and
    threads is reused (a resumed run keeps its denominator), and so is this process's own earlier
    probe of them; otherwise the peak is looked up or probed, and rank 0 writes the file. Every rank
    calls it (the peaks are summed over ranks)."""
    dtype = PRECISION_DTYPES[precision]
    if device.type == "cuda":
        name, threads = torch.cuda.get_device_name(device), None
        if dtype == "float32" and torch.get_float32_matmul_precision() != "highest":
            dtype = "tf32"  # float32 products may run on the tensor cores
    else:
        name, threads = f"cpu: {cpu_name()}", torch.get_num_threads()
    want = {"device": name, "dtype": dtype, "processes": dist.world_size(), "threads": threads}
    path = run_dir / "perf.json" if run_dir is not None else None
    cached = _read_record(path) if path is not None else None
    if cached is not None and {k: cached.get(k) for k in want} == want:
        return cached
    key = (str(device), dtype, threads)
    given = os.environ.get(PEAK_ENV)
    if given is not None:
        _MEASURED[key] = (_given_peak(given), "given", f"{PEAK_ENV}={given}")
    elif key not in _MEASURED:
        table = gpu_peak(name, dtype) if device.type == "cuda" else None
        if table is not None:
            _MEASURED[key] = (table[0], "datasheet", table[1])
        else:
            peak, how = probe(device, torch.bfloat16 if dtype == "bfloat16" else torch.float32)
            rates = ", ".join(f"n = {n}: {r}" for n, r in how["products"].items())
            on = f" on {threads} threads" if threads else " (a GPU not in the datasheet table)"
            source = f"square {dtype} products{on}, fastest of each size: {rates}"
            machine = f"{name} | {dtype} | torch {torch.__version__}"
            if device.type == "cpu":
                machine += f" | {threads} threads | {kernels.backend()[0]}"
            busy = device.type == "cpu" and kernels.busy_load() is not None
            best, source = best_probe(machine, peak, source, busy=busy)
            _MEASURED[key] = (best, "probe", source)
    peak, method, source = _MEASURED[key]
    record = {
        **want,
        "method": method,
        "source": source,
        "peak_flops_per_s": peak,
        "total_peak_flops_per_s": dist.global_sum(peak, device) if dist.is_distributed() else peak,
    }
    if path is not None and dist.is_main():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1) + "\n")
    return record


#: Set to one process's peak FLOP/s (e.g. ``989e12``) to skip the datasheet and the probe: the
#: figure a user knows for a device not in the table, or a test suite's way around a second of
#: probing in every process. Recorded in ``perf.json`` with method "given".
PEAK_ENV = "PROXIMAL_PEAK_FLOPS"


def _given_peak(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ConfigError(f"{PEAK_ENV}={text!r}: give one process's peak in FLOP/s, e.g. 989e12")
    return value


#: This process's peaks by (device, dtype, threads): ``(FLOP/s, method, source)``.
_MEASURED: dict[tuple, tuple[float, str, str]] = {}


def _read_record(path: Path) -> dict | None:
    """``perf.json``'s record, or None where there is none or it cannot be used."""
    try:
        record = json.loads(path.read_text())
        return record if float(record["total_peak_flops_per_s"]) > 0 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def step_metrics(*, flops: float, tokens: int, seconds: float, peak: float) -> dict[str, float]:
    """A step's ``perf/`` metrics: ``tokens`` trained per second, model ``flops`` per second, and
    that as a fraction of the ``peak`` FLOP/s (MFU), over the step's wall time ``seconds``."""
    s = max(seconds, 1e-9)
    return {
        "perf/tokens_per_s": tokens / s,
        "perf/flops_per_s": flops / s,
        "perf/mfu": flops / s / peak,
    }


def online_step_flops(
    shapes: dict[str, ModelShape | None],
    *,
    prompt_mask: torch.Tensor,
    response_mask: torch.Tensor,
    policy: str,
    forward: Sequence[str],
    trained: dict[str, Tokens],
    device: torch.device | str = "cpu",
) -> float:
    """The model FLOPs of one step of an online method, all processes together.

    This rank's rollout — ``prompt_mask`` (B, P) and ``response_mask`` (B, T), its real tokens — was
    decoded by ``policy`` and scored by a forward pass without gradients of each model in
    ``forward`` over its prompt and response (logits on the response positions), and ``trained``
    maps each model to the tokens of its training passes, every process's together (each optimiser
    epoch's pass counted again). Models are named as in ``shapes`` (:meth:`Run.record_models`'s
    names); a name whose shape is None is a model the run does not hold, and is skipped.
    """

    def shape(name: str) -> ModelShape | None:
        if name not in shapes:
            raise KeyError(f"no model {name!r} was recorded (have {', '.join(shapes)})")
        return shapes[name]

    prompts, responses = prompt_mask.sum(1).tolist(), response_mask.sum(1).tolist()
    local = generate_flops(shape(policy), prompts, responses)
    seq = Tokens.of([p + r for p, r in zip(prompts, responses)], head=int(sum(responses)))
    local += sum(forward_flops(s, seq) for s in map(shape, forward) if s is not None)
    passes = [(shape(name), tokens) for name, tokens in trained.items()]
    return dist.global_sum(local, device) + sum(
        train_flops(s, tokens) for s, tokens in passes if s is not None
    )


def global_tokens(tokens: Tokens, device: torch.device | str = "cpu") -> Tokens:
    """``tokens`` summed over every process."""
    if not dist.is_distributed():
        return tokens
    summed = dist.all_reduce_sum(
        torch.tensor([tokens.body, tokens.squares, tokens.head], dtype=torch.float64, device=device)
    )
    return Tokens(*(int(v) for v in summed.tolist()))
