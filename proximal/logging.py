"""Run logging: one JSON line per step, with TensorBoard and Weights & Biases as opt-in extras.

Metric names are flattened with ``/`` (``loss/policy``, ``kl/beta``); the JSONL file is the source
of truth that reports and resume tests read.
"""

from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path
from typing import Any


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (1e308 if v > 0 else -1e308)
    return v


#: What each optional logger needs installed, and the message when it is missing.
TENSORBOARD_MISSING = (
    "output.tensorboard=true needs TensorBoard: pip install 'proximal-rlhf[tensorboard]'"
)
WANDB_MISSING = "output.wandb_project needs Weights & Biases: pip install 'proximal-rlhf[wandb]'"


def missing_extras(tensorboard: bool, wandb_project: str | None) -> list[str]:
    """One message per optional logger asked for whose package is not installed (nothing is imported)."""
    return ([TENSORBOARD_MISSING] if tensorboard and find_spec("tensorboard") is None else []) + (
        [WANDB_MISSING] if wandb_project and find_spec("wandb") is None else []
    )


class MetricsLogger:
    """Appends ``{"step": k, ...}`` lines to ``run_dir/metrics.jsonl`` and mirrors them to optional sinks.

    ``tensorboard=True`` needs the ``tensorboard`` package; ``wandb_project`` needs ``wandb``. Both are
    optional extras; a clear error says which package to install when asked for and missing.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        config: dict | None = None,
        filename: str = "metrics.jsonl",
    ):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tb = None
        self._wandb = None
        if tensorboard:
            try:
                # lazy: optional logger, imported only when asked for
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(TENSORBOARD_MISSING) from e
            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            try:
                # lazy: optional logger, imported only when asked for
                import wandb
            except ImportError as e:
                raise ImportError(WANDB_MISSING) from e
            self._wandb = wandb.init(project=wandb_project, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def truncate_jsonl(path: str | Path, step: int) -> None:
    """Keep only the lines of ``path`` whose ``step`` is ≤ ``step`` (all lines go for step 0).

    Used when a run (re)starts: lines written after the checkpoint it resumes from, including a
    half-written last line of a crashed run, are dropped so the file never holds a step twice.
    """
    p = Path(path)
    if not p.exists():
        return
    keep = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue
    p.write_text("".join(line + "\n" for line in keep), encoding="utf-8")


def read_metrics(path: str | Path) -> list[dict]:
    """All rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_samples(
    run_dir: str | Path,
    step: int,
    prompts: list[str],
    completions: list[str],
    scores,
    components: dict,
    valid,
    n: int,
    extra: list[dict] | None = None,
) -> None:
    """The first ``n`` trained-on (valid) rows of a rollout, appended to ``run_dir/samples.jsonl``:
    step, prompt, response, total score and each reward source's score (and ``extra[i]``'s keys:
    a multi-turn row's ``trajectory``, its turns)."""
    rows = [i for i, ok in enumerate(valid.tolist()) if ok][:n]
    if not rows:
        return
    with (Path(run_dir) / "samples.jsonl").open("a", encoding="utf-8") as fh:
        for i in rows:
            row = {
                "step": step,
                "prompt": prompts[i],
                "response": completions[i],
                "score": float(scores[i]),
                # null: a reward function that returned None (does not apply to the row)
                **{f"score/{k}": _plain(float(v[i])) for k, v in components.items()},
                **(extra[i] if extra is not None else {}),
            }
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
