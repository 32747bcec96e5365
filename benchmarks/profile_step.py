"""Where one PPO step's time goes: one step of ``proximal ppo`` (or of TRL 1.12's PPOTrainer) on a
benchmark work under ``torch.profiler``, with the time of each phase.

    python benchmarks/profile_step.py                         # proximal, tiny, step 2 (after one warm-up)
    python benchmarks/profile_step.py --work wide --rows 40 --trace /tmp/wide.json
    python benchmarks/profile_step.py --side trl              # TRL, in benchmarks/.venv-trl-ppo

proximal runs in this process (``proximal.trainers.ppo.train`` on the same config the harness uses),
with the loop's calls wrapped in timers and ``record_function`` labels: generation, scoring (the
reward model), experience (log π_old, log π_ref, V_old), advantages (rewards, GAE, whitening: what is
left between experience and update), the PPO epochs, and the rest of the step (logging, samples).
TRL runs in its anchor environment (``trl_ppo_run.py --profile``), its phases timed by wrapping
TRL's module functions: generation, reference forward, reward/value forward, and in the epochs the
forward passes, backward passes and optimiser steps.

Prints the phases and the top operators by self CPU time; ``--trace`` writes a Chrome trace
(chrome://tracing, ui.perfetto.dev). A profiled step runs slower than an unprofiled one (the
profiler's own overhead, a few per cent on these sizes); compare phases with each other, and the
step with compare_trl.py's numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from harness import anchors  # noqa: E402
from harness.sides import child_env, trl_command  # noqa: E402
from harness.works import WORKS, with_precision, write_models, write_prompts  # noqa: E402


def profile_proximal(
    work, assets, *, warmup: int, rows: int, sort: str, trace: Path | None, by_shape: bool = False
) -> dict:
    from harness import proximal_side
    from torch.profiler import ProfilerActivity, profile, record_function

    import proximal.trainers.ppo as ppo
    from proximal.config import load_config
    from proximal.train.host import tune_allocator

    tune_allocator()  # as the command line does

    target = warmup + 1
    times: dict[str, float] = {}
    state = {"step": 0, "prof": None, "t0": 0.0}

    @contextmanager
    def phase(name: str):
        on = state["step"] == target
        t = time.perf_counter()
        with record_function(f"phase::{name}") if on else _null():
            yield
        if on:
            times[name] = times.get(name, 0.0) + time.perf_counter() - t

    orig_collect, orig_exp, orig_update = ppo.collect, ppo.compute_experience, ppo.ppo_update
    orig_first = ppo.first_pass

    def first_pass(
        *a, **kw
    ):  # the first epoch's actor forward, which is log π_old: part of the experience
        with phase("experience"):
            return orig_first(*a, **kw)

    def collect(step, **kw):
        state["step"] = step
        if step == target:
            state["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            state["prof"].__enter__()
            state["t0"] = time.perf_counter()
        with phase("generate+score"):
            got = orig_collect(step, **kw)
        if step == target:
            times["generate"] = got.generate_s
        return got

    def compute_experience(*a, **kw):
        with phase("experience"):
            out = orig_exp(*a, **kw)
        state["t_exp"] = time.perf_counter()
        return out

    def ppo_update(*a, **kw):
        if state["step"] == target:
            times["advantages"] = time.perf_counter() - state["t_exp"]
        with phase("ppo epochs"):
            out = orig_update(*a, **kw)
        if state["step"] == target:
            state["t_upd"] = time.perf_counter()
        return out

    ppo.collect, ppo.compute_experience, ppo.ppo_update = collect, compute_experience, ppo_update
    ppo.first_pass = first_pass
    with tempfile.TemporaryDirectory() as tmp:
        cfg_dict = proximal_side.ppo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=target,
            out_dir=Path(tmp) / "run",
        )
        path = proximal_side.write_config(cfg_dict, Path(tmp) / "config.yaml")
        cfg = load_config(ppo.PPOConfig, path)
        run_dir = ppo.train(cfg)
        prof = state["prof"]
        prof.__exit__(None, None, None)
        rows_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = float(rows_[target - 1]["time/step_s"])
    times["score"] = times.pop("generate+score") - times["generate"]
    times = {k: times[k] for k in ("generate", "score", "experience", "advantages", "ppo epochs")}
    times["rest of the step"] = step_s - sum(times.values())
    if trace:
        prof.export_chrome_trace(str(trace))
    table = prof.key_averages(group_by_input_shape=by_shape).table(sort_by=sort, row_limit=rows)
    return {"side": "proximal", "step": target, "step_s": step_s, "phases": times, "table": table}


@contextmanager
def _null():
    yield


def profile_trl(
    work, assets, *, warmup: int, rows: int, sort: str, trace: Path | None, threads: int
) -> dict:
    py = anchors.ensure(anchors.ANCHORS["trl-ppo"], log=print)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trl.json"
        cmd = trl_command(work, assets, py, steps=warmup + 1, threads=threads, out=out)
        cmd += [
            "--profile-step",
            str(warmup + 1),
            "--profile-rows",
            str(rows),
            "--profile-sort",
            sort,
        ]
        if trace:
            cmd += ["--profile-trace", str(trace)]
        subprocess.run(cmd, env=child_env(threads, pythonpath=[]), check=True, cwd=str(BENCH))
        r = json.loads(out.read_text())
    p = r["profile"]
    return {
        "side": "trl",
        "step": warmup + 1,
        "step_s": p["step_s"],
        "phases": p["phases"],
        "table": p["table"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--work", default="tiny", choices=[w for w, v in WORKS.items() if v.method == "ppo"]
    )
    ap.add_argument("--side", default="proximal", choices=("proximal", "trl"))
    ap.add_argument("--bf16-precision", default="bf16-mixed", choices=("bf16-mixed", "bf16-true"))
    ap.add_argument(
        "--warmup", type=int, default=1, help="unprofiled steps before the profiled one (default 1)"
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rows", type=int, default=25, help="operators to list")
    ap.add_argument(
        "--sort",
        default="self_cpu_time_total",
        help="torch.profiler sort key (default %(default)s)",
    )
    ap.add_argument(
        "--trace", type=Path, default=None, help="write a Chrome trace of the profiled step here"
    )
    ap.add_argument(
        "--by-shape", action="store_true", help="group operators by input shapes (proximal side)"
    )
    ap.add_argument("--workdir", type=Path, default=BENCH / ".work")
    ap.add_argument(
        "--json", type=Path, default=None, help="also write the phases and the table as JSON"
    )
    a = ap.parse_args(argv)

    work = with_precision(WORKS[a.work], a.bf16_precision)
    model = write_models(work, a.workdir)
    assets = {
        "model": model,
        "prompts": write_prompts(work, a.workdir, 10 * work.batch, model["policy"]),
    }
    if a.side == "proximal":
        import torch

        torch.set_num_threads(a.threads)
        res = profile_proximal(
            work,
            assets,
            warmup=a.warmup,
            rows=a.rows,
            sort=a.sort,
            trace=a.trace,
            by_shape=a.by_shape,
        )
    else:
        res = profile_trl(
            work,
            assets,
            warmup=a.warmup,
            rows=a.rows,
            sort=a.sort,
            trace=a.trace,
            threads=a.threads,
        )

    print(
        f"\n{res['side']} PPO, work {work.name} (B={work.batch}, P={work.prompt_len}, R={work.response_len}, "
        f"{work.precision if res['side'] == 'proximal' else ('bf16=True' if work.bf16 else 'float32')}), "
        f"step {res['step']} of one process, {a.threads} threads: {res['step_s']:.3f} s under the profiler"
    )
    for name, s in res["phases"].items():
        print(f"  {name:34s} {s:8.3f} s  {100 * s / res['step_s']:5.1f} %")
    print(f"\ntop {a.rows} operators by {a.sort}:\n{res['table']}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
