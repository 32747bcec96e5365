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
- it is switched on: by default on x86-64 CPUs with AVX-512 that are not Intel's (where MKL's AVX2
  path is what was measured to lose half the speed; on Intel CPUs MKL runs AVX-512 itself, and on
  ARM — Apple's laptops — torch's BLAS is the platform's own), or with ``PROXIMAL_CPU_MATMUL=onednn``
  anywhere; ``PROXIMAL_CPU_MATMUL=blas`` switches it off (read at each call).

Parameters, state dicts and checkpoints are untouched: only the modules' ``forward`` changes.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
from functools import partial

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

#: Products smaller than this many multiply-adds stay with torch's BLAS (see the module docstring).
MIN_MACS = 1 << 21


def _onednn_op():
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        op = ops._linear_pointwise.default if ops is not None else None
    except (AttributeError, RuntimeError):
        op = None
    return op if op is not None and torch.backends.mkldnn.is_available() else None


_OP = _onednn_op()


def default_on(machine: str, cpuinfo: str) -> bool:
    """Whether oneDNN is the default for float32 products on this CPU: x86-64, AVX-512 (``avx512f``)
    and a vendor other than Intel, from ``platform.machine()`` and ``/proc/cpuinfo``'s text."""
    if machine.lower() not in ("x86_64", "amd64"):
        return False
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
    return (
        vendor is not None
        and vendor.group(1) != "GenuineIntel"
        and flags is not None
        and "avx512f" in flags.group(1).split()
    )


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: only PROXIMAL_CPU_MATMUL=onednn turns it on
        return ""


_DEFAULT_ON = default_on(platform.machine(), _read_cpuinfo())


def enabled() -> bool:
    """``PROXIMAL_CPU_MATMUL``: ``onednn`` on, ``blas`` off, unset the CPU's default (:func:`default_on`)."""
    choice = os.environ.get("PROXIMAL_CPU_MATMUL")
    if choice is None or choice == "":
        return _DEFAULT_ON
    return choice.lower() != "blas"


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


def _weight_grad(gy: Tensor, x: Tensor) -> Tensor:
    """∂W = ∂yᵀ·x for ∂y (M, N) and x (M, K). oneDNN reads its first operand row-major, and here both
    operands have the summed dimension M as rows, so one is copied transposed: ∂yᵀ (M·N numbers), or
    instead xᵀ for (xᵀ·∂y)ᵀ, which then also transposes the (K, N) result (M·K + N·K) — the smaller copy
    wins (measured, 1024 tokens of a 256 → 1024 projection: 1.74 ms against 1.50 ms)."""
    (M, N), K = gy.shape, x.shape[1]
    if M * N <= (M + N) * K:
        return _mm(gy.t(), x.t())
    return _mm(x.t(), gy.t()).t().contiguous()


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
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _Linear.apply(x, weight, bias)
    return _mm(x, weight, bias)


def _forward(module: torch.nn.Module, x: Tensor) -> Tensor:
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
        w = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights).to(dtype), rows)
        return w, None if biases[0] is None else torch.cat(biases).to(dtype)


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
    oneDNN, it is switched off (:func:`enabled`), autocast is to another dtype, or the copies would
    exceed :data:`MAX_PACKED_BYTES` (they are held for the duration)."""
    dtype = autocast_dtype() or torch.float32
    modules = []
    if _OP is not None and enabled() and dtype in (torch.float32, torch.bfloat16):
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
    through :func:`linear`; returns how many. A no-op (0) where torch has no oneDNN. Idempotent."""
    if _OP is None:
        return 0
    n = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            if not isinstance(module.__dict__.get("forward"), partial):
                module.forward = partial(_forward, module)
            n += 1
    return n
