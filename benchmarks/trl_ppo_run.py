"""One TRL PPO run of a benchmark work, in the anchor's own environment (benchmarks/.venv-trl-ppo,
TRL 1.12.0: the last release with PPOTrainer, ``trl.experimental.ppo``). Started by compare_trl.py,
one fresh process per run; imports nothing from proximal.

    benchmarks/.venv-trl-ppo/bin/python benchmarks/trl_ppo_run.py --policy DIR --reward DIR \
        --prompt-ids FILE --batch 16 --response-length 48 --steps 10 --out result.json [--bf16]

Writes ``--out``: the wall-clock time at each ``on_step_end`` (a TrainerCallback), so step k's time is
the span from step k-1's end to step k's (step 1's from ``on_train_begin``), the process's peak RSS
and what was checked (every response exactly R tokens, no special token sampled).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

T_START = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--reward", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--response-length", type=int, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--profile-step",
        type=int,
        default=0,
        help="profile this step with torch.profiler and time its phases (benchmarks/profile_step.py)",
    )
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--profile-sort", default="self_cpu_time_total")
    ap.add_argument("--profile-trace", default=None)
    a = ap.parse_args()

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tok = AutoTokenizer.from_pretrained(a.policy)
    tok.padding_side = "left"
    special = torch.tensor(
        sorted({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id} - {None})
    )

    # Every response must be exactly R sampled tokens with no special token among them (the policy is
    # built so that none can be drawn; this checks it, at the cost of one comparison per step).
    checked = {"calls": 0, "bad": []}
    generate = ppo_module.batch_generation

    def checked_generation(model, queries, *args, **kwargs):
        query_responses, logits = generate(model, queries, *args, **kwargs)
        response = query_responses[:, queries.shape[1] :]
        checked["calls"] += 1
        if response.shape[1] != a.response_length or bool(torch.isin(response, special).any()):
            checked["bad"].append(
                {"length": response.shape[1], "special": int(torch.isin(response, special).sum())}
            )
        return query_responses, logits

    ppo_module.batch_generation = checked_generation

    ids = json.load(open(a.prompt_ids))
    train = datasets.Dataset.from_dict({"input_ids": ids})
    t_load = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(
        a.reward, dtype=torch.float32, num_labels=1
    )
    value = AutoModelForSequenceClassification.from_pretrained(
        a.reward, dtype=torch.float32, num_labels=1
    )

    stamps: list[float] = []
    prof = Profiler(ppo_module, a.profile_step) if a.profile_step else None

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            if prof:
                prof.boundary(len(stamps) - 1)

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())
            if prof:
                prof.boundary(len(stamps) - 1)

    B = a.batch
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=B,
            gradient_accumulation_steps=1,
            num_ppo_epochs=4,
            num_mini_batches=1,
            total_episodes=a.steps * B,
            response_length=a.response_length,
            missing_eos_penalty=None,
            stop_token=None,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            num_sample_generations=0,
            local_rollout_forward_batch_size=B,
            bf16=a.bf16,
            learning_rate=1e-5,
            temperature=1.0,
            seed=a.seed,
            disable_tqdm=True,
            logging_steps=a.steps + 1,
        )
        trainer = PPOTrainer(
            args=cfg,
            processing_class=tok,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            train_dataset=train,
            value_model=value,
            callbacks=[StepTimer()],
        )
        if prof:
            prof.wrap_trainer(trainer)
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
        acc = trainer.accelerator
        settings = {
            "accelerator.mixed_precision": str(acc.mixed_precision),
            "accelerator.native_amp": bool(getattr(acc, "native_amp", False)),
            "policy.is_gradient_checkpointing": bool(
                getattr(policy, "is_gradient_checkpointing", False)
            ),
            "policy.dtype": str(policy.dtype),
            "ref.dtype": str(ref.dtype),
            "reward.dtype": str(reward.dtype),
            "stop_token_id": trainer.stop_token_id,
            "generation_config.eos_token_id": policy.generation_config.eos_token_id,
            "num_total_batches": cfg.num_total_batches,
            "mini_batch_size": cfg.mini_batch_size,
            "local_batch_size": cfg.local_batch_size,
            "gradient_checkpointing(arg)": cfg.gradient_checkpointing,
            "vf_coef": cfg.vf_coef,
            "kl_coef": cfg.kl_coef,
            "cliprange": cfg.cliprange,
            "max_grad_norm(arg, unused by PPOTrainer.train)": cfg.max_grad_norm,
        }

    period = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    result = {
        "side": "trl",
        "method": "ppo",
        "period_s": period,
        "stamps": stamps,
        "start_to_train_s": t_train - T_START,
        "load_s": t_train - t_load,
        "train_s": t_end - t_train,
        "ru_maxrss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "threads": torch.get_num_threads(),
        "checked_generations": checked,
        "settings": settings,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "datasets": datasets.__version__,
        },
    }
    if prof:
        result["profile"] = prof.result(
            rows=a.profile_rows, sort=a.profile_sort, trace=a.profile_trace
        )
    json.dump(result, open(a.out, "w"), indent=1)
    if checked["bad"] or checked["calls"] != a.steps:
        print(
            f"trl_ppo_run: responses were not exactly {a.response_length} non-special tokens: {checked}",
            file=sys.stderr,
        )
        return 3
    return 0


class Profiler:
    """torch.profiler over one step (from the previous step's end to its own), and the time of its
    phases, by wrapping TRL's module functions: generation, the reference forward, the reward and value
    forwards, in the PPO epochs the forward, backward and optimiser-step calls, and its housekeeping
    (``gc.collect``, ``empty_cache``, ``log``)."""

    def __init__(self, module, step: int):
        import torch.profiler

        self.module, self.step, self.on = module, step, False
        self.times: dict[str, float] = {}
        self.prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
        )
        self.t0 = self.step_s = 0.0
        self._timed("batch_generation", "generation")
        self._timed("get_reward", "reward + value forward (rollout)")
        forward = module.forward

        def timed_forward(model, *args, **kw):
            import torch

            name = (
                "epochs: forward (policy + value)"
                if torch.is_grad_enabled()
                else "reference forward (rollout)"
            )
            with self.phase(name):
                return forward(model, *args, **kw)

        module.forward = timed_forward
        self._timed("empty_cache", "empty_cache")
        import gc
        import types

        collect = gc.collect

        def timed_collect(*args, **kw):
            with self.phase("gc.collect"):
                return collect(*args, **kw)

        module.gc = types.SimpleNamespace(collect=timed_collect)  # the module's own `gc` name only

    def _timed(self, attr: str, name: str):
        fn = getattr(self.module, attr)

        def wrapped(*args, **kw):
            with self.phase(name):
                return fn(*args, **kw)

        setattr(self.module, attr, wrapped)

    def wrap_trainer(self, trainer):
        backward, step = trainer.accelerator.backward, trainer.optimizer.step

        def timed_backward(*args, **kw):
            with self.phase("epochs: backward"):
                return backward(*args, **kw)

        def timed_step(*args, **kw):
            with self.phase("epochs: optimizer step"):
                return step(*args, **kw)

        trainer.accelerator.backward, trainer.optimizer.step = timed_backward, timed_step
        log = trainer.log

        def timed_log(*args, **kw):
            with self.phase("log"):
                return log(*args, **kw)

        trainer.log = timed_log

    def phase(self, name: str):
        import contextlib

        import torch.profiler

        @contextlib.contextmanager
        def cm():
            if not self.on:
                yield
                return
            t = time.perf_counter()
            with torch.profiler.record_function(f"phase::{name}"):
                yield
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t

        return cm()

    def boundary(self, finished: int):
        """Called at train begin (0) and at each step's end (k)."""
        if finished == self.step - 1:
            self.prof.__enter__()
            self.on, self.t0 = True, time.perf_counter()
        elif finished == self.step and self.on:
            self.step_s = time.perf_counter() - self.t0
            self.on = False
            self.prof.__exit__(None, None, None)

    def result(self, *, rows: int, sort: str, trace: str | None) -> dict:
        phases = dict(self.times)
        phases["rest of the step"] = self.step_s - sum(phases.values())
        if trace:
            self.prof.export_chrome_trace(trace)
        return {
            "step_s": self.step_s,
            "phases": phases,
            "table": self.prof.key_averages().table(sort_by=sort, row_limit=rows),
        }


if __name__ == "__main__":
    sys.exit(main())
