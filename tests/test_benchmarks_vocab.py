"""The real-vocabulary benchmarks (issue 22) measure what they say: the Qwen2 works' tokenizer holds
the whole vocabulary in its BPE table and round-trips the prompts, their policy cannot sample a
special token, the growth script's state bytes are the hand count, and its criteria read the numbers
the right way round. A benchmark is not a test: nothing here asserts a time or a memory figure of
proximal itself."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from harness import report  # noqa: E402
from harness.works import (  # noqa: E402
    ALPHABET,
    GRPO_VOCAB,
    MINI_QWEN,
    PPO_VOCAB,
    QWEN_VOCAB,
    SPECIALS,
    WORKS,
    build_tokenizer,
    write_models,
    write_prompts,
)


def test_vocab_works_are_qwen2_at_its_vocabulary_with_64_token_responses():
    for w in (PPO_VOCAB, GRPO_VOCAB):
        assert (w.arch, w.vocab, w.tied, w.kv_heads) == ("qwen2", 151_936, True, 2)
        assert w.response_len >= 64 and w.batch == 32 and w.steps == 3
    assert GRPO_VOCAB.batch // GRPO_VOCAB.group_size == 8  # 8 prompts x 4 completions
    assert report.TARGETS["ppo-vocab"] == 0.35 and report.TARGETS["grpo-vocab"] == 0.5
    assert report.RSS_TARGETS == {"ppo-vocab": 0.3, "grpo-vocab": 0.4}
    # The existing works keep their checkpoints' names (their recipe did not change).
    assert WORKS["tiny"].model_key() == "llama-v2048-h256-l4-a4-i1024-tied-s0"
    assert PPO_VOCAB.model_key() == "qwen2-v151936-h128-l2-a4-kv2-i512-tied-s0"


def test_qwen2_tokenizer_has_the_whole_vocabulary_in_its_table():
    tok = build_tokenizer(QWEN_VOCAB, "qwen2")
    assert len(tok) == QWEN_VOCAB
    assert [tok.convert_tokens_to_ids(s) for s in SPECIALS] == [0, 1, 2, 3]
    # Entries, not added tokens: only the 4 specials are "added".
    assert len(tok.get_added_vocab()) == len(SPECIALS)
    last = QWEN_VOCAB - 1 - len(SPECIALS) - len(ALPHABET)
    assert tok.convert_ids_to_tokens(QWEN_VOCAB - 1) == f"<t{last}>"
    assert tok.decode([QWEN_VOCAB - 1]).startswith("<t")
    with pytest.raises(ValueError, match="smaller than"):
        build_tokenizer(16, "qwen2")


def test_qwen2_mini_work_cannot_sample_a_special_token_and_prompts_round_trip(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = write_models(MINI_QWEN, tmp_path)
    policy_dir = Path(m["policy"])
    assert json.loads((policy_dir / "config.json").read_text())["model_type"] == "qwen2"
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert model.config.vocab_size == MINI_QWEN.vocab == 4096
    ids = torch.randint(4, MINI_QWEN.vocab, (3, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)
    assert bool((logp[..., m["special_ids"]] < -200).all())
    p = write_prompts(MINI_QWEN, tmp_path, 5, m["policy"])
    texts = [json.loads(line)["prompt"] for line in Path(p["jsonl"]).read_text().splitlines()]
    ids_json = json.loads(Path(p["ids"]).read_text())
    from proximal.data.chat import encode_prompt
    from proximal.models.loading import load_tokenizer

    loaded = load_tokenizer(m["policy"])
    assert len(loaded) == MINI_QWEN.vocab
    assert [encode_prompt(t, loaded) for t in texts] == ids_json
    assert [AutoTokenizer.from_pretrained(policy_dir)(t)["input_ids"] for t in texts] == ids_json


def test_growth_state_bytes_are_the_hand_count():
    import vocab_growth

    model = {"params_policy": 1000, "params_reward": 700}
    ppo = vocab_growth.state_bytes("ppo", model, "32-true")
    # actor 4 x 1000 (weights, grads, AdamW m and v), reference 1000, reward 700, critic 4 x 700; float32
    assert ppo["total"] == 4 * (4 * 1000 + 1000 + 700 + 4 * 700)
    assert ppo["gradients"] == 4 * (1000 + 700)
    # one trained model is updated at a time: the held state has the larger one's gradients only
    assert ppo["held"] == ppo["total"] - 4 * 700
    grpo = vocab_growth.state_bytes("grpo", model, "32-true")
    assert grpo["total"] == 4 * (4 * 1000 + 1000) and grpo["gradients"] == 4000
    assert grpo["held"] == grpo["total"]
    mixed = vocab_growth.state_bytes("grpo", model, "bf16-mixed")  # frozen reference in bfloat16
    assert mixed["total"] == 4 * 4 * 1000 + 2 * 1000
    w = vocab_growth.work_at("ppo", 64_000)
    assert (w.vocab, w.hidden, w.batch) == (64_000, PPO_VOCAB.hidden, PPO_VOCAB.batch)
    assert vocab_growth.head_flops_per_pass(w) == 2 * 32 * 64 * 128 * 64_000


def test_growth_criteria_read_the_numbers_the_right_way_round():
    import vocab_growth

    def pt(v, above, step):
        return {
            "method": "ppo",
            "logprobs": "fused",
            "V": v,
            "above_held_state_bytes": above,
            "above_state_bytes": above - v,  # the critic's gradients, V-sized, counted too
            "step_s": step,
        }

    ok = vocab_growth.summarize([pt(32_000, 100, 2.0), pt(64_000, 105, 3.0), pt(128_000, 109, 5.0)])
    s = ok["ppo/fused"]
    assert s["above_held_state_spread"] == pytest.approx(0.09) and s["memory_met"]
    assert "above_state_spread" not in s  # negative figures: no spread is given
    assert s["step_growth"] == {32_000: 1.0, 64_000: 1.5, 128_000: 2.5}
    assert s["head_growth"] == {32_000: 1.0, 64_000: 2.0, 128_000: 4.0} and s["time_met"]
    assert s["fit"]["b_s_per_token"] == pytest.approx(3.0 / 96_000, rel=0.05)
    bad = vocab_growth.summarize([pt(32_000, 100, 1.0), pt(64_000, 120, 2.5)])["ppo/fused"]
    assert bad["above_held_state_spread"] == pytest.approx(0.2)
    assert not bad["memory_met"] and not bad["time_met"]  # 20 % spread; 2.5x the time for 2x V


def test_report_names_each_works_steps():
    assert report._steps({"steps": 10, "steps_of": {"tiny": 10}}) == "10 steps a run"
    assert (
        report._steps({"steps": None, "steps_of": {"tiny": 10, "wide": 10, "ppo-vocab": 3}})
        == "10 steps a run (ppo-vocab: 3)"
    )
    assert report._met(0.31, 0.3) == "no" and report._met(0.3, 0.3) == "yes"
    assert report._met(None, 0.3) == "—"


def test_compare_trl_takes_each_works_steps_and_smoke_with_trl():
    import compare_trl

    a = compare_trl.parse_args(["--works", "tiny,ppo-vocab"])
    assert a.steps_of == {"tiny": 10, "ppo-vocab": 3}
    a = compare_trl.parse_args(["--works", "tiny,ppo-vocab", "--steps", "4"])
    assert a.steps_of == {"tiny": 4, "ppo-vocab": 4}
    a = compare_trl.parse_args(["--smoke", "--with-trl", "--works", "grpo-vocab"])
    assert a.steps_of == {"grpo-vocab": 1} and a.with_trl
    with pytest.raises(SystemExit):
        compare_trl.parse_args(["--with-trl"])  # only with --smoke


def test_growth_derives_a_points_figures_from_its_runs():
    import vocab_growth

    pt = {
        "method": "grpo",
        "logprobs": "fused",
        "V": 1000,
        "params": {"params_policy": 100, "params_reward": 90},
        "precision": "32-true",
        "memory_run": {
            "allocator_peak_bytes": 5000,
            # the actor's weights and AdamW moments, the reference's weights, 7 bytes of prompts
            "step_start_live_bytes": 4 * (3 * 100 + 100) + 7,
            "largest_allocations": [4 * 32 * 64 * 1000, 8],
        },
        "timing_runs": [
            {"median_step_s": 3.0, "peak_rss_mib": 10.0},
            {"median_step_s": 1.0, "peak_rss_mib": 30.0},
            {"median_step_s": 2.0, "peak_rss_mib": 20.0},
            {
                "error": "exit 1",
                "median_step_s": 0.1,
                "peak_rss_mib": 1.0,
            },  # a failed run: left out
        ],
    }
    vocab_growth.derive(pt)
    assert pt["state_bytes"]["total"] == 4 * (4 * 100 + 100)
    assert pt["above_held_state_bytes"] == 5000 - 2000 and pt["above_state_bytes"] == 3000
    assert pt["step_start_minus_state_bytes"] == 7
    assert pt["largest_allocation_vs_BRV"] == 1.0  # one (B, R, V) float32 tensor: B 32, R 64
    assert pt["step_s"] == 2.0 and pt["peak_rss_mib"] == 20.0


def test_replace_keeps_arch_fields():
    w = replace(PPO_VOCAB, vocab=32_000)
    assert w.arch == "qwen2" and w.kv_heads == 2 and w.model_key().startswith("qwen2-v32000-")
