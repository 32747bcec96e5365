"""proximal against TRL on identical work, alternately in one invocation (issue 12).

    python benchmarks/compare_trl.py                          # every work, 3 rounds, 10 steps a run
    python benchmarks/compare_trl.py --works tiny,wide --rounds 5
    python benchmarks/compare_trl.py --more-rounds tiny=7,tiny-bf16=7,grpo=7   # the short works more often
    python benchmarks/compare_trl.py --smoke --works mini     # CI: 1 step, proximal only, no anchor install

Run it with proximal's Python (``.venv/bin/python``); it imports this tree's ``proximal``. In order it
(1) writes the benchmark models and prompts under ``--workdir`` (once; reused while their recipe is
unchanged), (2) creates or refreshes each anchor's virtual environment (``benchmarks/.venv-trl-ppo``:
TRL 1.12.0; ``benchmarks/.venv-trl-grpo``: the newest TRL; torch 2.13.0 in both, everything pinned in
``benchmarks/anchors/``), (3) for each round and each work runs proximal, then the anchor, each a
fresh process with the same torch thread count, sampling the machine's load before each, and (4)
writes ``--results`` (results.md) and the JSON of every number beside it. Methodology and columns:
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # this tree's proximal, whatever the venv has installed

from harness import anchors, report  # noqa: E402
from harness.measure import BUSY_NOTE, machine  # noqa: E402
from harness.proximal_side import has_command  # noqa: E402
from harness.sides import run_proximal, run_trl  # noqa: E402
from harness.works import DEFAULT_WORKS, WORKS, with_precision, write_models, write_prompts  # noqa: E402

NOTES = """
## How the two sides are made equal

- **Weights and prompts.** One causal-LM checkpoint is the policy and the reference on both sides; one
  one-label `AutoModelForSequenceClassification` checkpoint is the reward model and the critic (proximal
  `model.critic: reward_model`; TRL `reward_model` and `value_model` both loaded from it). Both sides read
  the same prompts: proximal the JSONL text, TRL PPO the token ids, which the harness checks are what
  proximal's tokenisation gives; every prompt is exactly P tokens, so nothing is padded.
- **Exactly R tokens per response.** proximal cannot be told not to stop at EOS (`rollout/sampling.py`
  always adds the tokenizer's EOS to the stop tokens), and TRL's PPOTrainer ends a response at its first
  pad token. So the benchmark policy cannot sample any special token: a hidden dimension no layer reads
  or writes holds a constant, and the special tokens' output rows are −1000 there, which puts their
  logits hundreds of nats below every other token's (benchmarks/harness/works.py). Their probability is
  exactly 0 in float32 and bfloat16. Each proximal run's `response/length_mean` is checked to be R and
  each TRL run checks every generated response (R tokens, no special id).
- **The same hyper-parameters where the issue fixes them**: 4 PPO epochs, one mini-batch of the whole
  batch (proximal `ppo.mini_batch_size = ppo.micro_batch_size = rollout.batch_size`; TRL
  `num_mini_batches=1, gradient_accumulation_steps=1, per_device_train_batch_size=B`), learning rate 1e-5
  for policy and critic, temperature 1 (TRL divides by 1 + 1e-7), CPU, the same torch thread count
  (OMP_NUM_THREADS in both processes, and `torch.set_num_threads` in TRL's).
- **Step time**: the span from one step's end to the next's, median over steps 2–N. TRL: `on_step_end`
  timestamps of a TrainerCallback. proximal: differences of `time/wall_s` in metrics.jsonl (its
  `time/step_s`, which leaves out logging, is in the JSON too). proximal writes a checkpoint after the
  last step (it always does; `train.save_every: 0`), TRL writes nothing (`save_strategy="no"`): that is in
  the process time only.

## What differs, and why it was left so

- TRL's PPO computes π_old from the logits `generate` returns and logits of every position in its
  epochs; proximal recomputes π_old with a forward pass and keeps only response logits. These are the
  implementations being compared, not settings.
- PPO loss details differ by default and were left at each library's default (they cost the same):
  value coefficient (TRL 0.1, proximal 0.5), gradient clipping (TRL's PPOTrainer.train never clips;
  proximal clips at 1.0), KL in the reward (both k1, β = 0.05), reward whitening off on both.
- TRL's PPOTrainer has one AdamW over policy and value model; proximal has one each (same rates).
- TRL's configs default `gradient_checkpointing=True`, but PPOTrainer's own training loop never turns it
  on (each run's JSON records `policy.is_gradient_checkpointing`: false), so neither side recomputes
  activations; proximal's `train.activation_checkpointing` stays false.
- **bf16 rows**: proximal runs `train.precision: bf16-mixed` (float32 master weights, bf16 autocast, frozen
  models held in bf16). TRL 1.12's PPOTrainer builds its own `Accelerator()` without a mixed-precision
  argument, and transformers 5.24's `TrainingArguments(bf16=True)` no longer exports
  ACCELERATE_MIXED_PRECISION, so **TRL's PPO bf16 run computes in float32** (its JSON records
  `accelerator.mixed_precision`). The bf16 rows therefore compare proximal's bf16 against TRL's float32.
- GRPO: TRL's GRPOConfig defaults `gradient_checkpointing=True` and `bf16=True`; both are set off here
  (proximal does neither by default), and `beta` = 0.04 (TRL's default 0 would skip the reference model),
  `loss_type` the same on both sides, 4 prompts × 4 completions a step, one optimiser step per
  generation (`num_iterations=1`). The reward is one pure-Python function on both sides
  (benchmarks/grpo_reward.py).
- Data order: both sides shuffle the same prompt set with their own generators, so a step sees other
  prompts on each side; with every prompt P tokens and every response R, the arithmetic is the same.
"""


def _versions_here() -> dict:
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "proximal"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except OSError:
        commit = "?"
    return {
        "commit": commit or "?",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument(
        "--works",
        default=",".join(DEFAULT_WORKS),
        help=f"comma-separated, from: {', '.join(WORKS)} (default: %(default)s)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="A B pairs per work (at least 3 for a result; default 3)",
    )
    ap.add_argument(
        "--more-rounds",
        default="",
        help="WORK=N,…: these works get N rounds instead (N ≥ --rounds; the short works' steps "
        "are the noisiest, and their rounds cost little). Rounds stay interleaved: round k runs "
        "every work that has a k-th round",
    )
    ap.add_argument(
        "--steps", type=int, default=10, help="training steps a run (default 10: medians of 2–10)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="torch threads in every process (default: the machine's %(default)s cores)",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI mode: 1 step, 1 round, proximal only, no anchor install; not a measurement",
    )
    ap.add_argument(
        "--bf16-precision",
        default="bf16-mixed",
        choices=("bf16-mixed", "bf16-true"),
        help="proximal's train.precision for the *-bf16 works (default %(default)s, the same "
        "arithmetic as autocast with float32 master weights)",
    )
    ap.add_argument(
        "--workdir",
        type=Path,
        default=BENCH / ".work",
        help="models, prompts, run logs (default benchmarks/.work, git-ignored)",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="results markdown; the JSON goes beside it (default benchmarks/results.md, "
        "benchmarks/.work/results-smoke.md with --smoke)",
    )
    ap.add_argument(
        "--timeout", type=float, default=3600, help="seconds allowed a run (default %(default)s)"
    )
    ap.add_argument(
        "--keep-runs", action="store_true", help="keep proximal's run directories (checkpoints)"
    )
    a = ap.parse_args(argv)
    a.works = [w.strip() for w in a.works.split(",") if w.strip()]
    unknown = [w for w in a.works if w not in WORKS]
    if unknown:
        ap.error(f"unknown work(s) {', '.join(unknown)}; choose from {', '.join(WORKS)}")
    if a.smoke:
        a.steps, a.rounds, a.more_rounds = 1, 1, ""
    if a.rounds < 1 or a.steps < 1 or a.threads < 1:
        ap.error("--rounds, --steps and --threads must be ≥ 1")
    a.rounds_of = {w: a.rounds for w in a.works}
    for item in filter(None, (x.strip() for x in a.more_rounds.split(","))):
        name, _, n = item.partition("=")
        if name not in a.rounds_of or not n.isdigit() or int(n) < a.rounds:
            ap.error(
                f"--more-rounds {item!r}: expected WORK=N with WORK one of --works ({', '.join(a.works)}) "
                f"and N ≥ --rounds ({a.rounds})"
            )
        a.rounds_of[name] = int(n)
    if a.results is None:
        a.results = (a.workdir / "results-smoke.md") if a.smoke else (BENCH / "results.md")
    return a


def schedule(works: list[str], rounds_of: dict[str, int]) -> list[tuple[int, str]]:
    """(round, work) in running order: round by round, each work that has that round, in ``works``' order."""
    last = max((rounds_of[w] for w in works), default=0)
    return [(k, w) for k in range(1, last + 1) for w in works if k <= rounds_of[w]]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    cores = os.cpu_count() or 1
    if a.threads > cores:
        log(
            f"[warn] --threads {a.threads} is more than the machine's {cores} cores: oversubscribed"
        )
    if not a.smoke and a.rounds < 3:
        log(f"[warn] --rounds {a.rounds}: issue 12 asks for at least 3 alternations")

    works = [with_precision(WORKS[w], a.bf16_precision) for w in a.works]
    skipped: dict[str, str] = {}
    if any(w.method == "grpo" for w in works) and not has_command("grpo"):
        for w in works:
            if w.method == "grpo":
                skipped[w.name] = (
                    "`proximal grpo` does not exist in this tree yet (issue 10); the pair was not run"
                )
                log(f"[skip] {w.name}: {skipped[w.name]}")
        works = [w for w in works if w.method != "grpo"]

    # 1. Models and prompts, written once.
    assets = {}
    for w in works:
        model = write_models(w, a.workdir)
        prompts = write_prompts(w, a.workdir, 10 * w.batch, model["policy"])
        assets[w.name] = {"model": model, "prompts": prompts}
        log(
            f"[models] {w.name}: {model['params_policy'] / 1e6:.3g}M-parameter policy, "
            f"{model['params_reward'] / 1e6:.3g}M reward model; specials ≥ {model['min_logit_gap']:.0f} nats down"
        )

    # 2. The anchors' environments.
    pythons, anchor_versions = {}, {}
    if not a.smoke:
        for name in sorted({"trl-ppo" if w.method == "ppo" else "trl-grpo" for w in works}):
            pythons[name] = anchors.ensure(anchors.ANCHORS[name], log=log)
            anchor_versions[name] = anchors.versions(pythons[name])

    # 3. Alternate: for each round, for each work that has that round, proximal then the anchor.
    runs = []
    by_name = {w.name: w for w in works}
    for k, name in schedule([w.name for w in works], a.rounds_of):
        w = by_name[name]
        sides = ["proximal"] if a.smoke else ["proximal", "trl"]
        for side in sides:
            scratch = a.workdir / "runs" / f"{w.name}-r{k}-{side}"
            scratch.mkdir(parents=True, exist_ok=True)
            if side == "proximal":
                r = run_proximal(
                    w,
                    assets[w.name],
                    steps=a.steps,
                    threads=a.threads,
                    scratch=scratch,
                    timeout_s=a.timeout,
                    keep_run=a.keep_runs,
                )
            else:
                py = pythons["trl-ppo" if w.method == "ppo" else "trl-grpo"]
                r = run_trl(
                    w,
                    assets[w.name],
                    py,
                    steps=a.steps,
                    threads=a.threads,
                    scratch=scratch,
                    timeout_s=a.timeout,
                )
            r["round"] = k
            runs.append(r)
            busy = r.get("cpu_busy_before", 0.0)
            warn = (
                f"  [warn: {busy:.2f} CPUs busy before it — {BUSY_NOTE}]"
                if busy > report.BUSY_WARN
                else ""
            )
            status = (
                f"FAILED ({r['error'][:300]})"
                if r.get("error")
                else (
                    f"{_s(r['median_step_s'])} s/step, {r['wall_s']:.1f} s process, {r['peak_rss_mib']:.0f} MiB"
                )
            )
            log(f"[run] round {k} {w.name:10s} {side:8s} {status}{warn}")

    # 4. Report.
    summary = report.summarize(runs, [w.name for w in works])
    data = {
        "meta": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(
                [Path(sys.executable).name, "benchmarks/compare_trl.py"]
                + list(sys.argv[1:] if argv is None else argv)
            ),
            "rounds": a.rounds,
            "rounds_of": a.rounds_of,
            "steps": a.steps,
            "threads": a.threads,
            "smoke": a.smoke,
            "bf16_precision": a.bf16_precision,
            "machine": machine(),
            "proximal": _versions_here(),
            "anchors": anchor_versions,
            "skipped": skipped,
            "works": {w.name: {**w.__dict__, "model": assets[w.name]["model"]} for w in works},
        },
        "summary": summary,
        "runs": runs,
    }
    report.write(a.results, data, NOTES)
    log(f"[done] {a.results} and {a.results.with_suffix('.json')}")
    for w, s in summary.items():
        log(
            f"  {w:10s} step ratio {_s(s['ratio_median_step_s'])}  process ratio {_s(s['ratio_wall_s'])}  "
            f"RSS ratio {_s(s['ratio_peak_rss_mib'])}   (proximal {_s(s['proximal_median_step_s'])} s/step, "
            f"TRL {_s(s['anchor_median_step_s'])} s/step)"
        )
    failed = sum(s["failed_runs"] for s in summary.values())
    return 1 if failed else 0


def _s(x) -> str:
    return "—" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
