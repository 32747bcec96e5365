"""One training run's life, the same for every command: start (devices, processes, seed, the run
directory and its overwrite guard), resume, log, checkpoint, finish.

A trainer calls, in order::

    run = open_run(...)                      # before any model loads: cheap checks first
    ... build models, optimisers, samplers ...
    start, counters = run.restore(trained, stateful)   # from the checkpoint, when resuming
    run.begin(cfg, start=start, total=total, counters=counters, progress=..., precision=...)
                                             # the run directory is now ours: config.yaml, logs, bar,
                                             # the device's peak FLOP/s (perf.json)
    run.record_models(engine=engine, actor=actor, ...)   # models.json, the models' FLOP shapes
    for step in range(start + 1, total + 1):
        ...
        run.log(step, {**metrics, **run.utilisation(seconds, flops=..., tokens=...)})
        stop = run.stop_requested()          # SIGTERM / SIGUSR1 / SIGINT on any rank (signals.py)
        if stop or due(step, total, save_every):
            run.save(step, trained=..., stateful=..., counters=..., exports=..., keep=...)
        if stop:
            run.stop(step)                   # raises signals.Stopped (not after the last step)
    run.finish()

The fixed-dataset methods (SFT, RM, DPO, SimPO) run this through :func:`proximal.train.fixed.fit`.

The run's parts are its own modules: what it tells the person watching (the bar, the lines it says,
``run.log``: :mod:`proximal.train.progress`) and what it records (``models.json`` and the best
checkpoint: :mod:`proximal.train.records`); the device's peak FLOP/s is :mod:`proximal.train.perf`'s.

``open_run(..., resume_dir="auto")`` (``--resume auto``) continues the run in ``output_dir`` from its
newest intact checkpoint when it has one and starts it otherwise, so one command line serves the
first launch and every relaunch; a run already at its last step raises :class:`RunFinished` before
anything is written (before any model loads where the trainer knows its step count by then:
``open_run(total=...)``, or :meth:`Run.check_finished` once the data is read).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from proximal import dist
from proximal.config import ConfigError, save_config
from proximal.logging import MetricsLogger, truncate_jsonl
from proximal.models import compiled, kernels
from proximal.models.flops import ModelShape
from proximal.rollout.engine import HFEngine
from proximal.train import signals
from proximal.train.checkpoint import (
    MANIFEST,
    CheckpointError,
    completed,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_name,
)
from proximal.train.host import bfloat16_note, busy_cpu_note
from proximal.train.optim import resync_schedule, seed_everything
from proximal.train.perf import measure_peak, step_metrics
from proximal.train.progress import Progress
from proximal.train.records import (
    BestCheckpoint,
    record_models,
    recorded_matmul,
    recorded_models,
)

#: Entries that mark a directory as a run of ours (so output.overwrite may replace it).
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")
#: Line-per-step logs that a resumed run cuts back to its checkpoint.
STEP_LOGS = ("metrics.jsonl", "samples.jsonl")
#: ``resume_dir`` of :func:`open_run` for ``--resume auto``: continue the run in ``output_dir`` from
#: its newest intact checkpoint when it has one, else start it.
AUTO = "auto"


class RunFinished(Exception):
    """``--resume auto`` of a run that already reached its last step: nothing to do (exit status 0)."""


def resolve_device(name: str) -> torch.device:
    """``train.device`` → a device: ``auto`` is cuda when available; under torchrun each process takes
    ``cuda:LOCAL_RANK``. ConfigError for a CUDA device this machine lacks."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if dist.launched_world_size() > 1:
            if ":" in name:
                raise ConfigError(
                    f"train.device = {name!r}: under torchrun give 'cuda' (or 'auto'); each "
                    "process takes cuda:LOCAL_RANK"
                )
            name = f"cuda:{dist.local_rank()}"
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= count:
            raise ConfigError(
                f"train.device = {name!r}, but this machine has {count or 'no'} CUDA devices"
            )
    return torch.device(name)


def check_per_rank(
    errors: list[str],
    name: str,
    total: int,
    micro_name: str | None = None,
    micro: int | None = None,
) -> None:
    """Append an error unless ``total`` splits evenly over the processes (and into ``micro``-sized
    passes on each), naming the fields and the process count. ``total`` not divisible by ``micro`` at
    all is the caller's own check (one message, not two)."""
    w = dist.launched_world_size()
    if total % w:
        errors.append(
            f"{name} = {total} is not divisible by the {w} processes (torchrun --nproc_per_node × nodes)"
        )
    elif micro_name is not None and total % micro == 0 and (total // w) % micro:
        errors.append(
            f"{name} = {total} over {w} processes is {total // w} rows each, not divisible by "
            f"{micro_name} = {micro}"
        )


def due(step: int, total: int, every: int) -> bool:
    """Whether a periodic action (a checkpoint, a held-out evaluation) runs after ``step``: every
    ``every`` steps and always after the last one (``every`` = 0: only then)."""
    return step == total or (every > 0 and step % every == 0)


@dataclass
class Run:
    """A run directory being trained into, and the process's place in the job."""

    command: str
    dir: Path
    device: torch.device
    resume_from: Path | None
    earlier: list[Path]
    notes: list[str]
    #: ``{"backend": "onednn" | "blas", "why": ...}`` of the float32 CPU products
    #: (:func:`proximal.models.kernels.configure`); None on other devices.
    cpu_matmul: dict | None = None
    #: ``--resume auto``; and the step of the checkpoint resumed from (None: a fresh run).
    auto: bool = False
    checkpoint_step: int | None = None
    #: The step count :meth:`begin` was given; the stop signal agreed at the last step boundary.
    total: int | None = None
    stop_signal: int = 0
    logger: MetricsLogger | None = None
    wall0: float = field(default_factory=time.perf_counter)
    #: The run's peak FLOP/s as ``perf.json`` records it (:func:`proximal.train.perf.measure_peak`),
    #: measured in :meth:`begin`; and each recorded model's FLOP shape, by :meth:`record_models`.
    peak: dict | None = None
    shapes: dict[str, ModelShape | None] = field(default_factory=dict)
    #: ``output.keep_best`` (:meth:`track_best`): the best value so far and its step
    #: (:class:`proximal.train.records.BestCheckpoint`).
    best: BestCheckpoint = field(default_factory=BestCheckpoint)
    #: Lines for ``run.log`` only (printed too with ``verbose``, ``output.verbose``): the choices that
    #: change no result (the CPU products' backend and why, a busy machine's note). Every line the
    #: run says goes to ``run.log`` as well (:meth:`say`), from :meth:`begin` on.
    quiet: list[str] = field(default_factory=list)
    verbose: bool = False
    #: The ``models.json`` of the run being resumed (``{}`` for a fresh run): its recorded choices.
    recorded: dict = field(default_factory=dict)
    #: The bar, the lines said and ``run.log`` (:class:`proximal.train.progress.Progress`).
    progress: Progress = field(init=False)

    def __post_init__(self) -> None:
        self.progress = Progress(self.command, verbose=self.verbose)

    @property
    def rank(self) -> int:
        return dist.rank()

    @property
    def world_size(self) -> int:
        return dist.world_size()

    @property
    def is_main(self) -> bool:
        return dist.is_main()

    # ------------------------------------------------------------------ resume
    def restore(self, trained: dict, stateful: dict) -> tuple[int, dict]:
        """``(start step, counters)``: (0, {}) for a fresh run; else the checkpoint's, with ``trained``
        (``{name: (module, optimizer)}``) and ``stateful`` (``{name: obj with load_state_dict}``) loaded."""
        if self.resume_from is None:
            return 0, {}
        state = load_checkpoint(self.resume_from, trained=trained)
        self.best.best = state.get("counters", {}).get("best")
        for name, obj in stateful.items():
            if obj is not None and state.get(name) is not None:
                obj.load_state_dict(state[name])
                if isinstance(obj, torch.optim.lr_scheduler.LambdaLR):
                    # the run may have been extended: the schedule's shape changed
                    resync_schedule(obj)
        return int(state["step"]), dict(state.get("counters", {}))

    def plan(self, total: int) -> None:
        """The run's step count, known before any model loads: "auto" compiling weighs its cost
        against it (:func:`proximal.models.compiled.plan`), and under ``--resume auto`` a finished run
        stops here (:meth:`check_finished`)."""
        compiled.plan(total)
        self.check_finished(total)

    def check_finished(self, total: int) -> None:
        """Under ``--resume auto``, raise :class:`RunFinished` when the checkpoint is the run's last
        step ``total`` (a blind relaunch of a finished run touches nothing)."""
        if self.auto and self.checkpoint_step is not None and self.checkpoint_step == total:
            raise RunFinished(
                f"the run in {self.dir} is finished (its checkpoint is step {total} of {total}); "
                "nothing to do (give a larger --train.steps to continue it)"
            )

    # ------------------------------------------------------------------ start
    def begin(
        self,
        cfg,
        *,
        start: int,
        total: int,
        counters: dict,
        progress: bool,
        tensorboard: bool = False,
        wandb_project: str | None = None,
        unit: str = "step",
        precision: str = "32-true",
        rollout_precision: str | None = None,
    ) -> None:
        """Take the run directory: delete an earlier run (only now that everything has loaded), write
        config.yaml, open the metrics log (cut back to ``start`` when resuming) and the progress bar;
        then measure the device's peak FLOP/s for products in ``precision``'s dtype
        (``train.precision``; ``perf.json``), before the clock of ``time/wall_s`` starts.
        ``rollout_precision``: the decode's own precision where it differs (``rollout.precision``),
        for the note on a CPU that would emulate bfloat16 (:func:`proximal.train.host.bfloat16_note`)."""
        self.check_finished(total)  # --resume auto of a finished run: nothing is written
        self.total = total
        # before anything is written: the checkpoint and the logs stay as they are
        if start > total:
            raise ConfigError(
                f"--resume {self.dir}: its checkpoint is at step {start}, past the {total} steps "
                f"this config trains (train.steps, or train.epochs); give --train.steps larger "
                f"than {start} to continue the run"
            )
        if self.stop_requested():  # signalled while loading: nothing trained, nothing to write
            signals.stopping()
            where = (
                f"the run continues from {self.resume_from.name}"
                if self.resume_from is not None
                else "nothing was written"
            )
            raise signals.Stopped(
                f"{signals.name(self.stop_signal)} received before the first step: stopped; "
                f"{where} (relaunch with --resume auto)",
                self.stop_signal,
                everywhere=True,
            )
        if start == total and start > 0:
            self.notes.append(
                f"the run is already at step {start} of {total}: nothing to train (give a larger "
                "--train.steps to continue it)"
            )
        if self.is_main:
            for p in self.earlier:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            self.dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.dir / "config.yaml")
            for name in STEP_LOGS:
                truncate_jsonl(self.dir / name, start)
            self.logger = MetricsLogger(
                self.dir, tensorboard=tensorboard, wandb_project=wandb_project
            )
            self.progress.open_log(self.dir, self.resume_from)
            for line in self.quiet:
                self.note(line)
            slow = bfloat16_note(self.device, precision, rollout_precision)
            for note in self.notes + ([slow] if slow else []):
                self.say(note)
            if progress:
                self.progress.open_bar(total=total, start=start, unit=unit)
        dist.barrier()
        self.peak = measure_peak(self.device, precision, self.dir)
        self.wall0 = time.perf_counter() - float(counters.get("wall_s", 0.0))

    def wall_s(self) -> float:
        return time.perf_counter() - self.wall0

    def record_models(self, engine: HFEngine | None = None, **models) -> dict:
        """Write ``models.json`` (:func:`proximal.train.records.record_models`: each model this run
        holds, counted from the live modules, with the CPU products' backend, the decode path of the
        model ``engine`` decodes, compiled blocks) and return it. Each model's FLOP shape is kept in
        ``shapes``, under the same names, for the steps' ``perf/`` metrics (:meth:`utilisation`)."""
        info, self.shapes = record_models(
            self.progress,
            self.dir,
            is_main=self.is_main,
            cpu_matmul=self.cpu_matmul,
            recorded=self.recorded,
            engine=engine,
            models=models,
        )
        return info

    def utilisation(self, seconds: float, *, flops: float, tokens: int) -> dict[str, float]:
        """A step's ``perf/tokens_per_s``, ``perf/flops_per_s`` and ``perf/mfu`` from its model
        ``flops`` (:mod:`proximal.models.flops`, every process's), its trained ``tokens`` and its wall
        time ``seconds``, against the peak :meth:`begin` measured (docs/performance.md)."""
        return step_metrics(
            flops=flops, tokens=tokens, seconds=seconds, peak=self.peak["total_peak_flops_per_s"]
        )

    def say(self, line: str) -> None:
        """Print ``proximal <command>: <line>`` (the caller decides which ranks speak), above the
        progress bar when there is one, and append it to ``run.log`` once :meth:`begin` opened it."""
        self.progress.say(line)

    def note(self, line: str) -> None:
        """A line for ``run.log`` only, printed as :meth:`say` prints only with ``output.verbose``:
        what the run chose where the choice changes no result (rank 0's)."""
        self.progress.note(line)

    def log(self, step: int, metrics: dict, postfix: dict | None = None) -> None:
        """Append a metrics row (rank 0) with the step's peak memory, and advance the progress bar.

        ``memory/peak_bytes``: the peak since the previous row (:func:`peak_memory_bytes`): on CUDA
        the allocator's, on CPU the process's resident set."""
        if step > 0:
            metrics = {**metrics, "memory/peak_bytes": peak_memory_bytes(self.device)}
        line = self.best.see(step, metrics)
        if line and self.is_main:
            self.say(line)
        if self.logger is not None:
            self.logger.log(step, metrics)
        if step > 0:
            self.progress.advance(postfix)

    # ------------------------------------------------------------------ the best checkpoint
    def track_best(self, metric: str | None, mode: str = "auto") -> None:
        """Keep the checkpoint of the best ``metric`` (``output.keep_best``: an ``eval/*`` name;
        None: nothing to do), larger better with ``mode`` max, smaller with min, and auto as
        :func:`~proximal.train.records.resolve_best_mode` resolves it (said in one line). Every row
        :meth:`log` writes after step 0 that holds it is compared; a new best makes :meth:`new_best`
        true for that step, and the trainer then checkpoints it."""
        line = self.best.track(metric, mode)
        if line and self.is_main:
            self.say(line)

    def new_best(self, step: int) -> bool:
        """Whether ``step``'s row set a new best ``output.keep_best`` value (checkpoint it now)."""
        return self.best.is_new(step)

    # ------------------------------------------------------------------ checkpoints
    def save(
        self, step: int, *, trained: dict, stateful: dict, counters: dict, exports: dict, keep: int
    ) -> Path:
        counters = {**counters, "wall_s": self.wall_s()}
        if self.best.best is not None:
            counters["best"] = dict(self.best.best)
        state = {
            name: obj.state_dict() if obj is not None else None for name, obj in stateful.items()
        }
        return save_checkpoint(
            self.dir / "checkpoints",
            step,
            trained=trained,
            state={**state, "counters": counters},
            exports=exports,
            keep=keep,
            meta={"command": self.command},
            best=self.best.kept_step(),
        )

    def stop_requested(self) -> bool:
        """Whether a stop signal (:mod:`proximal.train.signals`) reached this process or any other
        since the run opened: one decision for every rank (a max over ranks of the signal number,
        one small all-reduce per step when there are several), so all checkpoint the same step and
        none waits alone in a collective. Call it at the same point of every step."""
        got = signals.received()
        if self.world_size > 1:
            got = int(dist.all_reduce_max(torch.tensor([got], device=self.device))[0])
        self.stop_signal = got
        return got != 0

    def stop(self, step: int) -> None:
        """After step ``step``'s checkpoint, when :meth:`stop_requested`: end the run with
        :class:`~proximal.train.signals.Stopped` (exit status 75 for SIGTERM and SIGUSR1, 130 for
        SIGINT). After the last step there is nothing to stop: the run finishes as usual."""
        which = signals.name(self.stop_signal)
        if step == self.total:
            if self.is_main:
                self.say(f"{which} received during the last step: finishing the run")
            return
        signals.stopping()
        self.progress.close()
        if self.logger is not None:
            self.logger.close()
        raise signals.Stopped(
            f"{which} received: stopped after step {step} of {self.total}, checkpoint "
            f"{self.dir / 'checkpoints' / step_name(step)} written; the same command line with "
            f"--resume auto (or --resume {self.dir}) continues the run",
            self.stop_signal,
            everywhere=True,
        )

    def finish(self) -> None:
        self.progress.close()
        if self.logger is not None:
            self.logger.close()
        dist.barrier()
        signals.restore()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory since the previous call, the largest over processes: on CUDA the allocator's
    (``torch.cuda.max_memory_allocated``, then reset); on CPU the process's resident set (Linux's
    VmHWM, then reset through ``/proc/self/clear_refs``; where that cannot be written, the process's
    peak so far, ``ru_maxrss``)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        peak = _resident_peak()
    if dist.is_distributed():
        peak = int(dist.all_reduce_max(torch.tensor([peak], dtype=torch.float64, device=device))[0])
    return int(peak)


def _resident_peak() -> int:
    """The CPU process's peak resident bytes since the previous call (or since it started)."""
    try:
        with open("/proc/self/status") as fh:
            hwm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current resident set (Linux ≥ 4.0)
        return hwm
    except (OSError, StopIteration, ValueError):
        import resource  # lazy: Unix-only, and needed only where /proc cannot be read

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def earlier_run(run_dir: Path, overwrite: bool) -> list[Path]:
    """The entries of an earlier run in ``run_dir``, to delete once the new run has loaded.

    A directory holding a run is refused without ``overwrite`` (continue it with ``--resume``); a
    non-empty directory that is not a run is refused even with it, so nothing else is ever deleted.
    """
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output.dir = {run_dir}: exists and is not a directory")
    entries = sorted(run_dir.iterdir()) if run_dir.is_dir() else []
    if not entries:
        return []
    if not any((run_dir / m).exists() for m in RUN_MARKERS):
        raise ConfigError(
            f"output.dir = {run_dir} is not empty and does not look like a run directory (no "
            f"{', '.join(RUN_MARKERS)}); refusing to use it even with output.overwrite"
        )
    if not overwrite:
        raise FileExistsError(
            f"output.dir {run_dir} already holds a run; continue it with --resume {run_dir}, "
            "or start afresh with --output.overwrite true"
        )
    return entries


def unwritable(run_dir: Path) -> str | None:
    """Why no file can be created in ``run_dir`` (None: one can): the directory and any missing
    parents are made, a probe file is written and removed, then what was made is removed again, so
    a run that stops later on bad input leaves nothing behind. A path that exists and is not a
    directory is :func:`earlier_run`'s to report."""
    missing, p = [], run_dir
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    if run_dir.exists() and not run_dir.is_dir():
        return None
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        fd, probe = tempfile.mkstemp(prefix=".proximal-write-test-", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"output.dir = {run_dir}: cannot write there ({e.strerror or e}: {e.filename or run_dir})"
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
    return None


def open_run(
    command: str,
    *,
    output_dir: str,
    overwrite: bool,
    seed: int,
    device: str,
    dist_timeout_s: float,
    resume_dir: str | Path | None = None,
    cpu_matmul: str = "auto",
    total: int | None = None,
    compile: str = "eager",
    verbose: bool = False,
) -> Run:
    """Everything before the first model loads: the device, the backend of the float32 CPU products
    (``cpu_matmul``, ``train.cpu_matmul``: auto, onednn or blas, set process-wide by
    :func:`proximal.models.kernels.configure` and recorded at the start on a CPU), whether the models
    prepared from here compile their blocks (``compile``, ``train.compile``, process-wide through
    :func:`proximal.models.compiled.configure`; "eager" for a caller that does not say), the process group,
    the seed, the run directory's guard (or the checkpoint to resume, verified).

    ``resume_dir``: None starts a run in ``output_dir``; a run directory continues it; :data:`AUTO`
    continues the run in ``output_dir`` when it has an intact checkpoint and starts it otherwise
    (replacing the files of an earlier launch that never wrote one; a directory whose checkpoints
    are all damaged is refused). ``total``: the run's step count when the caller knows it before
    loading anything (ppo, grpo), so that ``--resume auto`` of a finished run stops here, and
    "auto" compiling knows the run's length (:meth:`Run.plan`; the others call it once their data
    is read).

    A resumed run takes the choices its run directory's ``models.json`` recorded — the CPU
    products' backend, "auto" compiling's length verdict, the decode path (:meth:`Run.record_models`)
    — so that its numbers continue the uninterrupted run's; where it cannot (the recorded backend is
    missing on this host, ``PROXIMAL_CPU_MATMUL`` overrides it) it says so in one line. The
    backend's line and a busy machine's note go to ``run.log`` and ``models.json``; printed only with
    ``verbose`` (``output.verbose``)."""
    dev = resolve_device(device)
    dist.init(dev, dist_timeout_s)
    auto = isinstance(resume_dir, str) and resume_dir == AUTO
    run_dir = Path(output_dir if auto or resume_dir is None else resume_dir)
    # A directory that cannot be written is found now, not at the first checkpoint (rank 0 looks:
    # the job's processes share the file system a run directory is on).
    problem = dist.broadcast_object(unwritable(run_dir) if dist.is_main() else None)
    if problem is not None:
        raise ConfigError(problem)
    notes: list[str] = []
    quiet: list[str] = []  # run.log's (and output.verbose's) lines: choices that change no result
    ckpt, step = None, None
    if resume_dir is not None:
        ckpt, found_notes = find_checkpoint(run_dir / "checkpoints")
        notes += found_notes
        damaged = "; ".join(n for n in found_notes if n.startswith("skipping"))
        if ckpt is None and auto and damaged:
            raise CheckpointError(
                f"--resume auto: {run_dir} has checkpoints but none is intact ({damaged}); to start "
                "the run afresh, launch it without --resume auto and with --output.overwrite true"
            )
        if ckpt is None and not auto:
            raise CheckpointError(
                f"--resume {run_dir}: no intact checkpoint under {run_dir / 'checkpoints'} "
                f"({damaged or 'none was ever written'})"
            )
    # The choices made by measurement: a resumed run takes those its run directory recorded, so
    # that its numbers continue the run's (kernels.configure, compiled.configure).
    recorded = recorded_models(run_dir) if ckpt is not None else {}
    matmul_before = recorded_matmul(recorded)
    backend, why = kernels.configure(cpu_matmul, recorded=matmul_before)
    compiled.configure(compile, recorded=compiled.recorded_verdict(recorded))
    if dist.is_distributed() and dev.type == "cpu":  # every rank multiplies as rank 0 chose
        backend, why, probed = dist.broadcast_object((backend, why, kernels.probed()))
        kernels.adopt(backend, why)
    else:
        probed = kernels.probed()
    seed_everything(seed)
    busy = None
    if dev.type == "cpu":
        # Printed where it changes a result — a resumed run that cannot use the backend it recorded,
        # a backend asked for and missing (oneDNN) — else a line of run.log
        line = f"cpu matmul: {backend} ({why})"
        if matmul_before is not None and backend != matmul_before:
            quiet.append(line)
            notes.insert(
                0,
                f"cpu matmul: {backend}, not the {matmul_before} the run being resumed used "
                f"({why}): from here its numbers differ from an uninterrupted run's in the last "
                "digits",
            )
        else:
            (notes if "; but " in why else quiet).append(line)
        busy = busy_cpu_note(torch.get_num_threads() * dist.launched_world_size())
        quiet += [busy] if busy else []
    if ckpt is not None:
        manifest = json.loads((ckpt / MANIFEST).read_text())
        step, wrote = int(manifest["step"]), manifest.get("command", command)
        if wrote != command:
            raise CheckpointError(
                f"{ckpt} is a checkpoint of proximal {wrote}, not of proximal {command}; give this "
                "run an output.dir of its own"
            )
        stale = [c for c in completed(run_dir / "checkpoints") if c.name > ckpt.name]
        # damaged ones skipped on the way: their steps are redone, so they must not be kept
        if stale:
            if dist.is_main():
                for c in stale:
                    shutil.rmtree(c, ignore_errors=True)
            notes.append(
                f"removed {', '.join(c.name for c in stale)}, newer than the checkpoint resumed from"
            )
        earlier = []
        if auto:
            notes.append(f"--resume auto: continuing from {ckpt.name}")
    else:
        # every rank checks (one shared file system), rank 0 deletes; --resume auto without a
        # checkpoint replaces what an earlier launch that never wrote one left (a run's files only)
        earlier = earlier_run(run_dir, overwrite or auto)
        if auto:
            notes.append(
                f"--resume auto: no checkpoint in {run_dir} yet, starting the run"
                + (" (replacing the files of an earlier launch)" if earlier else "")
            )
    dist.barrier()  # every rank has looked at the directory before rank 0 writes anything into it
    matmul = {"backend": backend, "why": why} if dev.type == "cpu" else None
    if matmul is not None and probed is not None:  # train.cpu_matmul: auto's measurement
        matmul["probe"] = {
            k: probed[k]
            for k in ("rates", "noise", "threads", "key", "cached", "busy_load", "rule")
            if k in probed
        }
    if matmul is not None and busy is not None:
        matmul["busy"] = busy
    run = Run(
        command,
        run_dir,
        dev,
        ckpt,
        earlier,
        notes,
        cpu_matmul=matmul,
        auto=auto,
        checkpoint_step=step,
        quiet=quiet,
        verbose=verbose,
        recorded=recorded,
    )
    if total is not None:
        run.plan(total)
    # From here a stop signal asks the run to stop after the step in progress (signals.py); the
    # handlers stay until Run.finish (or the command's end, proximal.train.command).
    signals.install()
    return run
