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
    a = ap.parse_args()

    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    import datasets
    import transformers
    import trl
    from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                              TrainerCallback)
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    tok = AutoTokenizer.from_pretrained(a.policy)
    tok.padding_side = "left"
    special = torch.tensor(sorted({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id} - {None}))

    # Every response must be exactly R sampled tokens with no special token among them (the policy is
    # built so that none can be drawn; this checks it, at the cost of one comparison per step).
    checked = {"calls": 0, "bad": []}
    generate = ppo_module.batch_generation

    def checked_generation(model, queries, *args, **kwargs):
        query_responses, logits = generate(model, queries, *args, **kwargs)
        response = query_responses[:, queries.shape[1]:]
        checked["calls"] += 1
        if response.shape[1] != a.response_length or bool(torch.isin(response, special).any()):
            checked["bad"].append({"length": response.shape[1], "special": int(torch.isin(response, special).sum())})
        return query_responses, logits

    ppo_module.batch_generation = checked_generation

    ids = json.load(open(a.prompt_ids))
    train = datasets.Dataset.from_dict({"input_ids": ids})
    t_load = time.perf_counter()
    policy = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(a.reward, dtype=torch.float32, num_labels=1)
    value = AutoModelForSequenceClassification.from_pretrained(a.reward, dtype=torch.float32, num_labels=1)

    stamps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    B = a.batch
    with tempfile.TemporaryDirectory() as tmp:
        cfg = PPOConfig(
            output_dir=tmp, per_device_train_batch_size=B, gradient_accumulation_steps=1, num_ppo_epochs=4,
            num_mini_batches=1, total_episodes=a.steps * B, response_length=a.response_length,
            missing_eos_penalty=None, stop_token=None, use_cpu=True, report_to=[], save_strategy="no",
            num_sample_generations=0, local_rollout_forward_batch_size=B, bf16=a.bf16, learning_rate=1e-5,
            temperature=1.0, seed=a.seed, disable_tqdm=True, logging_steps=a.steps + 1)
        trainer = PPOTrainer(args=cfg, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                             train_dataset=train, value_model=value, callbacks=[StepTimer()])
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
        acc = trainer.accelerator
        settings = {
            "accelerator.mixed_precision": str(acc.mixed_precision),
            "accelerator.native_amp": bool(getattr(acc, "native_amp", False)),
            "policy.is_gradient_checkpointing": bool(getattr(policy, "is_gradient_checkpointing", False)),
            "policy.dtype": str(policy.dtype), "ref.dtype": str(ref.dtype), "reward.dtype": str(reward.dtype),
            "stop_token_id": trainer.stop_token_id,
            "generation_config.eos_token_id": policy.generation_config.eos_token_id,
            "num_total_batches": cfg.num_total_batches, "mini_batch_size": cfg.mini_batch_size,
            "local_batch_size": cfg.local_batch_size, "gradient_checkpointing(arg)": cfg.gradient_checkpointing,
            "vf_coef": cfg.vf_coef, "kl_coef": cfg.kl_coef, "cliprange": cfg.cliprange,
            "max_grad_norm(arg, unused by PPOTrainer.train)": cfg.max_grad_norm,
        }

    period = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    result = {
        "side": "trl", "method": "ppo", "period_s": period, "stamps": stamps,
        "start_to_train_s": t_train - T_START, "load_s": t_train - t_load, "train_s": t_end - t_train,
        "ru_maxrss_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "threads": torch.get_num_threads(), "checked_generations": checked, "settings": settings,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "trl": trl.__version__,
                     "datasets": datasets.__version__},
    }
    json.dump(result, open(a.out, "w"), indent=1)
    if checked["bad"] or checked["calls"] != a.steps:
        print(f"trl_ppo_run: responses were not exactly {a.response_length} non-special tokens: {checked}",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
