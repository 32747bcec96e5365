"""Summaries of the alternated runs, ``results.md`` and the JSON of every number."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from harness import mfu
from harness.sides import BASELINE

#: Targets for the step-time ratio proximal / TRL: issue 12's works, and issue 22's at V = 151,936.
TARGETS = {
    "tiny": 0.5,
    "wide": 0.6,
    "tiny-bf16": 0.35,
    "wide-bf16": 0.3,
    "grpo": 0.5,
    "ppo-vocab": 0.35,
    "grpo-vocab": 0.5,
}
#: Targets for the peak-RSS ratio proximal / TRL: 1.0 on issue 12's works, issue 22's below.
RSS_TARGETS = {"ppo-vocab": 0.3, "grpo-vocab": 0.4}
RSS_TARGET_DEFAULT = 1.0
METRICS = (("median_step_s", "s/step"), ("wall_s", "process s"), ("peak_rss_mib", "peak RSS MiB"))
BUSY_WARN = 0.25  # busy CPUs of other processes before a run above which its numbers are suspect


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("rc") == 0 and not r.get("error")


def summarize(runs: list[dict], works: list[str]) -> dict:
    """Per work: each side's median over rounds of each metric, and the median (min, max) of the
    per-round ratios proximal / anchor (a pair counts only when both of its runs succeeded).

    With runs of the :data:`~harness.sides.BASELINE` side (``--baseline``), also the baseline's
    medians and the per-round ratios baseline / anchor and proximal / baseline
    (:func:`_baseline_summary`); without, the summary is what it always was."""
    with_baseline = any(r["side"] == BASELINE for r in runs)
    out = {}
    for w in works:
        rounds = sorted({r["round"] for r in runs if r["work"] == w})
        pairs, bases = [], []
        for k in rounds:
            here = [r for r in runs if r["work"] == w and r["round"] == k]
            p = next((r for r in here if r["side"] == "proximal"), None)
            t = next((r for r in here if r["side"] not in ("proximal", BASELINE)), None)
            pairs.append((p, t))
            bases.append(next((r for r in here if r["side"] == BASELINE), None))
        s: dict = {"rounds": len(rounds)}
        for key, _ in METRICS:
            for side, idx in (("proximal", 0), ("anchor", 1)):
                vals = [
                    pair[idx][key]
                    for pair in pairs
                    if _ok(pair[idx]) and pair[idx].get(key) is not None
                ]
                s[f"{side}_{key}"] = statistics.median(vals) if vals else None
            ratios = [
                p[key] / t[key] for p, t in pairs if _ok(p) and _ok(t) and p.get(key) and t.get(key)
            ]
            s[f"ratio_{key}"] = statistics.median(ratios) if ratios else None
            s[f"ratio_{key}_all"] = ratios
        mfu = [p["median_mfu"] for p, _ in pairs if _ok(p) and p.get("median_mfu") is not None]
        s["proximal_median_mfu"] = statistics.median(mfu) if mfu else None
        s["failed_runs"] = sum(1 for pair in pairs for r in pair if r is not None and not _ok(r))
        busy = [r.get("cpu_busy_before", 0.0) for pair in pairs for r in pair if r is not None]
        s["max_cpu_busy_before"] = max(busy) if busy else None
        if with_baseline:
            s["failed_runs"] += sum(1 for b in bases if b is not None and not _ok(b))
            busy += [b.get("cpu_busy_before", 0.0) for b in bases if b is not None]
            s["max_cpu_busy_before"] = max(busy) if busy else None
            s.update(_baseline_summary(pairs, bases))
        out[w] = s
    return out


def _median_ratios(pairs: list[tuple[dict | None, dict | None]], key: str) -> tuple:
    """(median, all) of the ratios a[key] / b[key] over the pairs whose two runs succeeded."""
    ratios = [a[key] / b[key] for a, b in pairs if _ok(a) and _ok(b) and a.get(key) and b.get(key)]
    return (statistics.median(ratios) if ratios else None), ratios


def _baseline_summary(pairs: list[tuple], bases: list[dict | None]) -> dict:
    """The baseline's figures of one work, round by round beside ``pairs`` (proximal, anchor):
    ``baseline_<metric>`` (its median over rounds), ``baseline_ratio_<metric>`` (baseline / anchor)
    and ``new_over_baseline_<metric>`` (proximal / baseline), each ratio the median of the per-round
    ratios with the list in ``…_all``; ``baseline_median_mfu`` (its ``perf/mfu``)."""
    s: dict = {}
    for key, _ in METRICS:
        vals = [b[key] for b in bases if _ok(b) and b.get(key) is not None]
        s[f"baseline_{key}"] = statistics.median(vals) if vals else None
        ratio, every = _median_ratios([(b, t) for b, (_, t) in zip(bases, pairs)], key)
        s[f"baseline_ratio_{key}"], s[f"baseline_ratio_{key}_all"] = ratio, every
        ratio, every = _median_ratios([(p, b) for b, (p, _) in zip(bases, pairs)], key)
        s[f"new_over_baseline_{key}"], s[f"new_over_baseline_{key}_all"] = ratio, every
    mfus = [b["median_mfu"] for b in bases if _ok(b) and b.get("median_mfu") is not None]
    s["baseline_median_mfu"] = statistics.median(mfus) if mfus else None
    return s


def annotate_baseline(summary: dict, measured: dict) -> None:
    """``baseline_mfu_probe`` beside :func:`harness.mfu.annotate`'s two: the work's model FLOPs (the
    same count) over the baseline's median step over the same probed peak."""
    for w, s in summary.items():
        m = measured["works"].get(w)
        if m is not None and "baseline_median_step_s" in s:
            s["baseline_mfu_probe"] = mfu.mfu(
                m["flops"]["total"], s["baseline_median_step_s"], m["peak"]["peak_flops_per_s"]
            )


def _f(x, nd=3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def _steps(meta: dict) -> str:
    """ "10 steps a run", or "10 steps a run (ppo-vocab, grpo-vocab: 3)" where works differ."""
    steps_of = meta.get("steps_of") or {}
    counts = sorted(set(steps_of.values()))
    if len(counts) <= 1:
        n = meta.get("steps") or (counts[0] if counts else "?")
        return f"{n} steps a run"
    common = meta.get("steps")  # --steps, where given, is the rule and --steps-of the exceptions
    if common not in counts:
        common = max(counts, key=lambda n: sum(1 for v in steps_of.values() if v == n))
    extra = "; ".join(
        f"{', '.join(w for w, v in steps_of.items() if v == n)}: {n}" for n in counts if n != common
    )
    return f"{common} steps a run ({extra})"


def _with_mfu(step_s, mfu) -> str:
    """A step time, with proximal's MFU beside it when there is one: "1.23 (MFU 0.41 %)"."""
    return _f(step_s) + (
        f" (MFU {100 * mfu:.2g} %)" if mfu is not None and step_s is not None else ""
    )


def _mfu(d: dict, probe: str, own: str):
    """The MFU shown beside a step time: ``d[probe]``, against the peak probed once in this
    invocation (:func:`harness.mfu.annotate`), where there is one; else ``d[own]``, the run's own
    ``perf/mfu``, against the peak that run probed for a second when it started — which moves with
    the machine's speed in that second (on a 2-core VM, two runs of the same step time read 55 % and
    75 %), so runs compare only on the invocation's one peak."""
    return d[probe] if d.get(probe) is not None else d.get(own)


def _met(ratio, target) -> str:
    return "—" if ratio is None or target is None else ("yes" if ratio <= target else "no")


def _rounds(meta: dict) -> str:
    """ "3 rounds", or "3 rounds (tiny, grpo: 7)" where some works had more."""
    more: dict[int, list[str]] = {}
    for w, n in meta.get("rounds_of", {}).items():
        if n != meta["rounds"]:
            more.setdefault(n, []).append(w)
    extra = "; ".join(f"{', '.join(ws)}: {n}" for n, ws in sorted(more.items()))
    return f"{meta['rounds']} rounds" + (f" ({extra})" if extra else "")


#: The summary table's columns for ``--baseline``, after the others.
BASELINE_HEADER = (
    " s/step baseline | ratio baseline/TRL | per-round ratios | new/baseline | per-round ratios |"
)
BASELINE_COLUMNS = 5


def _baseline_cells(s: dict) -> list[str]:
    """A summary row's :data:`BASELINE_HEADER` cells."""
    rounds = lambda xs: " ".join(f"{x:.3f}" for x in xs) or "—"  # noqa: E731
    return [
        _with_mfu(
            s.get("baseline_median_step_s"), _mfu(s, "baseline_mfu_probe", "baseline_median_mfu")
        ),
        _f(s.get("baseline_ratio_median_step_s"), 3),
        rounds(s.get("baseline_ratio_median_step_s_all", [])),
        _f(s.get("new_over_baseline_median_step_s"), 3),
        rounds(s.get("new_over_baseline_median_step_s_all", [])),
    ]


def baseline_mfu_lines(data: dict) -> list[str]:
    """The MFU section's rows for the baseline (empty without ``--baseline`` or a measurement):
    the same FLOPs a step over its median step over the same probed peak, beside this tree's."""
    measured, base = data["meta"].get("mfu"), data["meta"].get("baseline")
    if not measured or not base:
        return []
    pct = lambda x: "—" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    lines = [
        "",
        f"The baseline, proximal at commit {base['commit']}, on the same FLOPs a step and the same "
        "probed peak:",
        "",
        "| work | s/step baseline | MFU baseline | s/step proximal | MFU proximal | new/baseline |",
        "|---|---|---|---|---|---|",
    ]
    for w in measured["works"]:
        s = data.get("summary", {}).get(w, {})
        cells = [
            w,
            _f(s.get("baseline_median_step_s")),
            pct(s.get("baseline_mfu_probe")),
            _f(s.get("proximal_median_step_s")),
            pct(s.get("proximal_mfu_probe")),
            _f(s.get("new_over_baseline_median_step_s")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write(results_md: Path, data: dict, notes: str) -> None:
    """``results_md`` and, beside it, the same stem ``.json`` with every number."""
    meta, summary, runs = data["meta"], data["summary"], data["runs"]
    results_md.parent.mkdir(parents=True, exist_ok=True)
    results_md.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    m = meta["machine"]
    lines = [
        "# proximal against TRL, head to head",
        "",
        f"Measured {meta['date']} with `{meta['command']}` ({_rounds(meta)}, {_steps(meta)}, "
        f"{meta['threads']} torch threads a process; every run a fresh process; proximal and the anchor alternate "
        "A B A B within each work).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} memory "
        f"(AMX-BF16: {'yes' if m['amx_bf16'] else 'no'}, "
        f"AVX512-BF16: {'yes' if m['avx512_bf16'] else 'no'}); {m['os']}.",
        f"- proximal: commit {meta['proximal']['commit']}, torch {meta['proximal']['torch']}, "
        f"transformers {meta['proximal']['transformers']}.",
    ]
    for name, v in meta.get("anchors", {}).items():
        lines.append(
            f"- {name}: "
            + ", ".join(
                f"{k} {v[k]}" for k in ("torch", "transformers", "trl", "accelerate") if k in v
            )
            + "."
        )
    base = meta.get("baseline")
    if base:
        lines.append(
            f"- baseline (`--baseline {base['ref']}`): commit {base['commit']}, run third in each "
            f"round (proximal, TRL, baseline) from a checkout at `{base['tree']}` with the same Python, "
            f"configs and threads; its proximal imported from `{base['proximal_file']}`, this "
            f"tree's from `{base['new_proximal_file']}`."
        )
    busy = [r.get("cpu_busy_before") or 0.0 for r in runs]
    worst = max(busy) if busy else 0.0
    if worst > BUSY_WARN:
        lines += [
            "",
            f"**Warning: the machine was not quiet.** Before some runs other processes kept up to {worst:.2f} "
            f"CPUs busy (of {m['cores']}); with the cores oversubscribed a tiny model's step slows many "
            "times over, so these numbers measure the load, not the code. Rerun on a quiet machine.",
        ]
    lines += [
        "",
        "## Summary",
        "",
        "Each side's median over the rounds; a ratio is proximal / TRL, the median of the per-round ratios "
        "(each round's two runs are back to back). s/step = median step time of steps 2–N; process s = the "
        "whole process, spawn to exit; peak RSS = the process's peak resident set. Beside an s/step, "
        "its MFU: the work's model FLOPs a step / that s/step / the peak probed once in this "
        "invocation (the MFU section), so that every run and side is measured against one peak; "
        "without that probe, the median of steps 2–N of the run's own `perf/mfu` (against the peak "
        "each run probed when it started, which moves with the machine's speed in that second; "
        "results.json keeps it as `median_mfu`; docs/performance.md).",
        "",
        "| work | rounds | s/step proximal | s/step TRL | ratio | per-round ratios | target | met | "
        "process s proximal | process s TRL | ratio | peak RSS MiB proximal | peak RSS MiB TRL | ratio "
        "| RSS target | met |" + (BASELINE_HEADER if base else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" * BASELINE_COLUMNS if base else ""),
    ]
    if base:
        lines[-2:-2] = [
            f"The baseline columns are proximal at commit {base['commit']}: its s/step (with its "
            "MFU), the ratio baseline / TRL, and new / baseline = this tree's s/step over the "
            "baseline's; each ratio is the median of the per-round ratios (each round runs proximal, "
            "TRL and the baseline back to back), listed beside it.",
            "",
        ]
    for w, s in summary.items():
        ratio = s["ratio_median_step_s"]
        met = _met(ratio, TARGETS.get(w))
        rss_target = RSS_TARGETS.get(w, RSS_TARGET_DEFAULT)
        lines.append(
            "| "
            + " | ".join(
                [
                    w,
                    str(s["rounds"]),
                    _with_mfu(
                        s["proximal_median_step_s"],
                        _mfu(s, "proximal_mfu_probe", "proximal_median_mfu"),
                    ),
                    _f(s["anchor_median_step_s"]),
                    _f(ratio, 3),
                    " ".join(f"{x:.3f}" for x in s["ratio_median_step_s_all"]) or "—",
                    f"≤ {TARGETS[w]}" if w in TARGETS else "—",
                    met,
                    _f(s["proximal_wall_s"]),
                    _f(s["anchor_wall_s"]),
                    _f(s["ratio_wall_s"], 2),
                    _f(s["proximal_peak_rss_mib"], 4),
                    _f(s["anchor_peak_rss_mib"], 4),
                    _f(s["ratio_peak_rss_mib"], 2),
                    f"≤ {rss_target}",
                    _met(s["ratio_peak_rss_mib"], rss_target),
                ]
                + (_baseline_cells(s) if base else [])
            )
            + " |"
        )
    for w, why in meta.get("skipped", {}).items():
        lines.append(f"| {w} | skipped: {why} |" + " |" * (14 + (BASELINE_COLUMNS if base else 0)))
    lines += [
        "",
        "## Every run",
        "",
        "| work | round | side | s/step (2–N) | process s | peak RSS MiB | busy CPUs before | load avg before | "
        "log-probs | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        note = r.get("error", "")[:160].replace("|", "/")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["work"],
                    str(r["round"]),
                    r["side"],
                    _with_mfu(r.get("median_step_s"), _mfu(r, "mfu_probe", "median_mfu")),
                    _f(r.get("wall_s")),
                    _f(r.get("peak_rss_mib"), 4),
                    _f(r.get("cpu_busy_before"), 2),
                    " ".join(f"{x:.2f}" for x in r.get("loadavg_before", [])),
                    r.get("logprobs") or ("—" if r["side"] in ("proximal", BASELINE) else "logits"),
                    note,
                ]
            )
            + " |"
        )
    lines += mfu.report_lines(data)
    lines += baseline_mfu_lines(data)
    lines += ["", notes.strip(), ""]
    results_md.write_text("\n".join(lines))
