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
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
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


def tiny_causal_lm_config(arch: str, vocab_size: int, **config_kwargs):
    """:func:`tiny_config` naming its causal-LM class in ``architectures``, as the checkpoint
    :func:`build_tiny_causal_lm` saves does: what a check that reads a checkpoint's config (vLLM's
    architecture and heads) reads, without building the model."""
    cfg = tiny_config(arch, vocab_size, **config_kwargs)
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    return cfg


#: The shape arguments of :func:`tiny_config` a task's model option may set (``compare.model``).
SHAPE_KEYS = ("arch", "hidden", "layers", "heads", "kv_heads", "max_positions")


def shape_problems(shape: dict, field: str) -> list[str]:
    """Why ``shape`` (a task's :data:`SHAPE_KEYS` overrides merged over its default model, e.g.
    ``{"arch": "llama", "hidden": 64, "heads": 2, ...}``) is not a tiny model :func:`tiny_config`
    builds: an unknown key or architecture, a size below 1, heads that do not divide the hidden
    size, key-value heads that do not divide the heads. Each one line naming ``field``."""
    e = []
    unknown = [k for k in shape if k not in SHAPE_KEYS]
    if unknown:
        e.append(
            f"{field}: unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(SHAPE_KEYS)})"
        )
    if shape.get("arch") not in ARCHITECTURES:
        e.append(f"{field}.arch = {shape.get('arch')!r}: choose one of {', '.join(ARCHITECTURES)}")
    sizes = [k for k in SHAPE_KEYS[1:] if k in shape and shape[k] is not None]
    bad = [k for k in sizes if isinstance(shape[k], bool) or not isinstance(shape[k], int)]
    bad += [k for k in sizes if k not in bad and shape[k] < 1]
    e += [f"{field}.{k} = {shape[k]!r} must be an integer ≥ 1" for k in bad]
    if bad:
        return e
    hidden, heads, kv = shape.get("hidden"), shape.get("heads"), shape.get("kv_heads")
    if hidden and heads and hidden % heads:
        e.append(f"{field}: hidden = {hidden} is not a multiple of heads = {heads}")
    if heads and kv and heads % kv:
        e.append(f"{field}: heads = {heads} is not a multiple of kv_heads = {kv}")
    return e


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
