"""What ``proximal memory --run`` reads of a run: the method and the fields its plan needs, from the
run's YAML (a config file, or ``config.yaml`` in a run directory) with the command's own defaults for
every field the file leaves out.

Only the fields a plan needs are read, with plain YAML: no data file, reward function or checkpoint
has to exist — only the ``config.json`` of each model (``model.path``, ``model.reward_model``, a critic
checkpoint), for its shape, unless ``--config``/``--params`` give it instead. A run directory's
``config.yaml`` holds every section of its command (it is the whole config, written when the run
began), so the method is read from it: ``ppo``/``kl`` sections are PPO's, ``grpo`` GRPO's (RLOO with
``grpo.advantage: rloo``), ``distill`` on-policy distillation's (its teacher's config.json too, from
``model.teacher``), ``dpo`` and ``simpo`` theirs, ``data.loss_on`` SFT's, and a config with
none of these is reward-model training's. A hand-written file may leave every method's own section
out; ``--method`` then names it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from proximal.commands import config_class
from proximal.config import describe
from proximal.memory.budget import (
    DISTILL_LOSSES,
    ENGINES,
    LOGPROBS,
    METHODS,
    ONLINE,
    PRECISIONS,
    GiB,
)


class RunReadError(ValueError):
    """The run's YAML cannot be read or planned; the message names the file and the field."""


#: The command that trains each method the planner knows (rloo: grpo with grpo.advantage: rloo; every
#: other method is its own command): its config class (:mod:`proximal.commands`) gives the defaults.
COMMAND_OF = {method: "grpo" if method == "rloo" else method for method in METHODS}
#: What the logits path is where a command's config has no ``train.logprobs`` field.
LOGPROBS_WITHOUT_FIELD = "logits"


@dataclass
class RunPlan:
    """A run as the planner sees it: the method, where each model's config.json is (None = no such
    model), and the :class:`~proximal.memory.budget.Setup` fields the YAML decides."""

    method: str
    file: str
    actor_path: str
    reward_path: str | None = None
    teacher_path: str | None = None  # distill: model.teacher
    critic: str | None = None  # ppo: 'reward_model', 'policy' or a checkpoint path
    fields: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    compile: str = "eager"  # train.compile ('eager' where the command has no such field)
    steps: int | None = None  # train.steps (None: the data's epochs decide the run's length)


def read_yaml(path: str | Path) -> tuple[dict, str]:
    """The mapping in ``path`` (a YAML file, or a run directory's config.yaml) and the file read."""
    p = Path(path).expanduser()
    file = p / "config.yaml" if p.is_dir() else p
    if not file.is_file():
        where = f"no config.yaml in directory {p}" if p.is_dir() else f"no such file {p}"
        raise RunReadError(f"--run {path}: {where}")
    try:
        data = yaml.safe_load(file.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise RunReadError(f"{file}: not a readable YAML file: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RunReadError(f"{file}: not a run config (a mapping of sections)")
    return data, str(file)


def method_of(data: dict, complete: bool = False) -> str | None:
    """The method a config's sections name (module docstring), or None when they name none.
    ``complete``: the file holds every section of its command (a run directory's config.yaml), so
    a config with none of the other methods' marks is reward-model training's."""
    if "ppo" in data or "kl" in data:
        return "ppo"
    if "grpo" in data:
        advantage = (data.get("grpo") or {}).get("advantage")
        return "rloo" if advantage == "rloo" else "grpo"
    if "distill" in data:
        return "distill"
    for method in ("dpo", "simpo"):
        if method in data:
            return method
    if "loss_on" in (data.get("data") or {}):
        return "sft"
    return "rm" if complete and "train" in data and "data" in data else None


def _defaults(method: str) -> dict:
    """``{dotted field: default}`` of the method's command (its config class's ``--help`` defaults)."""
    # The config classes import the trainers' layers (torch): imported by name, when --run needs them.
    cls = config_class(COMMAND_OF[method])
    return {dotted: default for dotted, _type, default, _help in describe(cls)}


def _flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and not prefix:  # sections; a field's own mapping stays whole
            out.update(_flatten(v, f"{k}."))
        else:
            out[prefix + str(k)] = v
    return out


def read_run(path: str | Path, method: str | None = None) -> RunPlan:
    """The :class:`RunPlan` of the run at ``path``; ``method`` as ``--method`` gives it (it must agree
    with the sections the file has, when it has any)."""
    data, file = read_yaml(path)
    found = method_of(data, complete=Path(path).expanduser().is_dir())
    if method is None:
        if found is None:
            raise RunReadError(
                f"{file}: its sections do not say which method it runs; name it with --method "
                f"({', '.join(METHODS)})"
            )
        method = found
    elif found is not None and {found, method} not in ({"grpo", "rloo"}, {found}):
        raise RunReadError(
            f"{file}: --method {method}, but the file's sections are a {found} run's"
        )
    values = {**_defaults(method), **_flatten(data)}

    def get(name: str, kind: type | tuple = int, minimum: int | None = 1, none: bool = False):
        v = values.get(name)
        if v is None and none:
            return None
        ok = isinstance(v, kind) and not (isinstance(v, bool) and kind is int)
        if not ok or (minimum is not None and v < minimum):
            want = {int: "an integer", bool: "true or false", str: "a string"}.get(kind, "a value")
            bound = f" ≥ {minimum}" if minimum is not None and kind is int else ""
            raise RunReadError(f"{file}: {name} = {v!r} must be {want}{bound}")
        return v

    plan = RunPlan(method, file, actor_path=get("model.path", str, None))
    if not plan.actor_path:
        raise RunReadError(f"{file}: model.path is not set (a checkpoint directory)")
    f = plan.fields
    f["precision"] = get("train.precision", str, None)
    f["activation_checkpointing"] = get("train.activation_checkpointing", bool, None)
    f["logprobs"] = (
        get("train.logprobs", str, None) if "train.logprobs" in values else LOGPROBS_WITHOUT_FIELD
    )
    for name, key, choices in (
        ("train.precision", "precision", PRECISIONS),
        ("train.logprobs", "logprobs", LOGPROBS),
    ):
        if f[key] not in choices:
            raise RunReadError(f"{file}: {name} = {f[key]!r} is not one of {', '.join(choices)}")
    # proximal.models.parallel.choose_attention: on a CPU computing in bfloat16, eager attention.
    device = get("train.device", str, None)
    if device == "cpu" and f["precision"] != "32-true":
        f["attention"] = "eager"
    # A CPU run is planned in host memory against the machine's RAM; 'auto' (cuda when the machine
    # running the plan has one) and 'cuda' for a GPU.
    f["device"] = "cpu" if device == "cpu" else "cuda"
    if device == "auto":
        plan.notes.append(
            "train.device = auto: planned for a GPU; --device cpu plans it on a CPU, in host memory"
        )
    if "train.compile" in values:
        plan.compile = get("train.compile", str, None)
    # train.compile auto weighs compiling against the run's length (None: epochs decide it)
    steps = values.get("train.steps")
    plan.steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    f["lora_rank"] = get("model.lora_r", int, 0)
    targets = values.get("model.lora_target_modules") or ["all-linear"]
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise RunReadError(
            f"{file}: model.lora_target_modules = {targets!r} must be a list of names"
        )
    f["lora_targets"] = tuple(targets)
    if "model.frozen_sharding" in values:
        f["frozen_sharding"] = get("model.frozen_sharding", str, None)
    if method in ONLINE:
        f["batch"] = get("rollout.batch_size")
        f["response_len"] = get("rollout.max_new_tokens")
        f["prompt_len"] = get("data.max_prompt_length")
        f["gather_weights"] = get("rollout.gather_weights", bool, None)
        if "rollout.precision" in values:
            f["rollout_precision"] = get("rollout.precision", str, None, none=True)
        top_p, top_k = values.get("rollout.top_p"), values.get("rollout.top_k")
        truncates = (isinstance(top_p, (int, float)) and top_p < 1) or (
            isinstance(top_k, int) and top_k > 0
        )
        if values.get("rollout.replay_filter") is True and truncates:
            f["logprobs"] = "logits"  # the filter's replay needs whole vocabulary rows
            plan.notes.append(
                "rollout.replay_filter: the policy's log-probabilities through the logits "
                "(planned so for every model)"
            )
        # rollout.engine and rollout.kv_cache_gib are read where the command has them (its defaults)
        # or the file sets them
        if "rollout.engine" in values:
            f["engine"] = get("rollout.engine", str, None)
            if f["engine"] not in ENGINES:
                raise RunReadError(
                    f"{file}: rollout.engine = {f['engine']!r} is not one of {', '.join(ENGINES)}"
                )
        if "rollout.staleness" in values:
            k = get("rollout.staleness", int, None)
            if isinstance(k, bool) or k is None or k < 0:
                raise RunReadError(f"{file}: rollout.staleness = {k!r} must be an integer >= 0")
            f["staleness"] = k
        if "rollout.kv_cache_gib" in values:
            gib = get("rollout.kv_cache_gib", (int, float), None)
            if isinstance(gib, bool) or not (math.isfinite(gib) and gib > 0):
                raise RunReadError(
                    f"{file}: rollout.kv_cache_gib = {gib!r} must be a positive number of GiB"
                )
            f["engine_kv_cache"] = int(gib * GiB)
        plan.reward_path = get("model.reward_model", str, None, none=True)
    if method == "ppo":
        f["micro_batch"] = get("ppo.micro_batch_size")
        f["mini_batch"] = get("ppo.mini_batch_size")
        f["reuse_first_pass"] = get("ppo.reuse_first_pass", bool, None)
        f["critic_lora"] = get("model.critic_lora", bool, None)
        plan.critic = get("model.critic", str, None)
        if get("ppo.ptx_coef", (int, float), None) > 0:
            plan.notes.append("the PTX loss's forward (data.ptx_batch_size texts) is not counted")
    elif method in ("grpo", "rloo"):
        f["group_size"] = get("rollout.group_size", int, 2)
        f["micro_batch"] = get("grpo.micro_batch_size")
        responses = f["batch"] * f["group_size"]
        mini = get("grpo.mini_batch_size", none=True) or responses
        iterations = get("grpo.iterations")
        f["old_logprobs_pass"] = not (iterations == 1 and mini == responses)
        f["reference"] = get("grpo.beta", (int, float), None) > 0
    elif method == "distill":
        f["group_size"] = get("rollout.group_size")
        f["micro_batch"] = get("distill.micro_batch_size")
        f["old_logprobs_pass"] = True  # the advantage reads log π_old: always its own pass
        f["reference"] = False  # no KL term: the teacher is the signal
        f["distill_loss"] = get("distill.loss", str, None)
        if f["distill_loss"] not in DISTILL_LOSSES:
            raise RunReadError(
                f"{file}: distill.loss = {f['distill_loss']!r} is not one of "
                f"{', '.join(DISTILL_LOSSES)}"
            )
        plan.teacher_path = get("model.teacher", str, None) or None  # '' = not set
    else:
        f["max_length"] = get("data.max_length")
        f["batch"] = get("train.batch_size")
        f["micro_batch"] = get("train.micro_batch_size")
        tokens = get("train.micro_batch_tokens", none=True)
        if tokens is not None:
            rows = max(1, tokens // f["max_length"])
            f["micro_batch"] = rows
            plan.notes.append(
                f"train.micro_batch_tokens = {tokens}: planned as micro-batches of {rows} "
                f"row(s) of data.max_length = {f['max_length']} tokens"
            )
        if get("train.packing", bool, None):
            plan.notes.append(
                "train.packing: each micro-batch is planned as its rows padded to data.max_length "
                "(packed rows hold no more tokens)"
            )
    if method == "dpo":
        f["precompute_ref"] = get("train.precompute_ref_logprobs", bool, None)
    if values.get("eval.engine") == "vllm" and f.get("engine") != "vllm":
        plan.notes.append(
            "eval.engine = vllm: the evaluation's own vLLM engine (its weights and KV cache) is not "
            "counted"
        )
    return plan
