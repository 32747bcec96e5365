"""The report of ``proximal compare``: every number recomputed from the run directories.

Nothing here trusts a number held in memory by the comparison: :func:`collect_run` reads one run's
``models.json`` (the live modules' parameters, written by its trainer), ``metrics.jsonl`` (peak
memory, wall time, response lengths, optimiser steps), ``eval.json`` (the held-out evaluations along
the run) and ``compare_run.json`` (status, seed, budget); :func:`summarise` turns the runs into one
row per method and reward source, mean ± sample standard deviation over seeds; :func:`write_report`
writes ``compare.json``, ``compare.md`` and ``plots/``.

What each column measures (also in ``docs/compare.md``):

* **models resident, parameter bytes** — the models a run holds while it trains and their
  parameters' bytes, as its trainer counted them on the live modules (``models.json``);
* **peak memory** — the largest per-step allocator peak of the run (``memory/peak_bytes``: CUDA's
  ``max_memory_allocated``, on CPU the resident-set high-water mark reset before each step), over
  steps ≥ 2 so that the first step's one-off allocations do not count;
* **wall time** — training only (``time/wall_s`` of the last step: from the first step's start);
* **tokens generated** — online methods: Σ over steps of the mean response length × the responses
  sampled that step; offline methods generate none;
* **optimiser steps** — online methods: Σ of ``policy/optimizer_steps`` (PPO: epochs run ×
  mini-batches); DPO/SimPO: one per step;
* **held-out** — the final policy's means over the held-out prompts (``eval.json``); for a run
  with tools (the calculator task) each held-out response is a trajectory, with its tool calls and
  tool errors per trajectory beside exact match; with ``compare.eval_pass_k``, pass@k for each k,
  mean@n and maj@n of the main held-out score (:func:`proximal.evaluation.pass_metrics`);
* **stability** — over seeds: the spread (sample std) of the final held-out score; the fraction of
  runs that collapsed (final more than ``collapse_margin`` below the best of its evaluated
  checkpoints, the SFT model counting as the first); the largest change between consecutive
  checkpoints of any run (its own checkpoints: the move away from the SFT model is not counted).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from proximal.logging import read_metrics
from proximal.methods import METHODS, PAIRS, REWARD_MODEL

HELD_OUT = (
    ("gold", "gold ↑"),
    ("verifier", "verifier ↑"),
    ("proxy", "proxy (RM)"),
    ("kl", "KL to SFT"),
    ("length", "length"),
    ("format_error", "format errors"),
    ("tool_calls", "tool calls / trajectory"),
    ("tool_errors", "tool errors / trajectory"),
)

#: The pass@k family's mean keys after the columns above (``compare.eval_pass_k``): pass@k by k.
PASS_MEANS = ("mean@n", "maj@n")


def pass_columns(means: list[dict]) -> list[tuple[str, str]]:
    """The pass@k, mean@n and maj@n columns any of ``means`` (held-out means) holds, pass@k by k."""
    keys = {k for m in means for k in m}
    ks = sorted(int(k.removeprefix("pass@")) for k in keys if k.startswith("pass@"))
    return [(f"pass@{k}", f"pass@{k} ↑") for k in ks] + [
        (k, f"{k} ↑") for k in PASS_MEANS if k in keys
    ]


#: The comparison as it is commonly stated (Rafailov et al. 2023, Meng et al. 2024, Shao et al. 2024
#: and the surveys that summarise them), printed beside the measured cells.
CLAIMS = {
    "ppo": {
        "models": "4 (actor, critic, reference, reward)",
        "models_n": 4,
        "critic": "yes (V_φ)",
        "type": "online on-policy RL",
        "stability": "moderate (tune ε, β, λ, c₁)",
    },
    "dpo": {
        "models": "2 (actor, reference)",
        "models_n": 2,
        "critic": "no (implicit reward)",
        "type": "offline pairwise preference",
        "stability": "high",
    },
    "grpo": {
        "models": "2 (actor, reference) + rule verifier",
        "models_n": 2,
        "critic": "no (group baseline)",
        "type": "online group-sampled RL",
        "stability": "high",
    },
    "simpo": {
        "models": "1 (actor only)",
        "models_n": 1,
        "critic": "no (reference-free reward)",
        "type": "offline length-normalised preference",
        "stability": "high",
    },
    "rloo": {
        "models": "not in the usual table; 2 (actor, reference) + a reward",
        "models_n": 2,
        "critic": "no (leave-one-out baseline)",
        "type": "online group-sampled RL",
        "stability": "—",
    },
    # Issue 25's objectives: not in the usual table either; what their papers state.
    "gspo": {
        "models": "not in the usual table; 2 (actor, reference) + a reward",
        "models_n": 2,
        "critic": "no (group baseline)",
        "type": "online group-sampled RL, one clipped ratio per response (Zheng et al. 2025)",
        "stability": "—",
    },
    "cispo": {
        "models": "not in the usual table; 2 (actor, reference) + a reward",
        "models_n": 2,
        "critic": "no (group baseline)",
        "type": "online REINFORCE with a clipped, stop-gradient IS weight (MiniMax-M1 2025)",
        "stability": "—",
    },
    "reinforce_pp": {
        "models": "not in the usual table; 2 (actor, reference) + a reward",
        "models_n": 2,
        "critic": "no (batch-normalised returns)",
        "type": "online REINFORCE, KL in the reward (Hu et al. 2025)",
        "stability": "—",
    },
    # Issue 44: not in the usual table; what its papers state.
    "distill": {
        "models": "not in the usual table; 2 (student, teacher)",
        "models_n": 2,
        "critic": "no (the teacher grades every token)",
        "type": "online on-policy distillation (Agarwal et al. 2024; Thinking Machines 2025)",
        "stability": "—",
    },
    "reinforce_pp_baseline": {
        "models": "not in the usual table; 2 (actor, reference) + a reward",
        "models_n": 2,
        "critic": "no (group mean, then batch normalisation)",
        "type": "online group-sampled REINFORCE (Hu et al. 2025)",
        "stability": "—",
    },
}


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


# ----------------------------------------------------------------------------------------------
# One run
# ----------------------------------------------------------------------------------------------


def collect_run(run_dir: Path, spec: dict, *, collapse_margin: float, stability_score: str) -> dict:
    """One run's numbers, read from its directory (see the module docstring for each); ``spec`` is its
    entry of ``plan.json`` (name, group, method, source, seed)."""
    status = _json(run_dir / "compare_run.json") or {
        "status": "failed",
        "error": "no compare_run.json: the run never finished",
    }
    r = {
        **spec,
        **{
            k: status.get(k)
            for k in ("steps", "budget", "status", "error", "responses_per_step", "run_s")
        },
    }
    models = _json(run_dir / "models.json") or {}
    r["models"] = sorted(models)
    r["models_resident"] = len(models) if models else None
    r["param_bytes"] = sum(m["bytes"] for m in models.values()) if models else None
    metrics = run_dir / "metrics.jsonl"
    rows = [m for m in read_metrics(metrics) if "time/step_s" in m] if metrics.is_file() else []
    r["steps_run"] = len(rows)
    if rows:
        later = [
            m["memory/peak_bytes"] for m in rows if m["step"] >= 2 and "memory/peak_bytes" in m
        ]
        every = [m["memory/peak_bytes"] for m in rows if "memory/peak_bytes" in m]
        r["peak_bytes"] = max(later or every) if every else None
        r["wall_s"] = rows[-1]["time/wall_s"]
        per = status.get("responses_per_step") or 0
        online = METHODS[r["method"]].online
        r["tokens_generated"] = (
            round(sum(m.get("response/length_mean", 0.0) * per for m in rows)) if online else 0
        )
        # online methods log their optimiser steps; an offline step is one
        r["optimizer_steps"] = int(sum(m.get("policy/optimizer_steps", 1) for m in rows))
    ev = _json(run_dir / "eval.json")
    if ev is not None:
        final = ev["final"]["mean"]
        columns = [*HELD_OUT, *pass_columns([final])]
        r["held_out"] = {k: final[k] for k, _ in columns if k in final}
        curve = [(p["step"], p["mean"].get(stability_score)) for p in ev["curve"]]
        r["curve"] = [[s, v] for s, v in curve]
        values = [v for _, v in curve if v is not None]
        if values:
            r["best"] = max(values)
            r["collapsed"] = bool(r["best"] - values[-1] > collapse_margin)
            # the run's own checkpoints: the jump from the SFT model is progress, not a swing
            own = values[1:]
            r["max_swing"] = max((abs(b - a) for a, b in zip(own, own[1:])), default=None)
    elif r["status"] == "ok":
        r.update(status="failed", error="no eval.json: the run's evaluation never finished")
    return r


# ----------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and the sample standard deviation (None with fewer than two values)."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def summarise(runs: list[dict]) -> list[dict]:
    """One row per method and reward source (first-listed order): mean ± std over its finished runs."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(r["group"] or r["name"], []).append(r)
    table = []
    for group, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        row = {
            "group": group,
            "method": rs[0]["method"],
            "source": rs[0]["source"],
            "runs": len(rs),
            "finished": len(ok),
            "failed": [{"name": r["name"], "error": r["error"]} for r in rs if r["status"] != "ok"],
        }
        for key in (
            "models_resident",
            "param_bytes",
            "peak_bytes",
            "wall_s",
            "tokens_generated",
            "optimizer_steps",
        ):
            row[key] = mean_std([r.get(key) for r in ok])
        for key, _ in held_out_columns(runs):
            row[key] = mean_std([r.get("held_out", {}).get(key) for r in ok])
        row["models"] = ok[0]["models"] if ok else []
        row["collapse_frac"] = (
            (sum(r.get("collapsed", False) for r in ok) / len(ok)) if ok else None
        )
        swings = [r["max_swing"] for r in ok if r.get("max_swing") is not None]
        row["max_swing"] = max(swings) if swings else None
        table.append(row)
    return table


def held_out_columns(runs: list[dict]) -> list[tuple[str, str]]:
    """:data:`HELD_OUT`, then the pass@k columns any run's held-out means hold."""
    return [*HELD_OUT, *pass_columns([r.get("held_out", {}) for r in runs])]


def stated_models(method: str, source: str) -> int:
    """The stated model count for a run's reward source: the table states PPO with a learned reward
    model and GRPO with a verifier, so PPO on a verifier holds one model fewer and GRPO or RLOO on
    the reward model one more."""
    n = CLAIMS[method]["models_n"]
    if method == "ppo":
        return n if source == REWARD_MODEL else n - 1
    return n + (source == REWARD_MODEL)


def claims_notes(table: list[dict], score: str) -> dict[str, str]:
    """Per method: where the measurement agrees or disagrees with the commonly stated cells."""
    spread = {row["group"]: row[score][1] for row in table if row[score][1] is not None}
    ppo_spreads = [v for g, v in spread.items() if g.partition("@")[0] == "ppo"]
    notes: dict[str, str] = {}
    for row in table:
        group, claim, n = row["group"], CLAIMS.get(row["method"]), row["models_resident"][0]
        if claim is None or n is None:
            continue
        expected = stated_models(row["method"], row["source"])
        said = [
            f"models: agrees ({n:.0f} resident)"
            if round(n) == expected
            else f"models: disagrees ({n:.0f} resident, {expected} stated for this reward source; "
            "see the models column)"
        ]
        mine, rest = spread.get(group), [v for g, v in spread.items() if g != group]
        stability = None
        if mine is not None and rest:
            rank = (
                "the largest"
                if mine > max(rest)
                else "the smallest"
                if mine < min(rest)
                else "between the others'"
            )
            said.append(f"spread over seeds {mine:.3f}: {rank}")
            if claim["stability"].startswith("moderate"):
                stability = (
                    "stability: agrees (least stable here)"
                    if mine >= max(rest)
                    else "stability: disagrees (another method varied more over seeds)"
                )
            elif claim["stability"] == "high" and ppo_spreads:
                stability = (
                    "stability: agrees (steadier than PPO)"
                    if mine <= min(ppo_spreads)
                    else "stability: disagrees (varied more over seeds than PPO)"
                )
        if row["collapse_frac"] is not None:
            said.append(f"collapsed {row['collapse_frac']:.0%} of runs")
        notes[group] = "; ".join(said + ([stability] if stability else []))
    return notes


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _fmt(
    ms: tuple[float | None, float | None], digits: int = 3, scale: float = 1.0, unit: str = ""
) -> str:
    m, s = ms
    if m is None:
        return "—"
    text = f"{m / scale:.{digits}f}"
    if s is not None:
        text += f" ± {s / scale:.{digits}f}"
    return text + unit


def _count(ms) -> str:
    """A count: one integer when every seed gave the same, else mean ± std."""
    return _fmt(ms, 0) if ms[1] else _fmt((ms[0], None), 0)


def _mib(ms):
    return _fmt(ms, 1, 2**20)


def _label(row: dict) -> str:
    m = METHODS.get(row["method"])
    name = m.label if m else row["group"]
    if row["source"] not in (PAIRS, None):
        name = f"{name} ({row['source'].replace('_', ' ')})"
    if row["group"].endswith("-notool"):  # the calculator task's no-tool baseline
        name += ", no tool"
    return name


def _markdown(rows: list[list[str]], numeric: bool = True) -> str:
    head, *body = rows
    align = [":---" if i == 0 or not numeric else "---:" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])


def tables(result: dict) -> dict[str, list[list[str]]]:
    """The report's tables, as rows of strings (the first row the header)."""
    table, score = result["table"], result["stability_score"]
    held = [
        (k, h)
        for k, h in held_out_columns(result["runs"])
        if any(row.get(k, (None,))[0] is not None for row in table)
    ]
    cost = [
        [
            "method",
            "runs ok",
            "models resident",
            "parameters (MiB)",
            "peak memory (MiB)",
            "wall time (s)",
            "tokens generated",
            "optimiser steps",
        ]
    ]
    quality = [["method", *[h for _, h in held]]]
    stability = [
        [
            "method",
            f"final {score}: spread over seeds",
            f"collapsed (> {result['collapse_margin']} below best)",
            "largest swing between its checkpoints",
        ]
    ]
    for row in table:
        name = _label(row)
        cost.append(
            [
                name,
                f"{row['finished']}/{row['runs']}",
                _count(row["models_resident"])
                + (f" ({', '.join(row['models'])})" if row["models"] else ""),
                _mib(row["param_bytes"]),
                _mib(row["peak_bytes"]),
                _fmt(row["wall_s"], 1),
                _count(row["tokens_generated"]),
                _count(row["optimizer_steps"]),
            ]
        )
        quality.append([name, *[_fmt(row[k]) for k, _ in held]])
        spread = row[score][1]
        stability.append(
            [
                name,
                "—" if spread is None else f"{spread:.3f}",
                "—" if row["collapse_frac"] is None else f"{row['collapse_frac']:.0%}",
                "—" if row["max_swing"] is None else f"{row['max_swing']:.3f}",
            ]
        )
    claims = [
        [
            "method",
            "models (stated)",
            "critic (stated)",
            "optimisation (stated)",
            "stability (stated)",
            "measured here",
        ]
    ]
    for row in table:
        c = CLAIMS.get(row["method"], {})
        claims.append(
            [
                _label(row),
                c.get("models", "—"),
                c.get("critic", "—"),
                c.get("type", "—"),
                c.get("stability", "—"),
                result["notes"].get(row["group"], "—"),
            ]
        )
    failed = [["run", "error"]] + [
        [f["name"], f["error"] or "?"] for row in table for f in row["failed"]
    ]
    return {
        "cost": cost,
        "quality": quality,
        "stability": stability,
        "claims": claims,
        "failed": failed,
    }


def plot(result: dict, runs: list[dict], out: Path) -> list[str]:
    """``plots/gold_vs_kl.png``, ``plots/gold_vs_time.png`` and ``plots/curves.png``; the file names
    written (none without matplotlib)."""
    try:
        # lazy: matplotlib loads only when a figure is drawn
        import matplotlib

        matplotlib.use("Agg")
        # lazy: matplotlib loads only when a figure is drawn
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    score = result["stability_score"]
    (out / "plots").mkdir(exist_ok=True)
    colors = {g: f"C{i}" for i, g in enumerate(row["group"] for row in result["table"])}
    ok = [r for r in runs if r["status"] == "ok" and r.get("held_out")]
    written = []
    for name, x_key, x_label in (
        ("gold_vs_kl", "kl", "exact KL to the SFT model (nats per response)"),
        ("gold_vs_time", "wall_s", "training wall time (s)"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for g in colors:
            pts = [
                (
                    (r["held_out"].get(x_key) if x_key == "kl" else r.get(x_key)),
                    r["held_out"].get(score),
                )
                for r in ok
                if r["group"] == g
            ]
            pts = [(x, y) for x, y in pts if x is not None and y is not None]
            if pts:
                ax.scatter(*zip(*pts), color=colors[g], label=g, s=28)
        sft = result.get("sft", {}).get(score)
        if sft is not None:
            ax.axhline(sft, color="gray", ls="--", lw=1, label="SFT model")
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"held-out {score}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "plots" / f"{name}.png", dpi=110)
        plt.close(fig)
        written.append(f"plots/{name}.png")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labelled = set()  # one legend entry per method, not per seed
    for r in ok:
        pts = [(s, v) for s, v in r.get("curve", []) if v is not None]
        steps = max(r.get("steps") or 1, 1)
        ax.plot(
            [s / steps for s, _ in pts],
            [v for _, v in pts],
            color=colors[r["group"]],
            alpha=0.8,
            marker="o",
            ms=3,
            label=None if r["group"] in labelled else r["group"],
        )
        labelled.add(r["group"])
    ax.set_xlabel("fraction of the budget spent")
    ax.set_ylabel(f"held-out {score}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "plots" / "curves.png", dpi=110)
    plt.close(fig)
    written.append("plots/curves.png")
    online = [r for r in ok if METHODS[r["method"]].online and r.get("responses_per_step")]
    if online:
        written.append(_plot_samples(plt, result, online, colors, out))
    return written


def samples_curves(runs: list[dict]) -> dict[str, list[tuple[int, float, int]]]:
    """Per group of online runs: ``(responses sampled, mean held-out score over its runs, runs)``
    at each evaluated step (step × the responses one step samples; the SFT model at 0)."""
    points: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        per = r["responses_per_step"]
        for s, v in r.get("curve", []):
            if v is not None:
                points.setdefault(r["group"], {}).setdefault(s * per, []).append(v)
    return {
        g: [(x, statistics.fmean(vs), len(vs)) for x, vs in sorted(by.items())]
        for g, by in points.items()
    }


def _plot_samples(plt, result: dict, runs: list[dict], colors: dict, out: Path) -> str:
    """``plots/gold_vs_samples.png``: the held-out score against the responses sampled, each run
    thin, each group's mean over its runs thick; the SFT model (and a distill teacher) dashed."""
    score = result["stability_score"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in runs:
        pts = [(s * r["responses_per_step"], v) for s, v in r.get("curve", []) if v is not None]
        ax.plot(*zip(*pts), color=colors[r["group"]], alpha=0.3, lw=1)
    for g, pts in samples_curves(runs).items():
        ax.plot(
            [x for x, _, _ in pts],
            [y for _, y, _ in pts],
            color=colors[g],
            lw=2.2,
            marker="o",
            ms=4,
            label=f"{g} (mean of {max(n for _, _, n in pts)} runs)",
        )
    sft = result.get("sft", {}).get(score)
    if sft is not None:
        ax.axhline(sft, color="gray", ls="--", lw=1, label="SFT model")
    teacher = (result.get("teacher") or {}).get(score)
    if teacher is not None:
        ax.axhline(teacher, color="black", ls=":", lw=1.2, label="distill teacher")
    ax.set_xlabel("responses sampled")
    ax.set_ylabel(f"held-out {score}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "plots" / "gold_vs_samples.png", dpi=110)
    plt.close(fig)
    return "plots/gold_vs_samples.png"


def collect(out: str | Path) -> tuple[dict, list[dict]]:
    """``(compare.json's contents, every run's record)`` from an output directory."""
    out = Path(out)
    cfg = (
        yaml.safe_load((out / "compare_config.yaml").read_text())
        if (out / "compare_config.yaml").is_file()
        else {}
    )
    margin = float(cfg.get("compare", {}).get("collapse_margin", 0.05))
    sft = (_json(out / "sft_eval.json") or {}).get("mean", {})
    # the distill runs' teacher, where compare trained it (base/teacher_eval.json)
    teacher = (_json(out / "base" / "teacher_eval.json") or {}).get("mean")
    score = "gold" if "gold" in sft or not sft else ("verifier" if "verifier" in sft else "proxy")
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else []
    # every planned run has a row, also one that never started
    runs = [
        collect_run(
            out / "runs" / spec["name"], spec, collapse_margin=margin, stability_score=score
        )
        for spec in plan
    ]
    table = summarise(runs)
    result = {
        "config": cfg,
        "collapse_margin": margin,
        "stability_score": score,
        "sft": sft,
        **({"teacher": teacher} if teacher else {}),
        "table": table,
        "runs": runs,
    }
    result["notes"] = claims_notes(table, score)
    return result, runs


def render_markdown(result: dict, plots: list[str], total_s: float | None) -> str:
    t = tables(result)
    cfg = result["config"].get("compare", {})
    score = result["stability_score"]
    lines = ["# proximal compare", ""]
    lines.append(
        f"{len(result['runs'])} runs: {', '.join(_label(r) for r in result['table'])}; "
        f"{cfg.get('seeds', '?')} seeds each (train.seed = 0, 1, …), from one SFT model. Budgets: every "
        f"online method samples {cfg.get('responses', '?')} responses, every offline method trains on "
        f"{cfg.get('pairs', '?')} preference pairs. Cells are mean ± sample standard deviation over the "
        "finished runs." + (f" Whole comparison: {total_s / 60:.1f} min." if total_s else "")
    )
    lines += [
        "",
        "## Held-out evaluation of the final policies",
        "",
        "The SFT model: "
        + ", ".join(
            f"{k} {v:.3f}"
            for k, v in result["sft"].items()
            if isinstance(v, (int, float)) and k != "eos"
        ),
        *(
            [
                "",
                "The distill runs' teacher (base/teacher): "
                + ", ".join(
                    f"{k} {v:.3f}"
                    for k, v in result["teacher"].items()
                    if isinstance(v, (int, float)) and k != "eos"
                ),
            ]
            if result.get("teacher")
            else []
        ),
        "",
        _markdown(t["quality"]),
        "",
        "## What each method cost",
        "",
        _markdown(t["cost"]),
        "",
        "## Stability",
        "",
        f"Measured on the held-out {score} at every evaluated checkpoint.",
        "",
        _markdown(t["stability"]),
        "",
        f"With {cfg.get('seeds', '?')} seeds a spread is itself uncertain: the relative standard error of a "
        "sample standard deviation from n runs is about 1/√(2(n−1)), so spreads within a factor of about two "
        "of each other do not separate the methods.",
        "",
        "## The comparison as commonly stated, beside the measurements",
        "",
        _markdown(t["claims"], numeric=False),
        "",
    ]
    if len(t["failed"]) > 1:
        lines += ["## Runs that failed", "", _markdown(t["failed"], numeric=False), ""]
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    lines += [
        "Every number above is recomputed from `runs/*/` (models.json, metrics.jsonl, eval.json, "
        "compare_run.json); `compare.json` holds them all."
    ]
    return "\n".join(lines) + "\n"


def write_report(out: str | Path, *, total_s: float | None = None) -> dict:
    """Write ``compare.json``, ``compare.md`` and ``plots/`` into ``out``; return compare.json's contents."""
    out = Path(out)
    result, runs = collect(out)
    plots = plot(result, runs, out)
    result["total_s"] = total_s
    tmp = out / "compare.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(out / "compare.json")
    (out / "compare.md").write_text(render_markdown(result, plots, total_s))
    return result


def terminal_summary(result: dict) -> str:
    """The held-out table, the cost table, and any failures, as plain text for the terminal."""
    t = tables(result)
    blocks = [t["quality"], t["cost"], t["stability"]] + (
        [t["failed"]] if len(t["failed"]) > 1 else []
    )
    text = []
    for rows in blocks:
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        text += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows] + [""]
    return "\n".join(text).rstrip()
