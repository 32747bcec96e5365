"""proximal's memory and step time as the vocabulary grows, at one model body (issue 22).

    .venv/bin/python benchmarks/vocab_growth.py                           # PPO and GRPO, 5 vocabularies
    .venv/bin/python benchmarks/vocab_growth.py --logprobs fused,logits   # and the logits path beside it
    .venv/bin/python benchmarks/vocab_growth.py --smoke --vocabs 32000,151936   # a quick check, 2 steps

Each point is the ``ppo-vocab`` or ``grpo-vocab`` work of ``compare_trl.py`` (Qwen2, hidden 128, 2
layers, 32 sequences of 32 + 64 tokens a step) with only the vocabulary changed, V ∈ {32,000, 64,000,
96,000, 128,000, 151,936}, and ``train.logprobs`` set to each path asked for. Two fresh processes a
point:

time     ``proximal <method>`` exactly as compare_trl.py runs it: the step time is the median of steps
         2–N (``--steps``, default 4) of the spans between metrics lines; the process's peak RSS is
         recorded too (for information: it also holds the interpreter, the libraries, the checkpoint
         files being read and written, and what glibc keeps of freed memory).
memory   the same run, 2 steps, under ``torch.profiler`` with ``profile_memory=True`` from before the
         models load (this script's ``--worker`` mode): every allocation and free of PyTorch's CPU
         allocator, as ``benchmarks/memory_check.py`` measures; the **allocator peak** is the largest
         sum of live bytes during step 2 (from step 1's metrics line to step 2's), when AdamW's states
         exist. This is the memory figure of the criterion, the CPU analogue of
         ``torch.cuda.max_memory_allocated()``.

**The state** is computed, not measured: the bytes of every model held — PPO: actor, reference,
reward model, critic; GRPO (β > 0): actor, reference — from the checkpoints' parameter counts and
their dtypes, with the trained ones' gradients and both AdamW moments (4 copies of a trained
model, 1 of a frozen one; float32 for every run here). **Above the state** = allocator peak − state:
what a step needs beyond weights, gradients and optimiser states — activations, the KV cache, the
sampler's buffers, and, on the logits path, the (B, T, V) logits and their gradient.

proximal's PPO never holds both trained models' gradients at once: it steps the actor and clears its
gradients (``set_to_none``) before the critic's backward (``trainers/ppo.py``, ``train/optim.py``).
So the state counted with *every* gradient overstates what is held by the smaller model's
gradients — V-sized here, which makes "above the state" fall as V grows. The criterion is therefore
taken against the **held state**: weights and AdamW moments of every model plus the gradients of
the largest trained one (for GRPO, one trained model, the two are the same). The issue's criterion:
allocator peak − held state stays within 10 % across V (largest / smallest − 1, per method and
path); both figures are in the table and the JSON. Two checks beside them: the live bytes as step 2
begins (gradients are freed between steps, so they are the state less every gradient, plus the
prompts: this checks the counted state against the allocator), and the largest single allocation
of step 2 against one (B, R, V) float32 tensor (B·R·V·4 bytes) — at or above 1, a logits-sized
tensor exists.

**Step time against the head's arithmetic.** Everything but the output layer is the same at every V,
and each pass of B·R response positions through the head is 2·B·R·H·V FLOPs (forward; the backward
twice that, and the fused path recomputes the forward in its backward), so the head's FLOPs a step
are proportional to V. The plot shows the step time and that line, both normalised at 32,000: the
criterion is step(V) / step(32k) ≤ V / 32k at every V (the rest of the step does not grow, so the
step grows no faster than the head). A least-squares fit step = a + b·V is in the JSON: ``a`` the
part of a step that does not depend on V, ``b`` the seconds each vocabulary entry adds.

Writes ``--out`` (benchmarks/vocab_growth.json) and ``--plot`` (benchmarks/vocab_growth.png), and
prints the table. Run with proximal's Python from the repository root, alone on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))  # this tree's proximal, whatever the venv has installed

from harness import proximal_side  # noqa: E402
from harness.measure import machine, run_measured  # noqa: E402
from harness.sides import GRPO_BETA, GRPO_LOSS, child_env, run_proximal  # noqa: E402
from harness.works import GRPO_VOCAB, PPO_VOCAB, Work, write_models, write_prompts  # noqa: E402

VOCABS = (32_000, 64_000, 96_000, 128_000, 151_936)
BASE = {"ppo": PPO_VOCAB, "grpo": GRPO_VOCAB}
MEMORY_STEPS = 2  # the peak is taken in step 2, after step 1 has created AdamW's states
SPREAD_LIMIT = 0.10  # the criterion: above-the-state memory within 10 % across V


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def work_at(method: str, vocab: int) -> Work:
    base = BASE[method]
    return replace(base, name=f"{base.name}-v{vocab}", vocab=vocab)


def state_bytes(method: str, model: dict, precision: str) -> dict:
    """The bytes of every model held, trained ones with gradients and AdamW's two moments.

    PPO: actor (trained) and reference from the policy checkpoint; reward model (frozen) and critic
    (trained, initialised from the reward model) from the classifier checkpoint. GRPO with β > 0: actor
    and reference. Trained models keep float32 master weights, gradients and moments at every
    precision; frozen ones are float32, or bfloat16 under ``bf16-mixed`` / ``bf16-true``.
    """
    trained_b = 4 if precision != "bf16-true" else 2
    frozen_b = 4 if precision == "32-true" else 2
    n_pi, n_r = model["params_policy"], model["params_reward"]
    parts = {"actor": 4 * n_pi * trained_b, "reference": n_pi * frozen_b}
    grads = [n_pi * trained_b]
    if method == "ppo":
        parts.update(reward=n_r * frozen_b, critic=4 * n_r * trained_b)
        grads.append(n_r * trained_b)
    total = sum(parts.values())
    # "gradients": their share of the total; between steps they are freed (set to None), so the live
    # bytes as a step begins are total - gradients (+ the prompts and a few small tensors). "held":
    # the total with only the largest trained model's gradients (one model is updated at a time).
    return {
        **parts,
        "total": total,
        "gradients": sum(grads),
        "held": total - sum(grads) + max(grads),
    }


def head_flops_per_pass(work: Work) -> float:
    """2·B·R·H·V: one forward of the output layer over every response position of a step."""
    return 2.0 * work.batch * work.response_len * work.hidden * work.vocab


# --------------------------------------------------------------------------------------------------
# The memory worker: one proximal run in this process, under the profiler
# --------------------------------------------------------------------------------------------------


def worker(method: str, config: Path, out: Path) -> int:
    """Run ``proximal <method> --config <config>`` here under ``torch.profiler`` (memory events from
    before the models load); write the live-bytes peak of each step, between metrics lines, to ``out``."""
    import torch  # noqa: F401  (the allocator's events start after torch is loaded)
    from torch.profiler import ProfilerActivity, profile

    import proximal.logging as plog
    from proximal.cli import main

    marks: list[tuple[int, int]] = []  # (time_ns, step) as each step's metrics line is written
    log = plog.MetricsLogger.log

    def marked_log(self, step, metrics):
        log(self, step, metrics)
        marks.append((time.time_ns(), int(step)))

    plog.MetricsLogger.log = marked_log
    t_start = time.time_ns()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        rc = main([method, "--config", str(config)])
    t_end = time.time_ns()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    if not events or not (t_start <= events[0][0] <= t_end):
        raise RuntimeError("the profiler's memory events are not on time.time_ns()'s clock")
    bounds = [(t_start, 0)] + marks  # step k: from mark k-1 to mark k
    live, overall, k = 0, 0, 0
    peaks: dict[int, int] = {}
    at_start: dict[int, int] = {}
    largest: dict[int, list[int]] = {}  # the 5 largest single allocations of each step
    for t, nbytes in events:
        while k < len(marks) and t > marks[k][0]:
            k += 1
        if k < len(marks) and marks[k][1] not in at_start:
            at_start[marks[k][1]] = live  # live bytes as the step begins
        live += nbytes
        overall = max(overall, live)
        if k < len(marks):
            step = marks[k][1]
            peaks[step] = max(peaks.get(step, 0), live)
            if nbytes > 0:
                top = largest.setdefault(step, [])
                top.append(nbytes)
                top.sort(reverse=True)
                del top[5:]
    result = {
        "rc": rc,
        "steps": [s for _, s in marks],
        "step_peak_bytes": peaks,
        "step_start_live_bytes": at_start,
        "step_largest_allocations": largest,
        "overall_peak_bytes": overall,
        "memory_events": len(events),
        "bounds_ns": bounds,
    }
    out.write_text(json.dumps(result, indent=1))
    return rc


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def measure_memory(
    work: Work, assets: dict, logprobs: str, *, threads: int, scratch: Path, timeout_s: float
) -> dict:
    run_dir = scratch / "run"
    cfg = _config(work, assets, MEMORY_STEPS, run_dir, logprobs)
    path = proximal_side.write_config(cfg, scratch / "config.yaml")
    out = scratch / "memory.json"
    out.unlink(missing_ok=True)
    m = run_measured(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            work.method,
            str(path),
            str(out),
        ],
        env=child_env(threads, pythonpath=[ROOT, BENCH]),
        log_path=scratch / "log.txt",
        timeout_s=timeout_s,
        cwd=str(ROOT),
    )
    used = proximal_side.logprobs_used(run_dir)
    subprocess.run(["rm", "-rf", str(run_dir)])  # checkpoints
    if m["rc"] != 0 or not out.is_file():
        return {"error": f"exit {m['rc']}: see {scratch / 'log.txt'}", **m}
    r = json.loads(out.read_text())
    peak = r["step_peak_bytes"].get(str(MEMORY_STEPS))
    return {
        **m,
        "logprobs": used,
        "allocator_peak_bytes": peak,
        "step_start_live_bytes": r["step_start_live_bytes"].get(str(MEMORY_STEPS)),
        "largest_allocations": r["step_largest_allocations"].get(str(MEMORY_STEPS)),
        "overall_peak_bytes": r["overall_peak_bytes"],
        "memory_events": r["memory_events"],
    }


def _config(work: Work, assets: dict, steps: int, run_dir: Path, logprobs: str) -> dict:
    if work.method == "ppo":
        return proximal_side.ppo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=steps,
            out_dir=run_dir,
            logprobs=logprobs,
        )
    return proximal_side.grpo_config(
        work,
        model=assets["model"],
        prompts=assets["prompts"],
        steps=steps,
        out_dir=run_dir,
        beta=GRPO_BETA,
        loss=GRPO_LOSS,
        logprobs=logprobs,
    )


def derive(pt: dict) -> dict:
    """A point's figures from its runs (in place): the state from its parameter counts, the allocator
    peak and what is above the state and the held state, the two checks, the median step time and
    peak RSS over its timing rounds."""
    pt["state_bytes"] = state_bytes(pt["method"], pt["params"], pt["precision"])
    r = pt.get("memory_run") or {}
    if r.get("allocator_peak_bytes") is not None:
        st = pt["state_bytes"]
        pt["allocator_peak_bytes"] = r["allocator_peak_bytes"]
        pt["above_state_bytes"] = r["allocator_peak_bytes"] - st["total"]
        pt["above_held_state_bytes"] = r["allocator_peak_bytes"] - st["held"]
        # The counted state against the allocator: what is live as step 2 begins, less the state
        # without gradients (the prompts and a few small tensors: about 0).
        pt["step_start_minus_state_bytes"] = r["step_start_live_bytes"] - (
            st["total"] - st["gradients"]
        )
        # The largest single allocation against one (B, R, V) float32 tensor of logits.
        w = BASE[pt["method"]]
        logits_bytes = 4 * w.batch * w.response_len * pt["V"]
        pt["largest_allocation_vs_BRV"] = max(r["largest_allocations"] or [0]) / logits_bytes
    ok = [t for t in pt.get("timing_runs", []) if not t.get("error") and t.get("median_step_s")]
    if ok:
        pt["step_s"] = statistics.median(t["median_step_s"] for t in ok)
        pt["peak_rss_mib"] = statistics.median(t["peak_rss_mib"] for t in ok)
    return pt


def summarize(points: list[dict]) -> dict:
    """Per method and path: the spread of above-the-state memory across V, the step times against
    V / 32k, and the fit step = a + b·V."""
    out = {}
    for key in sorted({(p["method"], p["logprobs"]) for p in points}):
        pts = sorted(
            (p for p in points if (p["method"], p["logprobs"]) == key), key=lambda p: p["V"]
        )
        s: dict = {"vocabs": [p["V"] for p in pts]}
        for name in ("above_state", "above_held_state"):
            above = [p[f"{name}_bytes"] for p in pts if p.get(f"{name}_bytes") is not None]
            if len(above) >= 2 and min(above) > 0:
                s[f"{name}_spread"] = max(above) / min(above) - 1
        if "above_held_state_spread" in s:
            s["memory_met"] = s["above_held_state_spread"] <= SPREAD_LIMIT
        timed = [p for p in pts if p.get("step_s") is not None]
        if len(timed) >= 2:
            t0, v0 = timed[0]["step_s"], timed[0]["V"]
            s["step_growth"] = {p["V"]: p["step_s"] / t0 for p in timed}
            s["head_growth"] = {p["V"]: p["V"] / v0 for p in timed}
            s["time_met"] = all(
                s["step_growth"][v] <= s["head_growth"][v] for v in s["step_growth"]
            )
            a, b = _fit([p["V"] for p in timed], [p["step_s"] for p in timed])
            s["fit"] = {"a_s": a, "b_s_per_token": b}
        out[f"{key[0]}/{key[1]}"] = s
    return out


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def table(points: list[dict]) -> str:
    """The points as a markdown table; × 32k and V / 32k are relative to each series' first point."""

    def mib(x) -> str:
        return "—" if x is None else f"{x / 2**20:,.0f}"

    rows = [
        "| method | log-probs | V | head GFLOP a pass | s/step | × first | V / first | allocator peak MiB "
        "| state MiB (held) | above the state MiB | above the held state MiB "
        "| largest allocation / B·R·V·4 | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first: dict = {}
    for p in sorted(points, key=lambda p: (p["method"], p["logprobs"], p["V"])):
        f = first.setdefault((p["method"], p["logprobs"]), p)
        step, step0, rss = p.get("step_s"), f.get("step_s"), p.get("peak_rss_mib")
        big = p.get("largest_allocation_vs_BRV")
        cells = [
            p["method"],
            p["logprobs"],
            f"{p['V']:,}",
            f"{p['head_gflop_pass']:.1f}",
            "—" if step is None else f"{step:.3g}",
            "—" if not (step and step0) else f"{step / step0:.2f}",
            f"{p['V'] / f['V']:.2f}",
            mib(p.get("allocator_peak_bytes")),
            f"{mib(p['state_bytes']['total'])} ({mib(p['state_bytes']['held'])})",
            mib(p.get("above_state_bytes")),
            mib(p.get("above_held_state_bytes")),
            "—" if big is None else f"{big:.2f}",
            "—" if rss is None else f"{rss:,.0f}",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = data["points"]
    methods = [m for m in ("ppo", "grpo") if any(p["method"] == m for p in points)]
    fig, axes = plt.subplots(2, len(methods), figsize=(5.5 * len(methods), 8), squeeze=False)
    style = {"fused": ("o", "-"), "logits": ("s", "--")}
    for col, method in enumerate(methods):
        ax_t, ax_m = axes[0][col], axes[1][col]
        paths = sorted({p["logprobs"] for p in points if p["method"] == method})
        vs_all = sorted({p["V"] for p in points if p["method"] == method})
        v0 = vs_all[0]
        ax_t.plot(vs_all, [v / v0 for v in vs_all], "k:", label=f"head FLOPs (∝ V), 1 at {v0:,}")
        for path_ in paths:
            pts = sorted(
                (p for p in points if p["method"] == method and p["logprobs"] == path_),
                key=lambda p: p["V"],
            )
            marker, line = style.get(path_, ("^", "-."))
            timed = [p for p in pts if p.get("step_s")]
            if timed:
                t0 = timed[0]["step_s"]
                ax_t.plot(
                    [p["V"] for p in timed],
                    [p["step_s"] / t0 for p in timed],
                    marker=marker,
                    linestyle=line,
                    label=f"step time, {path_} ({t0:.2f} s at {timed[0]['V']:,})",
                )
            mem = [p for p in pts if p.get("above_held_state_bytes") is not None]
            if mem:
                held = ax_m.plot(
                    [p["V"] for p in mem],
                    [p["above_held_state_bytes"] / 2**20 for p in mem],
                    marker=marker,
                    linestyle=line,
                    label=f"above the held state, {path_}",
                )
                if method == "ppo":  # the same with every gradient counted (see the docstring)
                    ax_m.plot(
                        [p["V"] for p in mem],
                        [p["above_state_bytes"] / 2**20 for p in mem],
                        marker=marker,
                        linestyle=":",
                        color=held[0].get_color(),
                        alpha=0.5,
                        label=f"above the state with both models' gradients, {path_}",
                    )
                ref = mem[0]["above_held_state_bytes"] / 2**20
                ax_m.axhspan(ref * (1 - SPREAD_LIMIT), ref * (1 + SPREAD_LIMIT), alpha=0.12)
        w = BASE[method]
        ax_t.set_title(
            f"{method.upper()}: step time against V (B = {w.batch}, P + R = "
            f"{w.prompt_len} + {w.response_len}, H = {w.hidden})",
            fontsize=9,
        )
        ax_t.set_xlabel("vocabulary V")
        ax_t.set_ylabel(f"relative to V = {v0:,}")
        ax_t.legend(fontsize=8)
        ax_t.grid(alpha=0.3)
        ax_m.set_title(
            f"{method.upper()}: allocator peak − (weights + gradients + AdamW)\n"
            f"band: ±{SPREAD_LIMIT:.0%} of the first point",
            fontsize=9,
        )
        ax_m.set_xlabel("vocabulary V")
        ax_m.set_ylabel("MiB")
        ax_m.set_ylim(bottom=0)
        ax_m.legend(fontsize=8)
        ax_m.grid(alpha=0.3)
    fig.suptitle(f"proximal, vocabulary growth ({data['meta']['date'][:10]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--methods", default="ppo,grpo", help="comma-separated: ppo, grpo (default both)"
    )
    ap.add_argument(
        "--vocabs",
        default=",".join(str(v) for v in VOCABS),
        help="comma-separated vocabulary sizes (default %(default)s)",
    )
    ap.add_argument(
        "--logprobs",
        default="fused",
        help="train.logprobs paths, comma-separated: fused, logits (default %(default)s; "
        "'fused,logits' runs both for contrast)",
    )
    ap.add_argument(
        "--steps", type=int, default=4, help="steps a timing run (median of 2–N; default 4)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timing runs a point, going over all points in turn (default 1; the value is their "
        "median)",
    )
    ap.add_argument(
        "--measure",
        default="time,memory",
        help="what to run: time, memory or both (default %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--smoke", action="store_true", help="2 steps a timing run, 1 round: a check, not a result"
    )
    ap.add_argument("--workdir", type=Path, default=BENCH / ".work")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default benchmarks/vocab_growth.json; <workdir>/vocab_growth-smoke.json "
        "with --smoke); the plot goes beside it as .png",
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument(
        "--report-only",
        type=Path,
        metavar="JSON",
        help="read a vocab_growth JSON, recompute its figures and summary, rewrite it with its plot "
        "and print the table (runs nothing)",
    )
    ap.add_argument(
        "--worker", nargs=3, metavar=("METHOD", "CONFIG", "OUT"), help=argparse.SUPPRESS
    )
    a = ap.parse_args(argv)
    if a.worker or a.report_only:
        return a
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    a.paths = [p.strip() for p in a.logprobs.split(",") if p.strip()]
    a.measures = {m.strip() for m in a.measure.split(",") if m.strip()}
    try:
        a.vocab_list = _ints(a.vocabs)
    except ValueError:
        ap.error(f"--vocabs {a.vocabs!r}: expected comma-separated integers")
    for name, got, allowed in (
        ("--methods", a.methods, BASE),
        ("--logprobs", a.paths, ("fused", "logits")),
        ("--measure", a.measures, ("time", "memory")),
    ):
        bad = [x for x in got if x not in allowed]
        if bad or not got:
            ap.error(f"{name}: {', '.join(bad) or 'nothing'} — choose from {', '.join(allowed)}")
    if min(a.vocab_list, default=0) < 128:
        ap.error(f"--vocabs {a.vocabs}: every size must be at least 128 (the alphabet's ids)")
    if a.smoke:
        a.steps, a.rounds = 2, 1
    if a.steps < 2 or a.rounds < 1:
        ap.error("--steps must be ≥ 2 (step 1 is left out) and --rounds ≥ 1")
    if a.out is None:
        a.out = (
            (a.workdir / "vocab_growth-smoke.json") if a.smoke else (BENCH / "vocab_growth.json")
        )
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.worker:
        method, config, out = a.worker
        return worker(method, Path(config), Path(out))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if a.report_only:
        try:
            data = json.loads(a.report_only.read_text())
            for pt in data["points"]:
                derive(pt)
        except (OSError, ValueError, KeyError) as e:
            log(f"[error] --report-only {a.report_only}: not a vocab_growth JSON ({e!r})")
            return 2
        data["summary"] = summarize(data["points"])
        a.report_only.write_text(json.dumps(data, indent=1, default=str) + "\n")
        report(data, a.report_only, log)
        return 0
    if not proximal_side.has_train_field("logprobs"):
        log("[error] this tree's proximal has no train.logprobs (issue 22's fused path)")
        return 2

    # 1. Models and prompts, once per (method, V).
    assets: dict = {}
    for method in a.methods:
        for v in a.vocab_list:
            w = work_at(method, v)
            model = write_models(w, a.workdir)
            assets[(method, v)] = {
                "work": w,
                "model": model,
                "prompts": write_prompts(w, a.workdir, 10 * w.batch, model["policy"]),
            }
            log(f"[models] {w.name}: {model['params_policy'] / 1e6:.3g}M-parameter policy")

    keys = [(m, p, v) for m in a.methods for p in a.paths for v in a.vocab_list]
    points = {
        k: {
            "method": k[0],
            "logprobs": k[1],
            "V": k[2],
            "head_gflop_pass": head_flops_per_pass(assets[(k[0], k[2])]["work"]) / 1e9,
            "params": {
                n: assets[(k[0], k[2])]["model"][n] for n in ("params_policy", "params_reward")
            },
            "precision": assets[(k[0], k[2])]["work"].precision,
            "timing_runs": [],
        }
        for k in keys
    }

    # 2. Memory: one profiled run a point (the allocator's bytes do not depend on the machine's load).
    if "memory" in a.measures:
        for k in keys:
            w = assets[(k[0], k[2])]["work"]
            scratch = a.workdir / "growth" / f"{w.name}-{k[1]}-memory"
            scratch.mkdir(parents=True, exist_ok=True)
            r = measure_memory(
                w,
                assets[(k[0], k[2])],
                k[1],
                threads=a.threads,
                scratch=scratch,
                timeout_s=a.timeout,
            )
            pt = points[k]
            pt["memory_run"] = r
            derive(pt)
            if r.get("allocator_peak_bytes") is not None:
                log(
                    f"[memory] {k[0]} {k[1]:6s} V={k[2]:>7,}: allocator peak "
                    f"{r['allocator_peak_bytes'] / 2**20:,.0f} MiB, state "
                    f"{pt['state_bytes']['total'] / 2**20:,.0f} MiB (held "
                    f"{pt['state_bytes']['held'] / 2**20:,.0f}), above the held state "
                    f"{pt['above_held_state_bytes'] / 2**20:,.0f} MiB; largest allocation "
                    f"{pt['largest_allocation_vs_BRV']:.2f} x B·R·V·4 bytes ({r['wall_s']:.0f} s)"
                )
            else:
                log(f"[memory] {k[0]} {k[1]} V={k[2]:,}: FAILED ({r.get('error')})")

    # 3. Time: rounds over every point in turn, fresh processes, as compare_trl.py runs proximal.
    if "time" in a.measures:
        for rnd in range(1, a.rounds + 1):
            for k in keys:
                w = assets[(k[0], k[2])]["work"]
                scratch = a.workdir / "growth" / f"{w.name}-{k[1]}-r{rnd}"
                scratch.mkdir(parents=True, exist_ok=True)
                r = run_proximal(
                    w,
                    assets[(k[0], k[2])],
                    steps=a.steps,
                    threads=a.threads,
                    scratch=scratch,
                    timeout_s=a.timeout,
                    logprobs=k[1],
                )
                r["round"] = rnd
                points[k]["timing_runs"].append(r)
                status = (
                    f"FAILED ({r['error'][:200]})"
                    if r.get("error")
                    else f"{r['median_step_s']:.3g} s/step, {r['peak_rss_mib']:,.0f} MiB peak RSS, "
                    f"{r['wall_s']:.0f} s process, {r['cpu_busy_before']:.2f} CPUs busy before"
                )
                log(f"[time] round {rnd} {k[0]} {k[1]:6s} V={k[2]:>7,}: {status}")
        for pt in points.values():
            derive(pt)

    # 4. Report.
    data = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(
                [Path(sys.executable).name, "benchmarks/vocab_growth.py"]
                + list(sys.argv[1:] if argv is None else argv)
            ),
            "steps": a.steps,
            "memory_steps": MEMORY_STEPS,
            "rounds": a.rounds,
            "threads": a.threads,
            "smoke": a.smoke,
            "machine": machine(),
            "proximal": proximal_side.version(),
            "works": {m: BASE[m].__dict__ for m in a.methods},
            "memory_measure": "allocator peak of step 2 (torch.profiler, profile_memory=True)",
        },
        "summary": summarize(list(points.values())),
        "points": list(points.values()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    report(data, a.out, log)
    failed = sum(
        1
        for p in points.values()
        for r in p["timing_runs"] + ([p["memory_run"]] if "memory_run" in p else [])
        if r.get("error")
    )
    return 1 if failed else 0


def report(data: dict, out: Path, log) -> None:
    """The plot beside ``out``, the table and each series' criteria on stdout."""
    plot(data, out.with_suffix(".png"))
    log(table(data["points"]))
    for key, s in data["summary"].items():
        spread = s.get("above_held_state_spread")
        log(
            f"  {key}: above-the-held-state spread "
            + (
                "—"
                if spread is None
                else f"{spread:.1%} ({'met' if s['memory_met'] else 'NOT met'})"
            )
            + "; step growth ≤ head growth: "
            + ("—" if "time_met" not in s else ("yes" if s["time_met"] else "NO"))
        )
    log(f"[done] {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    sys.exit(main())
