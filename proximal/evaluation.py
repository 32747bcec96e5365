"""Held-out evaluation of a policy, the same for every method: the demo's report and ``proximal compare``.

:func:`evaluate_policy` samples a policy on held-out prompts exactly as the online trainers sample
(:func:`proximal.rollout.sampling.sample`, one seeded generator per response, temperature 1), then
scores every response with whatever is given: a gold score and a rule verifier (``module:function``
reward functions, or callables), the reward model r_ψ, and the exact KL to the reference. Nothing
here trains; the same ``seed`` gives the same responses, so two policies evaluated with one seed
are compared on common random numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from proximal.data.collate import pad_left
from proximal.data.preferences import collate_pairs, load_preference_pairs
from proximal.data.prompts import load_prompts
from proximal.data.sources import read_rows
from proximal.models.loading import freeze, load_causal_lm, load_sequence_scorer, load_tokenizer
from proximal.models.reward import load_reward_model, pair_scores
from proximal.rollout.engine import row_seed
from proximal.rollout.sampling import response_kl, sample
from proximal.rollout.scoring import Scorer, load_reward_function
from proximal.tasks.digits import gold as digits_gold

ScoreFn = Callable[[list[str], list[str]], list[float]]


@torch.no_grad()
def evaluate_policy(
    policy: str | Path,
    *,
    reference: str | Path,
    prompts_file: str | Path,
    reward_model: str | Path | None = None,
    scores: dict[str, str | ScoreFn] | None = None,
    samples_per_prompt: int = 1,
    max_new_tokens: int = 12,
    seed: int = 0,
    batch_size: int = 256,
    max_prompt_length: int = 64,
) -> dict:
    """Sample ``policy`` on the prompts of ``prompts_file`` and measure each response.

    ``scores`` maps a name to a score function ``f(prompts, completions) -> list[float]`` (or its
    ``module:function`` spec); the default is the built-in task's gold score under ``"gold"``. Per
    response the result holds each of those, and

    * ``proxy`` — the reward model's score r_ψ(x, y) (with ``reward_model``), computed by the online
      trainers' own :class:`~proximal.rollout.scoring.Scorer`;
    * ``kl`` — Σ_t KL(π(·|s_t) ‖ π_ref(·|s_t)) over the response's tokens, each term exact over the
      vocabulary (the states s_t are sampled). Its expectation is the sequence KL of the
      KL-regularised objective (Ziegler et al. 2019); PPO's ``kl/seq_mean`` estimates the same
      quantity with the sampled-token (k1) estimator;
    * ``length`` — response tokens including EOS (as the trainers' ``response/length_mean``);
      ``eos`` — whether it stopped before ``max_new_tokens``.

    Returns the means under ``mean`` and every response under ``rows``.
    """
    if scores is None:
        scores = {"gold": "proximal.tasks.digits:gold_score"}
    functions = {
        name: load_reward_function(f) if isinstance(f, str) else f for name, f in scores.items()
    }
    tokenizer = load_tokenizer(str(policy), role="policy")
    actor = load_causal_lm(str(policy), role="policy")
    ref = load_causal_lm(str(reference), role="reference")
    for m in (actor, ref):
        freeze(m)
    scorer = Scorer(tokenizer)  # no reward model: decodes the completions
    if reward_model is not None:
        rm_tokenizer = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
        rm = load_sequence_scorer(str(reward_model), pad_token_id=rm_tokenizer.pad_token_id)
        freeze(rm)
        scorer = Scorer(
            tokenizer, reward_model=rm, reward_tokenizer=rm_tokenizer, micro_batch_size=batch_size
        )
    prompts = load_prompts(str(prompts_file), tokenizer, max_length=max_prompt_length)
    order = [i for i in range(len(prompts)) for _ in range(samples_per_prompt)]

    rows = []
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        ids, mask = pad_left([prompts.token_ids[i] for i in idx], tokenizer.pad_token_id)
        seeds = [
            row_seed(seed, 0, j) for j in range(start, start + len(idx))
        ]  # one generator per response
        r = sample(actor, tokenizer, ids, mask, seeds=seeds, max_new_tokens=max_new_tokens)
        texts = [prompts.texts[i] for i in idx]
        completions = scorer.completions(r)
        scored = {
            name: [float(v) for v in fn(texts, completions)] for name, fn in functions.items()
        }
        if reward_model is not None:
            _, comp = scorer(r, texts)
            scored["proxy"] = [float(v) for v in comp["reward_model"]]
        kl = response_kl(actor, ref, r).sum(1)  # Σ_t of the exact KL per state
        for j, completion in enumerate(completions):
            rows.append(
                {
                    "prompt": texts[j],
                    "response": completion,
                    **{k: v[j] for k, v in scored.items()},
                    "kl": float(kl[j]),
                    "length": int(r.response_mask[j].sum()),
                    "eos": bool(r.ended[j]),
                }
            )
    keys = [*scored, "kl", "length", "eos"]
    mean = {k: sum(float(row[k]) for row in rows) / len(rows) for k in keys}
    return {
        "policy": str(policy),
        "n": len(rows),
        "samples_per_prompt": samples_per_prompt,
        "seed": seed,
        "mean": mean,
        "rows": rows,
    }


@torch.no_grad()
def reward_model_gold_agreement(
    reward_model: str | Path,
    pairs_file: str | Path,
    gold: Callable[[str, str], float] | None = None,
) -> float:
    """How often the reward model orders a held-out pair as ``gold(prompt, response)`` does (the
    built-in task's gold score by default), over the pairs whose gold differs.

    Pairs are loaded, batched and scored exactly as ``proximal rm`` evaluates them.
    """
    gold = gold or digits_gold
    tok = load_tokenizer(str(reward_model), role="reward model", padding_side="right")
    rm, _ = load_reward_model(str(reward_model), "float32", tok)
    freeze(rm)
    pairs, _ = load_preference_pairs(pairs_file, tok, max_length=10_000)
    records = [r for _, r in read_rows(pairs_file)]
    r_w, r_l = pair_scores(rm, collate_pairs(pairs, tok.pad_token_id))
    agree = n = 0
    for rec, s_w, s_l in zip(records, r_w.tolist(), r_l.tolist()):
        g_w, g_l = gold(rec["prompt"], rec["chosen"]), gold(rec["prompt"], rec["rejected"])
        if g_w != g_l:
            n += 1
            agree += (s_w > s_l) == (g_w > g_l)
    return agree / n
