"""Asynchronous rollouts on this CPU (issue 43): wall time per step of ``proximal grpo`` and
``proximal ppo`` at ``rollout.staleness`` 0, 1 and 2, and the phase shares that give a paper-style
estimate of the gain where generation and training have devices of their own.

**The runs.** Every run is ``proximal grpo`` or ``proximal ppo`` through the CLI, a fresh process, on
the ``tiny`` and ``wide`` works of ``harness/works.py`` (their models written to disk with the
special tokens unreachable, so every response is exactly R tokens at every staleness; their
configs are ``harness/proximal_side.py``'s, PPO with ``--ppo-epochs`` epochs). The cases:

- ``sync-2t``: ``rollout.staleness`` 0 on 2 torch threads: today's synchronous loop with both cores —
  the fair baseline of the asynchronous runs, which use both cores too;
- ``k1``, ``k2``: ``rollout.staleness`` 1 and 2 with the default pinning (generator on core 1 with one
  thread, trainer on core 0 with one thread);
- ``sync-1t``: ``rollout.staleness`` 0 on 1 torch thread (what one core alone does).

Within an invocation the runs alternate (round 1: every work and method at sync-2t, k1, k2, sync-1t;
round 2 the same; …), so a slow spell of the machine falls on every case. The time per step is the
median over the steady steps ``--warm`` + 1 … N − k of the step's *period* (``time/wall_s``
differences: the whole loop, waiting for the generator included; at staleness k the last k steps
have no generation beside them, unlike a long run's, and are left out), then the median over
rounds; each case's ratio to sync-2t is the median of the per-round ratios (< 1: faster).

**Phase shares** (per step, from the metrics): ``gen_s`` = rows × ``response/length_mean`` /
``speed/gen_tokens_per_s`` (the seconds spent in generation: in the loop at staleness 0, in the
generator process at k ≥ 1); ``wait_s`` = ``time/wait_s`` (the trainer idle, waiting for the
generator's batch; k ≥ 1 only); ``busy_s`` = ``time/step_s`` − ``wait_s`` (the trainer's own work:
scoring, reference and old log-probabilities, the update, publishing the weights; at staleness 0 it
includes generation); ``solo_busy_s`` = ``busy_s`` of the last k steps, when the generator is idle
(against ``busy_s`` of the steady steps: what generating on the other core costs the trainer).
The generation share of a synchronous step is g = gen_s / step_s.

**The GPU estimate.** With generation and training on devices of their own (the asynchronous papers'
setting), a synchronous step costs g + (1 − g) of itself and an overlapped one max(g, 1 − g) plus the
weight synchronisation: the speed-up is at most 1 / max(g, 1 − g), 2× at g = ½. The summary gives the
measured g of sync-2t and that bound, and for this CPU the overlap bound of the k1 runs themselves:
sync-2t's period over max(generator's gen_s, trainer's busy_s) measured on one core each.

Run from the repository root::

    .venv/bin/python benchmarks/async.py                               # tiny and wide, 3 rounds
    .venv/bin/python benchmarks/async.py --works tiny --rounds 5
    .venv/bin/python benchmarks/async.py --smoke --out /tmp/a.md       # seconds: not a measurement

Writes ``--out`` (default ``benchmarks/results-async.md``) and the same name ``.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from harness import proximal_side  # noqa: E402
from harness.measure import cpu_busy, loadavg, machine  # noqa: E402
from harness.sides import child_env, source_path  # noqa: E402
from harness.works import MINI, WORKS, Work, write_models, write_prompts  # noqa: E402

#: name → (rollout.staleness, torch threads of the process). k ≥ 1 pins by default: the trainer
#: on core 0, the generator on core 1, one thread each.
CASES = {"sync-2t": (0, 2), "k1": (1, 2), "k2": (2, 2), "sync-1t": (0, 1)}
BASELINE = "sync-2t"
METHODS = ("grpo", "ppo")
GROUP = 4  # GRPO: completions per prompt (the harness's GRPO work: 4 prompts × 4 on tiny)
#: What a run directory keeps (the checkpoint and export of a wide run are large).
KEPT = ("metrics.jsonl", "run.log", "config.yaml")


def run_config(
    method: str,
    work: Work,
    staleness: int,
    *,
    model: dict,
    prompts: dict,
    steps: int,
    out_dir: Path,
    ppo_epochs: int,
) -> dict:
    """The harness's GRPO (``work.batch`` / 4 prompts × 4, β 0.04, one iteration) or PPO (the batch
    as one mini-batch, the critic from the reward model, ``ppo_epochs`` epochs) config, at
    ``rollout.staleness`` ``staleness`` (k ≥ 1: the default pinning and correction)."""
    if method == "grpo":
        w = replace(work, method="grpo", group_size=GROUP)
        cfg = proximal_side.grpo_config(
            w, model=model, prompts=prompts, steps=steps, out_dir=out_dir, beta=0.04, loss="grpo"
        )
    else:
        cfg = proximal_side.ppo_config(
            work, model=model, prompts=prompts, steps=steps, out_dir=out_dir
        )
        cfg["ppo"]["epochs"] = ppo_epochs
    cfg["rollout"]["staleness"] = staleness
    return cfg


def step_rows(run_dir: Path) -> list[dict]:
    rows = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    return [r for r in rows if "time/step_s" in r]


def phases(rows: list[dict], rows_per_step: int, warm: int, staleness: int = 0) -> dict:
    """Per-step phase seconds (module docstring) and their medians over the steady steps
    ``warm`` + 1 … N − k (all steps when there are none): at staleness k the last k steps train
    while the generator has nothing left to sample, unlike every step of a long run. Their
    trainer seconds are kept apart (``solo_busy_s``: what an update costs with the other core
    idle, against ``median_busy_s`` with the generator running beside it)."""
    wall = [float(r["time/wall_s"]) for r in rows]
    period = [wall[0]] + [b - a for a, b in zip(wall, wall[1:])]
    step = [float(r["time/step_s"]) for r in rows]
    wait = [float(r.get("time/wait_s", 0.0)) for r in rows]
    gen = [
        rows_per_step * float(r["response/length_mean"]) / float(r["speed/gen_tokens_per_s"])
        for r in rows
    ]
    busy = [s - w for s, w in zip(step, wait)]
    n = len(rows)
    steady = slice(warm, n - staleness) if n - staleness > warm else slice(None)

    def med(xs: list[float]) -> float:
        return statistics.median(xs[steady])

    return {
        "period_s": period,
        "step_s": step,
        "wait_s": wait,
        "gen_s": gen,
        "busy_s": busy,
        "staleness": [r.get("rollout/staleness", 0) for r in rows],
        "length_mean": [float(r["response/length_mean"]) for r in rows],
        "steady_steps": list(range(1, n + 1))[steady],
        "median_period_s": med(period),
        "median_step_s": med(step),
        "median_wait_s": med(wait),
        "median_gen_s": med(gen),
        "median_busy_s": med(busy),
        "solo_busy_s": statistics.median(busy[n - staleness :]) if 0 < staleness < n else None,
        "gen_share": med([g / s for g, s in zip(gen, step)]),
        "wait_share": med([w / p for w, p in zip(wait, period)]),
    }


def run_one(
    method: str,
    work: Work,
    case: str,
    k: int,
    *,
    model: dict,
    prompts: dict,
    steps: int,
    warm: int,
    ppo_epochs: int,
    workdir: Path,
    log,
) -> dict:
    """One run in a fresh process; its record (``rc``, load before it, per-step phases)."""
    staleness, threads = CASES[case]
    run_dir = workdir / "runs" / f"{work.name}-{method}-{case}-r{k}"
    cfg = run_config(
        method,
        work,
        staleness,
        model=model,
        prompts=prompts,
        steps=steps,
        out_dir=run_dir,
        ppo_epochs=ppo_epochs,
    )
    path = proximal_side.write_config(cfg, run_dir.with_suffix(".yaml"))
    rec = {"work": work.name, "method": method, "case": case, "round": k}
    rec.update(staleness=staleness, threads=threads)
    rec.update(loadavg_before=loadavg()[0], cpu_busy_before=cpu_busy(0.5))
    t0 = time.perf_counter()
    p = subprocess.run(
        proximal_side.command(method, path),
        cwd=str(ROOT),
        env=child_env(threads, pythonpath=source_path(ROOT)),
        capture_output=True,
        text=True,
    )
    rec["wall_s"] = time.perf_counter() - t0
    rec["rc"] = p.returncode
    (run_dir.parent / f"{run_dir.name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        log(f"  {run_dir.name}: exit {p.returncode}\n{(p.stdout + p.stderr)[-2000:]}")
        return rec
    rows = step_rows(run_dir)
    for f in run_dir.iterdir():
        if f.name not in KEPT:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    rec.update(phases(rows, work.batch, warm, staleness))
    if any(abs(n - work.response_len) > 1e-9 for n in rec["length_mean"]):
        raise AssertionError(f"{run_dir.name}: response lengths {rec['length_mean']}")
    want = [min(s - 1, staleness) for s in range(1, len(rows) + 1)]  # steps ≤ k: version 0
    if rec["staleness"] != want:
        raise AssertionError(f"{run_dir.name}: rollout/staleness {rec['staleness']}, not {want}")
    return rec


def summarize(runs: list[dict]) -> list[dict]:
    """Per work × method × case: the median over rounds of each run's medians, and the ratio to
    sync-2t as the median of the per-round ratios (rounds where both ran); for sync-2t the GPU bound
    1 / max(g, 1 − g), for k ≥ 1 this CPU's overlap bound (module docstring)."""
    ok = [r for r in runs if r["rc"] == 0]
    out = []
    keys = dict.fromkeys((r["work"], r["method"]) for r in runs)
    for work, method in keys:
        mine = [r for r in ok if (r["work"], r["method"]) == (work, method)]
        base = {r["round"]: r for r in mine if r["case"] == BASELINE}
        for case in CASES:
            rs = [r for r in mine if r["case"] == case]
            if not rs:
                continue
            row = {"work": work, "method": method, "case": case, "rounds": len(rs)}
            for x in ("period_s", "step_s", "wait_s", "gen_s", "busy_s"):
                row[x] = statistics.median(r[f"median_{x}"] for r in rs)
            row["gen_share"] = statistics.median(r["gen_share"] for r in rs)
            row["wait_share"] = statistics.median(r["wait_share"] for r in rs)
            solo = [r["solo_busy_s"] for r in rs if r.get("solo_busy_s") is not None]
            row["solo_busy_s"] = statistics.median(solo) if solo else None
            row["loadavg"] = statistics.median(r["loadavg_before"] for r in rs)
            ratios = [
                r["median_period_s"] / base[r["round"]]["median_period_s"]
                for r in rs
                if r["round"] in base
            ]
            row["ratios"] = ratios
            row["ratio"] = statistics.median(ratios) if ratios else None
            if case == BASELINE:
                g = row["gen_share"]
                row["gpu_bound"] = 1.0 / max(g, 1.0 - g)
            elif CASES[case][0] >= 1 and base:
                sync = statistics.median(b["median_period_s"] for b in base.values())
                row["overlap_s"] = max(row["gen_s"], row["busy_s"])
                row["cpu_bound"] = sync / row["overlap_s"]
            out.append(row)
    return out


def _f(x, digits: int = 3) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def markdown(data: dict) -> str:
    m = data["meta"]
    v = m["versions"]
    lines = [
        "# Asynchronous rollouts on this CPU: rollout.staleness 0, 1, 2 (issue 43)",
        "",
        f"Measured {m['date']} with `{m['command']}` ({m['rounds']} rounds, {m['steps']} steps a "
        f"run, medians over steps {m['warm'] + 1}..N − k; PPO {m['ppo_epochs']} epoch(s) a step), "
        f"proximal {v['proximal']}, torch {v['torch']}, on {m['machine'].get('cpu', '?')} "
        f"({m['machine'].get('cores', '?')} cores); load average at the start "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in m.get('loadavg_end', []))}; {m['wall_s']:.0f} s.",
        "",
    ]
    if m.get("smoke"):
        lines += ["**A smoke run (`--smoke`): the harness end to end, not a measurement.**", ""]
    if m.get("note"):
        lines += [m["note"], ""]
    lines += [
        "Cases: `sync-2t` staleness 0 on 2 threads (the baseline), `k1`/`k2` staleness 1/2 with the "
        "default pinning (trainer core 0, generator core 1, one thread each), `sync-1t` staleness "
        "0 on 1 thread. s/step: the median step period (wall clock, waiting included); ratio: to "
        "sync-2t, the median of the per-round ratios (< 1 is faster). gen: generation seconds a step "
        "(k ≥ 1: in the generator); busy: the trainer's step less its wait (generator idle: in the "
        "last k steps, with nothing left to generate); wait share: of the period.",
        "",
        "| work | method | case | s/step | ratio to sync-2t (per round) | gen s | busy s | "
        "busy s, generator idle | wait s | wait share | gen share of step | load |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["summary"]:
        per = " ".join(f"{x:.3f}" for x in r["ratios"])
        ratio = f"{r['ratio']:.3f} ({per})" if r["ratio"] is not None else "—"
        lines.append(
            f"| {r['work']} | {r['method']} | {r['case']} | {_f(r['period_s'])} | {ratio} | "
            f"{_f(r['gen_s'])} | {_f(r['busy_s'])} | {_f(r.get('solo_busy_s'))} | "
            f"{_f(r['wait_s'])} | {r['wait_share']:.0%} | {r['gen_share']:.0%} | "
            f"{r['loadavg']:.2f} |"
        )
    lines += [
        "",
        "## The GPU estimate from the phase shares",
        "",
        "g: generation's share of a synchronous (sync-2t) step. With generation and training on "
        "devices of their own, the overlapped step is max(g, 1 − g) of the synchronous one (plus the "
        "weight synchronisation), so the speed-up is at most 1 / max(g, 1 − g). On this CPU the "
        "k1 runs' own bound: sync-2t's s/step over max(the generator's gen s, the trainer's busy "
        "s), each on one core.",
        "",
        "| work | method | g (sync-2t) | GPU bound 1/max(g, 1−g) | k1 measured speed-up | "
        "k1 CPU overlap bound |",
        "|---|---|---:|---:|---:|---:|",
    ]
    by = {(r["work"], r["method"], r["case"]): r for r in data["summary"]}
    for work, method in dict.fromkeys((r["work"], r["method"]) for r in data["summary"]):
        b, k1 = by.get((work, method, BASELINE)), by.get((work, method, "k1"))
        if b is None:
            continue
        speed = f"{1 / k1['ratio']:.2f}×" if k1 and k1.get("ratio") else "—"
        cpu = f"{k1['cpu_bound']:.2f}×" if k1 and "cpu_bound" in k1 else "—"
        lines.append(
            f"| {work} | {method} | {b['gen_share']:.2f} | {b['gpu_bound']:.2f}× | {speed} | {cpu} |"
        )
    lines += ["", "## Every run", ""]
    lines += [
        "| work | method | case | round | s/step | gen s | busy s | wait s | load before | rc |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["runs"]:
        if r["rc"] != 0:
            lines.append(
                f"| {r['work']} | {r['method']} | {r['case']} | {r['round']} | — | — | — | — | "
                f"{r['loadavg_before']:.2f} | {r['rc']} |"
            )
            continue
        lines.append(
            f"| {r['work']} | {r['method']} | {r['case']} | {r['round']} | "
            f"{_f(r['median_period_s'])} | {_f(r['median_gen_s'])} | {_f(r['median_busy_s'])} | "
            f"{_f(r['median_wait_s'])} | {r['loadavg_before']:.2f} | 0 |"
        )
    return "\n".join(lines) + "\n" + data.get("appendix", "")


def versions() -> dict:
    import importlib.metadata as md  # lazy: only here

    return {"proximal": proximal_side.version(), "torch": md.version("torch")}


APPENDIX_MARK = "<!-- learning: kept across measurements -->"


def merge(results: list[dict]) -> dict:
    """One results file from several invocations: their runs together, summarised again; the
    first one's meta, with every invocation's command, date, rounds and load listed."""
    meta = dict(results[0]["meta"])
    meta["merged"] = [
        {k: r["meta"].get(k) for k in ("command", "date", "rounds", "steps", "steps_of", "wall_s")}
        | {"loadavg": [r["meta"]["loadavg_start"], r["meta"].get("loadavg_end")]}
        for r in results
    ]
    meta["command"] = " + ".join(f"`{m['command']}`" for m in meta["merged"]).strip("`")
    meta["wall_s"] = sum(r["meta"]["wall_s"] for r in results)
    meta["rounds"] = "/".join(str(r["meta"]["rounds"]) for r in results)
    meta["steps"] = "/".join(str(r["meta"]["steps"]) for r in results)
    meta["loadavg_end"] = results[-1]["meta"].get("loadavg_end", [])
    runs = [run for r in results for run in r["runs"]]
    return {"meta": meta, "runs": runs, "summary": summarize(runs)}


def write_results(path: Path, data: dict) -> None:
    """``path`` (markdown) and its ``.json``. A section after :data:`APPENDIX_MARK` in an existing
    ``path`` (the learning table) is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file():
        old = path.read_text()
        if APPENDIX_MARK in old:
            data["appendix"] = "\n" + old[old.index(APPENDIX_MARK) :]
    path.with_suffix(".json").write_text(
        json.dumps({k: v for k, v in data.items() if k != "appendix"}, indent=1)
    )
    path.write_text(markdown(data))


# ------------------------------------------------------------------------------------------------
# Learning at staleness 1 and 2 against 0: a table from `proximal compare` output directories
# ------------------------------------------------------------------------------------------------


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def learning_runs(compare_dir: Path, task: str) -> list[dict]:
    """Every finished run of a ``proximal compare`` output directory: its method, seed, staleness
    and ``rollout.correction`` (from its config), the final policy's held-out means (gold, the
    verifier, KL to the SFT model) and, over its steps, the mean of ``rollout/mismatch_k3`` and of
    the share of tokens the tis weight truncated (``rollout/correction_truncated_frac``)."""
    import yaml  # lazy: only the learning table reads run configs

    out = []
    for run in sorted((compare_dir / "runs").glob("*-seed*")):
        if not (run / "compare_run.json").is_file() or not (run / "eval.json").is_file():
            continue  # running, or failed before its evaluation
        info = json.loads((run / "compare_run.json").read_text())
        if info.get("status") != "ok":
            continue
        r = yaml.safe_load((run / "config.yaml").read_text())["rollout"]
        final = json.loads((run / "eval.json").read_text())["final"]["mean"]
        rows = [
            json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()
        ]
        rows = [x for x in rows if "time/step_s" in x]

        def mean_of(key: str, rows=rows) -> float | None:
            xs = [float(x[key]) for x in rows if x.get(key) is not None]
            return statistics.mean(xs) if xs else None

        k = int(r.get("staleness", 0))
        corr = r.get("correction")
        mode = (
            ("tis" if k >= 1 else "none") if corr is None else ("none" if corr == "off" else corr)
        )
        out.append(
            {
                "task": task,
                "dir": compare_dir.name,
                "method": info["method"],
                "seed": info["seed"],
                "staleness": k,
                "correction": "default" if corr is None else str(corr),
                "mode": mode,
                "gold": final.get("gold"),
                # the digit task's exact sort; the arithmetic task's gold is its exact match
                "verifier": final.get("verifier", final.get("gold")),
                "format_error": final.get("format_error"),
                "kl": final.get("kl"),
                "mismatch_k3": mean_of("rollout/mismatch_k3"),
                "truncated_frac": mean_of("rollout/correction_truncated_frac"),
                "staleness_logged": max(
                    (int(x.get("rollout/staleness", 0)) for x in rows), default=0
                ),
                "train_s": float(rows[-1]["time/wall_s"]) if rows else None,
            }
        )
    return out


def learning_markdown(runs: list[dict], sft: dict[str, dict], note: str = "") -> str:
    """The learning section: per task × method × staleness × correction, mean ± sample std over
    seeds of the held-out gold, the verifier's exact match and the KL to the SFT model."""
    lines = [
        APPENDIX_MARK,
        "## Learning at staleness 1 and 2 against 0",
        "",
    ]
    if note:
        lines += [note, ""]
    lines += [
        "| task | method | staleness | rollout.correction (applied) | seeds | gold ↑ | exact match ↑ "
        "| gold − staleness 0's, per seed | format errors | KL to SFT "
        "| mismatch k3 (mean over steps) | tokens truncated by tis |",
        "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    tasks = {t: i for i, t in enumerate(dict.fromkeys(r["task"] for r in runs))}  # as given
    keys = dict.fromkeys(
        (r["task"], r["method"], r["staleness"], r["correction"], r["mode"])
        for r in sorted(
            runs, key=lambda r: (tasks[r["task"]], r["method"], r["staleness"], r["mode"])
        )
    )
    for task, method, k, corr, mode in keys:
        rs = [
            r
            for r in runs
            if (r["task"], r["method"], r["staleness"], r["correction"], r["mode"])
            == (task, method, k, corr, mode)
        ]

        def cell(key: str, digits: int = 3, rs=rs) -> str:
            xs = [r[key] for r in rs if r[key] is not None]
            if not xs:
                return "—"
            m, sd = _mean_std(xs)
            return f"{m:.{digits}f} ± {sd:.{digits}f}"

        def sci(key: str, rs=rs) -> str:
            xs = [r[key] for r in rs if r[key] is not None]
            return f"{statistics.mean(xs):.2g}" if xs else "—"

        sync = {
            r["seed"]: r["gold"]
            for r in runs
            if (r["task"], r["method"], r["staleness"]) == (task, method, 0)
        }
        diffs = [f"{r['gold'] - sync[r['seed']]:+.3f}" for r in rs if r["seed"] in sync]
        lines.append(
            f"| {task} | {method} | {k} | {corr} ({mode}) | "
            f"{','.join(str(r['seed']) for r in rs)} | {cell('gold')} | {cell('verifier')} | "
            f"{' '.join(diffs) if k else '—'} | {cell('format_error')} | {cell('kl', 2)} | "
            f"{sci('mismatch_k3')} | "
            f"{sci('truncated_frac')} |"
        )
    for task, m in sft.items():
        lines += [
            "",
            f"The SFT model every {task} run starts from: gold {m['gold']:.3f}, exact match "
            f"{m.get('verifier', m['gold']):.3f}"
            + (f", format errors {m['format_error']:.3f}." if "format_error" in m else "."),
        ]
    return "\n".join(lines) + "\n"


def write_learning(out: Path, dirs: list[str], note: str) -> None:
    """``TASK=DIR,DIR,…`` compare directories → the learning section of ``out`` (kept across speed
    measurements: written after :data:`APPENDIX_MARK`, whatever stood there replaced)."""
    runs, sft = [], {}
    for spec in dirs:
        task, paths = spec.split("=", 1)
        for d in paths.split(","):
            runs += learning_runs(Path(d), task)
            f = Path(d) / "sft_eval.json"
            if f.is_file() and task not in sft:
                got = json.loads(f.read_text())
                sft[task] = got["mean"]
    text = out.read_text() if out.is_file() else ""
    head = text[: text.index(APPENDIX_MARK)] if APPENDIX_MARK in text else text
    out.write_text(head.rstrip("\n") + "\n\n" + learning_markdown(runs, sft, note))
    out.with_name(out.stem + "-learning.json").write_text(json.dumps(runs, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--works", default="tiny,wide", help="comma-separated works of harness/works.py"
    )
    ap.add_argument("--methods", default="grpo,ppo")
    ap.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}"
    )
    ap.add_argument(
        "--cases-of",
        default="",
        help="WORK=case+case,… : other cases for some works (e.g. wide=sync-2t+k1+k2)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps a run")
    ap.add_argument("--steps-of", default="", help="WORK=N,… : other step counts for some works")
    ap.add_argument("--warm", type=int, default=2, help="steps left out of each run's medians")
    ap.add_argument("--ppo-epochs", type=int, default=1, help="PPO's epochs a step")
    ap.add_argument("--workdir", type=Path, default=BENCH / ".work" / "async")
    ap.add_argument("--out", type=Path, default=BENCH / "results-async.md")
    ap.add_argument("--note", default="", help="a sentence for the results")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the mini work, GRPO, sync-2t and k1, 3 steps, 1 round: the harness end to end, "
        "not a measurement",
    )
    ap.add_argument(
        "--learning",
        nargs="+",
        metavar="TASK=DIR,…",
        help="write the learning section of --out from these `proximal compare` output "
        "directories instead of measuring (--note: its sentence)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="write --out from these results files' runs instead of measuring (each a work of "
        "its own, say; every invocation listed)",
    )
    args = ap.parse_args(argv)
    if args.merge:
        write_results(args.out, merge([json.loads(p.read_text()) for p in args.merge]))
        return 0
    if args.learning:
        write_learning(args.out, args.learning, args.note)
        return 0
    works = {**WORKS, "mini": MINI}
    if args.smoke:
        args.works, args.methods, args.cases, args.rounds = "mini", "grpo", "sync-2t,k1", 1
        args.steps, args.warm, args.cases_of, args.steps_of = 3, 1, "", ""
    names = args.works.split(",")
    cases = args.cases.split(",")
    cases_of = {w: c.split("+") for w, c in (x.split("=") for x in args.cases_of.split(",") if x)}
    steps_of = {w: int(n) for w, n in (x.split("=") for x in args.steps_of.split(",") if x)}
    unknown = (
        set(names) - set(works)
        | set(args.methods.split(",")) - set(METHODS)
        | {c for cs in [cases, *cases_of.values()] for c in cs} - set(CASES)
    )
    if unknown:
        ap.error(f"unknown work, method or case: {', '.join(sorted(unknown))}")
    args.workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.time()
    data: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/async.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(),
            "versions": versions(),
            "loadavg_start": loadavg(),
            "rounds": args.rounds,
            "steps": args.steps,
            "steps_of": steps_of,
            "cases_of": cases_of,
            "warm": args.warm,
            "ppo_epochs": args.ppo_epochs,
            "smoke": args.smoke,
            "note": args.note,
            "works": {n: asdict(works[n]) for n in names},
        },
        "runs": [],
    }
    inputs = {}
    for n in names:
        w = works[n]
        model = write_models(w, args.workdir)
        steps = steps_of.get(n, args.steps)
        inputs[n] = (model, write_prompts(w, args.workdir, 4 * w.batch * steps, model["policy"]))
    for k in range(1, args.rounds + 1):
        for n in names:
            for method in args.methods.split(","):
                for case in cases_of.get(n, cases):
                    model, prompts = inputs[n]
                    rec = run_one(
                        method,
                        works[n],
                        case,
                        k,
                        model=model,
                        prompts=prompts,
                        steps=steps_of.get(n, args.steps),
                        warm=args.warm,
                        ppo_epochs=args.ppo_epochs,
                        workdir=args.workdir,
                        log=log,
                    )
                    data["runs"].append(rec)
                    if rec["rc"] == 0:
                        log(
                            f"r{k} {n} {method} {case}: {rec['median_period_s']:.3f} s/step, "
                            f"gen {rec['median_gen_s']:.3f} s, busy {rec['median_busy_s']:.3f} s, "
                            f"wait {rec['median_wait_s']:.3f} s (load {rec['loadavg_before']:.2f})"
                        )
    data["summary"] = summarize(data["runs"])
    data["meta"]["wall_s"] = time.time() - t0
    data["meta"]["loadavg_end"] = loadavg()
    write_results(args.out, data)
    log(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 1 if any(r["rc"] != 0 for r in data["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
