"""Tiny models and tokenizers, built locally, saved in Hugging Face format.

Tests and the demo never download weights: they build a character-level tokenizer with the
``tokenizers`` library and a few-layer transformer from a ``transformers`` config, save both with
``save_pretrained``, and then load them through the same ``from_pretrained`` path a user's real
checkpoint takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")
ARCHITECTURES = ("llama", "gpt2", "qwen2")


def build_char_tokenizer(
    alphabet: Sequence[str],
    *,
    specials: Sequence[str] = SPECIAL_TOKENS,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer: one token per character of ``alphabet`` (ASCII).

    ``specials`` are, in order, pad, eos, bos and unk; their ids are 0..3, the characters follow.

    It is written as a byte-level BPE with no merges, the format of GPT-2, Llama-3 and Qwen2
    tokenizers: transformers 5 rebuilds a ``qwen2`` checkpoint's tokenizer as ``Qwen2Tokenizer``
    whatever class was saved, and only a byte-level vocabulary survives that with the same ids
    (a plain word-level one silently loses its spaces there).
    """
    pad, eos, bos, unk = specials
    chars = [c for c in alphabet if c not in specials]
    for c in chars:
        if len(c) != 1 or ord(c) > 127:
            raise ValueError(f"build_char_tokenizer: {c!r} is not a single ASCII character")
    repeated = sorted({c for c in chars if chars.count(c) > 1})
    if repeated:  # each would take a second id past the vocabulary the model is built with
        raise ValueError(
            f"build_char_tokenizer: the alphabet repeats {', '.join(map(repr, repeated))}; give each "
            "character once"
        )
    symbol = _bytes_to_unicode()
    vocab = {t: i for i, t in enumerate(specials)}
    for c in chars:
        vocab[symbol[ord(c)]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, eos_token=eos, bos_token=bos, unk_token=unk
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character map (byte-level BPE's alphabet)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiny_config(
    arch: str,
    vocab_size: int,
    *,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int | None = None,
    max_positions: int = 256,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int = 2,
    num_labels: int | None = None,
):
    """A ``transformers`` config for a tiny model of a given architecture (llama, gpt2 or qwen2)."""
    common = dict(
        vocab_size=vocab_size,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        tie_word_embeddings=False,
    )
    if num_labels is not None:
        common["num_labels"] = num_labels
    if arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2",
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=max_positions,
            n_inner=4 * hidden,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    if arch in ("llama", "qwen2"):
        return AutoConfig.for_model(
            arch,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads or heads,
            max_position_embeddings=max_positions,
            **common,
        )
    raise ValueError(
        f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}"
    )


def _ids(tokenizer) -> dict:
    return dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )


def _save(model, tokenizer, out: Path) -> Path:
    """``save_pretrained`` of both, without transformers' "Writing model shards" bar (a tiny model is
    written in milliseconds; the bar would only clutter a test's or the demo's output)."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    return out


def build_tiny_causal_lm(
    out_dir: str | Path, tokenizer, *, arch: str = "llama", seed: int = 0, **config_kwargs
) -> Path:
    """Save a randomly initialised tiny causal LM and ``tokenizer`` to ``out_dir``; return the path."""
    torch.manual_seed(seed)
    cfg = tiny_config(arch, len(tokenizer), **_ids(tokenizer), **config_kwargs)
    model = AutoModelForCausalLM.from_config(cfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return _save(model, tokenizer, Path(out_dir))


def build_tiny_reward_model(
    out_dir: str | Path,
    tokenizer,
    *,
    arch: str = "llama",
    seed: int = 0,
    num_labels: int = 1,
    **config_kwargs,
) -> Path:
    """Save a randomly initialised tiny ``AutoModelForSequenceClassification`` (one label) and tokenizer."""
    torch.manual_seed(seed)
    cfg = tiny_config(
        arch, len(tokenizer), num_labels=num_labels, **_ids(tokenizer), **config_kwargs
    )
    model = AutoModelForSequenceClassification.from_config(cfg)
    return _save(model, tokenizer, Path(out_dir))
