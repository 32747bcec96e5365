"""What a run records beside its metrics: ``models.json`` (each model it holds, counted from the live
modules, with the choices made for it — the CPU products' backend, the decode path, compiled blocks)
and the best checkpoint (``output.keep_best``: the best held-out value so far and its step, kept in
every checkpoint's counters). :class:`proximal.train.run.Run` holds one :class:`BestCheckpoint` and
writes ``models.json`` through :func:`record_models`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from proximal.config import ConfigError
from proximal.models.flops import ModelShape, model_shape
from proximal.rollout.engine import HFEngine
from proximal.train.progress import Progress

# ----------------------------------------------------------------------------------------------
# The best checkpoint
# ----------------------------------------------------------------------------------------------

#: The metrics ``output.keep_best_mode: auto`` takes as better smaller besides names ending in "loss":
#: the held-out KL of the policy to its reference, per sequence and per token.
MIN_METRICS = ("eval/kl", "eval/kl_per_token", "eval/kl_ref")


def resolve_best_mode(metric: str, mode: str) -> tuple[str, str]:
    """``output.keep_best_mode`` for ``metric``: ``(max | min, why)``. An explicit max or min stands;
    auto is min for a name ending in "loss" and for :data:`MIN_METRICS`, max otherwise."""
    if mode != "auto":
        return mode, f"output.keep_best_mode = {mode}"
    if metric.endswith("loss") or metric in MIN_METRICS:
        return "min", "output.keep_best_mode = auto: min for a loss or a KL"
    return "max", "output.keep_best_mode = auto: max for any metric but a loss or a KL"


@dataclass
class BestCheckpoint:
    """``output.keep_best`` and ``keep_best_mode`` (:meth:`track`); the best value logged so far,
    ``{"metric", "value", "step"}`` (saved in every checkpoint's counters, so it survives a resume);
    the step whose row set a new best."""

    metric: str | None = None
    mode: str = "max"  # resolved: max or min
    best: dict | None = None
    new_step: int | None = None

    def track(self, metric: str | None, mode: str = "auto") -> str | None:
        """Keep the checkpoint of the best ``metric`` (None: nothing to do), larger better with
        ``mode`` max, smaller with min, and auto as :func:`resolve_best_mode` resolves it. Returns
        the line that says so (None without a metric)."""
        resolved, why = resolve_best_mode(metric, mode) if metric is not None else (mode, "")
        self.metric, self.mode = metric, resolved
        if metric is None:
            return None
        return (
            f"keep best: {metric}, {'smaller' if resolved == 'min' else 'larger'} is better ({why})"
        )

    def see(self, step: int, metrics: dict) -> str | None:
        """Compare a logged row that holds held-out metrics; a new best makes :meth:`is_new` true for
        ``step`` and returns the line that says so. ConfigError when the row lacks the metric."""
        m = self.metric
        if m is None or not any(k.startswith("eval/") for k in metrics):
            return None
        if m not in metrics:  # a held-out row without it: the name is wrong (step 0 says so first)
            names = sorted(k for k in metrics if k.startswith("eval/"))
            raise ConfigError(
                f"output.keep_best = {m!r}: this run logs no such metric; its held-out metrics "
                f"are {', '.join(names)}"
            )
        value = float(metrics[m])
        if step == 0 or not math.isfinite(value):
            return None  # step 0 is the starting model, which no checkpoint of this run holds
        same = self.best is not None and self.best.get("metric") == m  # a resume may change it
        old = self.best["value"] if same else None
        if old is None or (value > old if self.mode == "max" else value < old):
            self.best = {"metric": m, "value": value, "step": step}
            self.new_step = step
            return f"new best {m} = {value:.6g} at step {step}: checkpointing it"
        return None

    def is_new(self, step: int) -> bool:
        """Whether ``step``'s row set a new best value (checkpoint it now)."""
        return self.new_step == step

    def kept_step(self) -> int | None:
        """The step whose checkpoint is kept as the best (None: none is)."""
        return self.best["step"] if self.best is not None and self.metric else None


# ----------------------------------------------------------------------------------------------
# models.json
# ----------------------------------------------------------------------------------------------


def record_models(
    progress: Progress,
    run_dir: Path,
    *,
    is_main: bool,
    cpu_matmul: dict | None,
    recorded: dict,
    engine: HFEngine | None = None,
    models: dict,
) -> tuple[dict, dict[str, ModelShape | None]]:
    """Write ``run_dir/models.json`` (rank 0): each of ``models`` counted from the live modules —
    parameters, bytes (all ranks together), dtypes, whether it trains; a module shared by two names
    counted once, under the first. Returns ``(that dict, each model's FLOP shape)``.

    Each model on the CPU also gets ``"cpu_matmul"`` (``cpu_matmul``: this process's float32
    products), the model ``engine`` decodes ``"decode": {"path", "reason"}`` (following the path
    ``recorded``, the resumed run's models.json, chose), and a compiled one ``"compile"``; rank 0
    says the decode path and the compile line (:func:`compile_line`) through ``progress``."""
    info = resident_models(**models)
    shapes = {name: model_shape(m) if m is not None else None for name, m in models.items()}
    followed = None
    for name, module in models.items():
        if name not in info:
            continue
        on_cpu = next(module.parameters()).device.type == "cpu"
        if cpu_matmul is not None and on_cpu:
            info[name]["cpu_matmul"] = dict(cpu_matmul)
        if engine is not None and module is engine.model:
            entry = recorded.get(name)
            before = entry.get("decode") if isinstance(entry, dict) else None
            followed = engine.follow_recorded(before) if isinstance(before, dict) else None
            info[name]["decode"] = engine.decode_path()
        record = getattr(module, "_proximal_compile", None)
        if record is not None:
            info[name]["compile"] = dict(record)
    if engine is not None and not any("decode" in entry for entry in info.values()):
        raise ValueError("record_models: the engine's model is not one of the models given")
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "models.json").write_text(json.dumps(info, indent=1) + "\n")
        if engine is not None:
            progress.say(f"decode: {engine.describe_decode()}")
        if followed:
            progress.say(followed)
        line = compile_line(info)
        if line:
            progress.say(line)
        else:  # "auto" left every model eager: the reasons go to run.log
            line = compile_line(info, every=True)
            if line:
                progress.note(line)
    return info, shapes


def resident_models(**models) -> dict[str, dict]:
    """``{name: {"parameters", "bytes", "dtypes", "trainable"}}`` for every module given (None = not
    held), from the live parameters; sharded parameters count their global size."""
    seen: set[int] = set()
    out = {}
    for name, module in models.items():
        if module is None:
            continue
        params = [p for p in module.parameters() if id(p) not in seen]
        if not params:  # shares every parameter with a model already counted
            continue
        seen.update(id(p) for p in params)
        out[name] = {
            "parameters": sum(p.numel() for p in params),
            "bytes": sum(p.numel() * p.element_size() for p in params),
            "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
        }
    return out


def compile_line(info: dict[str, dict], every: bool = False) -> str | None:
    """The start line on ``train.compile`` from models.json's entries: which models run compiled blocks
    and why, which do not and why — printed when a model compiled, or when compiling was asked for and
    could not be done (``blocks`` declined, or the toolchain failing); a model "auto" leaves eager
    says nothing (``every``: the line all the same, for ``run.log``). None otherwise."""
    records = {name: e["compile"] for name, e in info.items() if "compile" in e}
    asked = (
        "train.compile = blocks"  # at the start of a reason (an "auto" reason may name it after)
    )
    if not records or not (
        every
        or any(
            r["blocks"] or "; but " in r["why"] or r["why"].startswith(asked)
            for r in records.values()
        )
    ):
        return None
    groups: dict[tuple[int, str], list[str]] = {}
    for name, r in records.items():
        groups.setdefault((r["blocks"], r["why"]), []).append(name)
    parts = [
        f"{', '.join(names)}: {f'{n} blocks compiled' if n else 'eager'} ({why})"
        for (n, why), names in groups.items()
    ]
    return "compile: " + "; ".join(parts)


def recorded_models(run_dir: Path) -> dict:
    """The ``models.json`` of the run in ``run_dir`` (``{name: entry}``), or ``{}`` where it has none
    or it cannot be read (a run from before it was written: its choices are made afresh)."""
    try:
        models = json.loads((run_dir / "models.json").read_text())
    except (OSError, ValueError):
        return {}
    return models if isinstance(models, dict) else {}


def recorded_matmul(models: dict) -> str | None:
    """The CPU products' backend a run's ``models.json`` recorded (``"onednn"`` or ``"blas"``, the
    first model's that has one), or None."""
    for entry in models.values():
        matmul = entry.get("cpu_matmul") if isinstance(entry, dict) else None
        if isinstance(matmul, dict) and matmul.get("backend") in ("onednn", "blas"):
            return matmul["backend"]
    return None
