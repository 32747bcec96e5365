"""Float32 matrix multiplications on CPU through oneDNN instead of the BLAS torch links.

torch's CPU wheels compute a float32 ``nn.Linear`` with MKL's ``sgemm``. On CPUs that are not
Intel's (AMD EPYC, measured here), MKL takes its AVX2 code path, while oneDNN — which torch also
ships, and uses for bfloat16 — dispatches on the instruction sets the CPU reports and runs AVX-512.
Measured on a 2-core AMD EPYC with AVX-512 (2 threads, ``benchmarks/README.md``): a (1024 × 256) ·
(256 × 1024) product takes 2.5 ms in MKL and 1.2 ms in oneDNN; 84 against 440 GFLOP/s for the
shapes of a small transformer block. The arithmetic is the same float32 multiply-add (no reduced
precision): the results differ from MKL's by float32 rounding of another summation order, and both
are as close to the float64 product (measured for 256-term sums of N(0, 1) products: largest error
5e-5 for oneDNN, 3e-5 for MKL, on values up to about 80).

:func:`use_onednn_linears` routes every ``nn.Linear`` of a model through :func:`linear`, which
uses oneDNN for the forward product and for both products of backward (∂x = ∂y·W, ∂W = ∂yᵀ·x)
when all of these hold, and is ``torch.nn.functional.linear`` otherwise:

- the tensors are float32 on CPU and no autocast is active (autocast must see ``F.linear`` to cast
  it), the weight is a plain tensor (not a DTensor), and torch has the oneDNN operator;
- the product is big enough for oneDNN to pay: below about 2²¹ multiply-adds (one row of a decode
  step, LoRA's rank-r factors) its per-call set-up costs more than MKL's (measured: a 1 × 256 ·
  256 × 1024 product takes 28 µs in oneDNN, 22 µs in MKL);
- the process's backend is "onednn" (:func:`configure`, once, before models are prepared:
  ``train.cpu_matmul`` through :func:`proximal.train.run.open_run`). "auto" measures, not guesses
  by vendor (issue 27): a probe of the two libraries on a small transformer block's products
  (:data:`PROBE_SHAPES`, some tens of milliseconds, :func:`probe_seconds`) takes oneDNN where it is
  faster than torch's BLAS by more than the probe's noise (:func:`decide`), and the result is kept
  per machine — CPU model, torch version, thread count — in ``~/.cache/proximal/cpu_matmul.json``
  (:func:`auto_backend`), so later runs read it instead. Where nothing is cached and the machine is
  busy (:func:`busy_load`), or the probe's rounds are noisier than :data:`PROBE_CACHE_NOISE`, a timing
  would be noise and could flip between two starts: "auto" then takes torch's BLAS by rule, caches
  nothing, and says so. A resumed run takes the backend its run directory recorded
  (``configure(recorded=...)``), so its numbers continue the run's bit for bit.
  ``PROXIMAL_CPU_MATMUL`` (onednn, blas, auto) overrides the choice. (Measured: MKL takes its AVX2
  path on AMD's AVX-512 CPUs, half oneDNN's rate there; on Intel's, MKL runs AVX-512 itself; the
  probe needs no list of either.)

The oneDNN operators are torch internals (``torch.ops.mkldnn._linear_pointwise`` and, for the
weights packed for decoding, ``_reorder_linear_weight``): :func:`configure` looks each one up and
tries it on a small product whose result is exact, so a torch release that renamed or changed one
gives the public path (``F.linear``, or unpacked weights) and a reason, never a failing run.

Parameters, state dicts and checkpoints are untouched: only the modules' ``forward`` changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from proximal.config import ConfigError

#: Products smaller than this many multiply-adds stay with torch's BLAS (see the module docstring).
MIN_MACS = 1 << 21

#: ``train.cpu_matmul`` and ``PROXIMAL_CPU_MATMUL``: the CPU's default, oneDNN, or torch's BLAS.
CHOICES = ("auto", "onednn", "blas")
#: The environment variable that overrides ``train.cpu_matmul``.
ENV = "PROXIMAL_CPU_MATMUL"


def _mkldnn_op(name: str):
    """``torch.ops.mkldnn.<name>.default``, or None where this torch has no such operator (a build
    without oneDNN, or a release that renamed it)."""
    try:
        op = getattr(torch.ops.mkldnn, name).default
    except (AttributeError, RuntimeError):
        return None
    return op if torch.backends.mkldnn.is_available() else None


# Looked up again, and tried, by configure(); found here so that a module that never configures
# (and the tests' skip conditions) see what this torch has.
_OP = _mkldnn_op("_linear_pointwise")  # (x, W, b, "none", [], "") -> x·Wᵀ + b
_REORDER = _mkldnn_op("_reorder_linear_weight")  # (W, rows) -> W in oneDNN's blocked layout

#: The backend of this process's float32 CPU products and why: set by :func:`configure`; None until
#: then (the first product configures "auto").
_BACKEND: tuple[str, str] | None = None


#: "auto"'s probe: the products (M, K, N) of a small transformer block at 512 tokens — a 256-wide
#: attention projection, a 256 → 1024 and a 1024 → 256 MLP product (the tiny benchmark work's shapes
#: at half its batch). About 0.6 GFLOP a round; at 50–500 GFLOP/s the probe takes 10–70 ms.
PROBE_SHAPES = ((512, 256, 256), (512, 256, 1024), (512, 1024, 256))
#: Timed rounds of each backend (after one warm-up round each), alternating so that a slow spell of
#: the machine hits both.
PROBE_ROUNDS = 4
#: The smallest relative difference taken as real, whatever the rounds' spread says.
PROBE_MIN_MARGIN = 0.05
#: A measurement noisier than this (a busy machine: rounds of one backend apart by more) is not
#: trusted: "auto" takes torch's BLAS by rule and keeps nothing, so the next run measures again; so
#: is a machine whose other processes keep the cores busy (:func:`busy_load`), which slows both
#: backends alike and hides from the rounds' spread: there nothing is measured.
PROBE_CACHE_NOISE = 0.25
#: "auto"'s backend where a measurement cannot be trusted: torch's own (the public path).
RULE_BACKEND = "blas"
#: Where "auto"'s measurements are kept (:func:`cache_path`): one entry per :func:`machine_key`.
CACHE_NAME = "cpu_matmul.json"

#: This process's "auto" measurement (:func:`auto_backend`'s record), or None.
_PROBED: dict | None = None


def probe_flops() -> int:
    """The FLOPs of one probe round: 2·M·K·N summed over :data:`PROBE_SHAPES`."""
    return sum(2 * m * k * n for m, k, n in PROBE_SHAPES)


def decide(seconds: dict[str, list[float]]) -> tuple[str, dict]:
    """ "auto"'s choice from the probe's round times: ``seconds["blas"]`` and ``seconds["onednn"]``,
    each round one product of every :data:`PROBE_SHAPES` shape. A backend's time is its fastest
    round, and the noise the larger relative gap between a backend's median and fastest round
    (at least :data:`PROBE_MIN_MARGIN`); oneDNN is taken when its time is below BLAS's by more than
    the noise, torch's BLAS otherwise — the public path, where nothing is measured to gain.

    Returns ``(backend, record)``, record ``{"backend", "rates": {"onednn", "blas"} in FLOP/s,
    "noise"}``."""
    best = {b: min(seconds[b]) for b in ("blas", "onednn")}
    noise = max(statistics.median(seconds[b]) / best[b] - 1 for b in best)
    margin = max(noise, PROBE_MIN_MARGIN)
    backend = "onednn" if best["onednn"] * (1 + margin) < best["blas"] else "blas"
    rates = {b: probe_flops() / t for b, t in best.items()}
    return backend, {"backend": backend, "rates": rates, "noise": noise}


def describe(record: dict) -> str:
    """``decide``'s record in words: "oneDNN 412, BLAS 201 GFLOP/s on 2 threads (noise 3 %)"; for a
    choice by rule (:func:`auto_backend`'s ``"rule"``), the rule and why."""
    busy = record.get("busy_load")
    if record.get("rule") == "busy":
        return (
            f"torch's BLAS by rule: the machine is busy (load {busy:.1f} beyond the free cores), "
            "so a timing would be noise; nothing measured or cached"
        )
    r = record["rates"]
    rates = (
        f"oneDNN {r['onednn'] / 1e9:.0f}, BLAS {r['blas'] / 1e9:.0f} GFLOP/s on "
        f"{record.get('threads', '?')} threads (noise {100 * record['noise']:.0f} %)"
    )
    if record.get("rule") == "noisy":
        return f"torch's BLAS by rule: the probe was too noisy to trust, {rates}; not cached"
    return rates


def probe_seconds(rounds: int = PROBE_ROUNDS) -> dict[str, list[float]]:
    """Time ``rounds`` rounds of :data:`PROBE_SHAPES` through torch's BLAS (``F.linear``) and through
    oneDNN, alternating, after a warm-up round of each, on this process's threads; float32 operands
    of N(0, 1) values. ``{"blas": [s, …], "onednn": [s, …]}``. Needs the oneDNN operator (:func:`configure`
    tried it)."""
    gen = torch.Generator().manual_seed(0)
    operands = [
        (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen))
        for m, k, n in PROBE_SHAPES
    ]
    fns = {
        "blas": torch.nn.functional.linear,
        "onednn": lambda x, w: _OP(x, w, None, "none", [], ""),
    }
    out: dict[str, list[float]] = {b: [] for b in fns}
    with torch.no_grad():
        for r in range(rounds + 1):
            for b, fn in fns.items():
                t0 = time.perf_counter()
                for x, w in operands:
                    fn(x, w)
                if r:  # round 0 warms up the thread pool, the caches and oneDNN's kernels
                    out[b].append(time.perf_counter() - t0)
    return out


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as fh:
            found = re.search(r"^model name\s*:\s*(.+)$", fh.read(), re.M)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_key() -> str:
    """What the probe's result holds for: the CPU model, torch's version and the thread count."""
    return f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def busy_load() -> float | None:
    """The 1-minute load average where it exceeds the cores this process's threads leave free by
    more than half a core (other work competes for them: a probe then measures the load), else
    None; None where the platform has no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    free = max(0, (os.cpu_count() or 1) - torch.get_num_threads())
    return load if load > free + 0.5 else None


def cache_path(name: str = CACHE_NAME) -> Path:
    """``$XDG_CACHE_HOME/proximal/<name>`` (``~/.cache`` without the variable): where per-machine
    measurements are kept, "auto"'s in :data:`CACHE_NAME`."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "proximal" / name


def read_cache(path: Path) -> dict:
    """A per-machine cache's entries by key; empty where the file is missing or unreadable (it is
    then measured again)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_cache(path: Path, entries: dict) -> None:
    """Replace ``path`` whole with ``entries`` (written beside it, then renamed: a reader never sees
    half a file); a cache that cannot be written is left as it is."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def auto_backend(probe=None, path: Path | None = None) -> tuple[str, dict]:
    """ "auto"'s backend on this machine: the cached measurement for :func:`machine_key` when
    ``path`` (:func:`cache_path`) has one, else ``probe()``'s (:func:`decide`), written there — other
    machines' entries kept, the file replaced whole; a cache that cannot be read is measured again,
    one that cannot be written is left (the choice stands for this process). Where a timing cannot
    be trusted the backend is :data:`RULE_BACKEND` by rule and nothing is cached: on a busy machine
    (:func:`busy_load`, kept as ``busy_load``; nothing is measured, ``"rule": "busy"``), or where the
    probe was noisier than :data:`PROBE_CACHE_NOISE` (``"rule": "noisy"``, its rates kept). Returns
    ``(backend, record)`` with the record's ``key``, ``threads`` and ``cached`` (whether it was
    read)."""
    path = cache_path() if path is None else path
    key = machine_key()
    entries = read_cache(path)
    hit = entries.get(key)
    if (
        isinstance(hit, dict)
        and hit.get("backend") in ("onednn", "blas")
        and isinstance(hit.get("rates"), dict)
        and isinstance(hit.get("noise"), (int, float))
    ):
        return hit["backend"], {**hit, "cached": True}
    busy = busy_load()
    if busy is not None:
        record = {"backend": RULE_BACKEND, "rule": "busy", "busy_load": busy}
        return RULE_BACKEND, {
            **record,
            "key": key,
            "threads": torch.get_num_threads(),
            "cached": False,
        }
    backend, record = decide((probe or probe_seconds)())
    record.update(key=key, threads=torch.get_num_threads())
    if record["noise"] > PROBE_CACHE_NOISE:
        return RULE_BACKEND, {**record, "backend": RULE_BACKEND, "rule": "noisy", "cached": False}
    entries[key] = record
    write_cache(path, entries)
    return backend, {**record, "cached": False}


def _op_problems() -> tuple[str | None, str | None]:
    """Why the oneDNN product cannot be used, and why weights cannot be packed for it (None: they
    can): each operator looked up and tried on a 3 × 4 · 4 × 5 product of small integers, exact in
    float32, against torch's own."""
    global _OP, _REORDER
    _OP, _REORDER = _mkldnn_op("_linear_pointwise"), _mkldnn_op("_reorder_linear_weight")
    x = torch.arange(12.0).reshape(3, 4) - 5
    w = torch.arange(20.0).reshape(5, 4) % 7 - 3
    b = torch.arange(5.0)
    want = torch.nn.functional.linear(x, w, b)

    def problem(name: str, op, compute) -> str | None:
        if op is None:
            return f"this torch has no torch.ops.mkldnn.{name} (or no oneDNN)"
        return _test_product(f"torch.ops.mkldnn.{name}", compute, want)

    linear = problem("_linear_pointwise", _OP, lambda: _OP(x, w, b, "none", [], ""))
    if linear is not None:
        return linear, "no oneDNN product"
    return None, problem(
        "_reorder_linear_weight", _REORDER, lambda: _OP(x, _REORDER(w, 3), b, "none", [], "")
    )


def _test_product(what: str, compute: Callable[[], Tensor], want: Tensor) -> str | None:
    """Why ``compute()`` (an operator named ``what`` on a small exact product) cannot be trusted:
    it raised, or did not give ``want``; None when it gave it exactly."""
    try:
        got = compute()
    except Exception as e:  # an internal operator may change in any torch release, or refuse a CPU
        return f"{what} failed on a test product ({type(e).__name__}: {e})"
    if not (isinstance(got, Tensor) and got.shape == want.shape and torch.equal(got, want)):
        return f"{what} gave a wrong test product"
    return None


def configure(choice: str = "auto", recorded: str | None = None) -> tuple[str, str]:
    """Set this process's backend for float32 CPU products from ``choice`` (``train.cpu_matmul``:
    auto, onednn or blas), unless ``PROXIMAL_CPU_MATMUL`` overrides it; return ``(backend, why)``,
    backend "onednn" or "blas". oneDNN asked for where its operator is missing or wrong is "blas",
    and a missing or wrong reorder operator leaves the weights unpacked; ``why`` says so. "auto"
    takes ``recorded`` where given (the backend a resumed run recorded, so that its numbers
    continue; nothing is measured), else :func:`auto_backend`'s choice (kept for :func:`probed`;
    ``why`` gives its rates, or its rule). ConfigError for a value outside :data:`CHOICES`."""
    global _BACKEND, _REORDER, _PROBED
    if choice not in CHOICES:
        raise ConfigError(f"train.cpu_matmul = {choice!r} is not one of {', '.join(CHOICES)}")
    source = f"train.cpu_matmul = {choice}"
    env = os.environ.get(ENV, "").strip().lower()
    if env:
        if env not in CHOICES:
            raise ConfigError(f"{ENV}={env!r} is not one of {', '.join(CHOICES)}")
        if env != choice:
            choice, source = env, f"{ENV}={env} overrides train.cpu_matmul = {choice}"
    _PROBED = None
    if choice == "auto" and recorded in ("onednn", "blas"):
        choice, source = recorded, f"{source}: {recorded}, as the run being resumed recorded"
    backend, why = choice, source
    if choice in ("auto", "onednn"):
        linear, packing = _op_problems()
        if linear is not None:
            backend = "blas"
            why = (
                f"{source}: {linear}"
                if choice == "auto"
                else f"{why}; but {linear}: torch's F.linear instead"
            )
        else:
            if choice == "auto":
                backend, _PROBED = auto_backend()
                how = (
                    "cached measurement, "
                    if _PROBED["cached"]
                    else ""
                    if "rule" in _PROBED
                    else "measured, "
                )
                why = f"{source}: {how}{describe(_PROBED)}"
            if backend == "onednn" and packing is not None:
                _REORDER = None  # packed_weights packs nothing: each product reorders its weight
                why = f"{why}; decode weights are not packed ({packing})"
    _BACKEND = backend, why
    return _BACKEND


def adopt(backend: str, why: str) -> tuple[str, str]:
    """Take another process's :func:`configure` result (a job's rank 0's, so that every rank
    computes its products alike); "onednn" where this process's operator fails is "blas"."""
    global _BACKEND
    if backend == "onednn" and _OP is None:
        backend, why = "blas", f"{why}; but this process has no oneDNN product"
    _BACKEND = backend, why
    return _BACKEND


def probed() -> dict | None:
    """The measurement behind this process's "auto" choice (:func:`auto_backend`'s record), or None
    where the backend was given or no probe could run."""
    return _PROBED


def backend() -> tuple[str, str]:
    """``(backend, why)`` of this process: :func:`configure`'s, or "auto"'s when nothing configured it."""
    return _BACKEND if _BACKEND is not None else configure()


def enabled() -> bool:
    """Whether float32 CPU products go through oneDNN (:func:`backend` is "onednn")."""
    return backend()[0] == "onednn"


def _mm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x · weightᵀ (+ bias) by oneDNN; x is (..., K), weight (N, K), possibly strided."""
    return _OP(x, weight, bias, "none", [], "")


def _applies(x: Tensor, weight: Tensor) -> bool:
    if (
        _OP is None
        or x.device.type != "cpu"
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
    ):
        return False
    if torch.is_autocast_enabled("cpu") or type(weight) not in (Tensor, torch.nn.Parameter):
        return False
    if x.numel() * weight.shape[0] < MIN_MACS:  # (M·K)·N multiply-adds
        return False
    return enabled()


def _weight_grad(gy: Tensor, x: Tensor, mm=None) -> Tensor:
    """∂W = ∂yᵀ·x for ∂y (M, N) and x (M, K). oneDNN reads its first operand row-major, and here both
    operands have the summed dimension M as rows, so one is copied transposed: ∂yᵀ (M·N numbers), or
    instead xᵀ for (xᵀ·∂y)ᵀ, which then also transposes the (K, N) result (M·K + N·K) — the smaller copy
    wins (measured, 1024 tokens of a 256 → 1024 projection: 1.74 ms against 1.50 ms)."""
    mm = mm or _mm  # the custom operator inside a compiled block
    (M, N), K = gy.shape, x.shape[1]
    if M * N <= (M + N) * K:
        return mm(gy.t(), x.t(), None)
    return mm(x.t(), gy.t(), None).t().contiguous()


class _Linear(torch.autograd.Function):
    """y = x·Wᵀ + b with oneDNN products in forward and backward; saves what F.linear saves (x, W)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        gy = grad_y.reshape(-1, grad_y.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = _mm(gy, weight.t()).view(x.shape)  # ∂y · W
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(gy, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by oneDNN where that applies (module docstring)."""
    if not _applies(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return _onednn_linear(x, weight, bias)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _Linear.apply(x, weight, bias)
    return _mm(x, weight, bias)


# Inside a compiled block (proximal.models.compiled) the products go through two custom operators:
# Inductor cannot lower oneDNN's operator itself, and an opaque operator with its shape and its
# gradient declared keeps the block one graph (a graph break at every linear costs more than compiling
# saves). Their arithmetic is _Linear's, call for call.
@torch.library.custom_op("proximal::onednn_mm", mutates_args=())
def _onednn_mm(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _mm(x, weight, bias)


@torch.library.custom_op("proximal::onednn_linear", mutates_args=())
def _onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return _mm(x, weight, bias)


def _product_shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Either operator's output as the compiler sees it: (..., N) for x (..., K) and weight (N, K)."""
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


_onednn_mm.register_fake(_product_shape)
_onednn_linear.register_fake(_product_shape)


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    gy = grad_y.reshape(-1, grad_y.shape[-1])
    if ctx.needs_input_grad[0]:
        grad_x = _onednn_mm(gy, weight.t(), None).view(x.shape)
    if ctx.needs_input_grad[1]:
        grad_w = _weight_grad(gy, x.reshape(-1, x.shape[-1]), mm=_onednn_mm)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = gy.sum(0)
    return grad_x, grad_w, grad_b


_onednn_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _forward(module: torch.nn.Module, x: Tensor) -> Tensor:
    if torch.compiler.is_compiling():  # a compiled block: no packed copies (decoding is eager)
        return linear(x, module.weight, module.bias)
    dtype = module.__dict__.get("_proximal_pack_dtype")  # set inside packed_weights
    if dtype is not None and not torch.is_grad_enabled() and _packs(dtype, x):
        packed = module.__dict__.get("_proximal_packed")
        if packed is None:  # the first call inside packed_weights reorders the weight, once
            packed = module._proximal_packed = _pack(
                [module.weight], [module.bias], dtype, module._proximal_pack_rows
            )
        return packed_linear(x, *packed)
    return linear(x, module.weight, module.bias)


def autocast_dtype(device_type: str = "cpu") -> torch.dtype | None:
    """The dtype autocast on ``device_type`` casts products to, or None when it is off there."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _packs(dtype: torch.dtype, x: Tensor) -> bool:
    """Whether a weight packed in ``dtype`` computes this call as the plain path would: float32 copies
    serve float32 inputs without autocast; bfloat16 copies serve calls under bfloat16 autocast, which
    would cast the input, weight and bias to bfloat16 and multiply those."""
    if dtype == torch.float32:
        return x.dtype == torch.float32 and autocast_dtype() is None
    return autocast_dtype() == dtype and x.dtype in (torch.float32, dtype)


def _pack(weights: list[Tensor], biases: list[Tensor | None], dtype: torch.dtype, rows: int):
    """(W, b): the weights stacked, cast to ``dtype`` and reordered for oneDNN at ``rows`` rows; the
    biases stacked and cast too, or None."""
    with torch.no_grad():
        w = _REORDER(torch.cat(weights).to(dtype), rows)
        return w, None if biases[0] is None else torch.cat(biases).to(dtype)


#: The dtypes :func:`packed_weights` packs in: float32, and bfloat16 under CPU autocast to it (where
#: this CPU has oneDNN's bfloat16 products: :func:`packs_bfloat16`).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


_BF16_PACKING: list[str | None] = []  # packs_bfloat16's test product's answer, once per process


def packs_bfloat16() -> str | None:
    """Why weights cannot be packed in bfloat16 on this CPU, or None where they can: oneDNN's bfloat16
    reorder and product tried once on a 3 × 4 · 4 × 5 product of small integers (exact in bfloat16)
    against torch's own (:func:`_bfloat16_problem`). oneDNN's bfloat16 path needs AVX-512 (BW, VL, DQ)
    or AVX-NE-CONVERT; on an AVX2-only CPU (AMD Zen 3, for one) it raises, and there bfloat16
    decoding multiplies by the plain weights, as autocast does."""
    if _OP is None or _REORDER is None:
        return "no oneDNN product or reorder operator"
    if not _BF16_PACKING:
        _BF16_PACKING.append(_bfloat16_problem())
    return _BF16_PACKING[0]


def _bfloat16_problem() -> str | None:
    x = (torch.arange(12.0).reshape(3, 4) - 5).bfloat16()
    w = (torch.arange(20.0).reshape(5, 4) % 7 - 3).bfloat16()
    return _test_product(
        "oneDNN's bfloat16 product",
        lambda: _OP(x, _REORDER(w, 3), None, "none", [], ""),
        torch.nn.functional.linear(x, w),
    )


def bfloat16_instructions() -> bool | None:
    """Whether this CPU multiplies bfloat16 natively as oneDNN sees it (AVX-512 with BW, VL and DQ, or
    AVX-NE-CONVERT, as its bfloat16 path asks; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``), or
    None where this torch cannot say. Without them torch emulates bfloat16 products in float32 and
    converts around every call: measured on an AVX2-only AMD EPYC (Zen 3), a bf16-mixed PPO step of
    the tiny benchmark work took about 81 s, against 3.7 s in float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an internal operator: absent from some builds
        return None


#: :func:`packed_weights` packs at most this many bytes of weights (the copy lives while it is entered).
MAX_PACKED_BYTES = 2 << 30


@contextlib.contextmanager
def packed_weights(model: torch.nn.Module, rows: int):
    """While entered, and only for passes without gradients (decoding), each linear routed by
    :func:`use_onednn_linears` multiplies by a copy of its weight reordered once into oneDNN's
    blocked layout, instead of oneDNN reordering the plain weight at every call — at a decode step's
    few rows that reordering is a large part of the product (measured, 16 rows · 256 → 1024: 43.5 µs
    against 33 µs; 48 decode steps of the tiny benchmark work: 0.176 → 0.146 s). A weight is
    reordered at its first such call inside (a linear never called costs nothing); :func:`fused_packed`
    reorders several side by side. ``rows`` is the expected number of rows, oneDNN's hint for the
    layout. The weights must not change inside. Yields the number of linears taking part.

    Entered under CPU autocast to bfloat16 (``bf16-mixed`` decodes so), the copies are bfloat16 and
    serve the calls made under it: autocast would cast the input, weight and bias to bfloat16 and
    multiply those, and the packed product is bit for bit that one (``tests/models/test_kernels.py``),
    without casting and reordering the weight at every call (measured, 16 rows · 256 → 1024: 43 µs
    against 26 µs; the tiny benchmark work's bf16 decode 0.129 → 0.112 s with the lean step's
    bfloat16 buffers).

    Packs only float32 CPU weights that are plain tensors (not sharded), none when torch has no
    working oneDNN product or reorder operator (:func:`configure` tried them), the backend is
    "blas" (:func:`enabled`), autocast is to another dtype (or to bfloat16 where oneDNN has no
    bfloat16 product on this CPU: :func:`packs_bfloat16`), or the copies would exceed
    :data:`MAX_PACKED_BYTES` (they are held for the duration)."""
    dtype = autocast_dtype() or torch.float32
    modules = []
    if (
        enabled()
        and _OP is not None
        and _REORDER is not None
        and (dtype == torch.float32 or (dtype in PACKED_DTYPES and packs_bfloat16() is None))
    ):
        for m in model.modules():
            w = getattr(m, "weight", None)
            if (
                isinstance(m.__dict__.get("forward"), partial)
                and type(w) in (Tensor, torch.nn.Parameter)
                and w.dtype == torch.float32
                and w.device.type == "cpu"
            ):
                modules.append(m)
    if sum(m.weight.numel() * dtype.itemsize for m in modules) > MAX_PACKED_BYTES:
        modules = []
    try:
        for m in modules:
            m._proximal_pack_rows, m._proximal_pack_dtype = int(rows), dtype
        yield len(modules)
    finally:
        for m in modules:
            for key in ("_proximal_pack_rows", "_proximal_pack_dtype", "_proximal_packed"):
                m.__dict__.pop(key, None)


def fused_packed(modules: list[torch.nn.Module]) -> tuple[Tensor, Tensor | None] | None:
    """One reordered weight for linears that read the same input (a layer's query, key and value
    projections): ``(W, b)`` with W the rows of their weights stacked and reordered like
    :func:`packed_weights`' (b their biases stacked, or None), for :func:`packed_linear` — one oneDNN
    call instead of several, each of whose outputs is a slice of its output. None unless every
    module takes part in an entered :func:`packed_weights` (so on CPU, in its dtype, inside its memory
    bound) and they all have a bias or none has; the weights must not change while it is used."""
    if not modules or any("_proximal_pack_dtype" not in m.__dict__ for m in modules):
        return None
    if (
        len({m.weight.shape[1] for m in modules}) != 1
        or len({m.bias is None for m in modules}) != 1
    ):
        return None
    m = modules[0]
    return _pack(
        [m.weight for m in modules],
        [m.bias for m in modules],
        m._proximal_pack_dtype,
        m._proximal_pack_rows,
    )


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x · Wᵀ (+ b) for a weight packed by :func:`packed_weights` or :func:`fused_packed` (no
    gradients), with x cast to the weight's dtype as autocast would (a bfloat16 result then)."""
    return _OP(x.to(weight.dtype), weight, bias, "none", [], "")


def use_onednn_linears(model: torch.nn.Module) -> int:
    """Route each ``nn.Linear`` of ``model`` (peft's LoRA layers' base and adapter linears included)
    through :func:`linear`; returns how many. A no-op (0) where the backend is "blas" (configure it
    first: :func:`configure`, else "auto" is taken here) or torch has no oneDNN product. Idempotent."""
    if not enabled() or _OP is None:
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            if not isinstance(module.__dict__.get("forward"), partial):
                module.forward = partial(_forward, module)
            n += 1
    return n
