"""Step time of ``proximal ppo`` on the tiny work against response length and against batch size (issue 12 §3).

    python benchmarks/scaling.py                       # R in 32,64,128,256 at B=16; B in 8,16,32,64 at R=48
    python benchmarks/scaling.py --rounds 5 --trl      # also TRL 1.12's PPOTrainer at every point, alternately

Each point is the tiny work (Llama 2048 vocab, hidden 256, 4 layers, prompts of 16 tokens) with one
size changed; each run a fresh process, the value of a point the median over rounds of its runs'
median step time (steps 2–N), its bar the rounds' min–max. The rounds go over all points in turn, so
a slow spell of the machine spreads over every point instead of bending one. Writes
``--out`` (benchmarks/scaling.png) and the numbers beside it (scaling.json). The dashed line of each
panel is a least-squares fit a + b·x: growth close to linear leaves the points on it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # this tree's proximal, whatever the venv has installed

from harness import anchors  # noqa: E402
from harness.measure import machine  # noqa: E402
from harness.sides import run_proximal, run_trl  # noqa: E402
from harness.works import TINY, Work, write_models, write_prompts  # noqa: E402


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def points(
    lengths: list[int], batches: list[int], base: Work = TINY
) -> list[tuple[str, int, Work]]:
    out = [
        ("length", R, replace(base, name=f"tiny-R{R}-B{base.batch}", response_len=R))
        for R in lengths
    ]
    out += [
        ("batch", B, replace(base, name=f"tiny-R{base.response_len}-B{B}", batch=B))
        for B in batches
    ]
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (sweep, label, fixed) in zip(
        axes,
        (
            ("length", "response length R (tokens)", f"B = {TINY.batch}"),
            ("batch", "batch size B (sequences)", f"R = {TINY.response_len}"),
        ),
    ):
        for side, marker in (("proximal", "o"), ("trl", "s")):
            pts = [
                p for p in data["points"] if p["sweep"] == sweep and p.get(f"{side}_s") is not None
            ]
            if not pts:
                continue
            xs, ys = [p["x"] for p in pts], [p[f"{side}_s"] for p in pts]
            lo = [y - p[f"{side}_min_s"] for y, p in zip(ys, pts)]
            hi = [p[f"{side}_max_s"] - y for y, p in zip(ys, pts)]
            line = ax.errorbar(
                xs,
                ys,
                yerr=[lo, hi],
                marker=marker,
                linestyle="none",
                capsize=3,
                label=f"{'proximal' if side == 'proximal' else 'TRL 1.12'} (median, min–max)",
            )
            if len(xs) >= 2:
                a, b = fit(xs, ys)
                grid = [
                    min(xs) + (max(xs) - min(xs)) * i / 64 for i in range(65)
                ]  # a line is a curve on the log axis
                ax.plot(
                    grid,
                    [a + b * x for x in grid],
                    "--",
                    color=line[0].get_color(),
                    alpha=0.6,
                    label=f"fit {a:.2g} + {b:.2g}·x s",
                )
        ax.set_xlabel(label)
        ax.set_ylabel("seconds per PPO step (median of steps 2–N)")
        ax.set_title(fixed)
        ax.set_xscale("log", base=2)
        ax.set_xticks([p["x"] for p in data["points"] if p["sweep"] == sweep])
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    m = data["meta"]
    fig.suptitle(
        f"PPO step time on tiny, {m['machine']['cpu']} ({m['machine']['cores']} cores, {m['threads']} threads), "
        f"{m['date'][:10]}" + ("  [machine was loaded]" if m.get("loaded") else ""),
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--lengths", type=_ints, default=[32, 64, 128, 256], help="response lengths at B = 16"
    )
    ap.add_argument("--batches", type=_ints, default=[8, 16, 32, 64], help="batch sizes at R = 48")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--trl",
        action="store_true",
        help="also run TRL 1.12's PPOTrainer at every point (alternately)",
    )
    ap.add_argument("--workdir", type=Path, default=BENCH / ".work")
    ap.add_argument(
        "--out",
        type=Path,
        default=BENCH / "scaling.png",
        help="the figure; the JSON goes beside it",
    )
    ap.add_argument("--timeout", type=float, default=3600)
    a = ap.parse_args(argv)

    pts = points(a.lengths, a.batches)
    assets = {}
    for _, _, w in pts:
        model = write_models(w, a.workdir)
        assets[w.name] = {
            "model": model,
            "prompts": write_prompts(w, a.workdir, 10 * w.batch, model["policy"]),
        }
    trl_python = anchors.ensure(anchors.ANCHORS["trl-ppo"], log=print) if a.trl else None

    runs = []
    for k in range(1, a.rounds + 1):
        for sweep, x, w in pts:
            sides = ["proximal", "trl"] if a.trl else ["proximal"]
            for side in sides:
                scratch = a.workdir / "scaling" / f"{w.name}-r{k}-{side}"
                scratch.mkdir(parents=True, exist_ok=True)
                if side == "proximal":
                    r = run_proximal(
                        w,
                        assets[w.name],
                        steps=a.steps,
                        threads=a.threads,
                        scratch=scratch,
                        timeout_s=a.timeout,
                    )
                else:
                    r = run_trl(
                        w,
                        assets[w.name],
                        trl_python,
                        steps=a.steps,
                        threads=a.threads,
                        scratch=scratch,
                        timeout_s=a.timeout,
                    )
                r.update(round=k, sweep=sweep, x=x)
                runs.append(r)
                print(
                    f"[run] round {k} {sweep} {x:4d} {side:8s} "
                    + (
                        f"FAILED ({r['error'][:200]})"
                        if r.get("error")
                        else f"{r['median_step_s']:.3g} s/step"
                    )
                    + f"  (busy CPUs before: {r['cpu_busy_before']:.2f})",
                    flush=True,
                )

    summary = []
    for sweep, x, w in pts:
        row = {
            "sweep": sweep,
            "x": x,
            "work": w.name,
            "batch": w.batch,
            "response_len": w.response_len,
        }
        for side in ("proximal", "trl"):
            vals = [
                r["median_step_s"]
                for r in runs
                if r["work"] == w.name
                and r["sweep"] == sweep
                and r["side"] == side
                and not r.get("error")
                and r.get("median_step_s") is not None
            ]
            if vals:
                row.update(
                    {
                        f"{side}_s": statistics.median(vals),
                        f"{side}_min_s": min(vals),
                        f"{side}_max_s": max(vals),
                        f"{side}_all_s": vals,
                    }
                )
        summary.append(row)
    busy = max((r.get("cpu_busy_before") or 0.0) for r in runs) if runs else 0.0
    data = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "rounds": a.rounds,
            "steps": a.steps,
            "threads": a.threads,
            "machine": machine(),
            "max_cpu_busy_before": busy,
            "loaded": busy > 0.25,
            "command": " ".join(["benchmarks/scaling.py"] + (argv or sys.argv[1:])),
        },
        "points": summary,
        "runs": runs,
    }
    a.out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, a.out)
    print(f"[done] {a.out} and {a.out.with_suffix('.json')}")
    for row in summary:
        print(
            f"  {row['sweep']:6s} {row['x']:4d}  proximal {row.get('proximal_s', float('nan')):.3g} s/step"
            + (f"  TRL {row['trl_s']:.3g} s/step" if "trl_s" in row else "")
        )
    return 1 if any(r.get("error") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
