"""The tiny checkpoints every PPO test stands on load back as they were built: a policy saved with a
tokenizer must encode and decode text the same way after ``from_pretrained``, whatever the
architecture (``proximal.models.tiny`` is what the tests and the demo use instead of downloads)."""

from __future__ import annotations

import pytest
from ppo_support import ALPHABET, prompt_texts

from proximal.models.loading import load_tokenizer


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_tiny_checkpoint_tokenizer_round_trips(arch, assets):
    built = assets.tokenizer
    loaded = load_tokenizer(str(assets.policy(arch)))
    for text in prompt_texts()[:6] + [ALPHABET]:
        ids = built(text, add_special_tokens=False).input_ids
        assert loaded(text, add_special_tokens=False).input_ids == ids, (
            f"{arch}: {type(loaded).__name__} encodes {text!r} differently from the tokenizer it was saved with"
        )
        assert loaded.decode(ids) == text
    assert (loaded.pad_token_id, loaded.eos_token_id) == (built.pad_token_id, built.eos_token_id)
