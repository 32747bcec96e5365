"""Runs through the vllm rollout engine (issue 41), end to end.

* ``proximal ppo --rollout.engine vllm``: healthy steps, ``models.json`` recording the engine, and
  the engine's μ equal to the trainer's π_old (``rollout/mismatch_k1``) at every step — so the
  weights were pushed after every update.
* A multi-turn GRPO run through vllm: each trajectory's ids are exactly the engine's sampled ids and
  the observations' template rendering, the agent mask True exactly on the sampled ones, each turn's
  input the prompt and everything before it; μ equal to π_old with the observations in context.
* dpo's ``--eval.engine vllm``: the held-out evaluations are sampled by a vllm engine holding the
  policy's weights of that step (the numbers of a fresh engine over the saved policy, not the hf
  engine's), and the run closes it.
* Two processes under FSDP2: after optimiser steps of the sharded policy, each rank's engine holds
  the policy's weights (``rollout.gather_weights`` true and false).

vLLM takes over process-wide state (its parallel state is one per process), so these tests carry
the ``vllm`` marker and run in their own pytest process in ``.venv-vllm`` (``make test-vllm``); every
engine is closed before the next is built (the runs close theirs when they end).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (make test-vllm builds .venv-vllm)"
)

from multiproc import run_ranks  # noqa: E402
from ppo_support import REQUIRED_METRICS, ppo_main, read_jsonl, tiny_config  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402

from proximal.models.loading import load_tokenizer  # noqa: E402
from proximal.models.tiny import build_tiny_causal_lm  # noqa: E402
from proximal.rollout.engine import row_seed  # noqa: E402

AGENTS = Path(__file__).resolve().parents[1] / "agents"
if str(AGENTS) not in sys.path:  # the agent tests' helpers and environments (workers import them)
    sys.path.insert(0, str(AGENTS))

from test_agent_runs import TALK, _multi_turn_checks, _prompts, grpo_config, grpo_main  # noqa: E402
from test_trajectory import Recording  # noqa: E402

#: tests/agents' chat template (a user turn "8 " + content + " ", an assistant's "9 " + content + EOS).
TEMPLATE = str(AGENTS.parent / "fixtures" / "data" / "chat_template.jinja")

pytestmark = pytest.mark.vllm

KV = 32 << 20  # 32 MiB of KV cache: thousands of tokens at these shapes


@pytest.fixture(scope="module")
def policy(assets):
    """A tiny float32 Qwen2 whose heads vLLM's CPU attention runs (hidden 64, 2 heads: dimension
    32), on the tests' character tokenizer."""
    return build_tiny_causal_lm(
        assets.root / "vllm_cli_qwen2", assets.tokenizer, arch="qwen2", hidden=64, heads=2
    )


# ----------------------------------------------------------------------------------------------
# proximal ppo --rollout.engine vllm
# ----------------------------------------------------------------------------------------------


def test_a_ppo_run_samples_through_vllm_and_its_mu_is_the_trainers_pi_old(
    policy, assets, tmp_path, capsys
):
    """Three PPO steps (the critic from the policy, a rule reward): every required metric finite,
    the engine recorded in models.json and the start line and closed at the end, and at every step the engine's μ of the
    sampled tokens equal to the trainer's π_old (|mismatch_k1| < 1e-5 in float32, every ratio
    within 1e-5 of 1) — after the first step only if each update's weights reached the engine (an
    update moves the policy by a KL near 0.07 here)."""
    run = tmp_path / "ppo"
    cfg = tiny_config(
        policy,
        assets.prompts,
        run,
        rollout={"engine": "vllm", "kv_cache_gib": KV / 2**30},
        ppo={"epochs": 2},
        optim={"lr": 1e-2, "critic_lr": 1e-2},
        train={"steps": 3},
    )
    assert ppo_main(cfg) == 0, capsys.readouterr().err
    assert not parallel_state.model_parallel_is_initialized()  # the run closed its engine
    said = capsys.readouterr().out
    assert "decode: vLLM " in said and "processed_logprobs" in said
    decode = json.loads((run / "models.json").read_text())["actor"]["decode"]
    assert decode["path"] == "vllm" and decode["dtype"] == "float32"
    assert decode["logprobs_mode"] == "processed_logprobs" and decode["kv_cache_bytes"] == KV
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in REQUIRED_METRICS:
            assert math.isfinite(r[key]), (r["step"], key, r.get(key))
        assert r["response/length_mean"] > 0
        assert abs(r["rollout/mismatch_k1"]) < 1e-5, (r["step"], r["rollout/mismatch_k1"])
        assert abs(r["rollout/ratio_max"] - 1) < 1e-5 and abs(r["rollout/ratio_min"] - 1) < 1e-5
        # each update moves the policy by far more (its second epoch's KL to π_old): a step sampled
        # by an engine still holding the previous weights would be as far from π_old
        assert r["policy/approx_kl"] > 1e-3, (r["step"], r["policy/approx_kl"])


# ----------------------------------------------------------------------------------------------
# A multi-turn GRPO run through vllm
# ----------------------------------------------------------------------------------------------


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _check_trajectories(call: dict, stops: set[int], obs: list[int]) -> int:
    """tests/agents/test_trajectory.py's id-by-id check of one batch of trajectories against what
    the engine was given and sampled (``Recording``): each turn's input is exactly the prompt and
    everything appended before it; the trajectory is exactly each turn's sampled ids (cut after its
    stop token) and, between turns, the observation's ids ``obs``; the agent mask is True exactly on
    the sampled ids; μ is 0 at the observations. Returns how many observations it saw."""
    seen = 0
    for b, t in enumerate(call["trajs"]):
        expected, mask, turn = [], [], 0
        for ids, amask, call_seeds, params, sampled in call["engine"]:
            want = call["seeds"][b] if turn == 0 else row_seed(call["seeds"][b], turn)
            if want not in call_seeds:
                continue
            i = call_seeds.index(want)
            assert ids[i][amask[i].bool()].tolist() == t.prompt_ids + expected
            seq = sampled[i].tolist()
            cut = next((j for j, x in enumerate(seq) if x in stops), len(seq))
            seq = seq[: min(cut + 1, params.max_new_tokens)]
            expected += seq
            mask += [True] * len(seq)
            turn += 1
            if len(t.turns) > turn:  # the trajectory went on: the observation follows
                expected += obs
                mask += [False] * len(obs)
                seen += 1
        assert t.ids == expected and t.agent_mask == mask and len(t.turns) == turn >= 1
        assert all(mu == 0.0 for mu, a in zip(t.behaviour_logprobs, mask) if not a)
        assert len(t.behaviour_logprobs) == len(t.ids)
    return seen


def test_a_multi_turn_grpo_run_through_vllm_keeps_ids_masks_and_mu(
    policy, tmp_path, monkeypatch, capsys
):
    """tests/agents/test_agent_runs.py's multi-turn GRPO run (the Talk environment: the reply "ab",
    per-turn rewards) with the vllm engine and a chat template: the same run-level checks
    (``_multi_turn_checks``), every trajectory id by id against the engine's calls with the
    observation rendered as the template writes it ("8 ab 9 "), and μ equal to π_old with the
    observations in the context (|mismatch_k1| < 1e-5)."""
    from proximal.agents import collect

    batches = []
    real = collect.run_trajectories

    def recorded(engine, tokenizer, envs, prompt_ids, rows, **kw):
        engine = Recording(engine)
        trajs = real(engine, tokenizer, envs, prompt_ids, rows, **kw)
        batches.append({"trajs": trajs, "engine": engine.calls, "seeds": list(kw["seeds"])})
        return trajs

    monkeypatch.setattr(collect, "run_trajectories", recorded)
    cfg = grpo_config(
        policy,
        _prompts(tmp_path, turns=2),
        tmp_path / "run",
        model={"reward_functions": [], "chat_template": TEMPLATE},
        rollout={"stop_token_ids": [11, 12, 13], "engine": "vllm", "kv_cache_gib": KV / 2**30},
        env=TALK,
        tools={"workers": 1},
        output={"samples_per_step": 8},
    )
    assert grpo_main(cfg) == 0, capsys.readouterr().err
    _multi_turn_checks(tmp_path / "run", 2)
    tok = load_tokenizer(str(policy))
    stops = {tok.eos_token_id, 11, 12, 13}
    assert len(batches) == 2  # one rollout a step
    assert sum(_check_trajectories(b, stops, _ids(tok, "8 ab 9 ")) for b in batches) > 0
    for r in read_jsonl(tmp_path / "run" / "metrics.jsonl"):
        assert abs(r["rollout/mismatch_k1"]) < 1e-5, (r["step"], r["rollout/mismatch_k1"])


# ----------------------------------------------------------------------------------------------
# dpo --eval.engine vllm
# ----------------------------------------------------------------------------------------------

#: The held-out evaluation of the dpo run: every frac_a and length of 2 responses a prompt.
EVAL = {"every": 0, "samples_per_prompt": 2, "seed": 11, "max_new_tokens": 6}


def _evaluated(weights, reference, prompts_file, engine: str) -> dict:
    """The ``eval/*`` metrics of the policy at ``weights`` (loaded afresh), sampled through a new
    engine of kind ``engine`` (closed after), as the run's evaluation computes them."""
    from ppo_support import frac_a

    from proximal.data.prompts import load_prompts
    from proximal.evaluation import METRIC_NAMES, evaluate_loaded
    from proximal.models.loading import freeze, load_causal_lm
    from proximal.rollout.engine import HFEngine
    from proximal.rollout.vllm import VLLMEngine

    tok = load_tokenizer(str(weights))
    actor, ref = load_causal_lm(str(weights)), load_causal_lm(str(reference))
    for m in (actor, ref):
        freeze(m)
    if engine == "vllm":
        built = VLLMEngine(actor, tok.pad_token_id, kv_cache_bytes=KV, max_model_len=64)
    else:
        built = HFEngine(actor, tok.pad_token_id)
    try:
        out = evaluate_loaded(
            actor,
            reference=ref,
            tokenizer=tok,
            prompts=load_prompts(str(prompts_file), tok, max_length=16),  # data.max_length
            functions={"a": frac_a},
            samples_per_prompt=EVAL["samples_per_prompt"],
            max_new_tokens=EVAL["max_new_tokens"],
            seed=EVAL["seed"],
            engine=built,
        )
    finally:
        if engine == "vllm":
            built.close()
    return {METRIC_NAMES.get(k, f"eval/{k}"): v for k, v in out["mean"].items()}


def test_dpo_samples_its_held_out_evaluations_through_its_own_vllm_engine(
    policy, assets, tmp_path, capsys
):
    """dpo with ``--eval.engine vllm``: the evaluations before the first step and after the last are
    exactly those of a new vllm engine over the policy of that step (the start, the exported
    result) — not the hf engine's, which draws other responses — so the run sampled them through a
    vllm engine holding that step's weights (the final one only if it was pushed after the updates:
    the final policy samples other responses than the start). The run ends with its engine closed
    (vLLM's model-parallel state torn down)."""
    from test_dpo_cli import write_yaml  # noqa: E402  (tests/trainers on sys.path)

    from proximal.cli import main

    config = write_yaml(
        tmp_path / "dpo.yaml",
        policy,
        tmp_path,
        "dpo",
        eval={
            "prompts": str(assets.prompts),
            "scores": {"a": "ppo_support:frac_a"},
            "kv_cache_gib": KV / 2**30,
            **EVAL,
        },
        optim={"lr": 1e-2},
    )
    assert main(["dpo", "--config", config, "--eval.engine", "vllm"]) == 0, capsys.readouterr().err
    assert not parallel_state.model_parallel_is_initialized()
    rows = {
        r["step"]: r
        for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
        if "eval/a" in r  # the sampled evaluation's rows
    }
    assert sorted(rows) == [0, 2]
    want = {}
    for step, weights in ((0, policy), (2, tmp_path / "run")):
        want[step] = _evaluated(weights, policy, assets.prompts, "vllm")
        hf = _evaluated(weights, policy, assets.prompts, "hf")
        assert set(want[step]) == {"eval/a", "eval/kl_ref", "eval/length_mean", "eval/eos_frac"}
        for k, v in want[step].items():
            assert rows[step][k] == pytest.approx(v, rel=1e-6, abs=1e-7), (step, k)
        assert hf["eval/a"] != want[step]["eval/a"]  # the hf engine's responses are others
    assert want[0]["eval/a"] != want[2]["eval/a"]  # a stale engine would have sampled the start's
    assert want[2]["eval/kl_ref"] > 1e-6


# ----------------------------------------------------------------------------------------------
# Two processes, FSDP2
# ----------------------------------------------------------------------------------------------

#: Fixed sequences (BOS, then characters of the tiny alphabet) the engine and the policy score.
SEQUENCES = [[2, 5, 9, 11, 4, 7, 8, 14], [2, 6, 6, 10, 11], [2, 20, 4, 4, 4, 13, 9]]


def _policy_logprobs(model, sequences) -> list[torch.Tensor]:
    """log p(x_i | x_<i) of each token after the first, from the trainer's own forward (a sharded
    model's is collective: every rank passes the same sequences), float64 softmax of its logits."""
    out = []
    with torch.no_grad():
        for s in sequences:
            z = model(torch.tensor([s])).logits[0, :-1].double()
            out.append(z.log_softmax(-1).gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


def _gap(engine, model) -> float:
    got = engine.sequence_logprobs(SEQUENCES)
    ref = _policy_logprobs(model, SEQUENCES)
    return max(
        float((torch.tensor(g, dtype=torch.float64) - r).abs().max()) for g, r in zip(got, ref)
    )


def _sharded_engine_follows(policy_path: str, steps: int) -> dict:
    """On each rank: the tiny policy sharded (FSDP2), its vllm engine, then for gather_weights true
    and then false, ``steps`` AdamW steps on this rank's own rows (so the ranks' gradients differ and
    the reduction matters) and the engine's log-probabilities of SEQUENCES against the policy's."""
    from proximal import dist
    from proximal.models.loading import load_causal_lm
    from proximal.models.parallel import is_sharded, prepare_trained
    from proximal.rollout.vllm import VLLMEngine

    model = load_causal_lm(policy_path)
    prepare_trained(
        model, device=torch.device("cpu"), precision="32-true", world_size=dist.world_size()
    )
    assert is_sharded(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = VLLMEngine(model, 0, kv_cache_bytes=KV, max_model_len=64)
    g = torch.Generator().manual_seed(100 + dist.rank())
    out = {"start": _gap(engine, model)}  # the first push
    for gather in (True, False):
        before = _policy_logprobs(model, SEQUENCES)
        for _ in range(steps):
            ids = torch.cat([torch.full((4, 1), 2), torch.randint(4, 23, (4, 11), generator=g)], 1)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        engine.gather_weights = gather
        engine.after_update()
        moved = max(
            float((a - b).abs().max()) for a, b in zip(before, _policy_logprobs(model, SEQUENCES))
        )
        out[gather] = (_gap(engine, model), moved)
    out["pushes"] = engine.pushes
    engine.close()  # vLLM's groups go, the trainer's process group stays and still reduces
    total = torch.ones(1)
    torch.distributed.all_reduce(total)
    out["closed"] = (not parallel_state.model_parallel_is_initialized(), float(total))
    return out


def test_each_ranks_engine_holds_the_sharded_policys_weights_after_updates(policy):
    """Two processes, the policy sharded by FSDP2: after AdamW steps (the ranks' gradients reduced),
    each rank's engine scores fixed sequences as the policy does, within 1e-5, whether the push
    gathers the whole policy once (gather_weights true) or one tensor at a time (false). Each round
    of steps moved the policy's log-probabilities far more than that, so a stale push fails it.
    Closing the engine tears vLLM's groups down and keeps the trainer's process group working."""
    results = run_ranks(2, _sharded_engine_follows, str(policy), 3, timeout_s=600)
    for r in results:
        assert r["start"] <= 1e-5 and r["pushes"] == 3 and r["closed"] == (True, 2.0)
        for gather in (True, False):
            gap, moved = r[gather]
            assert gap <= 1e-5, (gather, gap)
            assert moved > 1e-2, (gather, moved)
