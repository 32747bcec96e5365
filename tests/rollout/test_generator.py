"""The generator process of ``rollout.staleness`` (``proximal.rollout.generator``), driven as a
trainer drives it: each batch it gives is, token for token (μ to float32 round-off), the batch the
synchronous engine samples from the version it names, with the same seeds; a generator that dies, hangs or
raises is reported, and leaves no process behind."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
import torch

from proximal.models.kernels import use_onednn_linears
from proximal.models.loading import load_tokenizer
from proximal.rollout.collect import Drawn, Prompts, Sampling, SingleTurn
from proximal.rollout.engine import HFEngine, row_seed
from proximal.rollout.generator import (
    GeneratorError,
    GeneratorLost,
    StaleRollouts,
    scheduled_version,
    split_cores,
    staleness_of,
)

SAMPLING = Sampling(max_new_tokens=6)


def _policy(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _drawn(tok, step: int) -> Drawn:
    texts = ["ab", "ba ab", "a b a", "bbb"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    positions = list(range(len(texts)))
    seeds = [row_seed(0, step, r) for r in positions]
    return Drawn(Prompts(ids, texts, [None] * len(texts), None, seeds), positions)


def _sync(policy, state: dict, tok, drawn: Drawn):
    """What the synchronous engine samples from ``state``'s weights: a fresh model of the policy's
    class and config, as the generator builds its own, on one thread as the generator runs."""
    model = type(policy)(policy.config).eval()
    model.load_state_dict(state)
    use_onednn_linears(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = HFEngine(model, tok.pad_token_id)
        got = SingleTurn(SAMPLING.max_new_tokens).respond(
            engine, tok, drawn.prompts, SAMPLING, device=torch.device("cpu")
        )
    finally:
        torch.set_num_threads(threads)
    return got.rollout


def _start(policy, tok, staleness=1, mode="exact", timeout_s=120.0, make=None) -> StaleRollouts:
    stale = StaleRollouts(staleness, mode, timeout_s=timeout_s)
    stale.start(
        policy,
        tok,
        version=0,
        make_responder=make or functools.partial(SingleTurn, SAMPLING.max_new_tokens),
        engine="hf",
        engine_kwargs={},
        device=torch.device("cpu"),
        cores=None,
        threads=1,
    )
    return stale


def _update(policy, opt) -> None:
    """One optimiser step that moves every weight (the guard's hook runs before it)."""
    x = torch.tensor([[3, 4, 5, 6]])
    loss = -policy(input_ids=x).logits.log_softmax(-1)[..., 4].mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_each_batch_is_the_synchronous_batch_of_the_version_it_was_scheduled(assets):
    staleness = 2  # steps 1-3 by version 0, step 4 by version 1 (tests/trainers: staleness 1)
    tok = load_tokenizer(str(assets.policy("llama")))
    policy = _policy(assets.policy("llama"))
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    snapshots = {0: {k: v.clone() for k, v in policy.state_dict().items()}}
    stale = _start(policy, tok, staleness)
    try:
        steps = 4
        for step in range(1, staleness + 2):
            stale.request(step, 0, _drawn(tok, step), SAMPLING)
        for step in range(1, steps + 1):
            taken = stale.take(step, torch.device("cpu"))
            assert taken.version == scheduled_version(step, staleness)
            assert staleness_of(step, taken.version) == min(step - 1, staleness)
            want = _sync(policy, snapshots[taken.version], tok, _drawn(tok, step))
            got = taken.responses.rollout
            assert torch.equal(got.response_ids, want.response_ids), step  # token for token
            # μ to float32 round-off: the generator is another process (measured: equal bit for bit
            # at some versions, within 3e-7 at others)
            torch.testing.assert_close(
                got.behaviour_logprobs, want.behaviour_logprobs, rtol=0, atol=1e-5
            )
            _update(policy, opt)
            stale.published(step)
            snapshots[step] = {k: v.clone() for k, v in policy.state_dict().items()}
            if step + 1 + staleness <= steps:
                stale.request(
                    step + 1 + staleness, step, _drawn(tok, step + 1 + staleness), SAMPLING
                )
        # the versions moved the weights: the last batch is not version 0's
        assert not torch.equal(snapshots[steps]["lm_head.weight"], snapshots[0]["lm_head.weight"])
    finally:
        stale.close()


def test_bounded_batches_are_sampled_by_the_version_they_name_within_the_bound(assets):
    tok = load_tokenizer(str(assets.policy("llama")))
    policy = _policy(assets.policy("llama"))
    opt = torch.optim.SGD(policy.parameters(), lr=0.5)
    snapshots = {0: {k: v.clone() for k, v in policy.state_dict().items()}}
    stale = _start(policy, tok, 2, mode="bounded")
    try:
        for step in (1, 2, 3):
            stale.request(step, 0, _drawn(tok, step), SAMPLING)
        for step in range(1, 6):
            taken = stale.take(step, torch.device("cpu"))
            assert 0 <= staleness_of(step, taken.version) <= 2
            want = _sync(policy, snapshots[taken.version], tok, _drawn(tok, step))
            assert torch.equal(taken.responses.rollout.response_ids, want.response_ids)
            _update(policy, opt)
            stale.published(step)
            snapshots[step] = {k: v.clone() for k, v in policy.state_dict().items()}
            if step + 3 <= 5:
                stale.request(step + 3, step, _drawn(tok, step + 3), SAMPLING)
    finally:
        stale.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not yet reaped is gone too
        return f.read().split(") ")[1].startswith("Z")


def test_a_generator_killed_is_lost_at_once(assets):
    tok = load_tokenizer(str(assets.policy("llama")))
    stale = _start(_policy(assets.policy("llama")), tok)
    pid = stale.process.pid
    os.kill(pid, signal.SIGKILL)
    stale.request(1, 0, _drawn(tok, 1), SAMPLING)
    t0 = time.monotonic()
    with pytest.raises(
        GeneratorLost, match=r"was killed by SIGKILL while the trainer waited for step 1's"
    ):
        stale.take(1, torch.device("cpu"))
    assert time.monotonic() - t0 < 15  # seen at the first poll, not after the timeout
    assert stale.process is None and _gone(pid)


def test_a_hung_generator_is_lost_after_the_timeout_and_killed(assets):
    tok = load_tokenizer(str(assets.policy("llama")))
    stale = _start(_policy(assets.policy("llama")), tok, timeout_s=2.0)
    pid = stale.process.pid
    os.kill(pid, signal.SIGSTOP)  # alive, answering nothing
    try:
        stale.request(1, 0, _drawn(tok, 1), SAMPLING)
        t0 = time.monotonic()
        with pytest.raises(GeneratorLost, match=r"gave nothing for 2 s .*it is hung"):
            stale.take(1, torch.device("cpu"))
        assert 2 <= time.monotonic() - t0 < 15  # the timeout, then a kill (not a 10 s wait)
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


class _Failing:
    """A responder whose second batch raises (an environment's mistake)."""

    max_tokens, row_tools, eval_keys = 6, None, ()

    def __init__(self):
        self.calls = 0
        self.inner = SingleTurn(6)

    def ready(self, tokenizer, policy):
        pass

    def respond(self, engine, tokenizer, prompts, sampling, **kw):
        self.calls += 1
        if self.calls == 2:
            raise KeyError("answer")
        return self.inner.respond(engine, tokenizer, prompts, sampling, **kw)

    def close(self):
        pass


def test_an_exception_in_the_generator_is_its_message_not_a_restart(assets):
    tok = load_tokenizer(str(assets.policy("llama")))
    stale = _start(_policy(assets.policy("llama")), tok, make=_Failing)
    pid = stale.process.pid
    stale.request(1, 0, _drawn(tok, 1), SAMPLING)
    stale.request(2, 0, _drawn(tok, 2), SAMPLING)
    stale.take(1, torch.device("cpu"))
    with pytest.raises(
        GeneratorError,
        match=r"KeyError: 'answer' \(test_generator.py:\d+\) sampling step 2's batch",
    ):
        stale.take(2, torch.device("cpu"))
    assert _gone(pid)


def test_cores_split_in_halves_on_one_cpu_process_only():
    mine = sorted(os.sched_getaffinity(0))
    trainer, generator = split_cores(None, device="cpu", world_size=1)
    if len(mine) >= 2:
        assert generator == mine[len(mine) // 2 :] and trainer == mine[: len(mine) // 2]
    assert split_cores([], device="cpu", world_size=1) == (None, None)
    assert split_cores(None, device="cpu", world_size=2) == (None, None)
    assert split_cores(None, device="cuda", world_size=1) == (None, None)
    assert split_cores([mine[-1]], device="cpu", world_size=1)[1] == [mine[-1]]


def test_the_schedule():
    # staleness 2: steps 1-3 by version 0, then step t by t - 3
    assert [scheduled_version(t, 2) for t in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    # a resume at step 5 without batches in flight: version 5 until the schedule reaches it
    assert [scheduled_version(t, 2, 5) for t in range(6, 10)] == [5, 5, 5, 6]
