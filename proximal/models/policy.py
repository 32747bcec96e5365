"""The models of the online and preference methods, built from config values.

- policy π_θ: an ``AutoModelForCausalLM``, optionally with LoRA adapters (peft);
- reference π_ref: a frozen copy of the policy's starting weights — or, with LoRA, the same weights
  with the adapters disabled, so no second copy is held in memory;
- critic V_φ (PPO): a one-label sequence-classification model read at every token, initialised from
  the reward model (the default), from the policy (a fresh zero head) or from a path.

The reward model is loaded with the scorer (:func:`proximal.rollout.scoring.build_scorer`).
Each builder loads in the dtype ``train.precision`` asks for and places the model (device, FSDP2
sharding across processes) through :mod:`proximal.models.parallel`.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from proximal.models.loading import (
    ModelLoadError,
    load_causal_lm,
    load_sequence_scorer,
    load_tokenizer,
)
from proximal.models.parallel import load_dtype, prepare_frozen, prepare_trained


def lora_config(task_type: str, r: int, alpha: float, target_modules: list[str]):
    """LoRA without dropout: models stay in eval mode in RLHF, so dropout would never act anyway."""
    # lazy: peft loads only for LoRA (it takes a second to import)
    from peft import LoraConfig

    targets = target_modules[0] if target_modules == ["all-linear"] else list(target_modules)
    return LoraConfig(
        task_type=task_type, r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets
    )


def with_adapters(model, config):
    """``peft.get_peft_model``, without the FutureWarning peft's own use of a deprecated transformers
    attribute (``is_gradient_checkpointing``) prints on every run."""
    # lazy: peft loads only for LoRA (it takes a second to import)
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        return get_peft_model(model, config)


def with_lora(model, task_type: str, lora: dict | None):
    """``model`` with LoRA adapters (``lora``: r, alpha, target_modules; peft ``task_type``
    'CAUSAL_LM' or 'SEQ_CLS', whose scalar head then trains in full), or ``model`` itself when
    ``lora`` is None. Only the adapters (and such a head) require gradients."""
    return with_adapters(model, lora_config(task_type, **lora)) if lora else model


def build_actor(path: str, *, dtype: str, lora: dict | None = None):
    """The trainable policy, in eval mode (no dropout: the rollout and the update must see one
    policy). With ``lora`` (r, alpha, target_modules) only the adapters train."""
    model = with_lora(
        load_causal_lm(path, role="policy (model.path)", dtype=dtype), "CAUSAL_LM", lora
    )
    model.eval()
    return model


class Reference:
    """π_ref: a frozen copy, or the LoRA actor with its adapters switched off."""

    def __init__(
        self,
        actor,
        *,
        path: str | None,
        dtype: str,
        shares_actor: bool,
        role: str = "reference (model.path)",
    ):
        self.shares_actor = shares_actor
        if shares_actor:
            self.model = actor
        else:
            self.model = load_causal_lm(path, role=role, dtype=dtype)

    @contextlib.contextmanager
    def active(self):
        if self.shares_actor:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.model


def build_policy(
    path: str,
    *,
    lora: dict | None,
    precision: str,
    device: torch.device,
    world_size: int,
    activation_checkpointing: bool = False,
    reference: bool = True,
    frozen_sharding: str = "shard",
    merge_lora: bool = False,
):
    """``(tokenizer, actor, reference or None)``, placed and (several processes) sharded.
    ``merge_lora``: the actor's exports are one plain checkpoint, its adapters merged into the
    weights (``output.merge_lora``), not the adapters alone."""
    tokenizer = load_tokenizer(path, role="policy tokenizer (model.path)")
    actor = build_actor(path, dtype=load_dtype(precision, trained=True), lora=lora)
    ref = None
    if reference:
        ref = load_reference(
            actor,
            path,
            lora=lora is not None,
            precision=precision,
            device=device,
            world_size=world_size,
            frozen_sharding=frozen_sharding,
        )
    prepare_trained(
        actor,
        device=device,
        precision=precision,
        world_size=world_size,
        activation_checkpointing=activation_checkpointing,
        merge_lora=merge_lora,
    )
    return tokenizer, actor, ref


def load_reference(
    actor,
    path: str,
    *,
    lora: bool,
    precision: str,
    device: torch.device,
    world_size: int,
    frozen_sharding: str = "shard",
) -> Reference:
    """π_ref for ``actor``: with ``lora``, the actor itself with its adapters disabled (nothing is loaded);
    otherwise a frozen copy of ``path`` in train.precision's frozen dtype, placed and (several
    processes) sharded or replicated. Every rank calls it."""
    ref = Reference(actor, path=path, dtype=load_dtype(precision, trained=False), shares_actor=lora)
    if not ref.shares_actor:
        prepare_frozen(ref.model, device=device, world_size=world_size, sharding=frozen_sharding)
    return ref


def tokenizer_mismatch(student, teacher, teacher_path: str) -> str | None:
    """One line saying how the teacher's tokenizer differs from the student's (its vocabulary,
    an id, a special token), or None when they agree: on-policy distillation compares the two
    models' probabilities of the same token ids, so they must share the tokenizer."""
    where = f"model.teacher {teacher_path}"
    vs, vt = student.get_vocab(), teacher.get_vocab()
    if len(vs) != len(vt):
        return (
            f"{where}: its tokenizer has {len(vt)} tokens, the student's (model.path) {len(vs)}; "
            "the teacher must share the student's tokenizer (cross-tokenizer distillation is not "
            "supported)"
        )
    differ = sorted(tok for tok, i in vs.items() if vt.get(tok) != i)
    if differ:
        return (
            f"{where}: its tokenizer maps {len(differ)} tokens to other ids than the student's "
            f"(e.g. {differ[0]!r}: {vt.get(differ[0])} vs {vs[differ[0]]}); the teacher must "
            "share the student's tokenizer (cross-tokenizer distillation is not supported)"
        )
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            return (
                f"{where}: its tokenizer's {name} is {getattr(teacher, name, None)}, the "
                f"student's {getattr(student, name, None)}; the teacher must share the student's "
                "tokenizer"
            )
    return None


def load_teacher(
    path: str,
    student_tokenizer,
    *,
    precision: str,
    device: torch.device,
    world_size: int,
    frozen_sharding: str = "shard",
) -> Reference:
    """The teacher of on-policy distillation, frozen like a reference (:func:`load_reference`): its
    tokenizer checked against the student's first (:func:`tokenizer_mismatch`: a
    :class:`~proximal.models.loading.ModelLoadError` in one line, before any teacher weight loads),
    then its output vocabulary. Every rank calls it."""
    mismatch = tokenizer_mismatch(
        student_tokenizer, load_tokenizer(path, role="teacher tokenizer (model.teacher)"), path
    )
    if mismatch:
        raise ModelLoadError(mismatch)
    teacher = Reference(
        None,
        path=path,
        dtype=load_dtype(precision, trained=False),
        shares_actor=False,
        role="teacher (model.teacher)",
    )
    prepare_frozen(teacher.model, device=device, world_size=world_size, sharding=frozen_sharding)
    return teacher


def build_critic(
    source: str,
    *,
    policy_path: str,
    reward_model_path: str | None,
    dtype: str,
    pad_token_id: int,
    lora: dict | None = None,
):
    """V_φ. ``source``: 'reward_model', 'policy' or a checkpoint path."""
    if source == "reward_model":
        model = load_sequence_scorer(
            reward_model_path,
            role="critic (from model.reward_model)",
            dtype=dtype,
            pad_token_id=pad_token_id,
        )
    elif source == "policy":
        model = load_sequence_scorer(
            policy_path,
            role="critic (from model.path)",
            dtype=dtype,
            pad_token_id=pad_token_id,
            new_head=True,
        )
    else:
        model = load_sequence_scorer(
            source, role="critic (model.critic)", dtype=dtype, pad_token_id=pad_token_id
        )
    model = with_lora(model, "SEQ_CLS", lora)
    model.eval()
    return model
