"""Soak: does a long run hold its memory, its open files and its disk? (issue 23, not a CI test)

A tiny ``proximal ppo`` run and a tiny ``proximal grpo`` run of ``--steps`` steps (500 by default),
each a child process launched exactly as a user would (``python -m proximal <command> --config``),
checkpointing every ``--save-every`` steps (50) and keeping ``--keep`` of them
(``train.keep_checkpoints``, 2). While a run trains, this process polls its run directory every
``--poll`` seconds; each time a new row lands in ``metrics.jsonl`` (step k done, logged before its
checkpoint is written), it samples the child:

rss          the child's resident set now (``VmRSS`` of ``/proc/PID/status``)
peak_rss     the child's own per-step peak resident set, as the run logged it (``memory/peak_bytes``:
             VmHWM since the previous step, reset each step)
fds          the child's open file descriptors (``/proc/PID/fd``)
checkpoints  the ``step_*`` directories under ``checkpoints/`` (and ``.step_*.tmp`` ones, apart)

A sample at step k is taken after step k's row and before its checkpoint is written, so the
change from step k to k + 1 holds the save of step k when k is a save step: the summary splits the
growth after warm-up into what the saves added and what the steps between them added.

Between rows it keeps the largest checkpoint-directory count it ever sees (a save renames the
new checkpoint into place before it deletes the oldest, so keep + 1 may exist for a moment).

**Verdict**, against allowances stated here, before measuring:

- memory is *flat after warm-up* when, over steps ``--warmup``..N, the least-squares slope of each of
  rss and peak_rss, times the N − warmup steps, is at most ``RSS_ALLOWANCE`` of the warm-up value
  (5 %: a leak of one small tensor or a list entry per step grows without bound, and would show as a
  steady slope; allocator noise and one-off caches do not) and their maximum is within
  ``RSS_ALLOWANCE`` of the warm-up value too. The warm-up value is the median over the ten steps
  from ``--warmup``, so one noisy sample does not set the bar;
- file descriptors: no more after warm-up than at the warm-up value (allowance 0), except as a
  blip: a sample is taken while the child may be writing a checkpoint (the last step's always is)
  or a log line, so a single sample may show up to ``FD_BLIP`` more, never as a trend — the median
  of the last ten samples must be the warm-up value or less;
- checkpoints: never more than keep + 1 directories at any poll, exactly keep when the run ends,
  and no ``.tmp`` directory left.

Writes ``benchmarks/results/soak.json`` (every sample, the summary and the verdict) and
``benchmarks/results/soak.png`` (rss, peak_rss and fds against the step). Exit status 0 when every
verdict holds, 1 otherwise.

    .venv/bin/python benchmarks/soak.py                         # ppo and grpo, 500 steps each
    .venv/bin/python benchmarks/soak.py --methods grpo --steps 100 --save-every 10   # a quick look

The runs are CPU-bound and single-threaded (``OMP_NUM_THREADS=1``); a busy machine makes them
slower, not different: nothing here is a time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

RSS_ALLOWANCE = 0.05  # of the warm-up value: slope × remaining steps, and max − warm-up value
FD_BLIP = 2  # descriptors a single sample may show above the warm-up value (a file being written)
ALPHABET = "abcdefgh 0123456789"  # the tiny policy's characters


def frac_a(prompts: list[str], completions: list[str]) -> list[float]:
    """The rule reward of both runs (``soak:frac_a``): the fraction of 'a' in the completion."""
    return [c.count("a") / max(1, len(c)) for c in completions]


# ----------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------


def build_assets(work: Path) -> dict[str, Path]:
    """Tiny Llama policy and reward model (2 layers, 32 wide) and 24 prompts, built once."""
    sys.path.insert(0, str(ROOT))
    from proximal.data.jsonl import write_jsonl  # lazy: torch and transformers load only here
    from proximal.models.tiny import (  # lazy: as above
        build_char_tokenizer,
        build_tiny_causal_lm,
        build_tiny_reward_model,
    )

    work.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(list(ALPHABET))
    out = {
        "policy": work / "policy",
        "reward_model": work / "rm",
        "prompts": work / "prompts.jsonl",
    }
    if not (out["policy"] / "config.json").is_file():
        build_tiny_causal_lm(out["policy"], tok, arch="llama", seed=0)
    if not (out["reward_model"] / "config.json").is_file():
        build_tiny_reward_model(out["reward_model"], tok, arch="llama", seed=1)
    prompts = [("abcdefgh"[i % 8] * (1 + i % 5)) + f" {i % 10}" for i in range(24)]
    write_jsonl(out["prompts"], [{"prompt": p} for p in prompts])
    return out


def run_config(method: str, assets: dict, run_dir: Path, a: argparse.Namespace) -> dict:
    train = {
        "steps": a.steps,
        "save_every": a.save_every,
        "keep_checkpoints": a.keep,
        "seed": 0,
        "device": "cpu",
    }
    output = {"dir": str(run_dir), "progress": False, "samples_per_step": 2}
    data = {"prompts": str(assets["prompts"]), "max_prompt_length": 16}
    if method == "ppo":  # all four models: actor, reference, reward model, critic from the RM
        return {
            "model": {
                "path": str(assets["policy"]),
                "reward_model": str(assets["reward_model"]),
                "critic": "reward_model",
                "reward_functions": ["soak:frac_a"],
            },
            "data": data,
            "rollout": {"batch_size": 4, "max_new_tokens": 8},
            "ppo": {"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2},
            "kl": {"controller": "adaptive", "target": 0.05, "beta": 0.1},
            "optim": {"lr": 1e-3, "critic_lr": 1e-3},
            "train": train,
            "output": output,
        }
    return {  # grpo: policy and reference, a rule reward
        "model": {"path": str(assets["policy"]), "reward_functions": ["soak:frac_a"]},
        "data": data,
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": train,
        "output": output,
    }


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _checkpoints(run_dir: Path) -> tuple[int, int]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return 0, 0
    names = [p.name for p in root.iterdir() if p.is_dir()]
    return sum(n.startswith("step_") for n in names), sum(n.startswith(".step_") for n in names)


def soak(method: str, assets: dict, a: argparse.Namespace) -> dict:
    """Run one method to the end, sampling at every step; its samples and summary."""
    import yaml  # lazy: only the runs need it (installed with proximal)

    run_dir = a.workdir / f"run-{method}"
    config = a.workdir / f"{method}.yaml"
    config.write_text(yaml.safe_dump(run_config(method, assets, run_dir, a), sort_keys=False))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    log = (a.workdir / f"{method}.log").open("w")
    shutil.rmtree(
        run_dir, ignore_errors=True
    )  # an earlier soak's rows must not be read as this one's
    cmd = [sys.executable, "-m", "proximal", method, "--config", str(config)]
    t0 = time.monotonic()
    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    samples: list[dict] = []
    seen_rows, offset, buffer, max_dirs, max_tmp = 0, 0, "", 0, 0
    while True:
        done = child.poll() is not None
        dirs, tmp = _checkpoints(run_dir)
        max_dirs, max_tmp = max(max_dirs, dirs), max(max_tmp, tmp)
        if metrics.is_file():
            with open(metrics) as fh:
                fh.seek(offset)
                buffer += fh.read()
                offset = fh.tell()
            *lines, buffer = buffer.split("\n")
            rows = [json.loads(line) for line in lines if line.strip()]
            if rows:  # sample once per poll even if several rows landed since the last one
                rss, fds = _rss(child.pid), _fds(child.pid)
            for row in rows:
                seen_rows += 1
                samples.append(
                    {
                        "step": row["step"],
                        "rss": rss,
                        "peak_rss": row.get("memory/peak_bytes"),
                        "fds": fds,
                        "checkpoints": dirs,
                        "tmp_checkpoints": tmp,
                        "wall_s": round(time.monotonic() - t0, 2),
                    }
                )
                if a.verbose and row["step"] % a.save_every == 0:
                    print(f"  {method} step {row['step']}: {samples[-1]}", flush=True)
        if done:
            break
        time.sleep(a.poll)
    log.close()
    end_dirs, end_tmp = _checkpoints(run_dir)
    return {
        "method": method,
        "command": " ".join(cmd),
        "returncode": child.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "samples": samples,
        "max_checkpoints_seen": max_dirs,
        "max_tmp_checkpoints_seen": max_tmp,
        "end_checkpoints": end_dirs,
        "end_tmp_checkpoints": end_tmp,
        **judge(samples, a, max_dirs, end_dirs, end_tmp),
    }


# ----------------------------------------------------------------------------------------------
# The verdict
# ----------------------------------------------------------------------------------------------


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def judge(samples: list[dict], a: argparse.Namespace, max_dirs: int, end_dirs: int, end_tmp: int):
    """The summary figures and the verdict of one run (see the module docstring)."""
    steps = [s["step"] for s in samples]
    if steps != list(range(1, a.steps + 1)) or any(s["rss"] is None for s in samples):
        return {"summary": {}, "verdict": {"complete": False}}
    after = [s for s in samples if s["step"] >= a.warmup]
    at_warmup = [s for s in after if s["step"] < a.warmup + 10]
    summary, verdict = {}, {"complete": True}
    span = samples[-1]["step"] - a.warmup
    for key in ("rss", "peak_rss", "fds"):
        series = [s[key] for s in samples]
        base = statistics.median(s[key] for s in at_warmup)
        post = [s[key] for s in after]
        slope = _slope([s["step"] for s in after], post)
        summary[key] = {
            "first": series[0],
            "at_warmup": base,
            "max_after_warmup": max(post),
            "min_after_warmup": min(post),
            "final": series[-1],
            "max": max(series),
            "slope_per_step": slope,
            "trend_over_run": slope * span,
        }
        if key != "fds":  # where the growth after warm-up happens: in the saves, or in the steps
            by_step = {s["step"]: s[key] for s in after}
            saves = sum(
                by_step[k + 1] - by_step[k]
                for k in by_step
                if k + 1 in by_step and k % a.save_every == 0
            )
            summary[key]["growth_in_saves"] = saves
            summary[key]["growth_between_saves"] = post[-1] - post[0] - saves
        if key == "fds":
            settled = statistics.median(series[-10:])
            summary[key]["median_last_10"] = settled
            verdict["fds_flat"] = max(post) <= base + FD_BLIP and settled <= base
        else:
            allowed = RSS_ALLOWANCE * base
            verdict[f"{key}_flat"] = slope * span <= allowed and max(post) - base <= allowed
    verdict["checkpoints_bounded"] = max_dirs <= a.keep + 1 and end_dirs == a.keep and end_tmp == 0
    return {"summary": summary, "verdict": verdict}


# ----------------------------------------------------------------------------------------------
# Figure and command line
# ----------------------------------------------------------------------------------------------


def plot(results: list[dict], path: Path, warmup: int) -> None:
    import matplotlib  # lazy: only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    mib = 1024 * 1024
    for r in results:
        steps = [s["step"] for s in r["samples"]]
        axes[0].plot(steps, [s["rss"] / mib for s in r["samples"]], label=r["method"], lw=1)
        peak = [(s["peak_rss"] or 0) / mib for s in r["samples"]]
        axes[1].plot(steps, peak, label=r["method"], lw=1)
        axes[2].plot(steps, [s["fds"] for s in r["samples"]], label=r["method"], lw=1)
    titles = ("resident set (MiB)", "per-step peak resident set (MiB)", "open file descriptors")
    for ax, title in zip(axes, titles):
        ax.axvline(warmup, color="grey", ls=":", lw=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ppo,grpo", help="comma-separated: ppo, grpo")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2, help="train.keep_checkpoints")
    p.add_argument("--warmup", type=int, default=100, help="first step judged for flatness")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument("--poll", type=float, default=0.02, help="seconds between samples")
    p.add_argument("--workdir", type=Path, default=HERE / ".work" / "soak")
    p.add_argument("--results", type=Path, default=HERE / "results" / "soak.json")
    p.add_argument("--plot", type=Path, default=HERE / "results" / "soak.png")
    p.add_argument("--verbose", action="store_true", help="print a sample at every checkpoint")
    a = p.parse_args(argv)
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.methods if m not in ("ppo", "grpo")]
    if bad:
        p.error(f"--methods: {', '.join(bad)} (give ppo, grpo or both)")
    if not 0 < a.warmup < a.steps - 10:
        p.error(f"--warmup {a.warmup} must leave at least 10 steps of the {a.steps} to judge")
    return a


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
        return out.stdout.decode().strip() or None
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    assets = build_assets(a.workdir)
    results = []
    for method in a.methods:
        print(f"soak: {method}, {a.steps} steps, a checkpoint every {a.save_every}", flush=True)
        r = soak(method, assets, a)
        results.append(r)
        print(
            f"soak: {method}: exit {r['returncode']}, {r['wall_s']} s, {r['verdict']}", flush=True
        )
    out = {
        "commit": _commit(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "allowances": {"rss_fraction": RSS_ALLOWANCE, "fd_blip": FD_BLIP},
        "runs": results,
    }
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps(out, indent=1) + "\n")
    plot(results, a.plot, a.warmup)
    ok = all(r["returncode"] == 0 and all(r["verdict"].values()) for r in results)
    print(f"soak: {'flat and bounded' if ok else 'FAILED'}; {a.results}, {a.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
