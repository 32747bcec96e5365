"""proximal against TRL on identical work, alternately in one invocation (issues 12 and 22).

    python benchmarks/compare_trl.py                          # every work, 3 rounds, each work's steps
    python benchmarks/compare_trl.py --works tiny,wide --rounds 5
    python benchmarks/compare_trl.py --more-rounds tiny=7,tiny-bf16=7,grpo=7   # the short works more often
    python benchmarks/compare_trl.py --works ppo-vocab,grpo-vocab   # issue 22: V = 151,936 (Qwen2)
    python benchmarks/compare_trl.py --smoke --works mini     # CI: 1 step, proximal only, no anchor install
    python benchmarks/compare_trl.py --smoke --with-trl --works ppo-vocab,grpo-vocab   # both sides, 1 step
    python benchmarks/compare_trl.py --baseline 124efa8      # and proximal at that commit, third each round

Run it with proximal's Python (``.venv/bin/python``); it imports this tree's ``proximal``. In order it
(1) writes the benchmark models and prompts under ``--workdir`` (once; reused while their recipe is
unchanged), (2) creates or refreshes each anchor's virtual environment (``benchmarks/.venv-trl-ppo``:
TRL 1.12.0; ``benchmarks/.venv-trl-grpo``: the newest TRL; torch 2.13.0 in both, everything pinned in
``benchmarks/anchors/``), (3) for each round and each work runs proximal, then the anchor, each a
fresh process with the same torch thread count, sampling the machine's load before each, and (4)
writes ``--results`` (results.md) and the JSON of every number beside it. With ``--baseline REF``
(issue 27) proximal also runs from a checkout of commit REF under ``--workdir``, third in each round
(proximal, anchor, baseline), and the results gain its step times and the ratios baseline / TRL and
new / baseline. Methodology and columns: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import shlex
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))  # this tree's proximal, whatever the venv has installed

from harness import anchors, mfu, report, sides  # noqa: E402
from harness.measure import BUSY_NOTE, machine  # noqa: E402
from harness.proximal_side import has_command, has_train_field  # noqa: E402
from harness.sides import BASELINE, run_proximal, run_trl  # noqa: E402
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

## The real-vocabulary works (issue 22: ppo-vocab, grpo-vocab)

- **Model**: Qwen2 (`Qwen2ForCausalLM` / `Qwen2ForSequenceClassification`, transformers' own classes on
  both sides) with Qwen2's vocabulary size, V = 151,936, on a small body — hidden 128, 2 layers, 4 query
  heads over 2 key/value heads, intermediate 512, tied embeddings as in Qwen2-0.5B — so the
  vocabulary-sized work (the head's products, log-softmax, their gradients) is most of a step.
- **Tokenizer**: built locally, nothing downloaded: the 4 specials, one id per prompt character, then
  `<tN>` entries up to 151,936, all in one byte-level BPE table with no merges (transformers loads it as
  `Qwen2Tokenizer` on both sides); prompts round-trip to the same ids as on the small works.
- **Batch**: as the wide work: 32 prompts of 32 tokens, responses of exactly 64 (PPO: 32 sequences a
  step; GRPO: 8 prompts × 4 completions). Every other setting as on the PPO and GRPO works above.
- **Steps**: 3 a run (the median of steps 2–3), since a TRL PPO step takes about a minute here.
- **What each side computes log-probabilities with**: proximal the path its config chooses
  (`train.logprobs`: `fused`, the default since issue 22, computes them from the hidden states chunk by
  chunk and never holds a (B, T, V) tensor; `logits` is the path before it); every run's record says
  which (`logprobs` in results.json). TRL 1.12's PPOTrainer takes the logits of every position of
  prompt + response in its epochs and keeps the generation's logits for π_old; TRL 1.16's GRPOTrainer
  takes the logits of the completion positions (`logits_to_keep`) and a row-by-row log-softmax.
- **Targets** (ratios proximal / TRL in one invocation): peak RSS ≤ 0.3 (PPO) and ≤ 0.4 (GRPO), step
  time ≤ 0.35 (PPO) and ≤ 0.5 (GRPO).
"""


def _versions_here() -> dict:
    from importlib.metadata import version  # the installed versions, without importing torch here

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
        "torch": version("torch"),
        "transformers": version("transformers"),
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
        "--steps",
        type=int,
        default=None,
        help="training steps a run (default: each work's own, 10 — medians of steps 2–10 — and 3 for "
        "the vocab works, whose TRL steps take tens of seconds)",
    )
    ap.add_argument(
        "--steps-of",
        dest="steps_of_arg",
        default="",
        help="WORK=N,…: these works run N steps a run instead (N ≥ 2, s/step being the median of "
        "steps 2–N; on a slow CPU a wide step takes minutes). The results say which works differ",
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
        help="CI mode: 1 step (or --steps), 1 round, proximal only, no anchor install; not a "
        "measurement",
    )
    ap.add_argument(
        "--with-trl",
        action="store_true",
        help="with --smoke: run the anchors too (installing them if needed), to see both sides run "
        "end to end",
    )
    ap.add_argument(
        "--logprobs",
        choices=("fused", "logits"),
        default=None,
        help="proximal's train.logprobs in every run (default: proximal's own default; the field "
        "exists from issue 22 on)",
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
    ap.add_argument(
        "--baseline",
        metavar="REF",
        default=None,
        help="a commit of this repository (sha, branch, tag, HEAD~1): proximal also runs from a "
        "checkout of it (under --workdir, made once), third in each round after the anchor, and "
        "the results gain s/step baseline, the ratio baseline/TRL and new/baseline",
    )
    a = ap.parse_args(argv)
    a.works = [w.strip() for w in a.works.split(",") if w.strip()]
    unknown = [w for w in a.works if w not in WORKS]
    if unknown:
        ap.error(f"unknown work(s) {', '.join(unknown)}; choose from {', '.join(WORKS)}")
    if a.with_trl and not a.smoke:
        ap.error("--with-trl goes with --smoke (a measurement always runs both sides)")
    if a.smoke:
        a.steps, a.rounds, a.more_rounds, a.steps_of_arg = a.steps or 1, 1, "", ""
    if a.rounds < 1 or (a.steps is not None and a.steps < 1) or a.threads < 1:
        ap.error("--rounds, --steps and --threads must be ≥ 1")
    a.steps_of = {w: a.steps or WORKS[w].steps for w in a.works}
    for item in filter(None, (x.strip() for x in a.steps_of_arg.split(","))):
        name, _, n = item.partition("=")
        if name not in a.steps_of or not n.isdigit() or int(n) < 2:
            ap.error(
                f"--steps-of {item!r}: expected WORK=N with WORK one of --works ({', '.join(a.works)}) "
                "and N ≥ 2"
            )
        a.steps_of[name] = int(n)
    a.rounds_of = {w: a.rounds for w in a.works}
    for item in filter(None, (x.strip() for x in a.more_rounds.split(","))):
        name, _, n = item.partition("=")
        if name not in a.rounds_of or not n.isdigit() or int(n) < a.rounds:
            ap.error(
                f"--more-rounds {item!r}: expected WORK=N with WORK one of --works ({', '.join(a.works)}) "
                f"and N ≥ --rounds ({a.rounds})"
            )
        a.rounds_of[name] = int(n)
    a.workdir = (
        a.workdir.resolve()
    )  # the anchors run in their own directory: paths must be absolute
    if a.results is None:
        a.results = (a.workdir / "results-smoke.md") if a.smoke else (BENCH / "results.md")
    a.baseline_commit = None
    if a.baseline is not None:
        a.baseline_commit = sides.resolve_commit(a.baseline, ROOT)
        if a.baseline_commit is None:
            ap.error(f"--baseline {a.baseline!r}: not a commit of {ROOT}")
    return a


def sides_in_order(a: argparse.Namespace) -> list[str]:
    """The runs of each round and work, in order: proximal (this tree), the anchor ("trl"; not with
    --smoke unless --with-trl), and proximal from the baseline's checkout (with --baseline)."""
    order = ["proximal"] if a.smoke and not a.with_trl else ["proximal", "trl"]
    return order + ([BASELINE] if a.baseline else [])


def prepare_baseline(a: argparse.Namespace, works: list, log) -> dict | str:
    """The ``--baseline`` checkout and what its children import (:func:`harness.sides.tree_proximal`,
    beside this tree's), as ``meta["baseline"]``; or a message saying why it cannot run these works.

    The baseline reads the configs this tree's harness writes. They set no field newer than issue
    22's ``train.logprobs`` (and that one only with ``--logprobs``), so any baseline from then on
    accepts them; the two things that can be missing from an older one are checked here."""
    tree = sides.baseline_tree(a.baseline_commit, a.workdir, root=ROOT, log=log)
    base, new = sides.tree_proximal(tree, a.threads), sides.tree_proximal(ROOT, a.threads)
    for info, where in ((base, tree), (new, ROOT)):
        if not Path(info["file"]).resolve().is_relative_to(where.resolve()):
            return f"a child run from {where} imports proximal from {info['file']}"
    if a.logprobs and "logprobs" not in (base["train_fields"] or []):
        return f"--logprobs {a.logprobs}: proximal at {base['commit']} has no train.logprobs field"
    if any(w.method == "grpo" for w in works) and "grpo" not in (base["commands"] or []):
        return f"proximal at {base['commit']} has no `proximal grpo` command"
    return {
        "ref": a.baseline,
        "sha": a.baseline_commit,
        "commit": base["commit"],
        "tree": str(tree),
        "proximal_file": base["file"],
        "new_commit": new["commit"],
        "new_proximal_file": new["file"],
    }


def prepare(works: list, workdir: Path, threads: int) -> tuple[dict, dict]:
    """Each work's models and prompts (written once, reused while their recipe holds) and the MFU
    yardstick (:func:`harness.mfu.measure`): ``(assets, measured)``. Run in a child (:func:`main`)."""
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    assets = {}
    for w in works:
        model = write_models(w, workdir)
        prompts = write_prompts(w, workdir, 10 * w.batch, model["policy"])
        assets[w.name] = {"model": model, "prompts": prompts}
        log(
            f"[models] {w.name}: {model['params_policy'] / 1e6:.3g}M-parameter policy, "
            f"{model['params_reward'] / 1e6:.3g}M reward model; specials ≥ {model['min_logit_gap']:.0f} nats down"
        )
    measured = mfu.measure(works, threads, log=log)
    log(f"[mfu] CPU: {measured['cpu']['model']}, widest vectors {measured['cpu']['vector']}")
    return assets, measured


def _run_mfu(r: dict, measured: dict) -> str:
    """ ", MFU 69.4 %" for a run's line: its work's model FLOPs / its s/step / the peak probed once
    in this invocation, as results.md shows it (report._mfu); the run's own ``perf/mfu``, against
    the second it probed at its start, only where this invocation has no probe for the work."""
    m = (measured or {}).get("works", {}).get(r["work"])
    if m is not None and r.get("median_step_s"):
        value = mfu.mfu(m["flops"]["total"], r["median_step_s"], m["peak"]["peak_flops_per_s"])
        return f", MFU {100 * value:.1f} %"
    if r.get("median_mfu") is not None:
        return f", MFU {100 * r['median_mfu']:.2g} % (its own probe)"
    return ""


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
    if a.logprobs and not has_train_field("logprobs"):
        log(
            f"[error] --logprobs {a.logprobs}: this tree's proximal has no train.logprobs field "
            "(issue 22's fused path has not landed)"
        )
        return 2
    skipped: dict[str, str] = {}
    if any(w.method == "grpo" for w in works) and not has_command("grpo"):
        for w in works:
            if w.method == "grpo":
                skipped[w.name] = (
                    "`proximal grpo` does not exist in this tree yet (issue 10); the pair was not run"
                )
                log(f"[skip] {w.name}: {skipped[w.name]}")
        works = [w for w in works if w.method != "grpo"]
    baseline = None
    if a.baseline:
        baseline = prepare_baseline(a, works, log)
        if isinstance(baseline, str):
            log(f"[error] --baseline {a.baseline}: {baseline}")
            return 2
        log(
            f"[baseline] {a.baseline} = commit {baseline['commit']}: proximal from "
            f"{baseline['proximal_file']}; this tree ({baseline['new_commit']}) from "
            f"{baseline['new_proximal_file']}"
        )

    # 1. Models and prompts, written once, and the yardstick (issue 27): each work's model FLOPs a
    # step and the machine's peak on its products, probed on the runs' thread count — in a child
    # process, so that this one never holds torch: a child's peak RSS (ru_maxrss) counts its parent's
    # resident set at the fork, so every run would read at least this process's size.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assets, measured = pool.apply(prepare, (works, a.workdir, a.threads))

    # 2. The anchors' environments.
    pythons, anchor_versions = {}, {}
    if not a.smoke or a.with_trl:
        for name in sorted({"trl-ppo" if w.method == "ppo" else "trl-grpo" for w in works}):
            pythons[name] = anchors.ensure(anchors.ANCHORS[name], log=log)
            anchor_versions[name] = anchors.versions(pythons[name])

    # 3. Alternate: for each round, for each work that has that round, proximal then the anchor
    # (then, with --baseline, proximal from the baseline's checkout).
    runs = []
    by_name = {w.name: w for w in works}
    order = sides_in_order(a)
    for k, name in schedule([w.name for w in works], a.rounds_of):
        w = by_name[name]
        for side in order:
            scratch = a.workdir / "runs" / f"{w.name}-r{k}-{side}"
            scratch.mkdir(parents=True, exist_ok=True)
            if side in ("proximal", BASELINE):
                r = run_proximal(
                    w,
                    assets[w.name],
                    steps=a.steps_of[w.name],
                    threads=a.threads,
                    scratch=scratch,
                    timeout_s=a.timeout,
                    keep_run=a.keep_runs,
                    logprobs=a.logprobs,
                    tree=Path(baseline["tree"]) if side == BASELINE else ROOT,
                    side=side,
                )
            else:
                py = pythons["trl-ppo" if w.method == "ppo" else "trl-grpo"]
                r = run_trl(
                    w,
                    assets[w.name],
                    py,
                    steps=a.steps_of[w.name],
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
                    + _run_mfu(r, measured)
                )
            )
            path = f" [logprobs: {r['logprobs']}]" if r.get("logprobs") else ""
            log(f"[run] round {k} {w.name:10s} {side:8s} {status}{path}{warn}")

    # 4. Report.
    summary = report.summarize(runs, [w.name for w in works])
    mfu.annotate(runs, summary, measured)
    if baseline:
        report.annotate_baseline(summary, measured)
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
            "steps_of": a.steps_of,
            "threads": a.threads,
            "smoke": a.smoke,
            "with_trl": a.with_trl,
            "logprobs": a.logprobs,
            "bf16_precision": a.bf16_precision,
            "machine": machine(),
            "proximal": _versions_here(),
            "anchors": anchor_versions,
            "skipped": skipped,
            "works": {w.name: {**w.__dict__, "model": assets[w.name]["model"]} for w in works},
            "mfu": measured,
            **({"baseline": baseline} if baseline else {}),
        },
        "summary": summary,
        "runs": runs,
    }
    report.write(a.results, data, NOTES)
    log(f"[done] {a.results} and {a.results.with_suffix('.json')}")
    for w, s in summary.items():
        log(
            f"  {w:10s} step ratio {_s(s['ratio_median_step_s'])}  process ratio {_s(s['ratio_wall_s'])}  "
            f"RSS ratio {_s(s['ratio_peak_rss_mib'])}   (proximal {_s(s['proximal_median_step_s'])} s/step"
            + (
                f" at MFU {100 * s['proximal_median_mfu']:.2g} %"
                if s.get("proximal_median_mfu") and s.get("proximal_mfu_probe") is None
                else ""
            )
            + ", "
            f"TRL {_s(s['anchor_median_step_s'])} s/step)"
            + (
                f"  MFU on the probed peak: proximal {100 * s['proximal_mfu_probe']:.1f} %"
                if s.get("proximal_mfu_probe") is not None
                else ""
            )
            + (
                f", TRL {100 * s['anchor_mfu_probe']:.1f} %"
                if s.get("anchor_mfu_probe") is not None
                else ""
            )
        )
        if baseline:
            log(
                f"  {'':10s} baseline {baseline['commit']}: {_s(s['baseline_median_step_s'])} s/step, "
                f"ratio to TRL {_s(s['baseline_ratio_median_step_s'])}, new/baseline "
                f"{_s(s['new_over_baseline_median_step_s'])}"
            )
    failed = sum(s["failed_runs"] for s in summary.values())
    return 1 if failed else 0


def _s(x) -> str:
    return "—" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    sys.exit(main())
