"""The demo's report: a Markdown page, PNG plots and ``report.json``, all read back from the run files.

Nothing here trains or samples. :func:`write_report` reads what the demo's stages wrote —
``task/task.json``, ``sft/metrics.jsonl``, ``rm/metrics.jsonl``, ``ppo*/metrics.jsonl`` and
``ppo*/config.yaml``, each run's ``models.json`` and the alternatives' ``config.yaml``, ``eval.json``,
``demo.json`` — and turns it into ``report.md`` with its plots
under ``plots/``. Every number printed in the report is also in ``report.json``, copied (never
recomputed) from those files, so a test can check that the two agree.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from proximal.logging import read_metrics
from proximal.tasks.digits import answer

GOLD = "score/proximal.tasks.digits:gold_score"
PROXY = "score/reward_model"
RUN_LABELS = {"ppo": "PPO", "ppo_overopt": "PPO over-optimised"}
ALTERNATIVES = ("dpo", "simpo", "grpo", "rloo")
POLICIES = ("sft", "ppo", "ppo_overopt", *ALTERNATIVES)
TABLE_COLUMNS = (
    ("gold", "gold score ↑"),
    ("proxy", "proxy reward (RM)"),
    ("kl", "KL to reference"),
    ("length", "length (tokens)"),
    ("eos", "EOS rate"),
)
#: Columns read from each run's own files: the models it held (models.json) and its stage's wall time.
RUN_COLUMNS = ("models held", "stage time (s)")
#: The arithmetic reasoning task's policies (``<out>/arithmetic/``) and held-out columns.
ARITHMETIC_POLICIES = ("sft", "ppo", "grpo", "rloo")
ARITHMETIC_COLUMNS = (
    ("exact_match", "exact match ↑"),
    ("format_error", "format errors"),
    ("kl", "KL to reference"),
    ("length", "length (tokens)"),
)


#: The calculator tool task's policies (``<out>/calculator/``): with the tool, then the no-tool
#: baseline; its held-out columns (trajectories' tool columns are 0 for the no-tool policies).
CALCULATOR_POLICIES = ("sft", "ppo", "grpo", "rloo", "sft_notool", "grpo_notool")
CALCULATOR_COLUMNS = (
    ("exact_match", "exact match ↑"),
    ("format_error", "format errors"),
    ("tool_calls", "tool calls / trajectory"),
    ("tool_errors", "tool errors / trajectory"),
    ("kl", "KL to its SFT model"),
    ("length", "policy tokens"),
)


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _beta_label(cfg: dict) -> str:
    kl = cfg["kl"]
    if kl["controller"] == "fixed":
        return f"β = {kl['beta']:g}"
    return f"{kl['controller']} β from {kl['beta']:g}, target KL {kl['target']:g}"


def _method_label(name: str, cfg: dict) -> str:
    if name == "dpo":
        return f"DPO, β = {cfg['dpo']['beta']:g}"
    if name == "simpo":
        return f"SimPO, β = {cfg['simpo']['beta']:g}, γ/β = {cfg['simpo']['gamma_beta_ratio']:g}"
    g = cfg["grpo"]
    kind = "RLOO" if g["advantage"] == "rloo" else "GRPO"
    return f"{kind} ({g['loss']} loss, β = {g['beta']:g}), exact-sort verifier"


def collect_arithmetic(out: Path, timings: dict) -> dict | None:
    """The arithmetic task's numbers, read from ``out/arithmetic`` (None when the demo has none)."""
    a = out / "arithmetic"
    if not (a / "eval.json").is_file():
        return None
    task = json.loads((a / "task" / "task.json").read_text())
    evaluation = json.loads((a / "eval.json").read_text())
    labels = {"sft": "SFT (the reference)"}
    for name in ARITHMETIC_POLICIES[1:]:
        cfg = yaml.safe_load((a / name / "config.yaml").read_text())
        if name == "ppo":
            labels[name] = f"PPO, {_beta_label(cfg)}, answer verifier"
        else:
            labels[name] = _method_label(name, cfg).replace("exact-sort", "answer")
    return {
        "labels": labels,
        "heldout": {p: evaluation[p]["mean"] for p in ARITHMETIC_POLICIES},
        "heldout_responses": evaluation["sft"]["n"],
        "models_held": {
            p: len(json.loads((a / p / "models.json").read_text())) for p in ARITHMETIC_POLICIES
        },
        "timings_s": {p: timings.get(f"arithmetic/{p}") for p in ARITHMETIC_POLICIES},
        "teacher_exact_match_eval": task["teacher_exact_match_eval"],
        "teacher_format_errors_train": task["teacher_format_errors_train"],
        "sizes": task["sizes"],
    }


def collect(out_dir: str | Path) -> dict:
    """Every number the report shows, read from the demo's run files under ``out_dir``."""
    out = Path(out_dir)
    task = json.loads((out / "task" / "task.json").read_text())
    demo = json.loads((out / "demo.json").read_text())
    evaluation = json.loads((out / "eval.json").read_text())
    sft_rows = [r for r in read_metrics(out / "sft" / "metrics.jsonl") if "eval/loss" in r]
    rm_rows = [r for r in read_metrics(out / "rm" / "metrics.jsonl") if "eval/accuracy" in r]
    runs = {}
    for name in ("ppo", "ppo_overopt"):
        rows = read_metrics(out / name / "metrics.jsonl")
        cfg = yaml.safe_load((out / name / "config.yaml").read_text())
        runs[name] = {
            "label": f"{RUN_LABELS[name]}, {_beta_label(cfg)}",
            "config": f"configs/demo/{name}.yaml",
            "kl_controller": cfg["kl"]["controller"],
            "beta_initial": cfg["kl"]["beta"],
            "step": [r["step"] for r in rows],
            "proxy": [r[PROXY] for r in rows],
            "gold": [r[GOLD] for r in rows],
            "kl": [r["kl/seq_mean"] for r in rows],
            "beta": [r["kl/beta"] for r in rows],
            "length": [r["response/length_mean"] for r in rows],
            "eos": [r["response/eos_frac"] for r in rows],
        }
    alternatives = {}
    for name in ALTERNATIVES:
        cfg = yaml.safe_load((out / name / "config.yaml").read_text())
        alternatives[name] = {
            "label": _method_label(name, cfg),
            "config": f"configs/demo/{name}.yaml",
            "steps": cfg["train"]["steps"],
        }
    models = {p: len(json.loads((out / p / "models.json").read_text())) for p in POLICIES}
    heldout = {p: evaluation[p]["mean"] for p in POLICIES}
    window = max(1, min(10, len(runs["ppo_overopt"]["step"]) // 5))
    o = runs["ppo_overopt"]
    gold_s, proxy_s, kl_s = (moving_average(o[k], window) for k in ("gold", "proxy", "kl"))
    peak = max(range(len(gold_s)), key=gold_s.__getitem__)
    return {
        "seed": demo["seed"],
        "quick": demo["quick"],
        "timings_s": demo["timings_s"],
        "task": {
            k: task[k]
            for k in (
                "teacher_gold_eval",
                "label_tau",
                "label_gold_agreement_train",
                "label_gold_agreement_eval",
                "sizes",
                "model",
            )
        },
        "sft": {
            "eval_loss_start": sft_rows[0]["eval/loss"],
            "eval_loss_end": sft_rows[-1]["eval/loss"],
        },
        "rm": {
            "eval_accuracy": rm_rows[-1]["eval/accuracy"],
            "eval_step": rm_rows[-1]["step"],
            "eval_reward_gap": rm_rows[-1]["eval/reward_gap"],
            "gold_agreement": evaluation["rm_gold_agreement"],
        },
        "heldout": heldout,
        "heldout_samples_per_prompt": evaluation["sft"]["samples_per_prompt"],
        "heldout_responses": evaluation["sft"]["n"],
        "gold_gain": heldout["ppo"]["gold"] - heldout["sft"]["gold"],
        "models_held": models,
        "runs": runs,
        "alternatives": alternatives,
        "arithmetic": collect_arithmetic(out, demo["timings_s"]),
        "calculator": collect_calculator(out, demo["timings_s"]),
        "overopt": {
            "window": window,
            "gold_peak": gold_s[peak],
            "gold_peak_step": o["step"][peak],
            "proxy_at_peak": proxy_s[peak],
            "kl_at_peak": kl_s[peak],
            "gold_final": gold_s[-1],
            "proxy_final": proxy_s[-1],
            "kl_final": kl_s[-1],
        },
    }


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

COLORS = {"ppo": "tab:blue", "ppo_overopt": "tab:red"}


def plot_training(r: dict, path: Path) -> None:
    """Per PPO step: proxy reward, gold score, KL to the reference and β, both runs."""
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib.pyplot as plt

    w = r["overopt"]["window"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = (
        ("proxy", "proxy reward r_ψ (reward model)"),
        ("gold", "gold score (never trained on)"),
        ("kl", "KL to reference (nats / response)"),
        ("beta", "β (KL coefficient)"),
    )
    for ax, (key, title) in zip(axes.flat, panels):
        for name, run in r["runs"].items():
            ax.plot(run["step"], run[key], color=COLORS[name], alpha=0.25, linewidth=1)
            ax.plot(
                run["step"],
                moving_average(run[key], w),
                color=COLORS[name],
                linewidth=2,
                label=run["label"],
            )
        if key == "gold":
            ax.axhline(
                r["heldout"]["sft"]["gold"], color="gray", linestyle=":", label="SFT (held-out)"
            )
        if key == "beta":
            ax.set_yscale("log")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("PPO step")
    axes[0, 1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"PPO training batches (thin: per step; thick: mean of the last {w} steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_overoptimisation(r: dict, path: Path) -> None:
    """The tiny-β run: proxy and gold per step, and gold against KL for both runs (Gao et al. 2022)."""
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib.pyplot as plt

    w = r["overopt"]["window"]
    o = r["runs"]["ppo_overopt"]
    fig, (ax1, ax3) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(
        o["step"],
        moving_average(o["proxy"], w),
        color="tab:red",
        linewidth=2,
        label="proxy (reward model)",
    )
    ax1.set_xlabel("PPO step")
    ax1.set_ylabel("proxy reward", color="tab:red")
    ax2 = ax1.twinx()
    ax2.plot(
        o["step"], moving_average(o["gold"], w), color="black", linewidth=2, label="gold score"
    )
    ax2.axhline(
        r["heldout"]["sft"]["gold"], color="gray", linestyle=":", label="SFT gold (held-out)"
    )
    ax2.axvline(r["overopt"]["gold_peak_step"], color="gray", linestyle="--", linewidth=1)
    ax2.set_ylabel("gold score")
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(lines, [ln.get_label() for ln in lines], loc="lower right", fontsize=8)
    ax1.set_title(
        f"{o['label']}: proxy keeps rising, gold peaks at step {r['overopt']['gold_peak_step']}"
    )
    ax1.grid(alpha=0.3)
    for name, run in r["runs"].items():
        ax3.plot(
            moving_average(run["kl"], w),
            moving_average(run["gold"], w),
            color=COLORS[name],
            linewidth=2,
            label=run["label"],
        )
    ax3.axhline(
        r["heldout"]["sft"]["gold"], color="gray", linestyle=":", label="SFT gold (held-out)"
    )
    ax3.set_xlabel("KL to reference (nats / response)")
    ax3.set_ylabel("gold score")
    ax3.set_title("gold against distance from the SFT model")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


METHOD_COLORS = {
    "sft": "gray",
    "ppo": "tab:blue",
    "ppo_overopt": "tab:red",
    "dpo": "tab:green",
    "simpo": "tab:olive",
    "grpo": "tab:purple",
    "rloo": "tab:orange",
}


def plot_methods(r: dict, path: Path) -> None:
    """Every policy on held-out prompts: gold against KL to the SFT model, and against training time."""
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib

    matplotlib.use("Agg")
    # lazy: matplotlib loads only when a figure is drawn
    import matplotlib.pyplot as plt

    labels = _policy_labels(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True)
    for ax, (x_key, x_label) in zip(
        axes,
        (
            ("kl", "KL to the SFT model (nats / response, held-out)"),
            ("time", "stage wall time (s)"),
        ),
    ):
        for name in POLICIES:
            x = r["heldout"][name]["kl"] if x_key == "kl" else r["timings_s"][name]
            ax.scatter(
                [x],
                [r["heldout"][name]["gold"]],
                s=60,
                color=METHOD_COLORS[name],
                label=labels[name],
                zorder=3,
            )
        ax.axhline(r["heldout"]["sft"]["gold"], color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gold score (held-out)")
    axes[0].set_title("gold against distance from the SFT model")
    axes[1].set_title("gold against training time")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


def _policy_labels(r: dict) -> dict[str, str]:
    return {
        "sft": "SFT (the reference)",
        **{n: run["label"] for n, run in r["runs"].items()},
        **{n: a["label"] for n, a in r["alternatives"].items()},
    }


def collect_calculator(out: Path, timings: dict) -> dict | None:
    """The calculator tool task's numbers, read from ``out/calculator`` (None when the demo has none)."""
    c = out / "calculator"
    if not (c / "eval.json").is_file():
        return None
    task = json.loads((c / "task" / "task.json").read_text())
    evaluation = json.loads((c / "eval.json").read_text())
    labels = {"sft": "SFT, with the tool (the reference)", "sft_notool": "SFT, no tool"}
    for name in ("ppo", "grpo", "rloo", "grpo_notool"):
        cfg = yaml.safe_load((c / name / "config.yaml").read_text())
        if name == "ppo":
            label = f"PPO, {_beta_label(cfg)}, critic across turns"
        else:
            label = _method_label(name, cfg).split(", exact-sort")[0]
        labels[name] = label + (", no tool" if name.endswith("_notool") else ", with the tool")
    heldout = {}
    for p in CALCULATOR_POLICIES:
        mean = dict(evaluation[p]["mean"])
        for key in ("tool_calls", "tool_errors", "malformed_calls", "turns"):
            mean.setdefault(key, 0.0 if key != "turns" else 1.0)  # a no-tool response: one turn
        heldout[p] = mean
    return {
        "labels": labels,
        "heldout": heldout,
        "heldout_responses": evaluation["sft"]["n"],
        "models_held": {
            p: len(json.loads((c / p / "models.json").read_text()))
            for p in CALCULATOR_POLICIES
            if (c / p / "models.json").is_file()
        },
        "timings_s": {p: timings.get(f"calculator/{p}") for p in CALCULATOR_POLICIES},
        "teacher_exact_match_eval": task["teacher_exact_match_eval"],
        "teacher_tool_use_eval": task["teacher_tool_use_eval"],
        "sizes": task["sizes"],
    }


def results_table(r: dict) -> list[list[str]]:
    """Rows of the held-out table: header, then one row per policy; held-out means as ``f"{x:.3f}"``,
    then the models the run held and its stage's wall time."""
    rows = [["policy"] + [title for _, title in TABLE_COLUMNS] + list(RUN_COLUMNS)]
    for name, label in _policy_labels(r).items():
        rows.append(
            [label]
            + [f"{r['heldout'][name][key]:.3f}" for key, _ in TABLE_COLUMNS]
            + [str(r["models_held"][name]), f"{r['timings_s'][name]:.0f}"]
        )
    return rows


def arithmetic_table(r: dict) -> list[list[str]]:
    """Rows of the arithmetic task's held-out table (header first), as :func:`results_table`'s."""
    a = r["arithmetic"]
    rows = [["policy"] + [title for _, title in ARITHMETIC_COLUMNS] + list(RUN_COLUMNS)]
    for name in ARITHMETIC_POLICIES:
        t = a["timings_s"].get(name)
        rows.append(
            [a["labels"][name]]
            + [f"{a['heldout'][name][key]:.3f}" for key, _ in ARITHMETIC_COLUMNS]
            + [str(a["models_held"][name]), "—" if t is None else f"{t:.0f}"]
        )
    return rows


def calculator_table(r: dict) -> list[list[str]]:
    """Rows of the calculator task's held-out table (header first): held-out means, then the
    stage's wall time."""
    c = r["calculator"]
    rows = [["policy"] + [title for _, title in CALCULATOR_COLUMNS] + ["stage time (s)"]]
    for name in CALCULATOR_POLICIES:
        t = c["timings_s"].get(name)
        rows.append(
            [c["labels"][name]]
            + [f"{c['heldout'][name][key]:.3f}" for key, _ in CALCULATOR_COLUMNS]
            + ["—" if t is None else f"{t:.0f}"]
        )
    return rows


def _markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "| :--- " + "| ---: " * (len(rows[0]) - 1) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def terminal_summary(r: dict) -> str:
    rows = results_table(r)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def fmt(row):
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    lines = [
        f"Held-out prompts ({r['heldout_responses']} sampled responses per policy):",
        fmt(rows[0]),
        fmt(["-" * w for w in widths]),
    ] + [fmt(row) for row in rows[1:]]
    lines.append(
        f"PPO gold - SFT gold = {r['gold_gain']:+.3f}; reward model held-out accuracy "
        f"{r['rm']['eval_accuracy']:.3f}; demo wall time {r['timings_s']['total']:.0f} s"
    )
    if r.get("arithmetic"):
        rows = arithmetic_table(r)
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += [
            "",
            f"Arithmetic task, held-out prompts ({r['arithmetic']['heldout_responses']} responses "
            "per policy):",
            fmt(rows[0]),
            fmt(["-" * w for w in widths]),
        ] + [fmt(row) for row in rows[1:]]
    if r.get("calculator"):
        rows = calculator_table(r)
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines += [
            "",
            f"Calculator tool task, held-out prompts ({r['calculator']['heldout_responses']} "
            "trajectories per policy):",
            fmt(rows[0]),
            fmt(["-" * w for w in widths]),
        ] + [fmt(row) for row in rows[1:]]
    lines.append(f"Report: {r['report']}")
    return "\n".join(lines)


def _samples(out: Path, n: int = 8) -> list[list[str]]:
    evaluation = json.loads((out / "eval.json").read_text())
    spp = evaluation["sft"]["samples_per_prompt"]
    rows = []
    for i in range(0, min(n * spp, evaluation["sft"]["n"]), spp):
        cells = [
            f"`{evaluation['sft']['rows'][i]['prompt']}`",
            f"`{answer(evaluation['sft']['rows'][i]['prompt'])}`",
        ]
        for p in POLICIES:
            row = evaluation[p]["rows"][i]
            cells.append(f"`{row['response'] or '∅'}` {row['gold']:.2f} / {row['proxy']:+.2f}")
        rows.append(cells)
    return rows


def render_markdown(r: dict, out: Path) -> str:
    o, rm, t = r["overopt"], r["rm"], r["timings_s"]
    labels = _policy_labels(r)
    quick_note = (
        "\n> **Quick demo** (`--quick`): a fraction of the data and steps, to check the plumbing. "
        "Its numbers say nothing about RLHF; run `proximal demo` for those.\n"
        if r["quick"]
        else ""
    )
    sample_rows = [["prompt", "right answer"] + [labels[p] for p in POLICIES]] + _samples(out)
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in t.items() if k != "total")
    alternatives_line = ", ".join(
        f"{labels[n].split(',')[0].split(' (')[0]} {r['heldout'][n]['gold']:.3f}"
        for n in ("ppo", *ALTERNATIVES)
    )
    tasks = _arithmetic_markdown(r) + _calculator_markdown(r)  # sections 6 and 7, when run
    return f"""# proximal demo report
{quick_note}
The whole of RLHF on the built-in digit-sorting task: SFT on a sloppy teacher's demonstrations, a
Bradley–Terry reward model on noisy preference labels, then PPO against that reward model. The
**gold score** (fraction of digits in the right place, 0–1) is what we actually want; no stage
trains on it. docs/demo.md explains every part of this page.

Seed {r["seed"]}; wall time {t["total"]:.0f} s ({timing}).

## 1. Every policy on held-out prompts

{r["heldout_responses"]} responses per policy ({r["heldout_samples_per_prompt"]} per held-out prompt), sampled at
temperature 1 as in training. KL is Σ over the response of the exact per-token KL(π ‖ π_ref), π_ref the
SFT model. "models held" counts the models the run kept in memory (its `models.json`); the stage
time is the stage's wall time, loading included.

{_markdown_table(results_table(r))}

**PPO raised the gold score by {r["gold_gain"]:+.3f}** over SFT (from {r["heldout"]["sft"]["gold"]:.3f} to
{r["heldout"]["ppo"]["gold"]:.3f}) at a KL of {r["heldout"]["ppo"]["kl"]:.3f} nats from the reference. The
sloppy teacher's own gold score is {r["task"]["teacher_gold_eval"]:.3f}; a perfect sorter scores 1.

The alternatives start from the same SFT model. **DPO** and **SimPO** never sample: they train on
the same noisy preference pairs the reward model was fitted to (DPO against the frozen SFT model,
SimPO with no reference at all); **GRPO** and **RLOO** sample G responses per prompt and learn from
the task's exact-sort verifier (1 for a perfect sort, else 0), with no critic and no reward model.
Held-out gold: {alternatives_line}. One seed, one budget per method as its config
sets it — for a measured comparison over seeds and matched budgets, run `proximal compare`
(docs/compare.md).

![Every method: gold against KL and against time](plots/methods.png)

## 2. The reward model

Held-out accuracy **{rm["eval_accuracy"]:.3f}** (step {rm["eval_step"]}; mean reward gap
{rm["eval_reward_gap"]:.3f}) against the noisy labels. The labels themselves agree with gold on
{r["task"]["label_gold_agreement_eval"]:.3f} of these pairs (Bradley–Terry labeller, τ = {r["task"]["label_tau"]:g}),
and the reward model orders {rm["gold_agreement"]:.3f} of them as gold does. SFT held-out loss went
from {r["sft"]["eval_loss_start"]:.3f} to {r["sft"]["eval_loss_end"]:.3f}.

## 3. PPO, step by step

![PPO training curves](plots/ppo_training.png)

Proxy reward, gold score, KL to the reference and β for each PPO step (training batches; thick
lines are the mean of the last {o["window"]} steps).

## 4. Over-optimisation

![Over-optimisation](plots/overoptimisation.png)

With {r["runs"]["ppo_overopt"]["label"].split(", ", 1)[1]} the policy is nearly free to leave the SFT model. Gold
(mean of {o["window"]} steps) peaks at **{o["gold_peak"]:.3f}** at step {o["gold_peak_step"]} (proxy
{o["proxy_at_peak"]:.3f}, KL {o["kl_at_peak"]:.3f}) and ends at **{o["gold_final"]:.3f}**, while the proxy
goes on to **{o["proxy_final"]:.3f}** at KL {o["kl_final"]:.3f}: the policy is finding what the reward model
overrates, not what is good. On held-out prompts this policy scores gold
{r["heldout"]["ppo_overopt"]["gold"]:.3f} against the sane run's {r["heldout"]["ppo"]["gold"]:.3f}, with
proxy {r["heldout"]["ppo_overopt"]["proxy"]:.3f} against {r["heldout"]["ppo"]["proxy"]:.3f}.

## 5. Samples, before and after

The first sample for the first held-out prompts; each cell is `response` gold / proxy.

{_markdown_table(sample_rows)}

{tasks}Files: `task/` (data, tokenizer, base model), `sft/`, `rm/` (checkpoints and metrics.jsonl),
`ppo/`, `ppo_overopt/`, `grpo/`, `rloo/` (metrics.jsonl, samples.jsonl, checkpoints/), `dpo/`, `simpo/`
(the policy, metrics.jsonl, checkpoints/), `eval.json` (every held-out response), `report.json` (every
number above).
"""


def _arithmetic_markdown(r: dict) -> str:
    a = r.get("arithmetic")
    if not a:
        return ""
    h = a["heldout"]
    gains = ", ".join(  # the method's name, without its label's settings "(grpo loss, β = …)"
        f"{a['labels'][n].split(',')[0].split(' (')[0]} "
        f"{h[n]['exact_match'] - h['sft']['exact_match']:+.3f}"
        for n in ARITHMETIC_POLICIES[1:]
    )
    return f"""## 6. A reasoning task: multi-step arithmetic with reference answers

Prompts such as `(7+5)*3=` carry their reference answer in an `answer` column; the right response works
it out and ends `answer: 36`. The SFT model learned from a sloppy teacher (right {a["teacher_exact_match_eval"]:.3f}
of the time; {a["teacher_format_errors_train"]:.3f} of its answers malformed); PPO (critic from the policy,
no reward model), GRPO and RLOO start from it and are rewarded by the verifier — 1 when the final
`answer: N` equals the row's reference, else 0, a malformed answer 0 and counted. Held-out: exact match
against the expression's own value (the gold score), the share of responses with no readable answer,
the exact KL to the SFT model and the length, {a["heldout_responses"]} responses per policy.

{_markdown_table(arithmetic_table(r))}

Exact match over SFT: {gains}.

"""


def _calculator_markdown(r: dict) -> str:
    c = r.get("calculator")
    if not c:
        return ""
    h = c["heldout"]
    gains = ", ".join(
        f"{n.upper()} {h[n]['exact_match'] - h['sft']['exact_match']:+.3f}"
        for n in ("ppo", "grpo", "rloo")
    )
    return f"""## 7. A tool task: multiplying with a calculator

Prompts such as `123*456=` carry their reference in an `answer` column. A tiny model cannot multiply
three-digit numbers in its head; with the `calculator` tool it writes `[calculator 123*456]`, reads the
result `{{56088}}` appended after its turn, and answers `answer: 56088`. The SFT model learned from a
sloppy teacher's conversations (right {c["teacher_exact_match_eval"]:.3f} of the time; it used the tool
in {c["teacher_tool_use_eval"]:.3f} of them); PPO (critic across turns: GAE over the policy's own
tokens, carried across each tool result), GRPO and RLOO start from it with the tool and are rewarded by
the verifier on the whole trajectory. The no-tool baseline learned the same teacher's answers alone and
is trained by GRPO without the tool. Held-out: exact match (gold), format errors, tool calls and tool
errors per trajectory, the exact KL to the row's SFT model and the policy's own tokens (tool results
not counted), {c["heldout_responses"]} trajectories per policy.

{_markdown_table(calculator_table(r))}

Exact match over the tool SFT model: {gains}; with the tool against without (GRPO):
{h["grpo"]["exact_match"]:.3f} against {h["grpo_notool"]["exact_match"]:.3f}.

"""


def write_report(out_dir: str | Path) -> dict:
    """Write ``report.md``, ``plots/*.png`` and ``report.json`` under ``out_dir``; return report.json's contents."""
    out = Path(out_dir)
    r = collect(out)
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    plot_training(r, plots / "ppo_training.png")
    plot_overoptimisation(r, plots / "overoptimisation.png")
    plot_methods(r, plots / "methods.png")
    r["report"] = str(out / "report.md")
    r["plots"] = [
        str(plots / n) for n in ("ppo_training.png", "overoptimisation.png", "methods.png")
    ]
    (out / "report.md").write_text(render_markdown(r, out))
    (out / "report.json").write_text(json.dumps(r, indent=1) + "\n")
    return r
