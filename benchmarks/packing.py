"""SFT on a length-skewed set, padded against packed, the same model and tokens per step.

Lengths are drawn from 8 to 512 tokens, most short (a geometric-like skew: 8 · 64^u with u ~ U(0,1)²).
Three ways to cut a step's 32 rows into micro-batches, each in its own fresh process (so its peak
resident memory, ``ru_maxrss``, is its own), alternating ``--repeats`` times:

- ``rows``: ``--rows`` rows a micro-batch in data order, padded (``train.micro_batch_size``, the
  default way);
- ``padded``: micro-batches of at most ``--budget`` tokens counted as rows × the longest, rows taken
  longest first (``train.micro_batch_tokens``);
- ``packed``: the same budget counted as the sum of lengths, each micro-batch one packed row
  (``train.packing``).

Prints the medians and the ratios to ``rows`` and to ``padded``.

    .venv/bin/python benchmarks/packing.py [--repeats 3] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from proximal.data.packing import plan_micro_batches
from proximal.data.sft import SFTExample
from proximal.models.loading import load_causal_lm
from proximal.models.tiny import build_char_tokenizer, build_tiny_causal_lm
from proximal.trainers.sft import nll_step

ROWS_PER_STEP = 32


def examples(n: int, vocab: int, seed: int = 0) -> list[SFTExample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = int(8 * 64 ** (rng.random() ** 2))  # 8 … 512, most short
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        out.append(SFTExample(ids, length // 4, "bench"))
    return out


def worker(model_dir: str, mode: str, steps: int, budget: int, rows_per_micro: int) -> dict:
    packed = mode == "packed"
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = load_causal_lm(model_dir, dtype="float32")
    model.train()
    data = examples(ROWS_PER_STEP * (steps + 1), model.config.vocab_size)
    tokens, seconds = 0, 0.0
    for s in range(steps + 1):  # step 0 warms up, not timed
        rows = data[s * ROWS_PER_STEP : (s + 1) * ROWS_PER_STEP]
        n = float(sum(r.n_targets for r in rows))
        t0 = time.perf_counter()
        if mode == "rows":
            groups = [
                list(range(i, min(i + rows_per_micro, len(rows))))
                for i in range(0, len(rows), rows_per_micro)
            ]
        else:
            groups = plan_micro_batches([[len(r.input_ids)] for r in rows], budget, packed=packed)
        for g in groups:
            nll_step(model, [rows[i] for i in g], 0, "cpu", n, packed=packed)
        model.zero_grad(set_to_none=True)
        if s:
            seconds += time.perf_counter() - t0
            tokens += sum(len(r.input_ids) for r in rows)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"tokens_per_s": tokens / seconds, "peak_mib": peak_mib}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=4, help="rows a micro-batch in the 'rows' mode")
    ap.add_argument("--worker", nargs=2, metavar=("MODEL_DIR", "MODE"))
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.steps, a.budget, a.rows)))
        return
    with tempfile.TemporaryDirectory() as d:
        tok = build_char_tokenizer(list("abcdefghijklmnopqrstuvwxyz"))
        path = build_tiny_causal_lm(
            Path(d) / "m",
            tok,
            seed=0,
            hidden=128,
            layers=4,
            heads=4,
            max_positions=1024,
        )
        got: dict[str, list[dict]] = {"rows": [], "padded": [], "packed": []}
        for _ in range(a.repeats):
            for mode in got:
                cmd = [sys.executable, __file__, "--worker", str(path), mode]
                cmd += ["--steps", str(a.steps), "--budget", str(a.budget), "--rows", str(a.rows)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                got[mode].append(json.loads(out.strip().splitlines()[-1]))
    med = {
        m: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "peak_mib")}
        for m, rs in got.items()
    }
    print(json.dumps({"runs": got, "median": med}, indent=1))
    for a_mode, b_mode in (("packed", "rows"), ("padded", "rows"), ("packed", "padded")):
        a, b = med[a_mode], med[b_mode]
        print(
            f"{a_mode}/{b_mode}: tokens/s × {a['tokens_per_s'] / b['tokens_per_s']:.2f}, "
            f"peak memory × {a['peak_mib'] / b['peak_mib']:.2f}"
        )


if __name__ == "__main__":
    main()
