"""``proximal demo``: the whole of RLHF offline on a CPU — SFT → reward model → PPO — with a report.

The task is the built-in digit-sorting task (:mod:`proximal.tasks.digits`), whose gold score is known
exactly, so the report can show what RLHF's own numbers cannot: whether the policy got *better*, or
only better at pleasing the reward model. Five stages, each printed as it runs:

1. **task** — write the data, the character tokenizer and a random tiny llama (``<out>/task``);
2. **sft** — fine-tune it on a sloppy teacher's demonstrations (``proximal sft``, ``configs/demo/sft.yaml``);
3. **rm** — fit a Bradley–Terry reward model to noisy preference labels, starting from the SFT model
   (``proximal rm``, ``configs/demo/rm.yaml``);
4. **ppo** — PPO with a sane β, critic initialised from the reward model (``configs/demo/ppo.yaml``),
   and the same run with a tiny β (``configs/demo/ppo_overopt.yaml``) to show over-optimisation;
5. **eval + report** — sample the SFT and PPO policies on held-out prompts, score them with the
   gold score, the reward model and the KL to the reference, and write ``<out>/report.md`` with plots.

Every trainer is the one the ``sft``, ``rm`` and ``ppo`` commands run, loaded from the YAML files
with the paths filled in as ``--section.key value`` overrides; the demo prints each stage's
equivalent command line. ``--quick`` shrinks data and steps for CI (about a minute or two).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

#: The demo's YAML configs, shipped inside the package (so a plain ``pip install`` runs the demo).
DEFAULT_CONFIGS = Path(__file__).resolve().parent / "configs" / "demo"
GOLD_FN = "proximal.tasks.digits:gold_score"
RUNS = ("ppo", "ppo_overopt")


@dataclass(frozen=True)
class Plan:
    """Sizes of one demo: the task's data and the overrides applied on top of the YAML configs."""
    task: dict
    sft: dict
    rm: dict
    ppo: dict
    ppo_overopt: dict
    eval_samples_per_prompt: int


FULL = Plan(task={}, sft={}, rm={}, ppo={}, ppo_overopt={}, eval_samples_per_prompt=4)

#: The CI-sized demo: every stage and artifact, a fraction of the data and steps. Its numbers show the
#: plumbing works, not that RLHF does (for that, run the full demo).
QUICK = Plan(
    task=dict(n_sft_train=1024, n_sft_eval=64, n_prefs_train=1024, n_prefs_eval=128, n_prompts_train=256,
              n_prompts_eval=64),
    sft={"train.steps": 150, "optim.warmup_steps": 10, "train.eval_every": 50},
    rm={"train.steps": 100, "optim.warmup_steps": 10, "train.eval_every": 50},
    ppo={"train.steps": 12},
    ppo_overopt={"train.steps": 12},
    eval_samples_per_prompt=1,
)


# ----------------------------------------------------------------------------------------------
# The pipeline
# ----------------------------------------------------------------------------------------------

def run_demo(out_dir: str | Path = "demo_out", quick: bool = False, seed: int = 0, *,
             configs: str | Path | None = None, echo: Callable[[str], None] = print) -> dict:
    """Run every stage into ``out_dir`` and write the report; return the report's numbers.

    The returned dict is ``report.json`` (:func:`proximal.report.collect`): held-out means per policy
    (``heldout``), the reward model's held-out accuracy (``rm``), the per-step PPO curves (``runs``),
    the over-optimisation summary (``overopt``), timings and the paths of the report and its plots.
    Raises ConfigError for a bad config file, DataError / ModelLoadError for bad inputs.
    """
    from proximal import report
    from proximal.tasks.digits import make_task_data
    from proximal.trainers import ppo, reward, sft

    out = Path(out_dir)
    configs = Path(configs) if configs is not None else DEFAULT_CONFIGS
    missing = [n for n in ("sft.yaml", "rm.yaml", "ppo.yaml", "ppo_overopt.yaml") if not (configs / n).is_file()]
    if missing:
        raise FileNotFoundError(f"demo configs: {', '.join(missing)} not found in {configs}; pass --configs DIR "
                                f"(a copy of {DEFAULT_CONFIGS})")
    plan = QUICK if quick else FULL
    out.mkdir(parents=True, exist_ok=True)
    task = out / "task"
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    def stage(n: int, name: str, what: str) -> float:
        echo(f"\n[{n}/6] {name}: {what}")
        return time.perf_counter()

    def done(name: str, t0: float, summary: str) -> None:
        timings[name] = time.perf_counter() - t0
        echo(f"      {summary}  ({timings[name]:.0f} s)")

    # 1. Task data, tokenizer, random base model.
    t0 = stage(1, "task", f"digit-sorting data, tokenizer and a random tiny llama -> {task}")
    info = make_task_data(task, seed, **plan.task)
    done("task", t0, f"teacher gold {info['teacher_gold_eval']:.3f}; labeller agrees with gold on "
                     f"{info['label_gold_agreement_train']:.1%} of training pairs")
    # Every config is loaded and validated now, so a mistake in any YAML stops the demo before training.
    cfgs = stage_configs(configs, out, seed, plan)

    def run_stage(n: int, name: str, what: str, train) -> None:
        cfg, command = cfgs[name]
        t0 = stage(n, name, what)
        echo(f"      same as: {command}")
        train(cfg)
        rows = _metrics(out / name)
        if name == "sft":
            loss = [r["eval/loss"] for r in rows if "eval/loss" in r]
            summary = f"held-out loss {loss[0]:.3f} -> {loss[-1]:.3f}"
        elif name == "rm":
            acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
            summary = (f"held-out accuracy {acc[-1]:.3f} (the labels agree with gold on "
                       f"{info['label_gold_agreement_eval']:.1%} of these pairs)")
        else:
            last = rows[-1]
            summary = (f"last step: proxy {last['score/reward_model']:.3f}, gold {last['score/' + GOLD_FN]:.3f}, "
                       f"KL {last['kl/seq_mean']:.3f}")
        done(name, t0, summary)

    # 2. SFT on the teacher's demonstrations.
    run_stage(2, "sft", "supervised fine-tuning on the sloppy teacher's demonstrations", sft.train)
    # 3. Reward model from the SFT model, on the noisy preference pairs.
    run_stage(3, "rm", "Bradley-Terry reward model on the noisy labeller's preference pairs", reward.train)
    # 4-5. PPO twice: a sane beta, and a tiny one. The gold score rides along with weight 0.
    run_stage(4, "ppo", "PPO with a sane beta (critic initialised from the reward model)", ppo.train)
    run_stage(5, "ppo_overopt", "PPO with a tiny beta: over-optimising the proxy", ppo.train)

    # 6. Held-out evaluation of the SFT and both PPO policies, with one shared sampling seed; the report.
    t0 = stage(6, "eval + report", f"sampling {plan.eval_samples_per_prompt} response(s) per held-out prompt "
                                   "from each policy; writing the report")
    max_new = cfgs["ppo"][0].rollout.max_new_tokens
    policies = {"sft": out / "sft", **{name: final_policy(out / name) for name in RUNS}}
    evaluation = {name: evaluate_policy(path, reference=out / "sft", reward_model=out / "rm",
                                        prompts_file=task / "prompts_eval.jsonl",
                                        samples_per_prompt=plan.eval_samples_per_prompt,
                                        max_new_tokens=max_new, seed=seed)
                  for name, path in policies.items()}
    evaluation["rm_gold_agreement"] = reward_model_gold_agreement(out / "rm", task / "prefs_eval.jsonl")
    (out / "eval.json").write_text(json.dumps(evaluation, indent=1) + "\n")
    timings["eval"] = time.perf_counter() - t0
    timings["total"] = time.perf_counter() - t_start
    (out / "demo.json").write_text(json.dumps({"seed": seed, "quick": quick, "configs": str(configs),
                                               "timings_s": timings}, indent=1) + "\n")
    results = report.write_report(out)
    echo(f"      done  ({time.perf_counter() - t0:.0f} s)")
    echo("\n" + report.terminal_summary(results))
    return results


def stage_configs(configs: Path, out: Path, seed: int, plan: Plan) -> dict:
    """``{stage: (config, equivalent command line)}``: each YAML file with paths, seed and ``plan`` filled in.

    All four are loaded (and validated) together; ConfigError lists what is wrong.
    """
    from proximal.config import ConfigError, load_config
    from proximal.trainers import ppo, reward, sft

    task = out / "task"
    stages = {
        "sft": (sft.SFTConfig, {"model.path": task / "base_model", "data.train_file": task / "sft_train.jsonl",
                                "data.eval_file": task / "sft_eval.jsonl", "output.dir": out / "sft",
                                "train.seed": seed}),
        "rm": (reward.RMConfig, {"model.path": out / "sft", "data.train_file": task / "prefs_train.jsonl",
                                 "data.eval_file": task / "prefs_eval.jsonl", "output.dir": out / "rm",
                                 "train.seed": seed}),
        **{name: (ppo.PPOConfig, {"model.path": out / "sft", "model.reward_model": out / "rm",
                                  "data.prompts": task / "prompts_train.jsonl", "output.dir": out / name,
                                  "train.seed": seed}) for name in RUNS},
    }
    result, errors = {}, []
    for name, (cls, overrides) in stages.items():
        overrides = {k: str(v) for k, v in {**overrides, **getattr(plan, name)}.items()}
        path = configs / f"{name}.yaml"
        command = (f"proximal {'ppo' if name in RUNS else name} --config {path} "
                   + " ".join(f"--{k} {v}" for k, v in overrides.items()))
        try:
            cfg = load_config(cls, path, overrides)
        except ConfigError as e:
            errors.append(f"{path}: {e}")
            continue
        if name in RUNS and (cfg.model.reward_functions != [GOLD_FN] or cfg.model.reward_function_weights != [0.0]):
            errors.append(f"{path}: the demo logs the gold score without training on it; keep "
                          f"model.reward_functions: [{GOLD_FN}] and model.reward_function_weights: [0.0]")
        result[name] = (cfg, command)
    if errors:
        raise ConfigError("demo configs:\n" + "\n".join(errors))
    return result


def final_policy(run_dir: Path) -> Path:
    """The actor saved by a finished PPO run: ``run_dir/checkpoints/<latest>/policy``."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest; did the PPO run finish?")
    return root / pointer.read_text().strip() / "policy"


def _metrics(run_dir: Path) -> list[dict]:
    from proximal.logging import read_metrics

    return list(read_metrics(Path(run_dir) / "metrics.jsonl"))


# ----------------------------------------------------------------------------------------------
# Held-out evaluation
# ----------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate_policy(policy: str | Path, *, reference: str | Path, reward_model: str | Path, prompts_file: str | Path,
                    samples_per_prompt: int = 1, max_new_tokens: int = 12, seed: int = 0,
                    batch_size: int = 256) -> dict:
    """Sample ``policy`` on held-out prompts and measure what the report's table shows.

    Sampling is PPO's own (:func:`proximal.rollout.sampling.sample`, temperature 1), so the numbers
    describe the policy PPO optimised, not a greedy decode of it. Per response:

    * ``gold`` — :func:`proximal.tasks.digits.gold_score`, in [0, 1];
    * ``proxy`` — the reward model's score r_ψ(x, y), computed by PPO's :class:`~proximal.rollout.scoring.Scorer`;
    * ``kl`` — Σ_t KL(π(·|s_t) ‖ π_ref(·|s_t)) over the response's tokens, each term exact over the
      vocabulary (the states s_t are sampled). Its expectation is the sequence KL of the KL-regularised
      objective (Ziegler et al. 2019); PPO's
      ``kl/seq_mean`` estimates the same quantity with the sampled-token (k1) estimator;
    * ``length`` — response tokens including EOS (as PPO's ``response/length_mean``); ``eos`` — stopped before T.

    Returns the means under ``mean`` and every response under ``rows``.
    """
    from proximal.data.prompts import load_prompts
    from proximal.models.loading import freeze, load_causal_lm, load_sequence_scorer, load_tokenizer
    from proximal.data.collate import pad_left
    from proximal.rollout.engine import row_seed
    from proximal.rollout.sampling import response_logits, sample
    from proximal.rollout.scoring import Scorer
    from proximal.tasks.digits import gold_score

    tokenizer = load_tokenizer(str(policy), role="policy")
    actor = load_causal_lm(str(policy), role="policy")
    ref = load_causal_lm(str(reference), role="reference")
    rm_tokenizer = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
    rm = load_sequence_scorer(str(reward_model), pad_token_id=rm_tokenizer.pad_token_id)
    for m in (actor, ref, rm):
        freeze(m)
    scorer = Scorer(tokenizer, reward_model=rm, reward_tokenizer=rm_tokenizer, micro_batch_size=batch_size)
    prompts = load_prompts(str(prompts_file), tokenizer, max_length=64)
    order = [i for i in range(len(prompts)) for _ in range(samples_per_prompt)]

    rows = []
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        ids, mask = pad_left([prompts.token_ids[i] for i in idx], tokenizer.pad_token_id)
        seeds = [row_seed(seed, 0, j) for j in range(start, start + len(idx))]  # one generator per response
        r = sample(actor, tokenizer, ids, mask, seeds=seeds, max_new_tokens=max_new_tokens)
        texts = [prompts.texts[i] for i in idx]
        _, comp = scorer(r, texts)
        completions = scorer.completions(r)
        golds = gold_score(texts, completions)  # in Python floats, exactly as the task defines it
        logp = torch.log_softmax(response_logits(actor, r).float(), -1)
        logq = torch.log_softmax(response_logits(ref, r).float(), -1)
        kl_tok = (logp.exp() * (logp - logq)).sum(-1)                       # (B, T), exact per state
        kl = torch.where(r.response_mask, kl_tok, 0.0).sum(1)
        for j, completion in enumerate(completions):
            rows.append({"prompt": texts[j], "response": completion, "gold": golds[j],
                         "proxy": float(comp["reward_model"][j]), "kl": float(kl[j]),
                         "length": int(r.response_mask[j].sum()), "eos": bool(r.ended[j])})
    mean = {k: sum(float(row[k]) for row in rows) / len(rows) for k in ("gold", "proxy", "kl", "length", "eos")}
    return {"policy": str(policy), "n": len(rows), "samples_per_prompt": samples_per_prompt, "mean": mean,
            "rows": rows}


@torch.no_grad()
def reward_model_gold_agreement(reward_model: str | Path, pairs_file: str | Path) -> float:
    """How often the reward model orders a held-out pair as the gold score does (pairs whose gold differs).

    Pairs are loaded, batched and scored exactly as ``proximal rm`` evaluates them.
    """
    from proximal.data.jsonl import read_jsonl
    from proximal.data.preferences import collate_pairs, load_preference_pairs
    from proximal.models.loading import freeze, load_tokenizer
    from proximal.tasks.digits import gold
    from proximal.trainers.reward import load_reward_model, pair_scores

    tok = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
    rm, _ = load_reward_model(str(reward_model), "float32", tok)
    freeze(rm)
    pairs, _ = load_preference_pairs(pairs_file, tok, max_length=10_000)
    records = [r for _, r in read_jsonl(pairs_file)]
    r_w, r_l = pair_scores(rm, collate_pairs(pairs, tok.pad_token_id))
    agree = n = 0
    for rec, w, l in zip(records, r_w.tolist(), r_l.tolist()):
        g_w, g_l = gold(rec["prompt"], rec["chosen"]), gold(rec["prompt"], rec["rejected"])
        if g_w != g_l:
            n += 1
            agree += (w > l) == (g_w > g_l)
    return agree / n


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="proximal demo",
        description="The whole of RLHF offline on a CPU: task data -> SFT -> reward model -> PPO, then a report.",
        epilog="The report is <out>/report.md; docs/demo.md explains how to read it.")
    parser.add_argument("--out", default="demo_out", help="output directory (default: demo_out)")
    parser.add_argument("--quick", action="store_true", help="the shrunken CI demo: less data, fewer steps")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and every stage (default: 0)")
    parser.add_argument("--configs", default=None,
                        help=f"directory holding sft.yaml, rm.yaml, ppo.yaml, ppo_overopt.yaml (default: {DEFAULT_CONFIGS})")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice, one per core)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: must be at least 1")
        torch.set_num_threads(args.threads)
    from proximal.train.command import run_reporting

    code, _ = run_reporting("demo", lambda: run_demo(args.out, quick=args.quick, seed=args.seed, configs=args.configs))
    return code
