"""The post-training methods that start from one SFT model — PPO, DPO, SimPO, GRPO and RLOO, GSPO,
CISPO, REINFORCE++ and REINFORCE++-baseline (``proximal grpo`` configs), and on-policy distillation
(``proximal distill``, a teacher grading the student's samples) — as ``proximal demo`` and
``proximal compare`` run them.

Each :class:`Method` says which command trains it, whether it samples its own responses (online) or
reads preference pairs (offline), and which reward sources it can learn from. The functions below
turn one set of inputs (an SFT model, a reward model, prompts, pairs, a rule verifier) into each
method's config overrides, and — in :func:`budget_steps`, the one place it is done — a budget into
a step count. Every method ends with a checkpoint whose ``policy/`` is a plain Hugging Face model
(:func:`final_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proximal.config import ConfigError

#: Where a method's reward comes from: the learned reward model r_ψ, a rule verifier (a reward
#: function such as exact-match), or — offline methods — the preference pairs r_ψ was trained on;
#: on-policy distillation learns from a teacher model grading every token (alone, or with the
#: verifier's reward added: "distill plus verify").
REWARD_MODEL, VERIFIER, PAIRS, TEACHER = "reward_model", "verifier", "pairs", "teacher"

#: The fields a preference pair is read from (proximal.data.preferences): the entries of a shared
#: column mapping an offline method takes (a mapping of a reference answer would name a column its
#: pairs lack).
PAIR_FIELDS = ("prompt", "messages", "chosen", "rejected")
#: The fields only preference pairs have: the entries an online method leaves out. Every other entry —
#: prompt, messages, tools, and the columns reward functions read, such as a reference answer — it takes.
PAIR_ONLY_FIELDS = ("chosen", "rejected")


@dataclass(frozen=True)
class Method:
    name: str  # the key: also the name of its YAML under proximal/configs/demo/
    label: str
    command: (
        str  # the `proximal` command that trains it (proximal.commands: its config and trainer)
    )
    online: bool  # samples its own responses while it trains
    sources: tuple[str, ...]  # the reward sources it can use, its default first

    def default_source(self, have_verifier: bool) -> str:
        if not self.online:
            return PAIRS
        return self.sources[0] if have_verifier or self.sources[0] != VERIFIER else REWARD_MODEL


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("ppo", "PPO", "ppo", True, (REWARD_MODEL, VERIFIER)),
        Method("dpo", "DPO", "dpo", False, (PAIRS,)),
        Method("simpo", "SimPO", "simpo", False, (PAIRS,)),
        Method("grpo", "GRPO", "grpo", True, (VERIFIER, REWARD_MODEL)),
        Method("rloo", "RLOO", "grpo", True, (VERIFIER, REWARD_MODEL)),
        # issue 25's objectives, each a `proximal grpo` config (not in compare's default list)
        Method("gspo", "GSPO", "grpo", True, (VERIFIER, REWARD_MODEL)),
        Method("cispo", "CISPO", "grpo", True, (VERIFIER, REWARD_MODEL)),
        Method("reinforce_pp", "REINFORCE++", "grpo", True, (VERIFIER, REWARD_MODEL)),
        Method(
            "reinforce_pp_baseline", "REINFORCE++-baseline", "grpo", True, (VERIFIER, REWARD_MODEL)
        ),
        # issue 44: the student samples, a teacher grades every token (never by default)
        Method("distill", "Distill", "distill", True, (TEACHER, VERIFIER)),
    )
}


def input_overrides(
    method: Method,
    source: str,
    *,
    sft: str | Path,
    reward_model: str | Path | None = None,
    prompts: str | Path | None = None,
    pairs: str | Path | None = None,
    eval_pairs: str | Path | None = None,
    verifier: str | None = None,
    gold: str | None = None,
    split: str | None = None,
    columns: dict[str, str] | None = None,
    teacher: str | Path | None = None,
) -> dict[str, Any]:
    """The config overrides that point ``method`` at the shared inputs: ``model.path`` = the SFT model
    (the start and, where there is one, the reference); online methods the training prompts and the
    reward ``source`` — the reward model, or the verifier (weight 1) — with the ``gold`` score, when
    given, as a weight-0 reward function (logged every step, never trained on); offline methods the
    preference pairs. ``split`` and ``columns`` describe the data given here, so they replace the
    method config's ``data.split`` and ``data.columns`` (null ones too: that config's were written
    for other files); an online method takes the entries of ``columns`` but those for :data:`PAIR_ONLY_FIELDS`,
    an offline one those for :data:`PAIR_FIELDS`. Distillation (``proximal distill``) also gets
    ``teacher`` as ``model.teacher``; with the source :data:`TEACHER` the verifier is only logged
    (weight 0, ``distill.reward_weight`` 0: the teacher's grades alone train the student), with
    :data:`VERIFIER` its reward is added to them (distill plus verify)."""
    out: dict[str, Any] = {"model.path": str(sft), "data.split": split, "data.columns": columns}
    if not method.online:
        if columns is not None:
            out["data.columns"] = {k: v for k, v in columns.items() if k in PAIR_FIELDS} or None
        out["data.train_file"] = str(pairs)
        out["data.eval_file"] = str(eval_pairs) if eval_pairs else None
        return out
    if columns is not None:
        out["data.columns"] = {
            k: v for k, v in columns.items() if k not in PAIR_ONLY_FIELDS
        } or None
    out["data.prompts"] = str(prompts)
    logged = [gold] if gold else []
    if method.command == "distill":
        out["model.teacher"] = str(teacher) if teacher else ""
        weight = 1.0 if source == VERIFIER else 0.0
        out.update(
            {
                "model.reward_model": None,
                "model.reward_functions": [verifier, *logged] if verifier else logged,
                "model.reward_function_weights": ([weight] if verifier else [])
                + [0.0] * len(logged),
            }
        )
        if source == TEACHER:
            out["distill.reward_weight"] = 0.0
        return out
    if source == REWARD_MODEL:
        out.update(
            {
                "model.reward_model": str(reward_model),
                "model.reward_functions": logged,
                "model.reward_function_weights": [0.0] * len(logged),
            }
        )
        if method.command == "ppo":
            out["model.critic"] = "reward_model"
    else:
        out.update(
            {
                "model.reward_model": None,
                "model.reward_functions": [verifier, *logged],
                "model.reward_function_weights": [1.0] + [0.0] * len(logged),
            }
        )
        if method.command == "ppo":
            out["model.critic"] = "policy"  # no reward model to initialise it from
    return out


def responses_per_step(method: Method, cfg) -> int:
    """Responses one step trains on: sampled (online: prompts × group size) or read (offline: two per pair)."""
    if method.command == "ppo":
        return cfg.rollout.batch_size
    if method.command in ("grpo", "distill"):
        return cfg.rollout.batch_size * cfg.rollout.group_size
    return 2 * cfg.train.batch_size


def budget_steps(method: Method, cfg, *, responses: int, pairs: int) -> tuple[int, str]:
    """The step count that spends the budget, and the budget in words: online methods sample
    ``responses`` responses each; offline methods train on ``pairs`` preference pairs each (so every
    online method sees as many responses as every other, and every offline method as many pairs).
    A budget smaller than one step is an error naming the fields."""
    if method.online:
        per = responses_per_step(method, cfg)
        steps, spent = responses // per, f"{responses} responses sampled"
        field = (
            "rollout.batch_size"
            if method.command == "ppo"
            else "rollout.batch_size × rollout.group_size"
        )
        need = f"compare.responses = {responses} is less than one step of {method.label} ({field} = {per})"
    else:
        per = cfg.train.batch_size
        steps, spent = pairs // per, f"{pairs} preference pairs"
        need = f"compare.pairs = {pairs} is less than one step of {method.label} (train.batch_size = {per})"
    if steps < 1:
        raise ConfigError(need)
    return steps, spent


def final_policy(run_dir: str | Path) -> Path:
    """The policy saved by a finished run of any method: ``run_dir/checkpoints/<latest>/policy``."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"{run_dir}: no checkpoints/latest; did the run finish?")
    return root / pointer.read_text().strip() / "policy"


def checkpoint_policies(run_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, policy directory)`` of every complete checkpoint of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = [
        (int(p.name.split("_")[1]), p / "policy")
        for p in root.glob("step_*")
        if (p / "manifest.json").is_file() and (p / "policy").is_dir()
    ]
    return sorted(found)
