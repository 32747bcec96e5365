"""Measured versus predicted for every method: the peak memory of a step of proximal's own trainer
against ``proximal memory --run`` on the same config.

For each run below a fresh Python process runs ``proximal <command> --config run.yaml`` — the real
trainer through its command line, three steps — under ``torch.profiler`` with
``profile_memory=True``, which records every allocation and free through PyTorch's CPU allocator:
the running sum is the live tensor bytes (the CPU analogue of ``torch.cuda.memory_allocated()``),
and the peak over the second step (AdamW's state exists by then; the third step is there so that no
end-of-run export falls in the window) is compared with the planner's per-device peak for the same
``run.yaml``, read by ``proximal.memory.command.plan_run`` exactly as ``proximal memory --run`` reads
it. ``static`` is the live bytes when the second step begins (weights and AdamW state); the planner's
counterpart is its "weights + optimizer state".

The models are built by ``proximal.models.tiny`` (Llama-style, untied head) and saved to disk as a
user's checkpoint would be; the tokenizer is the tiny character tokenizer with placeholder tokens
added up to the vocabulary, so the head is as wide as a small real model's relative to its body.
Every data row fills the configured lengths (SFT rows and preference pairs ``data.max_length``
tokens, prompts ``data.max_prompt_length``; responses run to ``rollout.max_new_tokens`` unless the
random policy samples EOS, p = 1/V per token), since the planner sizes the longest sequence a config
allows. Float matrix products go through torch's BLAS (``train.cpu_matmul: blas``): the oneDNN path
packs a copy of the weights for decoding, a CPU-only cost the planner (which plans GPUs) leaves out.

    .venv/bin/python benchmarks/memory_methods.py                  # every run, a table
    .venv/bin/python benchmarks/memory_methods.py --runs sft dpo --json

The tolerance is ±15 % (docs/memory.md argues it); ``tests/test_memory_methods.py`` asserts it for
every method at the ``small`` size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The model shape of every run: small enough for seconds a step on 2 cores, large enough that the
#: tensors (tens of MiB) dwarf the allocator's other traffic.
SHAPES = {
    # what tests/test_memory_methods.py runs: a few seconds a method
    "test": dict(vocab=4096, hidden=128, layers=2, heads=2),
    "small": dict(vocab=8192, hidden=256, layers=4, heads=4),
    "medium": dict(vocab=16384, hidden=384, layers=6, heads=6),
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
TOLERANCE = 0.15

#: name -> (command, the YAML's sections beyond model/data/output). Batches accumulate two
#: micro-batches, so the gradients of the first are held while the second runs.
RUNS: dict[str, tuple[str, dict]] = {
    "ppo": (
        "ppo",
        {
            "rollout": {"batch_size": 8, "max_new_tokens": 64},
            "ppo": {"epochs": 1, "mini_batch_size": 8, "micro_batch_size": 4},
            "data": {"max_prompt_length": 32},
        },
    ),
    "ppo-lora": (
        "ppo",
        {
            "model": {"lora_r": 8, "critic_lora": True},
            "rollout": {"batch_size": 8, "max_new_tokens": 64},
            "ppo": {"epochs": 1, "mini_batch_size": 8, "micro_batch_size": 4},
            "data": {"max_prompt_length": 32},
        },
    ),
    "grpo": (
        "grpo",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "grpo": {"micro_batch_size": 8, "beta": 0.04},
            "data": {"max_prompt_length": 32},
        },
    ),
    "rloo": (
        "grpo",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "grpo": {"micro_batch_size": 8, "beta": 0.0, "advantage": "rloo"},
            "data": {"max_prompt_length": 32},
        },
    ),
    "grpo-logits": (
        "grpo",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "grpo": {"micro_batch_size": 8, "beta": 0.04},
            "data": {"max_prompt_length": 32},
            "train": {"logprobs": "logits"},
        },
    ),
    "grpo-ckpt": (
        "grpo",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "grpo": {"micro_batch_size": 8, "beta": 0.04},
            "data": {"max_prompt_length": 32},
            "train": {"activation_checkpointing": True},
        },
    ),
    "grpo-bf16": (
        "grpo",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "grpo": {"micro_batch_size": 8, "beta": 0.04},
            "data": {"max_prompt_length": 32},
            "train": {"precision": "bf16-mixed"},
        },
    ),
    # on-policy distillation: a teacher twice the student's width (same tokenizer), no reference
    "distill": (
        "distill",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "distill": {"micro_batch_size": 8},
            "data": {"max_prompt_length": 32},
        },
    ),
    "distill-jsd": (
        "distill",
        {
            "rollout": {"batch_size": 4, "group_size": 4, "max_new_tokens": 64},
            "distill": {"micro_batch_size": 8, "loss": "jsd"},
            "data": {"max_prompt_length": 32},
        },
    ),
    "dpo": ("dpo", {"train": {"batch_size": 8, "micro_batch_size": 4}}),
    "dpo-bf16": (
        "dpo",
        {"train": {"batch_size": 8, "micro_batch_size": 4, "precision": "bf16-mixed"}},
    ),
    "dpo-precomputed": (
        "dpo",
        {"train": {"batch_size": 8, "micro_batch_size": 4, "precompute_ref_logprobs": True}},
    ),
    "simpo": ("simpo", {"train": {"batch_size": 8, "micro_batch_size": 4}}),
    "sft": ("sft", {"train": {"batch_size": 16, "micro_batch_size": 8}}),
    "sft-logits": (
        "sft",
        {"train": {"batch_size": 16, "micro_batch_size": 8, "logprobs": "logits"}},
    ),
    "sft-bf16": (
        "sft",
        {"train": {"batch_size": 16, "micro_batch_size": 8, "precision": "bf16-mixed"}},
    ),
    "rm": ("rm", {"train": {"batch_size": 8, "micro_batch_size": 4}}),
}
#: Sequence lengths: prompts and responses of the online runs, the rows of the others.
MAX_LENGTH, PROMPT, COMPLETION = 256, 64, 191  # 64 + 191 + EOS = 256 tokens


# --------------------------------------------------------------------------------------------------
# Assets: the models and the data, on disk
# --------------------------------------------------------------------------------------------------


def build_assets(root: Path, shape: dict) -> dict[str, Path]:
    """A tokenizer of ``shape['vocab']`` tokens, a policy, a one-label reward model, a teacher (the
    policy's shape at twice its width, for distill) and the data files (SFT rows, preference pairs,
    prompts) under ``root``; their paths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from proximal.data.jsonl import write_jsonl
    from proximal.models.tiny import build_char_tokenizer, tiny_config

    root.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(list(ALPHABET))
    tok.add_tokens([f"<x{i}>" for i in range(shape["vocab"] - len(tok))])
    ids = dict(
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    kw = dict(
        hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"], max_positions=512
    )
    paths = {"policy": root / "policy", "reward": root / "reward"}
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok), **ids, **kw))
    policy.generation_config.pad_token_id = tok.pad_token_id
    policy.generation_config.eos_token_id = tok.eos_token_id
    policy.save_pretrained(paths["policy"])
    tok.save_pretrained(paths["policy"])
    reward = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", len(tok), num_labels=1, **ids, **kw)
    )
    reward.save_pretrained(paths["reward"])
    tok.save_pretrained(paths["reward"])
    paths["teacher"] = root / "teacher"
    wide = {**kw, "hidden": 2 * shape["hidden"]}
    teacher = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok), **ids, **wide))
    teacher.save_pretrained(paths["teacher"])
    tok.save_pretrained(paths["teacher"])

    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice(ALPHABET[:26]) for _ in range(n))

    paths["sft"] = root / "sft.jsonl"
    write_jsonl(
        paths["sft"], [{"prompt": text(PROMPT), "completion": text(COMPLETION)} for _ in range(64)]
    )
    paths["pairs"] = root / "pairs.jsonl"
    write_jsonl(
        paths["pairs"],
        [
            {"prompt": text(PROMPT), "chosen": text(COMPLETION), "rejected": text(COMPLETION)}
            for _ in range(64)
        ],
    )
    paths["prompts"] = root / "prompts.jsonl"
    write_jsonl(paths["prompts"], [{"prompt": text(32)} for _ in range(64)])
    return paths


def run_config(name: str, assets: dict[str, Path], out: Path) -> dict:
    """The YAML of run ``name``: its command's sections over what every run shares."""
    command, sections = RUNS[name]
    online = command in ("ppo", "grpo", "distill")
    cfg = {
        "model": {"path": str(assets["policy"])},
        "data": (
            {"prompts": str(assets["prompts"])}
            if online
            else {
                "train_file": str(assets["sft" if command == "sft" else "pairs"]),
                "max_length": MAX_LENGTH,
            }
        ),
        "train": {"steps": 3, "save_every": 0, "device": "cpu", "cpu_matmul": "blas"},
        "output": {"dir": str(out), "overwrite": True, "progress": False},
    }
    if command == "distill":
        cfg["model"]["teacher"] = str(assets["teacher"])
        cfg["output"]["samples_per_step"] = 0
    elif online:
        cfg["model"]["reward_model"] = str(assets["reward"])
        cfg["output"]["samples_per_step"] = 0
    else:
        cfg["train"]["eval_every"] = 0
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


# --------------------------------------------------------------------------------------------------
# The worker: one run, one fresh process
# --------------------------------------------------------------------------------------------------


def worker(name: str, workdir: Path) -> dict:
    """Run ``name``'s trainer under the profiler; measure its second step; ask the planner."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import yaml
    from torch.profiler import ProfilerActivity, profile

    from proximal.cli import main
    from proximal.memory.budget import plan
    from proximal.memory.command import plan_run
    from proximal.train import run as run_module

    # One intra-op thread: the machine is usually shared; memory does not depend on the count.
    torch.set_num_threads(1)
    command, _ = RUNS[name]
    yaml_path = workdir / f"{name}.yaml"
    marks: list[tuple[int, int]] = []
    log = run_module.Run.log

    def marked(self, step, metrics, postfix=None):
        marks.append((time.time_ns(), step))
        return log(self, step, metrics, postfix)

    run_module.Run.log = marked
    t0 = time.time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        code = main([command, "--config", str(yaml_path)])
    seconds = time.time() - t0
    if code != 0:
        raise RuntimeError(f"proximal {command} exited with {code}")
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    starts = {step: t for t, step in marks}
    begin, end = starts[1], starts[2]  # the second step: after step 1's log, up to its own
    live, peak, static = 0, 0, None
    for t, nbytes in events:
        if static is None and t >= begin:
            static = live
        live += nbytes
        if begin <= t < end:
            peak = max(peak, live)
    setup, _ = plan_run(str(yaml_path), "rloo" if name == "rloo" else command)
    p = plan(setup)
    # The profiler counts the allocator's tensors: the plan's, less a CPU plan's host memory beyond
    # them (the process's imports, compiled code).
    tensors = p.peak - sum(p.host.values())
    return {
        "name": name,
        "method": setup.method,
        "peak": peak,
        "static": static,
        "predicted": tensors,
        "predicted_static": p.static,
        "predicted_phases": p.phases,
        "predicted_peak_phase": p.peak_phase,
        "ratio": peak / tensors,
        "seconds": round(seconds, 1),
        "events": len(events),
        "config": yaml.safe_load(yaml_path.read_text()),
    }


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def prepare(workdir: Path, shape: str, names: list[str]) -> None:
    """Build the assets and write each run's YAML under ``workdir``."""
    import yaml

    assets = build_assets(workdir / "assets", SHAPES[shape])
    for name in names:
        cfg = run_config(name, assets, workdir / "runs" / name)
        (workdir / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def run_one(name: str, workdir: Path) -> dict:
    """``worker`` for run ``name`` in a fresh interpreter; its result."""
    env = dict(
        os.environ,
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        OMP_NUM_THREADS="1",
        # transformers loads checkpoints on worker threads by default, and the profiler records only
        # this thread's allocations: a bfloat16 model converted there would go unseen.
        HF_DEACTIVATE_ASYNC_LOAD="1",
    )
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"memory_methods worker {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(results: list[dict], shape: str) -> str:
    """The table in docs/memory.md."""
    s = SHAPES[shape]
    rows = [
        f"Shape `{shape}`: hidden {s['hidden']} x {s['layers']} layers, vocabulary {s['vocab']}; "
        "`train.precision: 32-true` (the `bf16` runs: `bf16-mixed`), one process, sizes in MiB.",
        "",
        "| run | method | logprobs | static: predicted | measured | peak: predicted | measured | "
        "ratio | above static: predicted | measured | ratio | peak phase |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        train = r["config"].get("train", {})
        above_p, above_m = r["predicted"] - r["predicted_static"], r["peak"] - r["static"]
        rows.append(
            f"| {r['name']} | {r['method']} "
            f"| {'-' if r['method'] == 'rm' else train.get('logprobs', 'fused')} "
            f"| {_mib(r['predicted_static'])} | {_mib(r['static'])} | {_mib(r['predicted'])} "
            f"| {_mib(r['peak'])} | {r['ratio']:.2f} | {_mib(above_p)} | {_mib(above_m)} "
            f"| {above_m / above_p:.2f} | {r['predicted_peak_phase']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS), help="runs (default: all)"
    )
    ap.add_argument("--shape", choices=tuple(SHAPES), default="small", help="model shape")
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "memory_methods.json",
        help="where to write the results as JSON ('-' for nowhere)",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=tuple(RUNS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.workdir)))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="memory_methods_") as d:
        workdir = Path(d)
        prepare(workdir, args.shape, args.runs)
        for name in args.runs:
            r = run_one(name, workdir)
            print(
                f"{name:<16} measured {_mib(r['peak']):>8} MiB  predicted {_mib(r['predicted']):>8} "
                f"MiB  ratio {r['ratio']:.2f}  ({r['seconds']} s)",
                file=sys.stderr,
            )
            results.append(r)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(
            ["benchmarks/memory_methods.py"] + (argv if argv is not None else sys.argv[1:])
        )
        args.out.write_text(
            json.dumps(
                {
                    "versions": _versions(),
                    "command": command,
                    "shape": args.shape,
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )
    print(json.dumps(results, indent=1) if args.json else markdown(results, args.shape))
    return 0


def _versions() -> dict:
    import platform

    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    sys.exit(main())
