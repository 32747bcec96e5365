"""On a CUDA machine: every method's peak GPU memory against ``proximal memory --run``.

The runs of ``benchmarks/memory_methods.py`` (the same tiny models, data and configs), each in a fresh
Python process with ``train.device: cuda``: the real trainer through ``proximal <command> --config``,
three steps; ``torch.cuda.reset_peak_memory_stats()`` when the second step begins (after step 1's
metrics row) and ``torch.cuda.max_memory_allocated()`` when it ends is the step's peak — exactly the
tensors the planner counts (the CUDA context, the caching allocator's reserve and cuBLAS's workspace
are not in it, nor in the plan). The planner is asked about the same ``run.yaml`` as
``proximal memory --run`` reads it. On a GPU, bfloat16 runs use SDPA attention (no s x s matrix);
``--precision bf16-mixed`` checks autocast's weight copies and the bfloat16 frozen models.

    python benchmarks/memory_gpu_check.py                         # every run, float32
    python benchmarks/memory_gpu_check.py --precision bf16-mixed --shape medium
    python benchmarks/memory_gpu_check.py --runs ppo grpo --json

Not run in CI (no GPU there); ``tests/test_memory_methods.py`` checks that it imports and answers
``--help`` on a CPU. Results go to ``benchmarks/results/memory_gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_methods  # noqa: E402  (the runs, their assets and configs)

#: The runs worth a GPU: every method once, and the paths that differ there (bf16 without eager
#: attention is the flag's business).
DEFAULT_RUNS = ("ppo", "ppo-lora", "grpo", "rloo", "dpo", "simpo", "sft", "sft-logits", "rm")


def worker(name: str, workdir: Path) -> dict:
    """Run ``name`` on the GPU; its second step's peak allocated bytes, and the plan."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from proximal.cli import main
    from proximal.memory.budget import plan
    from proximal.memory.command import plan_run
    from proximal.train import run as run_module

    command, _ = memory_methods.RUNS[name]
    yaml_path = workdir / f"{name}.yaml"
    seen: dict[str, int] = {}
    log = run_module.Run.log

    def marked(self, step, metrics, postfix=None):
        torch.cuda.synchronize()
        if step == 1:
            seen["static"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        elif step == 2:
            seen["peak"] = torch.cuda.max_memory_allocated()
        return log(self, step, metrics, postfix)

    run_module.Run.log = marked
    t0 = time.time()
    code = main([command, "--config", str(yaml_path)])
    if code != 0:
        raise RuntimeError(f"proximal {command} exited with {code}")
    setup, _ = plan_run(str(yaml_path), "rloo" if name == "rloo" else command)
    p = plan(setup)
    return {
        "name": name,
        "method": setup.method,
        "precision": setup.precision,
        "peak": seen["peak"],
        "static": seen["static"],
        "predicted": p.peak,
        "predicted_static": p.static,
        "predicted_phases": p.phases,
        "predicted_peak_phase": p.peak_phase,
        "ratio": seen["peak"] / p.peak,
        "seconds": round(time.time() - t0, 1),
        "device_name": torch.cuda.get_device_name(),
    }


def prepare(workdir: Path, shape: str, names: list[str], precision: str) -> None:
    """The assets of ``memory_methods`` and each run's YAML, on the GPU in ``precision``."""
    import yaml

    assets = memory_methods.build_assets(workdir / "assets", memory_methods.SHAPES[shape])
    for name in names:
        cfg = memory_methods.run_config(name, assets, workdir / "runs" / name)
        cfg["train"].update(device="cuda", precision=precision)
        cfg["train"].pop("cpu_matmul", None)
        (workdir / f"{name}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def run_one(name: str, workdir: Path) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
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
            f"memory_gpu_check worker {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--runs",
        nargs="+",
        choices=tuple(memory_methods.RUNS),
        default=list(DEFAULT_RUNS),
        help="runs of benchmarks/memory_methods.py (default: every method once, and sft-logits)",
    )
    ap.add_argument(
        "--shape", choices=tuple(memory_methods.SHAPES), default="small", help="model shape"
    )
    ap.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed", "bf16-true"),
        default="32-true",
        help="train.precision of every run (default: 32-true)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "memory_gpu_check.json",
        help="where to write the results as JSON ('-' for nowhere)",
    )
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=tuple(memory_methods.RUNS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.workdir)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "memory_gpu_check: no CUDA device here (torch.cuda.is_available() is False)",
            file=sys.stderr,
        )
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="memory_gpu_check_") as d:
        workdir = Path(d)
        prepare(workdir, args.shape, args.runs, args.precision)
        for name in args.runs:
            r = run_one(name, workdir)
            print(
                f"{name:<16} max allocated {r['peak'] / 2**20:>9,.1f} MiB  predicted "
                f"{r['predicted'] / 2**20:>9,.1f} MiB  ratio {r['ratio']:.2f}  ({r['seconds']} s)",
                file=sys.stderr,
            )
            results.append(r)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"shape": args.shape, "precision": args.precision, "results": results}, indent=1
            )
            + "\n"
        )
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(
            "| run | method | static: predicted | measured | peak: predicted | measured | ratio |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['name']} | {r['method']} | {r['predicted_static'] / 2**20:,.1f} "
                f"| {r['static'] / 2**20:,.1f} | {r['predicted'] / 2**20:,.1f} "
                f"| {r['peak'] / 2**20:,.1f} | {r['ratio']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
