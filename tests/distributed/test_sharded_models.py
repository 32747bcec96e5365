"""The models work sharded (FSDP2 over gloo, 2 processes): generation with the full weights gathered
once, ranks stopping at different lengths without hanging and producing the unsharded model's
tokens; the critic and reward model's per-token values and scores; and the Hugging Face export,
which reloads with ``from_pretrained`` to exactly the gathered parameters."""

from __future__ import annotations

import pytest
import torch
from dist_support import ids
from multiproc import run_ranks

# Rank 0 gets the first two prompts, rank 1 the last two; rank 1's rows are forced to stop early.
PROMPTS = ["ab 1", "hhhh 2", "c", "dd 3"]


def _generate(policy_path: str, force_stop_on_rank: int | None, gather_weights: bool = True):
    from proximal import dist
    from proximal.data.collate import pad_left
    from proximal.models.loading import load_tokenizer
    from proximal.models.parallel import prepare_trained
    from proximal.models.policy import build_actor
    from proximal.rollout.engine import HFEngine, SamplingParams, row_seed

    tok = load_tokenizer(policy_path)
    actor = build_actor(policy_path, dtype="float32")
    W, rank = dist.world_size(), dist.rank()
    if W > 1:
        prepare_trained(actor, device=torch.device("cpu"), precision="32-true", world_size=W)
    per = len(PROMPTS) // W
    rows = list(range(rank * per, (rank + 1) * per))
    prompt_ids, mask = pad_left([ids(tok, PROMPTS[i]) for i in rows], tok.pad_token_id)
    # "Stop" on a token this rank samples often, so its rows end long before max_new_tokens; the
    # other rank keeps decoding to the limit. Any collective per decode step would hang here.
    stops = (tok.eos_token_id,) + (
        (ids(tok, "a")[0], ids(tok, "b")[0], ids(tok, " ")[0]) if rank == force_stop_on_rank else ()
    )
    params = SamplingParams(max_new_tokens=24, stop_token_ids=stops, temperature=1.0)
    from proximal.rollout import decode

    lean_steps = [0]
    step = decode.LeanDecoder.step

    def counted(self, *a):
        lean_steps[0] += 1
        return step(self, *a)

    decode.LeanDecoder.step = counted  # this process only (run_ranks starts fresh ones)
    engine = HFEngine(actor, tok.pad_token_id, gather_weights=gather_weights)
    out = engine.generate(prompt_ids, mask, [row_seed(0, 1, i) for i in rows], params)
    # Each row up to and including its first stop token (the engine pads after it).
    rows = [
        row[: next((k + 1 for k, t in enumerate(row) if t in stops), len(row))]
        for row in out.tolist()
    ]
    return rows, lean_steps[0]


@pytest.mark.parametrize("gather_weights", [True, False])
def test_generation_under_sharding_matches_the_unsharded_model(assets, gather_weights):
    """Gathered once (ranks stop on their own) or block by block (ranks decode in step until all are done)."""
    policy = str(assets.policy("llama"))
    sharded = run_ranks(
        2, _generate, policy, 1, gather_weights, timeout_s=120, collective_timeout_s=30
    )
    sharded, lean_steps = [rows for rows, _ in sharded], [n for _, n in sharded]
    alone = [run_ranks(1, _generate, policy, None)[0][0]]
    # Gathered weights decode the lean way (rollout/decode.py); block-by-block gathering needs the
    # model's own forward, whose FSDP hooks gather each block.
    assert all(n > 0 for n in lean_steps) if gather_weights else lean_steps == [0, 0], lean_steps
    longest = [max(map(len, rows)) for rows in sharded]
    assert longest[1] < longest[0] == 24, f"rank 1 should have stopped earlier: {longest}"
    # The same row seeds give the same tokens; rank 1's rows are prefixes cut by its extra stop tokens.
    for rank, rows in enumerate(sharded):
        for j, row in enumerate(rows):
            assert row == alone[0][rank * 2 + j][: len(row)], (rank, j)


def _scorers(rm_path: str):
    from proximal import dist
    from proximal.data.collate import pad_right
    from proximal.models.heads import last_token_scores, token_values
    from proximal.models.loading import load_sequence_scorer, load_tokenizer
    from proximal.models.parallel import prepare_frozen, prepare_trained

    tok = load_tokenizer(rm_path, padding_side="right")
    ids_, att = pad_right([ids(tok, t) + [tok.eos_token_id] for t in PROMPTS], tok.pad_token_id)
    critic = load_sequence_scorer(rm_path)
    reward = load_sequence_scorer(rm_path)
    if dist.world_size() > 1:
        prepare_trained(critic, device=torch.device("cpu"), precision="32-true", world_size=2)
        prepare_frozen(reward, device=torch.device("cpu"), world_size=2, sharding="shard")
    values = token_values(critic, ids_, att)
    values.sum().backward()  # the sharded critic also trains
    with torch.no_grad():
        scores = last_token_scores(reward, ids_, att)
    return values.detach(), scores


def test_critic_and_reward_model_work_sharded(assets):
    rm = str(assets.reward_model("llama"))
    ((v1, s1),) = run_ranks(1, _scorers, rm)
    (v2, s2), _ = run_ranks(2, _scorers, rm)
    torch.testing.assert_close(v2, v1, rtol=0, atol=1e-6)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-6)


def _export(policy_path: str, out: str, lora: bool):
    from proximal import dist
    from proximal.models.loading import load_tokenizer
    from proximal.models.parallel import export_pretrained, full_state_dict, prepare_trained
    from proximal.models.policy import build_actor

    torch.manual_seed(0)
    actor = build_actor(
        policy_path,
        dtype="float32",
        lora=dict(r=4, alpha=8, target_modules=["all-linear"]) if lora else None,
    )
    with (
        torch.no_grad()
    ):  # move the weights away from the checkpoint, so the export has something to show
        for p in actor.parameters():
            if p.requires_grad:
                p.add_(0.01 * torch.randn(p.shape))
    prepare_trained(
        actor, device=torch.device("cpu"), precision="32-true", world_size=dist.world_size()
    )
    export_pretrained(actor, load_tokenizer(policy_path), out, is_main=dist.is_main())
    full = full_state_dict(actor)
    return {k: v.clone() for k, v in full.items()} if dist.is_main() else None


def test_export_reloads_to_the_gathered_parameters(assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = str(assets.policy("llama"))
    full = run_ranks(2, _export, policy, str(tmp_path / "full"), False)[0]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full").state_dict()
    assert full.keys() == reloaded.keys()
    assert all(torch.equal(full[k], reloaded[k]) for k in full)

    lora = run_ranks(2, _export, policy, str(tmp_path / "lora"), True)[0]
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(policy), tmp_path / "lora"
    )
    state = model.state_dict()
    adapters = [k for k in lora if "lora_" in k]
    assert adapters and all(torch.equal(lora[k], state[k]) for k in adapters)
