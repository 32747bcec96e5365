"""Running one side of one work as a fresh process: proximal through its CLI, an anchor through its
runner script in its own environment. Each returns one record of plain numbers (see :func:`record`).

With ``--baseline REF`` proximal also runs from a checkout of another commit (:func:`baseline_tree`),
the side named :data:`BASELINE`: the same Python, the same config, ``PYTHONPATH`` and the working
directory that tree, so ``python -m proximal`` imports the baseline's code (:func:`tree_proximal`
says which files a child imports)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import proximal_side
from harness.measure import cpu_busy, loadavg, run_measured
from harness.proximal_side import median_from_step2
from harness.works import Work

BENCH = Path(__file__).resolve().parents[1]
ROOT = BENCH.parent
GRPO_BETA = (
    0.04  # β of the GRPO work on both sides (TRL's default 0.0 would skip the reference model)
)
GRPO_LOSS = "grpo"  # the loss type on both sides: grpo | dr_grpo | dapo
#: The side name of proximal run from the ``--baseline`` checkout (this tree's side is "proximal").
BASELINE = "baseline"


def child_env(threads: int, *, pythonpath: list[Path]) -> dict:
    """The environment of every child: the same thread counts on both sides, no hub access, no
    inherited PYTHONPATH (an anchor must not import this tree's proximal)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    }
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONUNBUFFERED="1",
    )
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def _before() -> dict:
    return {"loadavg_before": loadavg(), "cpu_busy_before": cpu_busy(1.0)}


def record(work: Work, side: str, measured: dict, periods: list[float], extra: dict) -> dict:
    """One run: whole-process wall and peak RSS (measured outside), step spans, the median of steps 2..N."""
    return {
        "work": work.name,
        "side": side,
        **measured,
        "period_s": periods,
        "median_step_s": median_from_step2(periods) if periods else None,
        **extra,
    }


def run_proximal(
    work: Work,
    assets: dict,
    *,
    steps: int,
    threads: int,
    scratch: Path,
    timeout_s: float,
    keep_run: bool = False,
    logprobs: str | None = None,
    tree: Path = ROOT,
    side: str = "proximal",
) -> dict:
    """``proximal <method>`` on ``work``; ``logprobs`` sets ``train.logprobs`` (None: the default).
    The record holds the path the run used, as its saved config says (``logprobs``).

    ``tree`` is the source tree whose ``proximal`` runs (this one, or a :func:`baseline_tree`); the
    record's side is ``side``. The config is this tree's either way: it sets no field newer than
    issue 22's ``train.logprobs`` (and that one only with ``logprobs``) but ``train.compile: blocks``
    where ``tree`` has that field, so a baseline from then on reads it as this tree does."""
    method = work.method
    run_dir = scratch / "run"
    if method == "ppo":
        cfg = proximal_side.ppo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=steps,
            out_dir=run_dir,
            logprobs=logprobs,
        )
    else:
        cfg = proximal_side.grpo_config(
            work,
            model=assets["model"],
            prompts=assets["prompts"],
            steps=steps,
            out_dir=run_dir,
            beta=GRPO_BETA,
            loss=GRPO_LOSS,
            logprobs=logprobs,
        )
    cfg = proximal_side.with_compiled_blocks(cfg, tree)
    path = proximal_side.write_config(cfg, scratch / "config.yaml")
    before = _before()
    m = run_measured(
        proximal_command(method, path, tree),
        env=child_env(threads, pythonpath=source_path(tree)),
        log_path=scratch / "log.txt",
        timeout_s=timeout_s,
        cwd=str(tree),  # `python -m` puts the working directory first on sys.path
    )
    extra = {
        **before,
        "log": str(scratch / "log.txt"),
        "threads": threads,
        "logprobs": proximal_side.logprobs_used(run_dir),
    }
    periods: list[float] = []
    if (run_dir / "metrics.jsonl").is_file():
        steps_ = proximal_side.read_steps(run_dir)
        shutil.copy(run_dir / "metrics.jsonl", scratch / "metrics.jsonl")
        periods = steps_["period_s"]
        extra.update(
            step_s=steps_["step_s"],
            median_own_step_s=median_from_step2(steps_["step_s"]),
            mfu=steps_["mfu"],
            median_mfu=median_from_step2([x for x in steps_["mfu"] if x is not None]),
            response_length_mean=steps_["response_length_mean"],
            eos_frac=steps_["eos_frac"],
        )
        bad = [x for x in steps_["response_length_mean"] if x != work.response_len]
        if bad:
            extra["error"] = (
                f"responses were not all {work.response_len} tokens (length_mean {bad[0]})"
            )
    if m["rc"] != 0 and "error" not in extra:
        extra["error"] = f"exit {m['rc']}: " + _tail(scratch / "log.txt")
    if not keep_run:
        shutil.rmtree(run_dir, ignore_errors=True)  # wide-vocab checkpoints are GBs
    return record(work, side, m, periods, extra)


#: Python run first in a child of another tree (the baseline): drops setuptools' finder of an
#: editable install from ``sys.meta_path``. Where the venv has this tree installed editable, that
#: finder comes after the path finder, so the other tree's own modules win, but a module the other
#: tree lacks would silently come from this one instead of failing (``import proximal.x`` in a
#: try, a feature probe).
ONLY_ITS_TREE = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable__')]"
)


def proximal_command(method: str, config_path: Path, tree: Path = ROOT) -> list[str]:
    """``python -m proximal <method> --config FILE`` (this tree); for another tree the same through
    ``runpy`` after :data:`ONLY_ITS_TREE`, so every ``proximal`` module comes from that tree."""
    if tree == ROOT:
        return proximal_side.command(method, config_path)
    main = "; import runpy; runpy.run_module('proximal', run_name='__main__', alter_sys=True)"
    return [sys.executable, "-c", ONLY_ITS_TREE + main, method, "--config", str(config_path)]


def source_path(tree: Path) -> list[Path]:
    """``PYTHONPATH`` of a proximal child run from ``tree``: its ``proximal`` package and its
    ``benchmarks`` directory (GRPO's reward function, ``grpo_reward``)."""
    return [tree, tree / "benchmarks"]


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)


def resolve_commit(ref: str, root: Path = ROOT) -> str | None:
    """The full sha of commit ``ref`` (a branch, tag, ``HEAD~1``, a short sha) in ``root``'s
    repository, or None where it names no commit."""
    r = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", cwd=root)
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def commit_of(tree: Path) -> str:
    """``tree``'s commit, short, ``+dirty`` when its ``proximal/`` has uncommitted changes."""
    commit = _git("rev-parse", "--short", "HEAD", cwd=tree).stdout.strip()
    dirty = _git("status", "--porcelain", "--", "proximal", cwd=tree).stdout.strip()
    return (commit or "?") + ("+dirty" if dirty else "")


def baseline_tree(sha: str, workdir: Path, *, root: Path = ROOT, log=print) -> Path:
    """A checkout of commit ``sha`` (full) at ``<workdir>/baseline-<sha[:12]>``: made once, reused
    while it is at ``sha`` with no file changed, made again otherwise.

    ``git clone --shared --no-checkout`` then ``checkout --detach``: the clone borrows ``root``'s
    objects (nothing copied) and writes nothing into ``root`` — not its files, branches, index or
    worktree list. It is built beside its place and renamed, so an interrupted one is never reused."""
    dest = workdir / f"baseline-{sha[:12]}"
    if dest.is_dir():
        head = _git("rev-parse", "HEAD", cwd=dest)
        changed = _git("status", "--porcelain", cwd=dest)
        if head.stdout.strip() == sha and changed.returncode == 0 and not changed.stdout.strip():
            return dest
        log(f"[baseline] {dest} is not a clean checkout of {sha[:12]}: making it again")
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    workdir.mkdir(parents=True, exist_ok=True)
    for cmd in (
        ["git", "clone", "--quiet", "--shared", "--no-checkout", str(root), str(tmp)],
        [
            "git",
            "-C",
            str(tmp),
            "-c",
            "advice.detachedHead=false",
            "checkout",
            "--quiet",
            "--detach",
            sha,
        ],
    ):
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-500:]}")
    tmp.rename(dest)
    log(f"[baseline] checked out {sha[:12]} at {dest}")
    return dest


#: Run in a child's environment: where its ``proximal`` comes from, its commands and train fields.
_PROBE = """
import dataclasses, json, proximal
out = {"file": proximal.__file__, "version": getattr(proximal, "__version__", None)}
try:
    from proximal.cli import COMMANDS
    out["commands"] = sorted(COMMANDS)
except Exception:
    out["commands"] = None
try:
    from proximal.train.sections import TrainSection
    out["train_fields"] = sorted(f.name for f in dataclasses.fields(TrainSection))
except Exception:
    out["train_fields"] = None
print(json.dumps(out))
"""


def tree_proximal(tree: Path, threads: int = 1, python: str = sys.executable) -> dict:
    """What a proximal child run from ``tree`` imports (the environment and working directory of
    :func:`run_proximal`, :func:`proximal_command`'s imports): ``{"file": proximal/__init__.py's
    path, "version", "commands": the CLI's commands, "train_fields": train.* fields (None where the
    tree has no such module), "commit": commit_of(tree), "tree"}``. Raises when ``proximal`` does
    not import there."""
    r = subprocess.run(
        [python, "-c", (ONLY_ITS_TREE if tree != ROOT else "") + _PROBE],
        env=child_env(threads, pythonpath=source_path(tree)),
        cwd=str(tree),
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"proximal does not import from {tree}: {r.stderr.strip()[-500:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {**out, "commit": commit_of(tree), "tree": str(tree)}


def trl_command(
    work: Work, assets: dict, python: Path, *, steps: int, threads: int, out: Path
) -> list[str]:
    model, prompts = assets["model"], assets["prompts"]
    if work.method == "ppo":
        cmd = [
            str(python),
            str(BENCH / "trl_ppo_run.py"),
            "--policy",
            model["policy"],
            "--reward",
            model["reward"],
            "--prompt-ids",
            prompts["ids"],
            "--batch",
            str(work.batch),
            "--response-length",
            str(work.response_len),
        ]
    else:
        cmd = [
            str(python),
            str(BENCH / "trl_grpo_run.py"),
            "--policy",
            model["policy"],
            "--prompts",
            prompts["jsonl"],
            "--prompts-per-step",
            str(work.batch // work.group_size),
            "--group-size",
            str(work.group_size),
            "--response-length",
            str(work.response_len),
            "--beta",
            str(GRPO_BETA),
            "--loss",
            GRPO_LOSS,
        ]
    cmd += [
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--seed",
        str(work.seed),
        "--out",
        str(out),
    ]
    return cmd + (["--bf16"] if work.bf16 else [])


def run_trl(
    work: Work,
    assets: dict,
    python: Path,
    *,
    steps: int,
    threads: int,
    scratch: Path,
    timeout_s: float,
) -> dict:
    out = scratch / "trl.json"
    out.unlink(missing_ok=True)
    cmd = trl_command(work, assets, python, steps=steps, threads=threads, out=out)
    before = _before()
    m = run_measured(
        cmd,
        env=child_env(threads, pythonpath=[]),
        log_path=scratch / "log.txt",
        timeout_s=timeout_s,
        cwd=str(BENCH),
    )
    extra = {**before, "log": str(scratch / "log.txt"), "threads": threads}
    periods: list[float] = []
    if out.is_file():
        r = json.loads(out.read_text())
        periods = r["period_s"]
        extra.update(
            {
                k: r[k]
                for k in (
                    "settings",
                    "versions",
                    "checked_generations",
                    "start_to_train_s",
                    "ru_maxrss_self_kib",
                )
            }
        )
    if m["rc"] != 0:
        extra["error"] = f"exit {m['rc']}: " + _tail(scratch / "log.txt")
    return record(work, "trl", m, periods, extra)


def _tail(path: Path, n: int = 6) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    return " | ".join(lines[-n:])[-800:]
