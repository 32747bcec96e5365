"""A plan as the table ``proximal memory`` prints, or as JSON (always in bytes)."""

from __future__ import annotations

from dataclasses import asdict

from proximal.memory.budget import UNITS, Plan, Setup, _count

COLUMNS = (
    ("parameters", "parameters"),
    ("optimizer", "optimizer state"),
    ("gradients", "gradients"),
    ("activations", "activations (training)"),
    ("kv_cache", "KV cache (rollout)"),
    ("total", "total"),
)

#: What each method's models are, for the table's first line.
TITLES = {
    "ppo": "PPO's four models",
    "grpo": "GRPO's models (actor, reference when β > 0, reward model)",
    "rloo": "RLOO's models (actor, reference when β > 0, reward model)",
    "distill": "on-policy distillation's models (student, teacher, reward model)",
    "dpo": "DPO's models (policy and reference)",
    "simpo": "SimPO's one model",
    "sft": "SFT's one model",
    "rm": "reward-model training's one model",
}


def fmt(nbytes: int | None, unit: str) -> str:
    if nbytes is None:
        return "not sized"
    v = nbytes / UNITS[unit]
    if v == 0:
        return f"0 {unit}"
    return f"{v:,.1f} {unit}" if v >= 10 else f"{v:,.3g} {unit}"


def layout(setup: Setup) -> str:
    if setup.device == "cpu":
        procs = f"{setup.gpus} processes" if setup.gpus > 1 else "one process"
        return f"the CPU, {procs} on {setup.nodes} node{'s' * (setup.nodes > 1)}: host memory"
    if setup.world == 1:
        where = "1 GPU"
    else:
        where = f"{setup.world} GPUs ({setup.nodes} node{'s' * (setup.nodes > 1)} x {setup.gpus})"
    what = {
        "single": "no sharding (each GPU holds whole models)",
        "fsdp": "FSDP full shard",
        "offload": "no sharding, AdamW state in CPU memory",
        "fsdp-offload": "FSDP full shard, AdamW state in CPU memory",
    }
    return f"{setup.strategy} on {where}: {what[setup.strategy]}"


def _sizes(st: Setup) -> str:
    numerics = f"precision {st.precision}" if st.precision else f"dtype {st.dtype}"
    per = "per process" if st.device == "cpu" else "per GPU"
    if st.online:
        group = f" x {st.group_size} responses" if st.group_size > 1 else ""
        s = st.prompt_len + st.response_len
        text = (
            f"  {numerics}; rollout batch {st.batch}{group} ({st.rollout_batch_per_gpu} sequences "
            f"{per}), micro-batch {st.micro_batch} {per}, {st.prompt_len} prompt + "
            f"{st.response_len} response = {s} tokens"
        )
    else:
        unit = "pairs" if st.method in ("dpo", "simpo", "rm") else "rows"
        text = (
            f"  {numerics}; batch {st.batch} {unit}, micro-batch {st.micro_batch} {unit} {per}, "
            f"sequences of {st.max_length} tokens"
        )
    text += f"; log-probabilities: {st.logprobs}" if st.method != "rm" else ""
    text += "; rollout engine vllm" if st.online and st.engine == "vllm" else ""
    text += f"; distill.loss {st.distill_loss}" if st.method == "distill" else ""
    text += f"; LoRA rank {st.lora_rank}" if st.lora_rank else ""
    text += "; activation checkpointing" if st.activation_checkpointing else ""
    text += "; compiled blocks (train.compile)" if st.compiled else ""
    return text


def render(
    p: Plan,
    unit: str,
    best: Plan | None,
    best_on_gpu: Plan | None = None,
    largest_micro_batch: int | None = None,
    memory_from: str = "",
) -> str:
    """The plan as ``proximal memory`` prints it. ``memory_from``: where a CPU run's memory figure
    comes from (this machine's RAM, or ``--host-memory``)."""
    st = p.setup
    if st.device == "cpu":
        return _render_cpu(p, unit, largest_micro_batch, memory_from)
    lines = [
        f"proximal memory: the memory budget of {TITLES[st.method]} (weights, AdamW states, "
        "gradients, activations), bytes on one GPU",
        *_head(p),
        f"  strategy {layout(st)}",
        "",
        *_table(p, unit),
    ]
    phase_txt = ", ".join(f"{k} {fmt(v, unit)}" for k, v in p.phases.items())
    at_least = "" if p.sized else "at least "
    lines += [
        f"peak per GPU: {at_least}{fmt(p.peak, unit)} = {_static_name(p)} "
        f"{fmt(p.static, unit)} + the largest phase, {p.peak_phase} ({phase_txt})"
    ]
    if p.cpu_optimizer:
        lines.append(
            f"CPU memory for the offloaded AdamW state: {fmt(p.cpu_optimizer, unit)} in all"
            f" ({fmt(-(-p.cpu_optimizer // st.nodes), unit)} per node)"
        )
    lines += _verdict(
        p,
        fmt(st.gpu_memory, unit),
        need=p.peak,
        where=" per GPU",
        unsized_where="",
        largest_micro_batch=largest_micro_batch,
        fits="fits this layout",
        per="GPU",
    )
    if best is None:
        hint = "reduce --micro-batch or the sequence length" + (
            "" if st.activation_checkpointing else ", or add --activation-checkpointing"
        )
        lines.append(
            f"cheapest strategy that fits: none up to 8192 GPUs; {hint} (activations of one "
            "micro-batch do not shrink with more GPUs)"
        )
    else:
        unsized = "" if best.sized else " (activations and KV cache not counted)"
        cpu = (
            f"; AdamW state takes {fmt(-(-best.cpu_optimizer // best.setup.nodes), unit)} of CPU "
            "memory per node"
            if best.cpu_optimizer
            else ""
        )
        lines.append(
            f"cheapest strategy that fits: {layout(best.setup)}, {fmt(best.peak, unit)} per GPU"
            f"{unsized}{cpu}"
        )
        if best.setup.offload and best_on_gpu is not None:
            lines.append(
                f"cheapest without CPU offload: {layout(best_on_gpu.setup)}, "
                f"{fmt(best_on_gpu.peak, unit)} per GPU{unsized}"
            )
    lines += [f"note: {n}" for n in p.notes]
    lines.append(
        "not counted: CUDA context and kernels (~0.5-1 GiB), allocator fragmentation and cache, "
        "communication buffers, temporaries inside kernels and AdamW's step (docs/memory.md)"
    )
    return "\n".join(lines)


def _static_name(p: Plan) -> str:
    """What ``p.static`` holds, as the peak's line names it."""
    engine = " + the vllm engine's KV cache" if "vllm engine" in p.rows else ""
    return f"weights + optimizer state{engine}"


def _head(p: Plan) -> list[str]:
    """The models and the sizes of the run, under the title."""
    st = p.setup

    def desc(role: str) -> str:
        spec = {"critic": st.critic, "reward": st.reward, "teacher": st.teacher}.get(role, st.actor)
        return f"  {role:<9} {_count(spec.n_params)} params" + (
            f" ({spec.arch.model_type}, {spec.arch.source})" if spec.arch else ""
        )

    return [*(desc(role) for role in p.rows), _sizes(st)]


def _table(p: Plan, unit: str) -> list[str]:
    """The budget table, a row per model and their sum, then each model's note."""
    lines = []
    table = [["model"] + [c for _, c in COLUMNS]]
    for role, r in p.rows.items():
        table.append([role] + [fmt(getattr(r, k), unit) for k, _ in COLUMNS])
    sums = [[getattr(r, k) for r in p.rows.values()] for k, _ in COLUMNS]
    table.append(["all at once"] + [fmt(None if None in col else sum(col), unit) for col in sums])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for j, row in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)
            )
        )
        if j == 0 or j == len(table) - 2:
            lines.append("  ".join("-" * wd for wd in widths))
    for role, r in p.rows.items():
        if r.note:
            lines.append(f"  {role}: {r.note}")
    lines.append("")
    return lines


def _render_cpu(p: Plan, unit: str, largest_micro_batch: int | None, memory_from: str) -> str:
    """A CPU run's plan: one process's bytes in host memory, with the process's imports and compiled
    graphs, against the machine's RAM (``setup.gpu_memory``)."""
    st = p.setup
    budget = fmt(st.gpu_memory, unit)
    source = f" ({memory_from})" if memory_from else ""
    lines = [
        f"proximal memory: the memory budget of {TITLES[st.method]} (weights, AdamW states, "
        "gradients, activations), bytes in host memory: a CPU run",
        *_head(p),
        f"  {layout(st)}, {budget}{source}",
        "",
        *_table(p, unit),
    ]
    phase_txt = ", ".join(f"{k} {fmt(v, unit)}" for k, v in p.phases.items())
    host_txt = "".join(f" + {name} {fmt(v, unit)}" for name, v in p.host.items())
    at_least = "" if p.sized else "at least "
    lines.append(
        f"peak per process: {at_least}{fmt(p.peak, unit)} = {_static_name(p)} "
        f"{fmt(p.static, unit)}{host_txt} + the largest phase, {p.peak_phase} ({phase_txt})"
    )
    processes = f" for {st.gpus} processes" if st.gpus > 1 else ""
    lines += _verdict(
        p,
        budget,
        need=p.peak * st.gpus,
        where=f" of host memory{processes}",
        unsized_where=" of host memory",
        largest_micro_batch=largest_micro_batch,
        fits="fits",
        per="process",
    )
    lines += [f"note: {n}" for n in p.notes]
    lines.append(
        "not counted: allocator fragmentation, temporaries inside kernels and AdamW's step, the "
        "data set's rows (docs/memory.md)"
    )
    return "\n".join(lines)


def _verdict(
    p: Plan,
    budget: str,
    *,
    need: int,
    where: str,
    unsized_where: str,
    largest_micro_batch: int | None,
    fits: str,
    per: str,
) -> list[str]:
    """The verdict line — ``need`` bytes against the ``budget`` of ``setup.gpu_memory``, ``where``
    saying of what (" per GPU", " of host memory for 2 processes"), ``unsized_where`` when the
    activations are not sized — and the largest micro-batch's line (``fits``: what it fits, ``per``:
    one GPU or process) where it was searched."""
    memory = p.setup.gpu_memory
    at_least = "" if p.sized else "at least "
    if not p.fits:
        verdict = f"verdict: DOES NOT FIT in {budget}{where} (needs {at_least}{need / memory:.1f}x)"
    elif not p.sized:
        verdict = (
            f"verdict: weights, optimizer and gradients fit in {budget}{unsized_where}, but "
            "activations and the KV cache are not sized"
        )
    else:
        verdict = f"verdict: FITS in {budget}{where} ({100 * need / memory:.0f}% used)"
    lines = [verdict]
    if largest_micro_batch is not None and p.sized:
        lines.append(
            f"largest micro-batch that {fits}: {largest_micro_batch} per {per}"
            if largest_micro_batch
            else f"largest micro-batch that {fits}: none (not even 1)"
        )
    return lines


def to_json(
    p: Plan,
    best: Plan | None,
    best_on_gpu: Plan | None = None,
    largest_micro_batch: int | None = None,
) -> dict:
    def where(x: Plan) -> dict:
        return {
            "strategy": x.setup.strategy,
            "gpus_per_node": x.setup.gpus,
            "nodes": x.setup.nodes,
            "world_size": x.setup.world,
            "peak_bytes_per_gpu": x.peak,
        }

    setup = asdict(p.setup)
    # each linear layer's shape is the count's, not the plan's
    for role in (
        "actor",
        "critic",
        "reward",
        "teacher",
    ):
        if (setup.get(role) or {}).get("arch"):
            setup[role]["arch"].pop("linears", None)
    return {
        "method": p.setup.method,
        "setup": setup,
        "bytes_per_gpu": {
            role: {
                **{k: getattr(r, k) for k, _ in COLUMNS},
                "n_params": r.n_params,
                "trainable_params": r.trainable,
                "note": r.note,
            }
            for role, r in p.rows.items()
        },
        "all_at_once_bytes": p.all_at_once,
        "static_bytes": p.static,
        "phase_bytes": p.phases,
        "peak_phase": p.peak_phase,
        "peak_bytes_per_gpu": p.peak,
        "activations_sized": p.sized,
        "cpu_optimizer_bytes": p.cpu_optimizer,
        "gpu_memory_bytes": p.setup.gpu_memory,  # on a CPU: the host memory planned against
        "device": p.setup.device,
        "host_bytes": p.host,
        "fits": p.fits,
        "largest_micro_batch": largest_micro_batch,
        "cheapest_fit": where(best) if best else None,
        "cheapest_fit_without_offload": where(best_on_gpu) if best_on_gpu else None,
        "notes": p.notes,
    }
