"""One TRL GRPO run of a benchmark work, in the anchor's own environment (benchmarks/.venv-trl-grpo,
the newest TRL: ``trl.GRPOTrainer``). Started by compare_trl.py, one fresh process per run; imports
nothing from proximal (only ``benchmarks/grpo_reward.py``, the reward both sides use).

    benchmarks/.venv-trl-grpo/bin/python benchmarks/trl_grpo_run.py --policy DIR --prompts FILE.jsonl \
        --prompts-per-step 4 --group-size 4 --response-length 48 --beta 0.04 --loss grpo --steps 10 \
        --out result.json [--bf16]

One step = one generation of prompts_per_step x group_size completions and one optimiser step on
them (steps_per_generation = gradient_accumulation_steps = 1, num_iterations = 1). Step times are
``on_step_end`` to ``on_step_end`` wall-clock spans (step 1's from ``on_train_begin``).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument(
        "--prompts", required=True, help="JSONL with {'prompt': str}, the file proximal reads"
    )
    ap.add_argument("--prompts-per-step", type=int, required=True)
    ap.add_argument("--group-size", type=int, required=True)
    ap.add_argument("--response-length", type=int, required=True)
    ap.add_argument("--beta", type=float, required=True)
    ap.add_argument("--loss", required=True)
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
    from grpo_reward import distinct_chars
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(a.policy)
    tok.padding_side = "left"
    special = {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id} - {None}
    prompts = [json.loads(line)["prompt"] for line in open(a.prompts) if line.strip()]
    train = datasets.Dataset.from_dict({"prompt": prompts})

    checked = {"calls": 0, "bad": []}

    def reward(prompts, completions, completion_ids=None, **kw):
        # Every completion must be exactly R sampled tokens with no special token among them.
        checked["calls"] += 1
        for ids in completion_ids or []:
            if len(ids) != a.response_length or special & set(ids):
                checked["bad"].append({"length": len(ids), "special": len(special & set(ids))})
        return distinct_chars(prompts, completions)

    policy = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32)
    stamps: list[float] = []

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    n = a.prompts_per_step * a.group_size
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=n,
            gradient_accumulation_steps=1,
            num_generations=a.group_size,
            max_completion_length=a.response_length,
            num_iterations=1,
            beta=a.beta,
            loss_type=a.loss,
            epsilon=0.2,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=1e-5,
            max_steps=a.steps,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            bf16=a.bf16,
            gradient_checkpointing=False,
            seed=a.seed,
            disable_tqdm=True,
            logging_steps=a.steps + 1,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[reward],
            args=cfg,
            train_dataset=train,
            processing_class=tok,
            callbacks=[StepTimer()],
        )
        t_train = time.perf_counter()
        trainer.train()
        t_end = time.perf_counter()
        settings = {
            "generation_batch_size": cfg.generation_batch_size,
            "steps_per_generation": cfg.steps_per_generation,
            "loss_type": cfg.loss_type,
            "beta": cfg.beta,
            "num_generations": cfg.num_generations,
            "scale_rewards": str(cfg.scale_rewards),
            "gradient_checkpointing": cfg.gradient_checkpointing,
            "bf16": cfg.bf16,
            "ref_model": trainer.ref_model is not None,
            "accelerator.mixed_precision": str(trainer.accelerator.mixed_precision),
            "eos_token_ids": list(trainer.eos_token_ids),
        }

    period = [b - a_ for a_, b in zip(stamps, stamps[1:])]
    result = {
        "side": "trl",
        "method": "grpo",
        "period_s": period,
        "stamps": stamps,
        "start_to_train_s": t_train - T_START,
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
    json.dump(result, open(a.out, "w"), indent=1)
    if checked["bad"] or checked["calls"] < a.steps:
        print(
            f"trl_grpo_run: completions were not exactly {a.response_length} non-special tokens: {checked}",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
