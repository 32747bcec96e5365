"""The MFU yardstick alone (issue 27): a work's model FLOPs a step, by phase, and the machine's peak
probed on the work's own products — without running either side. ``compare_trl.py`` does the same
at the start of every invocation and reports MFU beside the ratio to TRL.

    python benchmarks/mfu.py                                  # tiny: the count and the probe
    python benchmarks/mfu.py --works tiny,wide --threads 2
    python benchmarks/mfu.py --works tiny --step-s 1.05       # MFU of a step of 1.05 s
    python benchmarks/mfu.py --works tiny --run benchmarks/.work/runs/tiny-r1-proximal/run

``--run`` reads a proximal run's ``metrics.jsonl`` (the median ``time/wall_s`` span of steps 2–N,
as compare_trl.py measures a step) and checks the count against the run's own ``perf/`` numbers
(``perf/flops_per_s`` × ``time/step_s``: the same FLOPs). Counting and probe:
benchmarks/harness/mfu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from harness import mfu  # noqa: E402
from harness.proximal_side import median_from_step2, read_steps  # noqa: E402
from harness.works import WORKS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--works", default="tiny", help=f"comma-separated, from: {', '.join(WORKS)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--step-s", type=float, default=None, help="a step time to express as MFU")
    ap.add_argument("--run", type=Path, default=None, help="a proximal run directory to read")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    a = ap.parse_args(argv)
    works = [WORKS[w.strip()] for w in a.works.split(",") if w.strip()]

    import torch

    torch.set_num_threads(a.threads)
    measured = mfu.measure(works, a.threads)
    c = measured["cpu"]
    print(f"CPU: {c['model']}, widest vectors {c['vector']}, {a.threads} threads")
    for w in works:
        m = measured["works"][w.name]
        peak = m["peak"]["peak_flops_per_s"]
        for shape, rates in m["peak"]["shapes"].items():
            print(
                f"  {w.name} {shape:>20s}: "
                + ", ".join(f"{b} {r / 1e9:.0f} GFLOP/s" for b, r in rates.items())
            )
        step = a.step_s
        if a.run is not None:
            steps = read_steps(a.run)
            step = median_from_step2(steps["period_s"])
            own = [
                float(r["perf/flops_per_s"]) * float(r["time/step_s"])
                for r in map(json.loads, (a.run / "metrics.jsonl").read_text().split("\n")[:-1])
                if r.get("perf/flops_per_s") is not None
            ]
            if own:
                print(
                    f"  {w.name}: the run's own count {own[-1] / 1e9:.4g} GFLOP a step, "
                    f"this one {m['flops']['total'] / 1e9:.4g}"
                )
        if step:
            m["step_s"], m["mfu"] = step, mfu.mfu(m["flops"]["total"], step, peak)
            print(f"  {w.name}: {step:.3g} s a step → MFU {100 * m['mfu']:.1f} %")
    if a.json:
        a.json.write_text(json.dumps(measured, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
