"""A model's shape, counted from the model itself: the model built on PyTorch's meta device.

``architecture_from_config(config.json's dict)`` builds ``AutoModelForCausalLM.from_config`` and
``AutoModelForSequenceClassification.from_config(num_labels=1)`` under ``torch.device("meta")`` —
every parameter gets a shape and no memory, so a 70B model is counted in a second — and reads from
them what the planner needs: the parameter count of each head (tied embeddings counted once, as
``model.parameters()`` yields a shared tensor once), the largest block, the embedding, and the
(in, out) of every linear layer LoRA could adapt. There is no per-family table: any architecture
transformers knows is counted as transformers builds it. The activation terms read the config's
hidden size, layers, heads, KV heads, head width, MLP width and vocabulary, and two facts of the
block's structure (a gated MLP; RMSNorm or LayerNorm), both read off the built block.

torch and transformers load inside the functions that build the models (``# lazy:``): the
:class:`Architecture` itself, and everything the planner computes from it, is integer arithmetic.

Notation (as in :mod:`proximal.memory.budget`): L layers, h hidden size, q = heads · head_dim,
kv = KV heads · head_dim, I MLP width, V vocabulary, b bytes per element.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: LoRA's target that means every linear layer but the output head (peft's ``"all-linear"``).
ALL_LINEAR = "all-linear"


class ConfigReadError(ValueError):
    """A config.json could not be read or built; the message names the path and the field."""


@dataclass(frozen=True)
class Architecture:
    """The shape of a decoder-only transformer, enough to count its parameters and size its memory.

    The counts (``lm_params`` …) come from the model built on the meta device; the sizes (``hidden_size``
    …) from its config. ``linears`` holds ``(name, in, out)`` of every linear layer of the backbone
    (the name is the module's last component, as LoRA's ``target_modules`` match it); the output head is
    not among them.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    lm_params: int
    score_params: int
    block_params: int
    embedding_params: int
    linears: tuple[tuple[str, int, int], ...] = ()
    gated_mlp: bool = True
    rms_norm: bool = True
    source: str = ""
    checkpoint_class: str = ""  # config.json's first "architectures" entry, e.g. LlamaForCausalLM

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- parameters ----------------------------------------------------------------------------

    def params(self, head: str) -> int:
        """N for this backbone with ``head``: ``lm`` (the language-model head, nothing more when tied to
        the embedding) or ``score`` (the one-label scalar head of the reward model and the critic)."""
        if head == "lm":
            return self.lm_params
        if head == "score":
            return self.score_params
        raise ValueError(f"head {head!r} is not 'lm' or 'score'")

    def layer_params(self) -> int:
        """Parameters of one transformer block (the largest, where they differ)."""
        return self.block_params

    def backbone_params(self) -> int:
        """The model without its output head: N(score) − h, the one-label head's weights."""
        return self.score_params - self.hidden_size

    def lm_head_params(self) -> int:
        """V·h for an untied head, 0 for one tied to the input embedding."""
        return self.lm_params - self.backbone_params()

    def lora_params(self, rank: int, targets: tuple[str, ...] | list[str] = (ALL_LINEAR,)) -> int:
        """Adapter parameters at ``rank``: r·(in + out) for each linear layer LoRA adapts — every one
        of the backbone for ``all-linear`` (peft's, which skips the output head), else those whose
        name is in ``targets``."""
        every = ALL_LINEAR in targets
        return sum(rank * (i + o) for name, i, o in self.linears if every or name in targets)

    def largest_unit_params(self) -> int:
        """Parameters of the largest FSDP unit: a block, or the embedding (a unit of its own)."""
        return max(self.block_params, self.embedding_params)

    # ---- activations ---------------------------------------------------------------------------

    def saved_elements_per_token_layer(self) -> int:
        """Elements autograd keeps for backward, per token, in one transformer layer (no checkpointing).

        Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer Models",
        §4.1, counts the tensors each op saves for its backward; the same method applied to the Llama
        block as Hugging Face implements it, with a fused attention kernel (flash or SDPA):

            2 norms, each: its input x, the normalised x, the output (saved by the next linear)   2 * 3h
            attention: the kernel's inputs q (rotated), k, v and its output; the contiguous copy
                       of the output that o_proj saves                                           3q + 2kv
            SwiGLU MLP: gate output, SiLU output, up output, their product (saved by down_proj)    4I
                                                                                          = 6h + 3q + 2kv + 4I
        The rotary embedding saves only cos/sin (shared), residual adds save nothing, and a fused
        kernel stores a log-sum-exp per head instead of the s x s attention matrix. A LayerNorm block
        (GPT-2): LayerNorm saves x and its output (2h), a GELU MLP the c_fc and GELU outputs (2I):
        4h + 3q + 2kv + 2I.
        """
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        norm = 3 * h if self.rms_norm else 2 * h
        mlp = 4 * i if self.gated_mlp else 2 * i
        return 2 * norm + (q + 2 * kv) + 2 * q + mlp

    def activation_bytes_per_token_layer(self, b: int) -> int:
        """Bytes of ``saved_elements_per_token_layer`` at ``b`` bytes per element.

        Hugging Face's RMSNorm upcasts its input to float32 and saves that copy, so in 16-bit each of
        the two norms keeps x at 4 bytes, not b: (4 - b) * h extra bytes per norm.
        """
        upcast = 2 * (4 - b) * self.hidden_size if self.rms_norm else 0
        return b * self.saved_elements_per_token_layer() + upcast

    def final_norm_bytes_per_token(self, b: int) -> int:
        """The final norm's saved tensors (as one norm above); its output feeds the head."""
        if not self.rms_norm:
            return b * 2 * self.hidden_size
        return b * 3 * self.hidden_size + (4 - b) * self.hidden_size

    def forward_working_bytes_per_token(self, b: int) -> int:
        """Live bytes per token inside one layer of a no-grad forward (nothing is saved between layers).

        The largest moment is the MLP: the residual x and the normed input, and — gated — the SiLU
        output, the up output and their product (the gate output is freed by then): 2h + 3I.
        GELU MLP: 2h + 2I.
        """
        mlp = 3 * self.intermediate_size if self.gated_mlp else 2 * self.intermediate_size
        return b * (2 * self.hidden_size + mlp)

    def kv_bytes_per_token(self, b: int) -> int:
        """KV cache per token of one sequence: keys and values in every layer, 2 * L * kv * b."""
        return 2 * self.num_layers * self.kv_dim * b


# --------------------------------------------------------------------------------------------------
# Reading a config and counting its model
# --------------------------------------------------------------------------------------------------


def read_config(path: str | Path) -> tuple[dict, str]:
    """The dict in ``path`` (a config.json, or a model directory holding one) and the file read."""
    p = Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        where = f"no config.json in directory {p}" if p.is_dir() else f"no such file {p}"
        raise ConfigReadError(f"{path}: {where}")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigReadError(f"{file}: not a readable JSON config: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigReadError(f"{file}: not a model config (a JSON object with a model_type)")
    return cfg, str(file)


def load_architecture(path: str | Path) -> Architecture:
    """Read ``path`` (a model directory or its config.json) and count its model; never downloads."""
    cfg, file = read_config(path)
    return architecture_from_config(cfg, source=file)


def _config(cfg: dict, source: str):
    """The transformers config object of ``cfg`` (its ``model_type`` names the class)."""
    # lazy: transformers (and torch under it) load only when a model's shape is read
    from transformers import AutoConfig

    mt = cfg.get("model_type")
    if not mt:
        raise ConfigReadError(f"{source}: config has no model_type field")
    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(mt, **rest)
    except ValueError as e:
        if "Unrecognized" in str(e) or "model_type" in str(e):
            raise ConfigReadError(
                f"{source}: model_type {mt!r} is not one this transformers knows (pass --params N "
                "to size weights and optimizer state only)"
            ) from None
        raise ConfigReadError(f"{source}: transformers cannot build this config: {e}") from None


def _field(config, source: str, *names: str, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if default is not None:
        return default
    raise ConfigReadError(f"{source}: config has no {' / '.join(names)} field")


def _linear_shape(module) -> tuple[int, int] | None:
    """(in, out) of a linear layer: ``nn.Linear``, or transformers' ``Conv1D`` (GPT-2), whose weight
    is stored (in, out)."""
    # lazy: torch loads only when a model's shape is read
    import torch

    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        i, o = module.weight.shape
        return int(i), int(o)
    return None


def _blocks(model) -> list:
    """The transformer blocks (the classes transformers names in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def architecture_from_config(cfg: dict, source: str = "config") -> Architecture:
    """An :class:`Architecture` from a Hugging Face config dict, counted from the model built on the
    meta device (no memory, no weights, no download)."""
    import torch  # lazy: torch and transformers load only when a model's shape is read
    from transformers import (  # lazy: as torch
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
    )
    from transformers.utils import logging as hf_logging  # lazy: as torch

    config = _config(cfg, source)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = int(_field(text, source, "hidden_size", "n_embd", "d_model"))
    heads = int(_field(text, source, "num_attention_heads", "n_head"))
    kv_heads = int(_field(text, source, "num_key_value_heads", default=heads))
    head_dim = int(_field(text, source, "head_dim", default=h // heads))
    layers = int(_field(text, source, "num_hidden_layers", "n_layer"))
    vocab = int(_field(text, source, "vocab_size"))
    inner = int(_field(text, source, "intermediate_size", "n_inner", "ffn_dim", default=4 * h))

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.device("meta"):
            try:
                lm = AutoModelForCausalLM.from_config(config)
            except (ValueError, KeyError) as e:
                raise ConfigReadError(
                    f"{source}: model_type {cfg.get('model_type')!r} has no causal-LM class in this "
                    f"transformers ({e})"
                ) from None
            scorer = _sequence_classifier(AutoModelForSequenceClassification, cfg, source)
    finally:
        hf_logging.set_verbosity(verbosity)

    lm_params = sum(p.numel() for p in lm.parameters())  # a tied tensor is yielded once
    out_emb, in_emb = lm.get_output_embeddings(), lm.get_input_embeddings()
    tied = out_emb is not None and out_emb.weight is in_emb.weight
    head = 0 if tied or out_emb is None else out_emb.weight.numel()
    score_params = (
        sum(p.numel() for p in scorer.parameters()) if scorer is not None else lm_params - head + h
    )
    blocks = _blocks(lm)
    if not blocks:
        raise ConfigReadError(
            f"{source}: {type(lm).__name__} names no transformer block class (_no_split_modules)"
        )
    block_params = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    skip = {id(out_emb)} if out_emb is not None else set()
    linears = tuple(
        (name.rsplit(".", 1)[-1], *shape)
        for name, m in lm.named_modules()
        if id(m) not in skip and (shape := _linear_shape(m)) is not None
    )
    first = blocks[0]
    in_block = [s for m in first.modules() if (s := _linear_shape(m)) is not None]
    gated = sum(1 for _, o in in_block if o == inner) >= 2  # gate and up, both h -> I
    rms = any("RMSNorm" in type(m).__name__ for m in first.modules())
    return Architecture(
        model_type=str(cfg.get("model_type")),
        vocab_size=vocab,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inner,
        tie_word_embeddings=tied,
        lm_params=lm_params,
        score_params=score_params,
        block_params=block_params,
        embedding_params=in_emb.weight.numel(),
        linears=linears,
        gated_mlp=gated,
        rms_norm=rms,
        source=source,
        checkpoint_class=str((cfg.get("architectures") or [""])[0]),
    )


def _sequence_classifier(auto_cls, cfg: dict, source: str):
    """The one-label sequence classifier of ``cfg`` on the meta device, or None where transformers has
    no such class for the architecture (its count is then the backbone + h)."""
    one = {k: v for k, v in cfg.items() if k not in ("id2label", "label2id", "num_labels")}
    config = _config({**one, "num_labels": 1}, source)
    try:
        return auto_cls.from_config(config)
    except (ValueError, KeyError):
        return None
