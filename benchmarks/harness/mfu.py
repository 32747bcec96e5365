"""Model FLOP utilisation of a benchmark work's step (issue 27): its model FLOPs over the step time and
over the machine's peak product rate, probed in the same invocation on the work's own product shapes.

**The numerator** is proximal's own count (:mod:`proximal.models.flops`, the same functions
``perf/mfu`` uses in every run): the shapes come from the work's transformers configs instantiated on
the meta device (:func:`shapes`), and :func:`step_flops` adds up the passes of one step as the
trainers count them. A PPO step (``ppo.reuse_first_pass``, the default: log π_old from the first
epoch's forward) is the actor's decode, forwards without gradients of the reward model (scoring), the
reference (log π_ref) and the critic (V_old), and four epochs of the actor's and the critic's
training passes; a GRPO step (one iteration, β > 0, a Python reward) is the decode, the reference's
forward and one training pass of the actor.

**The denominator** (:func:`probe_peak`) is the rate of the work's own float32 products (bfloat16 for
the ``*-bf16`` works) on this process's threads: every linear of one forward pass over the training
batch — a block's q, k, v, o, gate, up and down at M = B·(P + R) rows, the output layer at the B·R
response rows — timed by torch's ``F.linear`` (the BLAS torch links, MKL on x86) and by oneDNN's
``_linear_pointwise`` (what ``train.cpu_matmul: onednn`` runs), each shape's best of several timed
batches. A backend's rate is the mix's FLOPs over its time (each shape weighted by how often a
forward pass runs it); the peak is the faster backend's rate (:func:`choose`). It is the rate a
step's products could reach if nothing else ran, so MFU = 1 is the products alone, back to back.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from types import SimpleNamespace

from harness.works import Work, model_config

#: A product: (rows M, inputs K, outputs N), computing (M, K) · (K, N).
Shape = tuple[int, int, int]
#: PPO epochs of every benchmark work (proximal_side.ppo_config and TRL's num_ppo_epochs).
PPO_EPOCHS = 4


def shapes(work: Work) -> dict:
    """``{"policy": ModelShape, "critic": ModelShape}`` of the work's causal LM and of its one-label
    classifier (reward model and critic), from their configs on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from proximal.models.flops import model_shape

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=1, bos_token_id=2)
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(model_config(work, tok))
        critic = AutoModelForSequenceClassification.from_config(
            model_config(work, tok, num_labels=1)
        )
    return {"policy": model_shape(policy), "critic": model_shape(critic)}


def step_flops(work: Work, model_shapes: dict | None = None) -> dict[str, int]:
    """The model FLOPs of one step of ``work``, by phase, and ``"total"`` (B sequences of P prompt
    and R response tokens, every one real)."""
    from proximal.models.flops import Tokens, forward_flops, generate_flops, train_flops

    s = model_shapes or shapes(work)
    B, P, R = work.batch, work.prompt_len, work.response_len
    seq = Tokens.of([P + R] * B, head=B * R)
    out = {"generation": generate_flops(s["policy"], [P] * B, [R] * B)}
    if work.method == "ppo":
        out["scoring"] = forward_flops(s["critic"], seq)  # r_ψ
        out["reference"] = forward_flops(s["policy"], seq)  # log π_ref
        out["old values"] = forward_flops(s["critic"], seq)  # V_old
        out["epochs"] = PPO_EPOCHS * (train_flops(s["policy"], seq) + train_flops(s["critic"], seq))
    elif work.method == "grpo":
        out["reference"] = forward_flops(s["policy"], seq)  # β = 0.04 > 0
        out["update"] = train_flops(s["policy"], seq)  # one iteration: π_old is its own forward
    else:
        raise ValueError(f"{work.name}: unknown method {work.method!r}")
    out["total"] = sum(out.values())
    return out


def product_shapes(work: Work) -> dict[Shape, int]:
    """The products of one forward pass of the work's policy over a training batch, ``{(M, K, N):
    how many}``: per layer q and o (d → H·h_d, H·h_d → d), k and v (d → H_kv·h_d), gate and up
    (d → I), down (I → d) at M = B·(P + R) rows; the output layer (d → V) at the B·R response rows."""
    B, P, R = work.batch, work.prompt_len, work.response_len
    d, head_dim = work.hidden, work.hidden // work.heads
    q, kv = work.heads * head_dim, (work.kv_heads or work.heads) * head_dim
    M = B * (P + R)
    out: dict[Shape, int] = {}
    per_layer = [(M, d, q), (M, d, kv), (M, d, kv), (M, q, d)]
    per_layer += [(M, d, work.intermediate)] * 2 + [(M, work.intermediate, d)]
    for shape in per_layer:
        out[shape] = out.get(shape, 0) + work.layers
    out[(B * R, d, work.vocab)] = out.get((B * R, d, work.vocab), 0) + 1
    return out


def flops_of(shape: Shape) -> int:
    M, K, N = shape
    return 2 * M * K * N


def choose(counts: dict[Shape, int], seconds: dict[str, dict[Shape, float]]) -> dict:
    """The peak from measured times: ``seconds[backend][shape]`` is one product's best time. Each
    backend's rate is the mix's FLOPs over its time, Σ n·2MKN / Σ n·t (``counts`` gives n); the peak
    is the faster backend's. Returns ``{"peak_flops_per_s", "backend", "rates": {backend: FLOP/s},
    "shapes": {"MxK->N": {backend: FLOP/s}}}``. A backend missing a shape is left out."""
    total = sum(n * flops_of(s) for s, n in counts.items())
    rates = {
        b: total / sum(n * t[s] for s, n in counts.items())
        for b, t in seconds.items()
        if all(s in t for s in counts)
    }
    if not rates:
        raise ValueError("no backend was timed on every shape")
    best = max(rates, key=lambda b: rates[b])
    per_shape = {
        f"{M}x{K}->{N}": {
            b: flops_of((M, K, N)) / t[(M, K, N)] for b, t in seconds.items() if (M, K, N) in t
        }
        for (M, K, N) in counts
    }
    return {
        "peak_flops_per_s": rates[best],
        "backend": best,
        "rates": rates,
        "shapes": per_shape,
    }


def backends(dtype) -> dict[str, Callable]:
    """``{name: f(x, w) -> x·wᵀ}``: "F.linear" always; "oneDNN" where torch's oneDNN linear works
    (:func:`proximal.models.kernels.configure` tried it)."""
    import torch

    from proximal.models import kernels

    out = {"F.linear": torch.nn.functional.linear}
    if kernels._op_problems()[0] is None:  # looks the operator up and tries it
        op = kernels._OP
        out["oneDNN"] = lambda x, w: op(x, w, None, "none", [], "")
    return out


def time_product(fn: Callable, shape: Shape, dtype, *, batches: int = 5, batch_s: float = 0.02):
    """One product's best time in seconds: ``fn`` on random (M, K) and (N, K) operands, after a
    warm-up, in ``batches`` timed batches of as many calls as fill about ``batch_s``; the fastest
    batch's time per call. Fewer batches (at least 3) for a product over a fifth of a second."""
    import torch

    M, K, N = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = torch.randn(N, K, generator=gen).to(dtype)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(x, w)
        first = time.perf_counter() - t0
        calls = max(1, math.ceil(batch_s / max(first, 1e-6)))
        if first > 0.2:
            batches = min(batches, 3)
        best = math.inf
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x, w)
            best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _warm(fn: Callable, shape: Shape, dtype, seconds: float = 0.3) -> None:
    """Products for about ``seconds`` before anything is timed: the thread pool awake, the clocks up
    (the first shape timed otherwise reads low)."""
    import torch

    x, w = torch.randn(shape[0], shape[1]).to(dtype), torch.randn(shape[2], shape[1]).to(dtype)
    end = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < end:
            fn(x, w)


def probe_peak(work: Work, threads: int, *, batches: int = 5) -> dict:
    """The machine's peak product rate for ``work`` on ``threads`` torch threads (module docstring):
    :func:`choose`'s record plus ``dtype``, ``threads`` and ``seconds`` (the probe's own time)."""
    import torch

    dtype = torch.bfloat16 if work.bf16 else torch.float32
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        counts = product_shapes(work)
        _warm(backends(dtype)["F.linear"], max(counts, key=flops_of), dtype)
        seconds = {
            name: {s: time_product(fn, s, dtype, batches=batches) for s in counts}
            for name, fn in backends(dtype).items()
        }
    finally:
        torch.set_num_threads(before)
    record = choose(counts, seconds)
    record.update(
        dtype=str(dtype).removeprefix("torch."),
        threads=threads,
        seconds=time.perf_counter() - t0,
    )
    return record


def cpu() -> dict:
    """The CPU: ``model`` (``/proc/cpuinfo``'s model name) and ``vector`` — the widest vector
    instructions it reports: "AVX-512 (512-bit)", "AVX2 (256-bit)", "NEON (128-bit)", or "?"."""
    from proximal.train.perf import cpu_name

    try:
        with open("/proc/cpuinfo") as fh:
            text = fh.read()
    except OSError:
        text = ""
    flags = set()
    found = re.search(r"^(flags|Features)\s*:(.*)$", text, re.M)
    if found:
        flags = set(found.group(2).split())
    if "avx512f" in flags:
        vector = "AVX-512 (512-bit)"
    elif "avx2" in flags:
        vector = "AVX2 (256-bit)"
    elif "asimd" in flags or "neon" in flags:
        vector = "NEON (128-bit)"
    else:
        vector = "?"
    return {"model": cpu_name(), "vector": vector}


def mfu(flops: float, step_s: float | None, peak: float) -> float | None:
    """Model FLOPs per second of a ``step_s``-second step over ``peak`` FLOP/s (None without a step)."""
    return None if not step_s else flops / step_s / peak


def describe_peak(rec: dict) -> str:
    """One line: "oneDNN 412 GFLOP/s (F.linear 201) in float32 on 2 threads"."""
    others = ", ".join(f"{b} {r / 1e9:.0f}" for b, r in rec["rates"].items() if b != rec["backend"])
    return (
        f"{rec['backend']} {rec['peak_flops_per_s'] / 1e9:.0f} GFLOP/s"
        + (f" ({others})" if others else "")
        + f" in {rec['dtype']} on {rec['threads']} threads"
    )


def measure(works: list[Work], threads: int, log=print) -> dict:
    """For each work: its step's FLOPs by phase and the peak probed on its products (one probe per
    distinct set of shapes and dtype: tiny and grpo share one). ``{"cpu": cpu(), "works": {name:
    {"flops": step_flops, "peak": probe_peak record}}}``; logs one line a work."""
    from harness.measure import cpu_busy, loadavg

    out: dict = {
        "cpu": cpu(),
        "works": {},
        "busy_cpus_before": cpu_busy(),
        "loadavg_before": loadavg(),
    }
    if out["busy_cpus_before"] > 0.25:
        log(
            f"[warn] {out['busy_cpus_before']:.2f} CPUs busy before the probe: the peak measures "
            "the load, and so does MFU"
        )
    probes: dict = {}
    for w in works:
        flops = step_flops(w)
        key = (tuple(sorted(product_shapes(w).items())), w.bf16)
        if key not in probes:
            probes[key] = probe_peak(w, threads)
        peak = probes[key]
        out["works"][w.name] = {"flops": flops, "peak": peak}
        phases = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in flops.items() if k != "total")
        log(
            f"[mfu] {w.name}: {flops['total'] / 1e9:.4g} GFLOP a step ({phases}); peak on its "
            f"products {describe_peak(peak)}"
        )
    return out


def annotate(runs: list[dict], summary: dict, measured: dict) -> None:
    """Add ``mfu_probe`` (model FLOPs / step time / the work's probed peak) to every run with a step
    time, and ``proximal_mfu_probe`` / ``anchor_mfu_probe`` (from each side's median step) to the
    summary."""
    for r in runs:
        m = measured["works"].get(r["work"])
        if m is not None:
            r["mfu_probe"] = mfu(
                m["flops"]["total"], r.get("median_step_s"), m["peak"]["peak_flops_per_s"]
            )
    for w, s in summary.items():
        m = measured["works"].get(w)
        if m is None:
            continue
        for side in ("proximal", "anchor"):
            s[f"{side}_mfu_probe"] = mfu(
                m["flops"]["total"], s.get(f"{side}_median_step_s"), m["peak"]["peak_flops_per_s"]
            )


def report_lines(data: dict) -> list[str]:
    """The MFU section of results.md (empty without a measurement)."""
    measured = data.get("meta", {}).get("mfu")
    if not measured:
        return []
    c = measured["cpu"]
    lines = [
        "",
        "## Model FLOP utilisation (issue 27)",
        "",
        f"CPU: {c['model']}, widest vectors {c['vector']}; before the probe "
        f"{measured.get('busy_cpus_before', 0):.2f} CPUs were busy with other work. "
        "MFU = a step's model FLOPs "
        "(`proximal.models.flops`, as `perf/mfu` counts them) / the median step time / the peak "
        "probed in this invocation on the work's own products (`benchmarks/harness/mfu.py`): every "
        "linear of one forward pass over the training batch, timed by torch's `F.linear` and by "
        "oneDNN's linear, each shape's best of 5 timed batches, on the runs' threads; the faster "
        "backend's rate over the mix. TRL's MFU is the same work's FLOPs over TRL's step.",
        "",
        "| work | GFLOP a step | phases (GFLOP) | probed peak GFLOP/s | backend | other | "
        "s/step proximal | MFU proximal | s/step TRL | MFU TRL | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary = data.get("summary", {})
    for w, m in measured["works"].items():
        p, s = m["peak"], summary.get(w, {})
        phases = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in m["flops"].items() if k != "total")
        other = ", ".join(f"{b} {r / 1e9:.0f}" for b, r in p["rates"].items() if b != p["backend"])
        pct = lambda x: "—" if x is None else f"{100 * x:.1f} %"  # noqa: E731
        num = lambda x: "—" if x is None else f"{x:.3g}"  # noqa: E731
        lines.append(
            "| "
            + " | ".join(
                [
                    w,
                    f"{m['flops']['total'] / 1e9:.4g}",
                    phases,
                    f"{p['peak_flops_per_s'] / 1e9:.0f} ({p['dtype']}, {p['threads']} threads)",
                    p["backend"],
                    other or "—",
                    num(s.get("proximal_median_step_s")),
                    pct(s.get("proximal_mfu_probe")),
                    num(s.get("anchor_median_step_s")),
                    pct(s.get("anchor_mfu_probe")),
                    num(s.get("ratio_median_step_s")),
                ]
            )
            + " |"
        )
    return lines
