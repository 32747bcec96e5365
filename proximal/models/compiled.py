"""Compiled transformer blocks (``train.compile``): the elementwise work around the products fused.

A step of a small model spends a third or more of its time outside the matrix products: RMSNorm
(a square, a mean, a reciprocal square root and two products per call), the rotary embedding (two
products, a concatenation, a negation and a sum for each of q and k), SwiGLU (``silu(gate) · up``),
the residual sums — each one a pass over memory in eager mode, forward and backward.
``torch.compile`` (Inductor; on a CPU it writes C++ loops and builds them with the machine's C++
compiler) fuses each chain into one loop, forward and backward, and leaves the products to the same
BLAS or oneDNN calls as before.

What is compiled is each **block** of the model's stack of identical transformer blocks, one by one —
PyTorch's "regional compilation": a block's graph is the same for every block, so after the first one
the others come from Inductor's cache (``/tmp/torchinductor_<user>``, kept across runs), and the model
outside the blocks (embedding, final norm, output layer: proximal's fused log-probabilities read the
hidden states) stays as it is. ``Module.compile`` compiles in place: the module's parameters, their
names, its state dict and checkpoints are unchanged, and any caller of the model gets the compiled
blocks.

The first call of each kind (frozen, trained with and without gradients, then the first new
sequence length, which compiles a graph for any length) compiles: on 2 CPU cores about 60 s for the
tiny benchmark work's four models with an empty cache, about 15 s from it (docs/performance.md).
Forwards that carry a KV cache and few-token probes run eager (:func:`eager_blocks`).
The products are unchanged; the fused loops sum in another order, so the numbers
differ from eager mode by float32 round-off (tests/models/test_compiled.py).

"auto" compiles where it was measured to pay and is safe: one process, a CPU, no LoRA adapters, no
activation checkpointing, blocks at least :data:`AUTO_MIN_HIDDEN` wide (below it a step is
milliseconds and compiling costs more than a short run saves), a run long enough for the time
compiling saves to repay what it costs (:func:`pays`: the run's step count × about
:data:`STEP_SAVING_S` a step at hidden 256, taken to grow with the width, against about
:data:`COMPILE_COST_S` of compiling; a 3-step smoke run stays eager), and a toolchain that compiles a
small function forward and backward (:func:`toolchain_problem`, checked once per process). A resumed
run takes the length verdict its run directory recorded (``models.json``), so extending
``train.steps`` does not switch it between compiled and eager (their numbers differ by float32
round-off). "blocks" compiles wherever the toolchain works (one process); where it does not the run
goes on in eager mode, slower, and says why. ``false`` and ``off`` mean "eager" (:func:`normalize`).
"""

from __future__ import annotations

import shutil

import torch

from proximal.models.loading import unwrap

#: ``train.compile``'s values.
CHOICES = ("auto", "blocks", "eager")
#: Other spellings of "eager" (:func:`normalize`): YAML reads ``false`` and ``off`` as false.
EAGER_ALIASES = ("false", "off")
#: "auto" compiles models whose hidden size is at least this (docs/performance.md has the measurements).
AUTO_MIN_HIDDEN = 256
#: "auto"'s estimate of what compiling costs a run, in seconds: measured on a 2-core AMD EPYC (Zen 3),
#: the tiny benchmark work's 6-step PPO run took 105.6 s with an empty Inductor cache against about
#: 31 s eager (47.3 s from the cache; docs/performance.md). The first run of a checkout pays the
#: empty cache's cost, so that is the estimate.
COMPILE_COST_S = 75.0
#: "auto"'s estimate of what compiled blocks save a step of a hidden-256 model, in seconds: the tiny
#: work's PPO step 1.38 → 1.27 s on a 2-core Xeon and 3.75 → 3.66 s on a 2-core Zen 3
#: (benchmarks/README.md, issue 27). Taken to grow with the width (the elementwise passes do): an
#: underestimate for wider models (the wide work, hidden 512: 21.2 → 20.0 s a step).
STEP_SAVING_S = 0.1

_PROBLEM: dict[str, str | None] = {}  # device type → toolchain_problem's answer, once per process
_CHOICE = (
    "eager"  # this process's train.compile: a training run sets it (configure); else no compiling
)
#: The run's step count (:func:`plan`) and the length verdict its run directory recorded (a resume;
#: :func:`configure`), for "auto"'s :func:`pays`.
_STEPS: int | None = None
_RECORDED: bool | None = None


def normalize(choice) -> str:
    """``train.compile`` with its other spellings of "eager" (false, off; YAML's boolean false) read
    as "eager"; other values as they are."""
    if choice is False or (isinstance(choice, str) and choice.strip().lower() in EAGER_ALIASES):
        return "eager"
    return choice


def configure(choice: str, *, recorded: bool | None = None) -> None:
    """Set this process's ``train.compile`` for the models prepared after it (a training run's start;
    a process that never calls it compiles nothing). ``recorded``: the length verdict of the run being
    resumed (``models.json``'s ``"pays"``), which "auto" then takes instead of :func:`pays`; the run's
    step count is :func:`plan`'s. ValueError outside :data:`CHOICES`."""
    global _CHOICE, _STEPS, _RECORDED
    choice = normalize(choice)
    if choice not in CHOICES:
        raise ValueError(f"train.compile = {choice!r} is not one of {', '.join(CHOICES)}")
    _CHOICE, _STEPS, _RECORDED = choice, None, recorded


def plan(steps: int | None) -> None:
    """The run's step count (``train.steps``, or the steps its epochs make), for "auto"'s
    :func:`pays`; known before the models are prepared."""
    global _STEPS
    _STEPS = steps


def pays(steps: int | None, hidden: int) -> tuple[bool, str]:
    """Whether compiling a hidden-``hidden`` model's blocks repays its cost over a run of ``steps``
    steps, and why: ``steps`` × :data:`STEP_SAVING_S` × hidden / 256 saved against
    :data:`COMPILE_COST_S` of compiling. An unknown length (None) does not compile."""
    if steps is None:
        return False, "the run's length is not known, so compiling may not pay"
    saving = STEP_SAVING_S * hidden / 256
    total = steps * saving
    verdict = ">" if total > COMPILE_COST_S else "≤"
    return total > COMPILE_COST_S, (
        f"{steps} steps × about {saving:.2g} s saved a step at hidden size {hidden} = {total:.3g} s "
        f"{verdict} about {COMPILE_COST_S:.0f} s of compiling"
    )


def choice() -> str:
    """This process's ``train.compile`` (:func:`configure`; "eager" until a run sets it)."""
    return _CHOICE


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of transformer blocks: the first ``ModuleList`` of two or more modules of one
    class inside the transformers model (under a peft wrapper), searched breadth first; None if none."""
    queue = [unwrap(model)]
    while queue:
        module = queue.pop(0)
        for child in module.children():
            if (
                isinstance(child, torch.nn.ModuleList)
                and len(child) >= 2
                and len({type(b) for b in child}) == 1
            ):
                return child
            queue.append(child)
    return None


def _hidden(model: torch.nn.Module) -> int | None:
    config = getattr(unwrap(model), "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def toolchain_problem(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run on this device type here (a sentence), or None: dynamo is
    unsupported on this Python, no C++ compiler is found (CPU), or a small function compiled forward
    and backward fails or disagrees with eager mode. Checked once per process and device type."""
    if device_type in _PROBLEM:
        return _PROBLEM[device_type]
    problem = None
    try:
        import torch._dynamo  # lazy: only a run that would compile pays its import

        if not torch._dynamo.is_dynamo_supported():
            problem = "torch.compile is not supported on this Python or platform"
    except Exception as e:  # noqa: BLE001 - any failure means: do not compile
        problem = f"torch.compile cannot load ({type(e).__name__}: {e})"
    if problem is None and device_type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler  # lazy: as above

            cxx = get_cpp_compiler()
        except Exception as e:  # noqa: BLE001
            cxx, problem = None, f"no C++ compiler for torch.compile ({type(e).__name__}: {e})"
        if problem is None and shutil.which(cxx) is None:
            problem = f"no C++ compiler for torch.compile ({cxx!r} is not on PATH; set CXX)"
    if problem is None:
        problem = _smoke(device_type)
    _PROBLEM[device_type] = problem
    return problem


def _smoke(device_type: str) -> str | None:
    """Compile x·sigmoid(x) on a few numbers, forward and backward; a sentence if it fails or differs."""

    def f(x):
        return (x * torch.sigmoid(x)).sum()

    try:
        x = torch.linspace(-2.0, 2.0, 8, device=device_type, requires_grad=True)
        y = torch.compile(f, dynamic=False)(x)
        (g,) = torch.autograd.grad(y, x)
        x0 = x.detach().requires_grad_()
        y0 = f(x0)
        (g0,) = torch.autograd.grad(y0, x0)
        if not (torch.allclose(y, y0, atol=1e-5) and torch.allclose(g, g0, atol=1e-5)):
            return "torch.compile's result differs from eager mode on a small function"
    except Exception as e:  # noqa: BLE001 - a broken toolchain shows up as anything
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"torch.compile fails on a small function ({type(e).__name__}: {first[:200]})"
    return None


def decide(
    choice: str,
    *,
    device_type: str,
    world_size: int,
    hidden: int | None,
    lora: bool,
    activation_checkpointing: bool,
    steps: int | None = None,
    recorded: bool | None = None,
) -> tuple[bool, str]:
    """Whether to compile a model's blocks, and why (``choice`` is ``train.compile``). "auto" asks
    last whether the run is long enough (:func:`pays` over ``steps``), or takes ``recorded``, the
    verdict of the run being resumed. The toolchain is not consulted here (:func:`apply` does, only
    when this says yes)."""
    go, why = _before_length(
        choice,
        device_type=device_type,
        world_size=world_size,
        hidden=hidden,
        lora=lora,
        activation_checkpointing=activation_checkpointing,
    )
    if go is not None:
        return go, why
    if recorded is not None:
        return recorded, (
            f"{why}: {'compiled' if recorded else 'eager'} as the run being resumed recorded "
            "(models.json), so that its numbers continue"
        )
    go, reason = pays(steps, hidden)
    if go:
        return True, f"{why}: {reason}"
    return False, f"{why}: {reason}, eager (train.compile = blocks asks)"


def _before_length(
    choice: str,
    *,
    device_type: str,
    world_size: int,
    hidden: int | None,
    lora: bool,
    activation_checkpointing: bool,
) -> tuple[bool | None, str]:
    """:func:`decide` up to the run's length: ``(go, why)``, or ``(None, why)`` where "auto" is left
    with the length to ask."""
    source = f"train.compile = {choice}"
    if choice == "eager":
        return False, source
    if world_size > 1:
        return False, f"{source}: several processes (compiled blocks under FSDP2 are not measured)"
    if choice == "blocks":
        return True, source
    if device_type != "cpu":
        return (
            False,
            f"{source}: on {device_type} it is not measured yet (train.compile = blocks asks)",
        )
    if lora:
        return False, f"{source}: LoRA adapters (not measured; train.compile = blocks asks)"
    if activation_checkpointing:
        return False, f"{source}: activation checkpointing (not measured; blocks asks)"
    if hidden is None or hidden < AUTO_MIN_HIDDEN:
        return False, (
            f"{source}: hidden size {hidden} < {AUTO_MIN_HIDDEN}, too small to repay compiling "
            "(train.compile = blocks asks)"
        )
    return None, f"{source}: hidden size {hidden} ≥ {AUTO_MIN_HIDDEN}"


def _raise_limits(count: int) -> None:
    """Each block is its own entry in dynamo's cache (its layer index is a constant of its graph), with
    and without gradients, static and dynamic lengths: room for all of them, or the later blocks would
    silently run eager."""
    import torch._dynamo.config as config  # lazy: as in toolchain_problem

    need = 4 * count + 8
    if getattr(config, "recompile_limit", need) < need:
        config.recompile_limit = need
    if getattr(config, "accumulated_recompile_limit", need) < need:
        config.accumulated_recompile_limit = need


def apply(
    model: torch.nn.Module,
    choice: str | None = None,
    *,
    world_size: int = 1,
    activation_checkpointing: bool = False,
) -> dict:
    """Compile ``model``'s blocks in place when :func:`decide` and the toolchain allow; return (and
    keep on the model as ``_proximal_compile``, for models.json) ``{"blocks": n compiled, "why": ...}``.
    ``choice``: ``train.compile``; None takes this process's (:func:`configure`). Where "auto" asked
    whether the run is long enough, the record also holds ``"steps"`` (the run's, :func:`plan`) and
    ``"pays"`` (the verdict, which a resumed run takes: :func:`recorded_verdict`)."""
    choice = _CHOICE if choice is None else normalize(choice)
    device_type = next(model.parameters()).device.type
    stack = blocks(model)
    facts = dict(
        device_type=device_type,
        world_size=world_size,
        hidden=_hidden(model),
        lora=hasattr(model, "peft_config"),
        activation_checkpointing=activation_checkpointing,
    )
    go, why = decide(choice, **facts, steps=_STEPS, recorded=_RECORDED)
    # The length verdict, where "auto" asked for it: a resumed run takes it (configure's recorded).
    length = (
        {"steps": _STEPS, "pays": go}
        if choice == "auto" and _before_length(choice, **facts)[0] is None
        else None
    )
    if go and stack is None:
        go, why = (
            False,
            f"{why}; but no stack of transformer blocks was found in {type(model).__name__}",
        )
    if go:
        problem = toolchain_problem(device_type)
        if problem is not None:
            go, why = False, f"{why}; but {problem}: eager mode, slower"
    n = 0
    if go:
        _raise_limits(len(stack))
        for block in stack:
            block.compile()
        n = len(stack)
    record = {"blocks": n, "why": why}
    if length is not None:
        record.update(length)
    model._proximal_compile = record
    return record


def recorded_verdict(models: dict) -> bool | None:
    """The length verdict ``"pays"`` of a run's ``models.json`` (``{name: entry}``), the first model's
    that has one; None where none does (a run that never asked, or an older run directory)."""
    for entry in models.values():
        record = entry.get("compile") if isinstance(entry, dict) else None
        if isinstance(record, dict) and isinstance(record.get("pays"), bool):
            return record["pays"]
    return None


def eager_blocks():
    """A context in which compiled blocks run their eager code, for the calls compiling would not
    repay: forwards that carry a KV cache (a rollout's prompt pass, and the decode steps where the
    lean decoder does not serve) and one-off probes of a few tokens. A block's graph reads its own
    layer's entry of a cache, so a cached forward would compile every block separately (a graph per
    layer, seconds of tracing each, more with an empty Inductor cache), and a probe's one-row batch
    would compile a graph of its own and then make the batch size dynamic; the compiled blocks
    serve the full-sequence forwards and backwards that make most of a step."""
    return torch.compiler.set_stance("force_eager")


def compiled_blocks(model: torch.nn.Module) -> int:
    """How many of ``model``'s blocks run compiled."""
    stack = blocks(model)
    return 0 if stack is None else sum(b._compiled_call_impl is not None for b in stack)
