"""``proximal memory``: the command line of the planner — flags, or a run's config (``--run``).

    proximal memory --params 70e9                               # PPO's four models, weights and states
    proximal memory --config ./policy --batch 128 ...           # a model's shape: activations too
    proximal memory --run grpo.yaml                             # the run a config describes
    proximal memory --run runs/dpo --gpus 8                     # a run directory: its saved config.yaml

Every problem is an argparse error (exit status 2) that names the flag, the file or the field.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

from proximal.memory.arch import ConfigReadError, load_architecture
from proximal.memory.budget import (
    DEVICES,
    DISTILL_LOSSES,
    DTYPES,
    ENGINES,
    LOGPROBS,
    METHODS,
    ONLINE,
    PRECISIONS,
    STRATEGIES,
    UNITS,
    GiB,
    ModelSpec,
    Setup,
    plan,
)
from proximal.memory.render import render, to_json
from proximal.memory.runconfig import RunPlan, RunReadError, read_run
from proximal.memory.search import cheapest_fit, largest_micro_batch

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

#: The flags' defaults without --run (with --run the config's fields are the defaults).
FLAG_DEFAULTS = dict(
    batch=64,
    prompt_len=512,
    response_len=512,
    max_length=1024,
    micro_batch=1,
    lora_rank=0,
    gpus=1,
    nodes=1,
    logprobs="full",
)


def _count_arg(text: str) -> int:
    """70e9, 70000000000, 70B, 7.5b, 350M."""
    t = text.strip().lower().replace("_", "")
    try:
        v = float(t[:-1]) * _SUFFIX[t[-1]] if t and t[-1] in _SUFFIX else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count (e.g. 70e9, 7B, 350M)"
        ) from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a parameter count must be positive")
    return int(round(v))


def _int_arg(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be at least {minimum}")
        return v

    return parse


def _gib_arg(what: str):
    def parse(text: str) -> int:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {what} memory must be positive")
        return int(v * GiB)

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="proximal memory",
        description="Will a run fit? The memory budget of every model a method holds — weights, "
        "AdamW states, gradients, activations, the rollout's KV cache — per model and per GPU, with "
        "a verdict, the largest micro-batch that fits and the cheapest layout that fits. From a "
        "run's config (--run, any method) or from flags (PPO's four models unless --method). "
        "Formulas, their derivation and the measured checks: docs/memory.md.",
        epilog="examples:\n  proximal memory --params 70e9\n"
        "  proximal memory --config ./my-llama --batch 128 --micro-batch 2 --activation-checkpointing "
        "--strategy fsdp --gpus 8 --nodes 4\n"
        "  proximal memory --config ./policy --reward-config ./rm --lora-rank 16 --json\n"
        "  proximal memory --run grpo.yaml --gpus 8\n"
        "  proximal memory --method distill --config ./student --teacher-config ./teacher\n"
        "  proximal memory --run runs/dpo --micro-batch 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = ap.add_argument_group("a run's config")
    run.add_argument(
        "--run",
        metavar="PATH",
        help="a run's YAML config, or a run directory (its config.yaml): plan the run it describes, "
        "reading only the fields a plan needs (no data or reward function has to exist; each "
        "model's config.json does, unless --config/--params give it); flags given as well override "
        "the config's values",
    )
    run.add_argument(
        "--method",
        choices=METHODS,
        help="the method to plan: with --run, needed when the file's sections do not name it "
        "(a run directory's do); without, the flags describe a run of it (default: ppo)",
    )
    m = ap.add_argument_group(
        "models (the reference is a copy of the actor; with LoRA, the actor's base)"
    )
    src = m.add_mutually_exclusive_group()
    src.add_argument(
        "--params",
        type=_count_arg,
        metavar="N",
        help="actor parameter count, e.g. 70e9 or 7B "
        "(sizes weights, gradients and optimizer state only)",
    )
    src.add_argument(
        "--config",
        "--model",
        dest="config",
        metavar="PATH",
        help="actor model directory or its config.json (read locally, never downloaded; counted "
        "from the model built on the meta device); sizes parameters, activations and KV cache. "
        "With --run: instead of model.path's",
    )
    for role, default in (
        ("critic", "the reward model's, which proximal ppo initialises it from"),
        ("reward", "the actor's backbone with a scalar head"),
        ("teacher", "distill: the student's own shape; it may be larger"),
    ):
        g = m.add_mutually_exclusive_group()
        g.add_argument(
            f"--{role}-params",
            type=_count_arg,
            metavar="N",
            help=f"{role} parameter count (default: {default}; with --run, the config's)",
        )
        g.add_argument(
            f"--{role}-config",
            metavar="PATH",
            help=f"{role} model directory or config.json (default: {default}; with --run, the "
            "config's)",
        )
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="train.precision's bytes: 32-true 4+4+8 per trained parameter, bf16-mixed float32 "
        "master weights (4+4+8) with bfloat16 compute and frozen models, bf16-true 2+2+4 "
        "(default: --dtype's budget; with --run, the config's)",
    )
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="without --precision: weights/gradients/activations dtype; 16-bit = mixed precision "
        "with float32 AdamW master copy (2N + 2N + 12N), float32 = 4N + 4N + 8N (default: bfloat16)",
    )
    ap.add_argument(
        "--batch",
        type=_int_arg(1),
        help="online methods: prompts per step; dpo, simpo, sft, rm: rows (pairs) per optimizer "
        "step; all GPUs together (default: 64)",
    )
    ap.add_argument(
        "--group-size",
        type=_int_arg(1),
        help="grpo, rloo, distill: responses per prompt (default: 8; distill 1)",
    )
    ap.add_argument(
        "--distill-loss",
        choices=DISTILL_LOSSES,
        help="distill: reverse_kl (the sampled tokens' log-probabilities through the head, as "
        "GRPO's update) or jsd (the teacher's forward again in the update and GKD's JSD over the "
        "whole vocabulary, a chunk of positions at a time) (default: reverse_kl; with --run, "
        "distill.loss)",
    )
    ap.add_argument(
        "--prompt-len", type=_int_arg(1), help="online methods: prompt tokens P (default: 512)"
    )
    ap.add_argument(
        "--response-len", type=_int_arg(1), help="online methods: response tokens T (default: 512)"
    )
    ap.add_argument(
        "--max-length",
        type=_int_arg(2),
        help="dpo, simpo, sft, rm: tokens of one sequence (default: 1024)",
    )
    ap.add_argument(
        "--micro-batch",
        type=_int_arg(1),
        help="sequences (pairs for dpo, simpo, rm) per forward/backward on one GPU (default: 1)",
    )
    ap.add_argument(
        "--lora-rank",
        type=_int_arg(0),
        help="LoRA rank on every linear layer of the trained models; 0 = full fine-tuning "
        "(default: 0)",
    )
    ap.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="keep only each layer's input and recompute the layer in backward",
    )
    ap.add_argument(
        "--no-forward-cache",
        dest="forward_cache",
        action="store_false",
        help="the trainer passes use_cache=False to its training and scoring forwards; by default "
        "transformers keeps every layer's K and V during any forward, and this is counted "
        "(--run: proximal's trainers never keep it)",
    )
    ap.add_argument(
        "--logprobs",
        choices=LOGPROBS,
        help="how log-probabilities are taken: fused (from hidden states in chunks, no logits), "
        "logits (the scored positions' logits, a memory-light log-softmax), full (a generic "
        "trainer: logits at every position, a float32 log-softmax kept) (default: full; with "
        "--run, train.logprobs)",
    )
    ap.add_argument(
        "--engine",
        choices=ENGINES,
        help="ppo, grpo, rloo, distill: what samples the rollouts (rollout.engine): hf, the policy's own "
        "decode (its KV cache in the rollout phase); vllm, a vLLM engine in every process with its "
        "own whole copy of the weights and a KV cache of --kv-cache-gib, both resident all step "
        "(default: hf; with --run, rollout.engine)",
    )
    ap.add_argument(
        "--staleness",
        type=_int_arg(0),
        metavar="K",
        help="ppo, grpo, rloo, distill: rollout.staleness; K >= 1 adds the generator process's "
        "memory, resident all step: its own copy of the policy and its decode (or its vLLM "
        "engine), and with several processes or LoRA the shared plain copy it reads (default: 0; "
        "with --run, the config's)",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=_gib_arg("KV-cache"),
        metavar="GIB",
        help="with --engine vllm: the engine's KV-cache budget per process in GiB "
        "(rollout.kv_cache_gib; default: 1; with --run, the config's)",
    )
    ap.add_argument(
        "--strategy",
        choices=STRATEGIES,
        help="single: whole models on each GPU; fsdp: full shard of weights, gradients and AdamW "
        "state over gpus*nodes; offload / fsdp-offload: AdamW state in CPU memory (default: "
        "single; with --run, fsdp on more than one GPU, as proximal shards)",
    )
    ap.add_argument("--gpus", type=_int_arg(1), help="GPUs per node (default: 1)")
    ap.add_argument("--nodes", type=_int_arg(1), help="nodes (default: 1)")
    ap.add_argument(
        "--gpu-memory",
        type=_gib_arg("GPU"),
        default=80 * GiB,
        metavar="GIB",
        help="memory of one GPU in GiB (default: 80)",
    )
    ap.add_argument(
        "--device",
        choices=DEVICES,
        help="cuda: plan the bytes on one GPU against --gpu-memory; cpu: the bytes of one process "
        "in host memory (with the process's imports and compiled graphs) against the machine's "
        "RAM (default: cuda; with --run, cpu for train.device: cpu)",
    )
    ap.add_argument(
        "--host-memory",
        type=_gib_arg("host"),
        metavar="GIB",
        help="with --device cpu: the host memory in GiB to plan against (default: this machine's "
        "RAM, MemTotal in /proc/meminfo)",
    )
    ap.add_argument(
        "--units", choices=tuple(UNITS), default="GiB", help="units of the table (default: GiB)"
    )
    ap.add_argument("--json", action="store_true", help="print the plan as JSON (always in bytes)")
    return ap


def _arch(flag: str, path: str, parser: argparse.ArgumentParser):
    try:
        return load_architecture(path)
    except ConfigReadError as e:
        parser.error(f"{flag} {e}")


def setup_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[Setup, RunPlan | None]:
    """Turn parsed flags (and ``--run``'s config) into a ``Setup``; every problem is a
    ``parser.error`` naming the flag, the file or the field."""
    run = None
    if args.run:
        try:
            run = read_run(args.run, args.method)
        except (RunReadError, ConfigReadError) as e:
            parser.error(str(e))
    elif args.params is None and args.config is None:
        parser.error("one of the arguments --params --config --run is required")
    method = run.method if run else (args.method or "ppo")
    fields = dict(FLAG_DEFAULTS) if run is None else {**run.fields, "forward_cache": False}
    if run is None:
        fields["forward_cache"] = args.forward_cache
        fields["group_size"] = 8 if method in ("grpo", "rloo") else 1
    elif not args.forward_cache:
        fields["forward_cache"] = False
    for name in (
        "batch",
        "group_size",
        "prompt_len",
        "response_len",
        "max_length",
        "micro_batch",
        "lora_rank",
        "gpus",
        "nodes",
        "logprobs",
        "precision",
        "distill_loss",
    ):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.activation_checkpointing:
        fields["activation_checkpointing"] = True
    if args.engine is not None:
        if args.engine == "vllm" and method not in ONLINE:
            parser.error(
                f"--engine vllm: {method} samples no rollouts (ppo, grpo, rloo and distill do)"
            )
        fields["engine"] = args.engine
    if args.staleness is not None:
        if args.staleness and method not in ONLINE:
            parser.error(
                f"--staleness: {method} samples no rollouts (ppo, grpo, rloo and distill do)"
            )
        fields["staleness"] = args.staleness
    if args.kv_cache_gib is not None:
        if fields.get("engine", "hf") != "vllm":
            parser.error(
                "--kv-cache-gib sizes the vllm engine's KV cache, and this plan's engine is hf "
                "(--engine vllm, or rollout.engine: vllm in the run's config)"
            )
        fields["engine_kv_cache"] = args.kv_cache_gib
    if args.device is not None:
        fields["device"] = args.device
    cpu = fields.get("device") == "cpu"
    world = fields.get("gpus", 1) * fields.get("nodes", 1)
    if cpu and args.strategy not in (None, "single"):
        parser.error(f"--strategy {args.strategy} is a GPU layout; a CPU run is planned as single")
    strategy = args.strategy or ("fsdp" if run and world > 1 and not cpu else "single")
    if strategy in ("fsdp", "fsdp-offload") and world == 1:
        parser.error(
            f"--strategy {strategy} shards over --gpus x --nodes GPUs; with 1 GPU use single or "
            "offload"
        )

    # The models: flags first, then the run's config.json files, then the defaults.
    head = "score" if method == "rm" else "lm"
    if args.config:
        actor_arch = _arch("--config", args.config, parser)
    elif args.params is None:  # --run: model.path's config.json
        actor_arch = _arch(f"{run.file}: model.path", run.actor_path, parser)
    else:
        actor_arch = None
    actor = ModelSpec.of(actor_arch, head) if actor_arch else ModelSpec(args.params)
    # A scorer that only shares the actor's shape (the flags' default reward model) was never loaded
    # from its causal-LM checkpoint: no unused head of that checkpoint comes with it.
    as_scorer = replace(actor_arch, checkpoint_class="") if actor_arch else None

    def scorer(flag: str, path: str | None, params: int | None) -> ModelSpec | None:
        if path:
            return ModelSpec.of(_arch(flag, path, parser), "score")
        if params:
            return ModelSpec(params)
        return None

    reward = scorer("--reward-config", args.reward_config, args.reward_params)
    if reward is None and method in ("ppo", "grpo", "rloo"):
        if run is not None:
            if run.reward_path:
                reward = ModelSpec.of(
                    _arch(f"{run.file}: model.reward_model", run.reward_path, parser), "score"
                )
        else:  # the reward model has the actor's backbone with a scalar head instead of the LM head
            reward = ModelSpec.of(as_scorer, "score") if actor_arch else ModelSpec(actor.n_params)
    critic = None
    if method == "ppo":
        critic = scorer("--critic-config", args.critic_config, args.critic_params)
        choice = run.critic if run is not None else "reward_model"
        if critic is None and choice == "policy":
            critic = ModelSpec.of(actor_arch, "score") if actor_arch else ModelSpec(actor.n_params)
        elif critic is None and choice not in (None, "reward_model"):
            critic = ModelSpec.of(_arch(f"{run.file}: model.critic", choice, parser), "score")
        elif critic is None:
            # as proximal ppo (and Ouyang et al. 2022): the critic starts from the reward model
            if reward is None:
                parser.error(
                    f"{run.file if run else '--run'}: model.critic = reward_model needs "
                    "model.reward_model (or --critic-config / --critic-params)"
                )
            critic = reward
    teacher = None
    if method == "distill":
        # the flags, else the run's model.teacher, else (flags alone) the student's own shape
        if args.teacher_config:
            teacher = ModelSpec.of(_arch("--teacher-config", args.teacher_config, parser), "lm")
        elif args.teacher_params:
            teacher = ModelSpec(args.teacher_params)
        elif run is not None:
            if not run.teacher_path:
                parser.error(
                    f"{run.file}: model.teacher is not set (the teacher's checkpoint directory; "
                    "or give its shape with --teacher-config / --teacher-params)"
                )
            teacher = ModelSpec.of(
                _arch(f"{run.file}: model.teacher", run.teacher_path, parser), "lm"
            )
        else:
            teacher = actor
    elif args.teacher_config or args.teacher_params:
        parser.error(f"--teacher-config/--teacher-params: {method} has no teacher (distill has)")
    if run is not None:
        fields["compiled"] = compiles(run.compile, fields, actor_arch, world, run.steps)
    memory = args.gpu_memory
    if cpu:
        memory = args.host_memory or host_memory_bytes()
        if memory is None:
            parser.error("--device cpu: this machine's RAM is unknown; give --host-memory GIB")
    try:
        setup = Setup(
            actor=actor,
            critic=critic,
            reward=reward,
            teacher=teacher,
            method=method,
            dtype=args.dtype,
            strategy=strategy,
            gpu_memory=memory,
            **fields,
        )
    except ValueError as e:
        parser.error(str(e))
    return setup, run


def compiles(choice: str, fields: dict, arch, world: int, steps: int | None = None) -> bool:
    """Whether a run's ``train.compile`` compiles its blocks (so the plan counts the compiled
    graphs): 'blocks' in one process; 'auto' where proximal.models.compiled's rule does — one process
    on a CPU, no LoRA, no activation checkpointing, a hidden size of at least AUTO_MIN_HIDDEN, and a
    run of ``steps`` long enough to repay compiling (``compiled.pays``). A length the config does not give
    (``train.steps`` null: the data's epochs decide it) is counted as compiling: a plan errs high."""
    if world > 1 or choice not in ("blocks", "auto"):
        return False
    if choice == "blocks":
        return True
    # lazy: the rule's threshold lives with the compiling code, which imports torch (--run has)
    from proximal.models.compiled import AUTO_MIN_HIDDEN, pays

    eligible = (
        fields.get("device") == "cpu"
        and not fields.get("lora_rank")
        and not fields.get("activation_checkpointing")
        and arch is not None
        and arch.hidden_size >= AUTO_MIN_HIDDEN
    )
    return eligible and (steps is None or pays(steps, arch.hidden_size)[0])


def host_memory_bytes() -> int | None:
    """This machine's RAM: MemTotal in /proc/meminfo (Linux), else the physical pages' bytes
    (``os.sysconf``); None where neither says."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cli(argv: list[str]) -> int:
    """``proximal memory``: print the plan (or ``--json``); exit 0 whether or not it fits."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup, run = setup_from_args(args, parser)
    p = plan(setup)
    if run is not None:
        p.notes[:0] = run.notes
    if setup.device == "cpu":  # no GPU layouts to search
        best = best_on_gpu = None
    else:
        best_on_gpu = cheapest_fit(setup, offload=False)
        # proximal's trainers have no CPU offload: for a run, the cheapest layout is one without it.
        best = best_on_gpu if run is not None else cheapest_fit(setup)
    largest = largest_micro_batch(setup) if p.sized else None
    if args.json:
        print(json.dumps(to_json(p, best, best_on_gpu, largest), indent=2))
    else:
        source = "--host-memory" if args.host_memory else "this machine's RAM"
        print(render(p, args.units, best, best_on_gpu, largest, memory_from=source))
    return 0


def plan_run(path: str, method: str | None = None, **overrides) -> tuple[Setup, RunPlan]:
    """The ``Setup`` of the run at ``path`` as ``proximal memory --run`` builds it (for scripts and
    the benchmarks): ``overrides`` are flags by their dest name (``gpus=8``, ``micro_batch=2``)."""
    parser = build_parser()
    args = parser.parse_args(["--run", str(path)] + (["--method", method] if method else []))
    args = argparse.Namespace(**{**vars(args), **overrides})
    setup, run = setup_from_args(args, parser)
    return replace(setup), run


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli(sys.argv[1:]))
