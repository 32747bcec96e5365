"""A behaviour snapshot of proximal's online methods: tiny runs whose every number is recorded, so a
refactor can show it changed none of them (issue 40, "Behaviour is unchanged, and shown to be").

Record the snapshot before the first change and after the last, on the same machine, and compare::

    python benchmarks/behaviour_snapshot.py --out before.json          # at the base commit
    python benchmarks/behaviour_snapshot.py --out after.json           # at the refactored commit
    python benchmarks/behaviour_snapshot.py --compare before.json after.json \\
        [--renamed policy/old_name=policy/new_name,...]

The proximal recorded is the one Python imports: ``PYTHONPATH=/path/to/other/checkout`` records
that checkout with this script (the snapshot names its commit, and ``+dirty`` if it had uncommitted
changes), so a commit older than this script can be the "before".

``--compare`` prints one row per run: how many metric values are bitwise equal, which differ (with
the largest absolute difference), the metric names one side lacks, and whether every exported
model's weights are equal. It exits 1 on any difference that ``--renamed`` (the renames made by
design, ``old=new``) does not account for, 0 otherwise.

What is recorded, per run:

* every line of the run's ``metrics.jsonl``, every key, the values exactly (the JSON file holds
  each float as Python's ``repr``, which reads back to the same bits; the comparison is on
  ``float.hex``, so −0.0 ≠ 0.0 and NaN = NaN). Keys that measure the clock (``time/``, ``speed/``,
  ``perf/``, ``memory/``, see :data:`CLOCK_PREFIXES`) are recorded too, but compared by name only;
* the SHA-256 of each final exported model's weights — the policy (the run directory) and, for PPO,
  the critic (``critic/``): the tensors of every ``*.safetensors`` file, in sorted name order, each
  as its name, dtype, shape and raw bytes (not the file, so its metadata does not matter).

The evaluations (:func:`proximal.evaluation.evaluate_policy`, single-turn and multi-turn) record
their ``mean`` and every response row as the lines.

The runs (:func:`_runs`, :func:`_evaluations`):

* PPO: single-turn (with evaluation during training); over an environment whose tool the policy
  calls (tool form, with evaluation during training); over a two-turn environment with per-turn
  rewards (step form); ``rollout.correction`` tis and bypass; LoRA on actor and critic (critic from
  a reward model);
* GRPO with each ``grpo.objective`` (clip — with evaluation during training — gspo, gspo_token,
  cispo), each REINFORCE++ ``grpo.advantage`` (reinforce_pp, reinforce_pp_baseline), Dr. GRPO,
  DAPO's loss with clip-higher, dual clip, an entropy bonus and several mini-batches and
  iterations, RLOO, the tool environment, and each ``rollout.correction`` mode (none, tis,
  token_mask, seq_mask — a log-asymmetric band — bypass), sampling under bfloat16 autocast and two
  iterations, so π_old is computed, μ ≠ π_old and every correction acts;
* :func:`proximal.evaluation.evaluate_policy`, single-turn (with a reward model) and multi-turn.

Each is 3 steps on a tiny Llama (2 layers, width 32, a 25-token vocabulary), one process, one
thread, float32 (the corrections' sampling aside), seed 0, through the public Python API
(``proximal.train_ppo`` / ``train_grpo`` on a YAML file) — the configs a user writes, so they
survive any internal refactor. Reward functions and environments are defined in this file and
named ``behaviour_snapshot:<name>`` (this directory is on ``sys.path``; the tool workers inherit
it).

The multi-turn run needs a policy that writes tool calls, which a random tiny model does not: the
script first teaches the tiny policy to answer ``[add 1 2]`` with a few plain-torch Adam steps
(no proximal code), and records that model's hash as the run ``setup/tool_policy``.

Deterministic on one machine: ``OMP_NUM_THREADS=1`` and one torch thread, the peak-FLOP probe
replaced by a fixed figure and torch's BLAS pinned for CPU matrix products (as tests/conftest.py
does). Run twice, two snapshots compare equal. About 20 s on a (busy) 2-core machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: Set before torch is first imported (its thread pools read them once): one thread; the peak-FLOP
#: probe replaced by a fixed figure (perf/mfu is clock-bound anyway); torch's BLAS for CPU matrix
#: products, not a per-process choice between backends (tests/conftest.py does the same).
DETERMINISTIC_ENV = {
    "OMP_NUM_THREADS": "1",
    "PROXIMAL_PEAK_FLOPS": "1e11",
    "PROXIMAL_CPU_MATMUL": "blas",
}

#: Metric-name prefixes whose values measure the clock or the process, never the computation:
#: compared by name only.
CLOCK_PREFIXES = ("time/", "speed/", "perf/", "memory/")

#: The policy's characters (ids 4… after pad, eos, bos, unk): tests/trainers/ppo/ppo_support.py's, and the
#: brackets of the minimal tool-call format.
ALPHABET = "abcdefgh 0123456789[]"
#: What the tool policy is taught to write (a call of :meth:`Adder.add` in ``tools.format: minimal``).
TOOL_CALL = "[add 1 2]"
FORMAT = 1


# ----------------------------------------------------------------------------------------------
# Reward functions, the environment and its tool (``behaviour_snapshot:<name>`` in the configs)
# ----------------------------------------------------------------------------------------------


def _text(c) -> str:
    return c if isinstance(c, str) else c[-1]["content"]


def frac_a(prompts: list, completions: list) -> list[float]:
    """The fraction of a completion's characters that are 'a'."""
    return [_text(c).count("a") / max(1, len(_text(c))) for c in completions]


def length(prompts: list, completions: list) -> list[float]:
    """The completion's length in characters over 10 (varies within a group from the first step)."""
    return [len(_text(c)) / 10 for c in completions]


class Adder:
    """The tool form of an environment: one tool, ``add``; the outcome reward is the number of calls
    over 4."""

    def reset(self, **row):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first.
            b: the second.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return self.calls / 4


class Talk:
    """The step form of an environment over two turns: the reply "ab", a per-turn reward of
    0.1·(the turn's 'a' count); the outcome is frac_a of the last turn."""

    def reset(self, **row):
        self.left, self.last = 2, ""

    def step(self, text: str):
        self.left -= 1
        self.last = text
        return "ab", 0.1 * text.count("a"), self.left <= 0

    def get_reward(self) -> float:
        return frac_a([""], [self.last])[0]


# ----------------------------------------------------------------------------------------------
# Assets: tiny models and prompts, built afresh (seeded) in the work directory
# ----------------------------------------------------------------------------------------------


def prompt_texts(n: int = 16) -> list[str]:
    """Prompts of 3 to 7 characters, so every batch is left-padded."""
    return [("abcdefgh"[i % 8] * (1 + i % 5)) + f" {i % 10}" for i in range(n)]


def build_assets(work: Path) -> dict[str, Path]:
    from proximal.data.jsonl import write_jsonl
    from proximal.models.tiny import (
        build_char_tokenizer,
        build_tiny_causal_lm,
        build_tiny_reward_model,
    )

    tok = build_char_tokenizer(list(ALPHABET))
    out = {
        "policy": build_tiny_causal_lm(work / "policy", tok, arch="llama", seed=0),
        "reward_model": build_tiny_reward_model(work / "rm", tok, arch="llama", seed=1),
        "prompts": work / "prompts.jsonl",
        "eval_prompts": work / "eval_prompts.jsonl",
    }
    write_jsonl(out["prompts"], [{"prompt": p} for p in prompt_texts(16)])
    write_jsonl(out["eval_prompts"], [{"prompt": p} for p in prompt_texts(20)[-4:]])
    out["tool_policy"] = teach_tool_call(out["policy"], work / "tool_policy")
    return out


def teach_tool_call(policy: Path, out_dir: Path, steps: int = 40) -> Path:
    """The tiny policy after ``steps`` Adam steps of teacher forcing on prompt → ``TOOL_CALL`` EOS
    (plain torch and transformers: it does not depend on the code under test)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(policy))
    model = AutoModelForCausalLM.from_pretrained(str(policy), torch_dtype=torch.float32)
    rows, masks = [], []
    for p in prompt_texts(16):
        prompt = tok(p, add_special_tokens=False)["input_ids"]
        answer = tok(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt + answer)
        masks.append([False] * len(prompt) + [True] * len(answer))
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    labels = torch.where(torch.tensor([m + [False] * (width - len(m)) for m in masks]), ids, -100)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out_dir))
    tok.save_pretrained(str(out_dir))
    return out_dir


# ----------------------------------------------------------------------------------------------
# The runs
# ----------------------------------------------------------------------------------------------


def _ppo(a: dict, **sections) -> dict:
    cfg = {
        "model": {
            "path": str(a["policy"]),
            "critic": "policy",
            "reward_functions": ["behaviour_snapshot:frac_a"],
        },
        "data": {"prompts": str(a["prompts"]), "max_prompt_length": 16},
        "rollout": {"batch_size": 4, "max_new_tokens": 8},
        "ppo": {"epochs": 2, "mini_batch_size": 4, "micro_batch_size": 2},
        "optim": {"lr": 1e-3, "critic_lr": 1e-3},
        "train": {"steps": 3, "seed": 0, "device": "cpu"},
        "output": {"progress": False, "samples_per_step": 2},
    }
    return _update(cfg, sections)


def _grpo(a: dict, **sections) -> dict:
    cfg = {
        "model": {"path": str(a["policy"]), "reward_functions": ["behaviour_snapshot:length"]},
        "data": {"prompts": str(a["prompts"]), "max_prompt_length": 16},
        "rollout": {"batch_size": 2, "group_size": 4, "max_new_tokens": 8},
        "grpo": {"micro_batch_size": 4, "beta": 0.04},
        "optim": {"lr": 1e-3},
        "train": {"steps": 3, "seed": 0, "device": "cpu"},
        "output": {"progress": False, "samples_per_step": 2},
    }
    return _update(cfg, sections)


def _update(cfg: dict, sections: dict) -> dict:
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def _eval(a: dict, **more) -> dict:
    return {"prompts": str(a["eval_prompts"]), "every": 1, "max_new_tokens": 6, **more}


#: The agent runs' environment and tool: the policy calls Adder.add in the minimal format.
AGENT = {
    "env": {"factory": "behaviour_snapshot:Adder", "max_turns": 3},
    "tools": {"format": "minimal", "workers": 1},
}
#: GRPO with π_old computed (two iterations) and sampling under bfloat16 autocast: μ ≠ π_old.
MISMATCH = {"precision": "bf16-mixed"}


def _runs(a: dict) -> dict[str, tuple[str, dict]]:
    """name → (command, config) of every training run."""
    grpo_iter = {"iterations": 2}
    return {
        "ppo/single_turn": (
            "ppo",
            _ppo(a, eval=_eval(a, scores={"len": "behaviour_snapshot:length"})),
        ),
        "ppo/agent_tool": (
            "ppo",
            _ppo(
                a,
                model={"path": str(a["tool_policy"])},
                rollout={"max_new_tokens": 10},
                eval=_eval(a, max_new_tokens=10),
                **AGENT,
            ),
        ),
        "ppo/agent_turn_rewards": (
            "ppo",
            _ppo(
                a,
                model={"reward_functions": []},
                rollout={
                    "stop_token_ids": [11, 12, 13]
                },  # some digits end a turn: turns stop early
                env={"factory": "behaviour_snapshot:Talk", "max_turns": 3},
                tools={"workers": 1},
            ),
        ),
        "ppo/correction_tis": (
            "ppo",
            _ppo(a, rollout={**MISMATCH, "correction": "tis", "correction_cap": 1.0005}),
        ),
        "ppo/correction_bypass": ("ppo", _ppo(a, rollout={**MISMATCH, "correction": "bypass"})),
        "ppo/lora": (
            "ppo",
            _ppo(
                a,
                model={
                    "reward_model": str(a["reward_model"]),
                    "critic": "reward_model",
                    "lora_r": 4,
                    "critic_lora": True,
                },
                optim={"lr": 1e-2, "critic_lr": 1e-2},
            ),
        ),
        "grpo/clip": ("grpo", _grpo(a, eval=_eval(a, scores={"a": "behaviour_snapshot:frac_a"}))),
        "grpo/clip_dapo_mini_batches": (
            "grpo",
            _grpo(
                a,
                grpo={
                    "loss": "dapo",
                    "clip_eps_high": 0.28,
                    "dual_clip": 3.0,
                    "mini_batch_size": 4,
                    "micro_batch_size": 2,
                    "iterations": 2,
                    "entropy_coef": 0.01,
                },
            ),
        ),
        "grpo/dr_grpo": ("grpo", _grpo(a, grpo={"loss": "dr_grpo", "advantage": "unscaled"})),
        "grpo/agent_tool": (
            "grpo",
            _grpo(
                a, model={"path": str(a["tool_policy"])}, rollout={"max_new_tokens": 10}, **AGENT
            ),
        ),
        "grpo/gspo": ("grpo", _grpo(a, grpo={"objective": "gspo"})),
        "grpo/gspo_token": ("grpo", _grpo(a, grpo={"objective": "gspo_token"})),
        "grpo/cispo": ("grpo", _grpo(a, grpo={"objective": "cispo", "clip_eps_high": 0.28})),
        "grpo/reinforce_pp": ("grpo", _grpo(a, grpo={"advantage": "reinforce_pp"})),
        "grpo/reinforce_pp_baseline": (
            "grpo",
            _grpo(a, grpo={"advantage": "reinforce_pp_baseline"}),
        ),
        "grpo/rloo": ("grpo", _grpo(a, grpo={"advantage": "rloo"})),
        **{
            f"grpo/correction_{mode}": (
                "grpo",
                _grpo(a, grpo=grpo_iter, rollout={**MISMATCH, "correction": mode, **band}),
            )
            for mode, band in (
                ("none", {}),
                ("tis", {"correction_cap": 1.0005}),
                ("token_mask", {"correction_band": [0.9995, 1.0005]}),
                ("seq_mask", {"correction_band": [0.99995, 1.0001]}),
                ("bypass", {}),
            )
        },
    }


def _evaluations(a: dict) -> dict[str, dict]:
    """name → keyword arguments of :func:`proximal.evaluation.evaluate_policy`."""
    common = {
        "reference": str(a["policy"]),
        "prompts_file": str(a["eval_prompts"]),
        "scores": {"a": "behaviour_snapshot:frac_a", "len": "behaviour_snapshot:length"},
        "weights": {"a": 1.0},
        "samples_per_prompt": 2,
        "max_new_tokens": 8,
        "seed": 0,
        "max_prompt_length": 16,
    }
    return {
        "evaluate_policy/single_turn": {
            **common,
            "policy": str(a["policy"]),
            "reward_model": str(a["reward_model"]),
        },
        "evaluate_policy/agent_tool": {
            **common,
            "policy": str(a["tool_policy"]),
            "max_new_tokens": 10,
            **AGENT,
        },
    }


# ----------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 over the tensors of every ``*.safetensors`` file in ``model_dir``, in sorted name
    order, each as its name, dtype, shape and raw bytes."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        tensors.update(load_file(str(f)))
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _jsonable(value):
    """A value as JSON holds it: tensors and numpy scalars as numbers, tuples as lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def record_run(command: str, cfg: dict, run_dir: Path) -> dict:
    import yaml

    import proximal

    cfg = _update(json.loads(json.dumps(cfg)), {"output": {"dir": str(run_dir)}})
    path = run_dir.with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    train = {"ppo": proximal.train_ppo, "grpo": proximal.train_grpo}[command]
    t0 = time.perf_counter()
    out = Path(train(str(path)))
    seconds = time.perf_counter() - t0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    weights = {"policy": weights_sha256(out)}
    if (out / "critic").is_dir():
        weights["critic"] = weights_sha256(out / "critic")
    return {"seconds": round(seconds, 2), "metrics": lines, "weights": weights}


def record_evaluation(kwargs: dict) -> dict:
    from proximal.evaluation import evaluate_policy

    t0 = time.perf_counter()
    ev = evaluate_policy(**kwargs)
    seconds = time.perf_counter() - t0
    lines = [_jsonable(ev["mean"])] + [_jsonable(r) for r in ev["rows"]]
    return {"seconds": round(seconds, 2), "metrics": lines, "weights": {}}


def snapshot(work: Path, only: list[str] | None = None) -> dict:
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    shutil.rmtree(work / "runs", ignore_errors=True)  # a kept work directory's old runs
    # The tool workers are `python -c` processes, whose sys.path starts with the working directory:
    # run from the work directory, so a checkout there can't shadow the proximal imported here.
    cwd = os.getcwd()
    os.chdir(work)
    try:
        return _snapshot(work, only)
    finally:
        os.chdir(cwd)


def _snapshot(work: Path, only: list[str] | None) -> dict:
    import torch

    import proximal

    t0 = time.perf_counter()
    assets = build_assets(work)
    runs: dict[str, dict] = {
        "setup/tool_policy": {
            "seconds": round(time.perf_counter() - t0, 2),
            "metrics": [],
            "weights": {"policy": weights_sha256(assets["tool_policy"])},
        }
    }
    todo = [(n, c, cfg) for n, (c, cfg) in _runs(assets).items()]
    todo += [(n, "evaluate", kw) for n, kw in _evaluations(assets).items()]
    for name, command, cfg in todo:
        if only and not any(name.startswith(o) for o in only):
            continue
        print(f"{name} ...", end=" ", file=sys.stderr, flush=True)
        if command == "evaluate":
            runs[name] = record_evaluation(cfg)
        else:
            runs[name] = record_run(command, cfg, work / "runs" / name.replace("/", "-"))
        print(f"{runs[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
    tree = Path(proximal.__file__).resolve().parents[1]
    return {
        "format": FORMAT,
        # the checkout proximal was imported from (PYTHONPATH may name another than this script's)
        "commit": _git(tree, "rev-parse", "HEAD"),
        "dirty": bool(_git(tree, "status", "--porcelain", "--untracked-files=no")),
        "proximal": str(tree / "proximal"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in DETERMINISTIC_ENV},
        "seconds": round(time.perf_counter() - t0, 1),
        "runs": runs,
    }


def _git(tree: Path, *args: str) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(tree), *args], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ----------------------------------------------------------------------------------------------
# Comparing two snapshots
# ----------------------------------------------------------------------------------------------


def _bits(value) -> object:
    """What "bitwise equal" compares: a float as ``float.hex`` (−0.0 ≠ 0.0, NaN = NaN), containers
    element by element, anything else as it is."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_bits(v) for v in value]
    return value


def _abs_diff(a, b) -> float:
    """|a − b| of two numbers (inf where only one is NaN or a side is not a number)."""
    numbers = (int, float)
    if (
        isinstance(a, bool)
        or isinstance(b, bool)
        or not (isinstance(a, numbers) and isinstance(b, numbers))
    ):
        return math.inf
    if math.isnan(a) or math.isnan(b):
        return 0.0 if math.isnan(a) and math.isnan(b) else math.inf
    if a == b:
        return 0.0
    return abs(float(a) - float(b))


def parse_renamed(text: str | None) -> dict[str, str]:
    """``old=new,old2=new2`` → {old: new}; ValueError on an entry without ``=``."""
    out: dict[str, str] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        old, eq, new = part.partition("=")
        if not eq or not old.strip() or not new.strip():
            raise ValueError(f"--renamed entry {part!r}: expected old=new")
        out[old.strip()] = new.strip()
    return out


def compare_run(before: dict, after: dict, renamed: dict[str, str]) -> dict:
    """One run's comparison. ``before``'s metric names are mapped through ``renamed`` first, so a
    metric renamed by design is compared with its new name and is neither missing nor new.

    Returns ``equal`` (values bitwise equal), ``clock`` (clock-bound values, compared by name
    only), ``differing`` ({name: max |Δ|}), ``missing`` (names only before), ``new`` (names only
    after), ``lines`` ((before, after) line counts), ``weights_equal`` and ``renamed`` (the renames
    that applied), and ``ok``: no difference ``renamed`` does not account for."""
    b_lines, a_lines = before["metrics"], after["metrics"]
    equal = clock = 0
    differing: dict[str, float] = {}
    missing: set[str] = set()
    new: set[str] = set()
    used: set[str] = set()
    for b_row, a_row in zip(b_lines, a_lines):
        mapped = {}
        for k, v in b_row.items():
            if k in renamed:
                used.add(k)
            mapped[renamed.get(k, k)] = v
        missing |= mapped.keys() - a_row.keys()
        new |= a_row.keys() - mapped.keys()
        for k in mapped.keys() & a_row.keys():
            if k.startswith(CLOCK_PREFIXES):
                clock += 1
            elif _bits(mapped[k]) == _bits(a_row[k]):
                equal += 1
            else:
                d = _abs_diff(mapped[k], a_row[k])
                differing[k] = max(differing.get(k, 0.0), d)
    weights_equal = before["weights"] == after["weights"]
    ok = (
        len(b_lines) == len(a_lines) and not differing and not missing and not new and weights_equal
    )
    return {
        "equal": equal,
        "clock": clock,
        "differing": differing,
        "missing": sorted(missing),
        "new": sorted(new),
        "lines": (len(b_lines), len(a_lines)),
        "weights_equal": weights_equal,
        "renamed": sorted(used),
        "ok": ok,
    }


def compare(before: dict, after: dict, renamed: dict[str, str] | None = None) -> tuple[list, bool]:
    """Every run of either snapshot: ``[(name, result or None where a side lacks it)]`` in
    ``before``'s order then ``after``'s new runs, and whether all are ``ok``."""
    renamed = renamed or {}
    rows, ok = [], True
    names = list(before["runs"]) + [n for n in after["runs"] if n not in before["runs"]]
    for name in names:
        b, a = before["runs"].get(name), after["runs"].get(name)
        if b is None or a is None:
            rows.append((name, {"absent": "before" if b is None else "after", "ok": False}))
            ok = False
            continue
        result = compare_run(b, a, renamed)
        rows.append((name, result))
        ok = ok and result["ok"]
    return rows, ok


def format_table(rows: list) -> str:
    """The comparison as a Markdown table."""
    out = [
        "| run | equal | differing (max abs diff) | missing | new | weights equal |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        if "absent" in r:
            out.append(f"| {name} | — | run absent {r['absent']} | | | no |")
            continue
        differing = ", ".join(f"{k} ({v:.3g})" for k, v in sorted(r["differing"].items()))
        lines = (
            "" if r["lines"][0] == r["lines"][1] else f"lines {r['lines'][0]} → {r['lines'][1]}; "
        )
        equal = f"{r['equal']}" + (f" (+{r['clock']} clock, names only)" if r["clock"] else "")
        if r["renamed"]:
            equal += f" (renamed: {', '.join(r['renamed'])})"
        out.append(
            f"| {name} | {equal} | {lines}{differing} | {', '.join(r['missing'])} | "
            f"{', '.join(r['new'])} | {'yes' if r['weights_equal'] else 'no'} |"
        )
    return "\n".join(out)


def _origin(snap: dict) -> str:
    """Where a snapshot was recorded: its commit (short), "+dirty" for uncommitted changes."""
    return (snap.get("commit") or "?")[:10] + ("+dirty" if snap.get("dirty") else "")


# ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Record or compare a behaviour snapshot of tiny PPO/GRPO runs (issue 40)."
    )
    p.add_argument("--out", type=Path, help="write the snapshot here (JSON)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    p.add_argument("--renamed", help="metric renames made by design, old=new,... (with --compare)")
    p.add_argument("--only", help="record only runs whose name starts with one of these (a,b,...)")
    p.add_argument(
        "--workdir", type=Path, help="keep the models and runs here (default: a temp dir)"
    )
    args = p.parse_args(argv)
    if (args.out is None) == (args.compare is None):
        p.error("give --out FILE or --compare BEFORE AFTER")
    if args.compare:
        try:
            renamed = parse_renamed(args.renamed)
        except ValueError as e:
            p.error(str(e))
        before, after = (json.loads(f.read_text()) for f in args.compare)
        rows, ok = compare(before, after, renamed)
        print(format_table(rows))
        print("\nequal" if ok else "\nDIFFERENT", f"({_origin(before)} → {_origin(after)})")
        return 0 if ok else 1
    if "torch" in sys.modules:
        p.error("record in a fresh process: torch was imported before the environment was set")
    os.environ.update(DETERMINISTIC_ENV)
    if str(HERE) not in sys.path:  # behaviour_snapshot:<name> specs
        sys.path.insert(0, str(HERE))
    only = [o for o in (args.only or "").split(",") if o]
    out = args.out.resolve()
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        snap = snapshot(args.workdir.resolve(), only)
    else:
        with tempfile.TemporaryDirectory(prefix="proximal-snapshot-") as d:
            snap = snapshot(Path(d), only)
    out.write_text(json.dumps(snap, indent=1) + "\n")
    print(f"{len(snap['runs'])} runs in {snap['seconds']} s → {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
