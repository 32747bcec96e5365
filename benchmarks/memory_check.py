"""Measured versus predicted: the peak memory of one real PPO step against ``proximal memory``.

For each configuration a fresh Python process builds the four models with
``proximal.models.tiny.tiny_config`` (float32, on the CPU), runs two PPO steps — rollout with the KV
cache, scoring by all four models, one AdamW update of the actor and of the critic, each accumulated
over micro-batches — and measures the second (steady-state) step. The planner is asked about the
same configuration through the same ``config.json`` a user would pass, with ``--dtype float32``.

Two measurements, both in a fresh subprocess per configuration:

allocator  every allocation and free made through PyTorch's CPU allocator, recorded by
           ``torch.profiler`` (``profile_memory=True``) from before the models are built; the live
           bytes are the running sum, and the peak of the second step is taken, overall and within
           each phase. This is the CPU analogue of ``torch.cuda.max_memory_allocated()``: exactly the
           tensors the planner counts, nothing of the interpreter.
rss        the process's peak resident set (``ru_maxrss``) minus its resident set just before the
           models are built (after a throwaway PPO step on a 2-layer model has paged in the library
           code a step touches). What the OS sees: tensors plus the freed memory glibc's malloc keeps
           in its heap (its mmap threshold grows to 32 MiB as large blocks are freed, so later
           tensors up to that size come from the heap and stay resident after they are freed).
rss-mmap   the same with ``MALLOC_MMAP_THRESHOLD_=65536`` (a fixed threshold: every tensor over
           64 KiB is its own mmap, returned to the OS when freed), which isolates that heap retention.

    .venv/bin/python benchmarks/memory_check.py                   # every configuration, every method
    .venv/bin/python benchmarks/memory_check.py --configs test --method allocator --json

The PPO step is written out here with plain ``transformers`` models on purpose: it must not depend on
``proximal.trainers.ppo`` (the planner is checked against what PyTorch allocates, not against our own
trainer's choices), and it follows the steps of docs/formulas.md (rollout, scoring, KL-shaped
rewards and GAE, actor and critic updates) the way every PPO trainer does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> shape and batch. All Llama-style (the architecture of proximal.models.tiny's default).
CONFIGS = {
    # the configuration tests/test_memory.py asserts (a few seconds on 2 cores)
    "test": dict(
        hidden=256,
        layers=4,
        heads=4,
        vocab=2048,
        batch=8,
        micro_batch=4,
        prompt_len=32,
        response_len=32,
    ),
    # three that differ in batch, response length and model size
    "small-long": dict(
        hidden=256,
        layers=6,
        heads=4,
        vocab=4096,
        batch=8,
        micro_batch=4,
        prompt_len=64,
        response_len=192,
    ),
    "medium": dict(
        hidden=384,
        layers=6,
        heads=6,
        vocab=4096,
        batch=16,
        micro_batch=8,
        prompt_len=64,
        response_len=64,
    ),
    "large": dict(
        hidden=512,
        layers=8,
        heads=8,
        vocab=8192,
        batch=8,
        micro_batch=2,
        prompt_len=128,
        response_len=128,
    ),
    # activation checkpointing (Hugging Face's per-layer gradient checkpointing)
    "medium-ckpt": dict(
        hidden=384,
        layers=6,
        heads=6,
        vocab=4096,
        batch=16,
        micro_batch=8,
        prompt_len=64,
        response_len=64,
        checkpointing=True,
    ),
}
PHASES = ("rollout", "scoring", "actor update", "critic update")
METHODS = ("allocator", "rss", "rss-mmap")  # on the CPU; "cuda" runs the same step on a GPU
LABELS = {
    "allocator": "allocator peak",
    "rss": "RSS - baseline",
    "rss-mmap": "RSS, fixed mmap threshold",
    "cuda": "CUDA max allocated",
}


# --------------------------------------------------------------------------------------------------
# The worker: one configuration, one fresh process
# --------------------------------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def response_logprobs(model, seq, prompt_len):
    """log pi(y_t | x, y_<t) of the response tokens. Shape: (m, T) from seq (m, P + T).

    The logits at every position come back from the model (float32); the log-softmax is taken over the
    T positions that predict response tokens. Returning only the gathered values lets the full
    logits go at the end of this function, as in any trainer that computes the loss in a helper.
    """
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits  # (m, s, V)
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float(), dim=-1)  # (m, T, V)
    return logp.gather(-1, seq[:, prompt_len:, None]).squeeze(-1)  # (m, T)


def ppo_step(actor, ref, critic, reward, opt_a, opt_c, prompts, T, mb, mark):
    """One PPO step (the steps of docs/formulas.md). ``mark(name)`` records when each phase starts."""
    from proximal.models.heads import last_token_scores, token_values

    B, P = prompts.shape
    beta, gamma, lam, eps, eps_v = 0.05, 1.0, 0.95, 0.2, 0.2
    # 1. Rollout (the token-level MDP): sample T tokens per prompt from the actor with the KV cache.
    mark("rollout")
    actor.eval()
    with torch.no_grad():
        seq = actor.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=T,
            min_new_tokens=T,
            pad_token_id=0,
            eos_token_id=1,
        )  # (B, P + T)
    mask = torch.ones_like(seq)
    # 2. Scoring (the four models): old and reference log-probs, values, reward — no grad, micro-batches.
    mark("scoring")
    old_lp, ref_lp, values, scores = [], [], [], []
    with torch.no_grad():
        for i in range(0, B, mb):
            s_ = seq[i : i + mb]
            old_lp.append(response_logprobs(actor, s_, P))
            ref_lp.append(response_logprobs(ref, s_, P))
            values.append(token_values(critic, s_, mask[i : i + mb])[:, P - 1 : -1])
            scores.append(last_token_scores(reward, s_, mask[i : i + mb]))
    old_lp, ref_lp, values, scores = (torch.cat(x) for x in (old_lp, ref_lp, values, scores))
    # 3. Per-token KL-shaped rewards (Ziegler et al. 2019), GAE (Schulman et al. 2015), whitened advantages.
    rewards = -beta * (old_lp - ref_lp)
    rewards[:, -1] += scores
    adv, last = torch.zeros_like(rewards), torch.zeros(B, device=seq.device)
    for t in reversed(range(T)):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros(B, device=seq.device)
        last = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * last
        adv[:, t] = last
    returns = adv + values
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    # 4. Actor update: clipped surrogate (Schulman et al. 2017), gradients accumulated over
    # micro-batches, one AdamW step.
    mark("actor update")
    actor.train()
    for i in range(0, B, mb):
        lp = response_logprobs(actor, seq[i : i + mb], P)
        ratio = torch.exp(lp - old_lp[i : i + mb])
        a = adv[i : i + mb]
        loss = -torch.min(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a).mean() * (len(a) / B)
        loss.backward()
    opt_a.step()
    opt_a.zero_grad(set_to_none=True)
    # 5. Critic update: clipped value loss.
    mark("critic update")
    critic.train()
    for i in range(0, B, mb):
        v = token_values(critic, seq[i : i + mb], mask[i : i + mb])[:, P - 1 : -1]
        v_old, ret = values[i : i + mb], returns[i : i + mb]
        v_clip = v_old + (v - v_old).clamp(-eps_v, eps_v)
        loss = 0.5 * torch.max((v - ret) ** 2, (v_clip - ret) ** 2).mean() * (len(v) / B)
        loss.backward()
    opt_c.step()
    opt_c.zero_grad(set_to_none=True)
    mark("end")


def _build_and_step(spec: dict, steps: int, device: str = "cpu", on_mark=None):
    """Build the four models of ``spec`` and run ``steps`` PPO steps; return (config, phase marks, seconds).

    ``on_mark(label)``, if given, is called as each phase starts, label ``"<step>:<phase>"``.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from proximal.models.tiny import tiny_config

    torch.manual_seed(0)
    P, T, B, mb = spec["prompt_len"], spec["response_len"], spec["batch"], spec["micro_batch"]
    cfg = tiny_config(
        "llama",
        spec["vocab"],
        hidden=spec["hidden"],
        layers=spec["layers"],
        heads=spec["heads"],
        max_positions=P + T,
        num_labels=1,
    )
    # The four models (Ouyang et al. 2022): the reference is a frozen copy of the actor (the SFT model), the
    # critic starts from the reward model (one-label sequence classifiers, as in proximal.models.heads).
    actor = AutoModelForCausalLM.from_config(cfg).to(device)
    ref = AutoModelForCausalLM.from_config(cfg).to(device)
    ref.load_state_dict(actor.state_dict())
    reward = AutoModelForSequenceClassification.from_config(cfg).to(device)
    critic = AutoModelForSequenceClassification.from_config(cfg).to(device)
    critic.load_state_dict(reward.state_dict())
    for m in (ref, reward):
        m.eval().requires_grad_(False)
    if spec.get("checkpointing"):
        for m in (actor, critic):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt_a = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    opt_c = torch.optim.AdamW(critic.parameters(), lr=1e-6)
    prompts = torch.randint(4, spec["vocab"], (B, P), device=device)

    marks: list[tuple[int, str]] = []

    def mark(label: str) -> None:
        if on_mark is not None:
            on_mark(label)
        marks.append((time.time_ns(), label))

    t0 = time.time()
    for step in range(steps):
        ppo_step(
            actor,
            ref,
            critic,
            reward,
            opt_a,
            opt_c,
            prompts,
            T,
            mb,
            lambda name, step=step: mark(f"{step}:{name}"),
        )
    seconds = time.time() - t0
    return cfg, marks, seconds


def worker(spec: dict, method: str) -> dict:
    """Build the four models, run two PPO steps, measure the second. Runs in a fresh process."""
    global torch
    import warnings

    warnings.filterwarnings("ignore")
    import resource

    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # One intra-op thread: the machine is usually shared (tests run in parallel) and oversubscribed
    # threads made the rollout 30x slower there; memory does not depend on the thread count.
    torch.set_num_threads(1)
    if method.startswith("rss"):
        # Page in the code a PPO step touches (kernels, autograd engine, generation) with a throwaway
        # 2-layer model first, so the baseline holds the libraries and the difference holds data.
        _build_and_step(
            dict(
                hidden=32,
                layers=2,
                heads=2,
                vocab=64,
                batch=2,
                micro_batch=1,
                prompt_len=4,
                response_len=4,
                checkpointing=spec.get("checkpointing", False),
            ),
            steps=1,
        )
        gc.collect()
    baseline_rss = _rss_bytes()

    prof = None
    if method == "allocator":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.__enter__()

    cuda: dict = {"phase_peak": {}}

    def on_cuda_mark(label: str) -> None:
        # torch.cuda.max_memory_allocated() since the last reset is the peak of the phase that just ended.
        torch.cuda.synchronize()
        step, phase = label.split(":")
        if cuda.get("label", "").startswith("1:"):
            cuda["phase_peak"][cuda["label"][2:]] = torch.cuda.max_memory_allocated()
        if label == "1:rollout":
            cuda["static"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        cuda["label"] = label

    device = "cuda" if method == "cuda" else "cpu"
    cfg, marks, seconds = _build_and_step(
        spec, steps=2, device=device, on_mark=on_cuda_mark if method == "cuda" else None
    )
    P, T, B, mb = spec["prompt_len"], spec["response_len"], spec["batch"], spec["micro_batch"]
    out = {"method": method, "spec": spec, "seconds": round(seconds, 1)}
    if method == "cuda":
        out.update(
            peak=max(cuda["phase_peak"].values()),
            static=cuda["static"],
            phase_peak=cuda["phase_peak"],
            device_name=torch.cuda.get_device_name(),
        )
    elif prof is not None:
        prof.__exit__(None, None, None)
        events = sorted(
            (e.start_ns(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]"
        )
        # Live bytes after each allocation or free; the peak within each phase of the second step.
        starts = {name: t for t, name in marks}
        bounds = [
            (p, starts[f"1:{p}"], starts[f"1:{q}"]) for p, q in zip(PHASES, PHASES[1:] + ("end",))
        ]
        live, phase_peak = 0, dict.fromkeys(PHASES, 0)
        static = None
        for t, nbytes in events:
            if static is None and t >= starts["1:rollout"]:
                static = live  # weights, AdamW state and the prompts, before the step begins
            live += nbytes
            for p, a, b in bounds:
                if a <= t < b:
                    phase_peak[p] = max(phase_peak[p], live)
        out.update(
            peak=max(phase_peak.values()), static=static, phase_peak=phase_peak, events=len(events)
        )
    else:
        # ru_maxrss is in KiB on Linux.
        out.update(
            peak=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss,
            baseline_rss=baseline_rss,
        )
    # The same question to the planner, through the config.json a user would pass.
    from proximal import memory

    with tempfile.TemporaryDirectory() as d:
        cfg.save_pretrained(d)
        arch = memory.load_architecture(d)
    setup = memory.Setup(
        actor=memory.ModelSpec.of(arch, "lm"),
        critic=memory.ModelSpec.of(arch, "score"),
        reward=memory.ModelSpec.of(arch, "score"),
        dtype="float32",
        batch=B,
        prompt_len=P,
        response_len=T,
        micro_batch=mb,
        activation_checkpointing=bool(spec.get("checkpointing")),
        # the step above: logits at every position and a float32 log-softmax kept for backward, and
        # transformers' forward KV cache (plain model() calls) — the planner's generic trainer
        logprobs="full",
        forward_cache=True,
    )
    p = memory.plan(setup)
    out.update(
        predicted=p.peak,
        predicted_static=p.static,
        predicted_phases=p.phases,
        predicted_peak_phase=p.peak_phase,
        n_params=arch.params("lm"),
        ratio=out["peak"] / p.peak,
    )
    return out


# --------------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------------


def run_one(name: str, method: str) -> dict:
    """Run ``worker`` for configuration ``name`` in a fresh interpreter; return its result."""
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if method == "rss-mmap":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", name, "--method", method],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"memory_check worker {name}/{method} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return {"name": name, **json.loads(lines[-1])}


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(results: list[dict]) -> str:
    """The tables in docs/memory.md."""
    methods = [m for m in LABELS if any(r["method"] == m for r in results)]
    rows = [
        "| config | N (actor) | hidden x layers, vocab | batch / micro | P + T | predicted peak (MiB) | "
        + " | ".join(f"{LABELS[m]} (MiB) | ratio" for m in methods)
        + " |",
        "|---" * (6 + 2 * len(methods)) + "|",
    ]
    by: dict[str, dict] = {}
    for r in results:
        by.setdefault(r["name"], {})[r["method"]] = r
    for name, d in by.items():
        any_ = next(iter(d.values()))
        s = any_["spec"]
        cells = [
            name,
            f"{any_['n_params'] / 1e6:.1f}M",
            f"{s['hidden']} x {s['layers']}, {s['vocab']}"
            + (" (ckpt)" if s.get("checkpointing") else ""),
            f"{s['batch']} / {s['micro_batch']}",
            f"{s['prompt_len']} + {s['response_len']}",
            _mib(any_["predicted"]),
        ]
        for m in methods:
            r = d.get(m)
            cells += [_mib(r["peak"]), f"{r['ratio']:.2f}"] if r else ["-", "-"]
        rows.append("| " + " | ".join(cells) + " |")
    phase_rows = [
        "",
        'Per phase (allocator or CUDA). "above static" compares only what the phase adds to the weights and '
        "AdamW state, the part the activation, logits and KV-cache formulas predict.",
        "",
        "| config | phase | predicted (MiB) | measured (MiB) | ratio | above static: predicted | measured | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, a in ((k, r) for k, d in by.items() for r in d.values() if "phase_peak" in r):
        name = key if a["method"] == "allocator" else f"{key} ({a['method']})"
        phase_rows.append(
            f"| {name} | static (weights + AdamW state) | {_mib(a['predicted_static'])} "
            f"| {_mib(a['static'])} | {a['static'] / a['predicted_static']:.2f} | | | |"
        )
        for ph in PHASES:
            extra = a["predicted_phases"][ph]
            pred = a["predicted_static"] + extra
            got = a["phase_peak"][ph]
            phase_rows.append(
                f"| {name} | {ph} | {_mib(pred)} | {_mib(got)} | {got / pred:.2f} "
                f"| {_mib(extra)} | {_mib(got - a['static'])} | {(got - a['static']) / extra:.2f} |"
            )
    return "\n".join(rows + phase_rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=tuple(CONFIGS),
        default=[c for c in CONFIGS if c != "test"],
        help="configurations to run (default: all but 'test')",
    )
    ap.add_argument(
        "--method",
        choices=METHODS + ("cuda", "all"),
        default="all",
        help="all = every CPU method; cuda = torch.cuda.max_memory_allocated() on a GPU",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "memory_check.json",
        help="where to write the results as JSON ('-' for nowhere)",
    )
    ap.add_argument(
        "--json", action="store_true", help="print the results as JSON instead of markdown"
    )
    ap.add_argument("--worker", choices=tuple(CONFIGS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(CONFIGS[args.worker], args.method)))
        return 0
    methods = METHODS if args.method == "all" else (args.method,)
    results = []
    for name in args.configs:
        for method in methods:
            r = run_one(name, method)
            print(
                f"{name:<12} {method:<9} measured {_mib(r['peak']):>9} MiB  predicted {_mib(r['predicted']):>9} MiB"
                f"  ratio {r['ratio']:.2f}  ({r['seconds']} s)",
                file=sys.stderr,
            )
            results.append(r)
    if str(args.out) != "-":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(
            ["benchmarks/memory_check.py"] + (argv if argv is not None else sys.argv[1:])
        )
        record = {"versions": _versions(), "command": command, "results": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(results, indent=1) if args.json else markdown(results))
    return 0


def _versions() -> dict:
    import platform

    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    sys.exit(main())
