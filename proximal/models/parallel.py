"""Where a model lives: device, precision, FSDP2 sharding, generation with sharded weights, and the
full-weight export.

One process: models are plain modules on one device. Several (``torchrun``): every model being
trained is sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``), one unit per transformer
block plus one for what remains (for a scorer — critic, reward model — the backbone and the scalar
head are units of their own, because :mod:`proximal.models.heads` calls them directly); frozen
models are sharded the same way or replicated (``model.frozen_sharding``).

Precision (``train.precision``): ``bf16-mixed`` keeps float32 master weights; in one process the
forward passes run under ``torch.autocast(bfloat16)`` (:func:`autocast`), sharded they use FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``. Frozen models are simply held
in bfloat16. ``bf16-true`` holds everything in bfloat16.
"""

from __future__ import annotations

import contextlib
import re
from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing as wrap_blocks,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from proximal.models import compiled
from proximal.models.kernels import use_onednn_linears
from proximal.models.loading import backbone, freeze, score_head, unwrap


def load_dtype(precision: str, *, trained: bool) -> str:
    """The dtype a model is loaded in: float32 master weights for a trained model under bf16-mixed."""
    if precision == "bf16-true":
        return "bfloat16"
    if precision == "bf16-mixed":
        return "float32" if trained else "bfloat16"
    return "float32"


def block_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (Hugging Face's ``_no_split_modules`` classes, e.g. LlamaDecoderLayer)."""
    names = set(getattr(unwrap(model), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def _is_scorer(model) -> bool:
    try:
        score_head(unwrap(model))
        return True
    except Exception:
        return False


def _backbone(model):
    return backbone(unwrap(model))


def apply_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each block's activations in backward (torch's non-reentrant checkpoint wrapper).

    Hugging Face's own ``gradient_checkpointing_enable`` acts only in train mode, and RLHF keeps its
    models in eval mode (no dropout: the rollout and the update must see one policy), so the blocks
    are wrapped instead. The wrapper's state-dict hooks keep every parameter name unchanged.
    """
    blocks = set(map(id, block_modules(model)))
    if not blocks:
        raise ValueError(
            f"{type(unwrap(model)).__name__}: no transformer blocks found for activation checkpointing"
        )
    wrap_blocks(
        model,
        checkpoint_wrapper_fn=partial(
            checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: id(m) in blocks,
    )


def shard(
    model: torch.nn.Module, *, mixed_precision: bool = False, trained: bool = True
) -> torch.nn.Module:
    """FSDP2 over the default device mesh: each block, then (scorers) backbone and head, then the root."""
    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    units = [(b, True) for b in block_modules(model)]
    if _is_scorer(model):
        units += [(_backbone(model), True), (score_head(unwrap(model)), True)]
    # The root keeps its parameters gathered between a trained model's forward and backward.
    units.append((model, not trained))
    for module, reshard in units:
        fully_shard(module, reshard_after_forward=reshard, **kwargs)
        module._proximal_reshard = reshard
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def choose_attention(
    model: torch.nn.Module, device: torch.device, compute_dtype: torch.dtype
) -> None:
    """On a CPU computing in bfloat16, use plain ("eager") attention: torch's fused CPU attention kernel
    is about 3× slower than two bfloat16 matmuls there (measured: 32 × 8 heads × 96 tokens, forward
    and backward, 31.8 ms against 9.3 ms); in float32 and on GPUs the model's own choice is kept."""
    if (
        device.type == "cpu"
        and compute_dtype == torch.bfloat16
        and hasattr(unwrap(model), "set_attn_implementation")
    ):
        try:
            unwrap(model).set_attn_implementation("eager")
        except (ValueError, ImportError):  # an architecture without it keeps its default
            pass


def prepare_trained(
    model: torch.nn.Module,
    *,
    device: torch.device,
    precision: str,
    world_size: int,
    activation_checkpointing: bool = False,
    merge_lora: bool = False,
) -> torch.nn.Module:
    """Move, optionally checkpoint, and (several processes) shard a model that will be trained.

    ``merge_lora``: :func:`export_pretrained` writes this (peft) model as one plain checkpoint with its
    adapters merged into the weights, not as adapters (``output.merge_lora``)."""
    model._proximal_merge_lora = merge_lora
    model.to(device)
    choose_attention(model, device, torch.float32 if precision == "32-true" else torch.bfloat16)
    if device.type == "cpu":
        use_onednn_linears(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if world_size > 1:
        shard(model, mixed_precision=precision == "bf16-mixed", trained=True)
    elif precision == "bf16-mixed":
        model._proximal_autocast = torch.bfloat16
    # train.compile
    compiled.apply(model, world_size=world_size, activation_checkpointing=activation_checkpointing)
    return model


def prepare_frozen(
    model: torch.nn.Module, *, device: torch.device, world_size: int, sharding: str = "shard"
) -> torch.nn.Module:
    """Freeze (eval mode, no gradients), move, and with several processes shard or replicate."""
    freeze(model)
    model.to(device)
    choose_attention(model, device, next(model.parameters()).dtype)
    if device.type == "cpu":
        use_onednn_linears(model)
    if world_size > 1 and sharding == "shard":
        shard(model, trained=False)
    compiled.apply(model, world_size=world_size)  # train.compile
    return model


def autocast(model: torch.nn.Module):
    """``torch.autocast(bfloat16)`` for a model prepared for bf16-mixed in one process, else a no-op."""
    dtype = getattr(model, "_proximal_autocast", None)
    if dtype is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=dtype)


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """Hold a sharded model's full weights for the duration (generation), then shard them again.

    Inside, forward passes issue no collectives, so ranks may run different numbers of decode steps
    and stop at their own lengths; every rank must enter and leave together (the gather and the
    reshard are collectives). A no-op for an unsharded model.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(getattr(m, "_proximal_reshard", True))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered to full tensors on CPU on rank 0 ({} on the other ranks).

    Every rank must call it (the gather is a collective). Unsharded: the module's own ``state_dict``.
    """
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def export_pretrained(
    model: torch.nn.Module,
    tokenizer,
    directory,
    *,
    is_main: bool = True,
    merge_lora: bool | None = None,
) -> None:
    """A plain Hugging Face checkpoint (``save_pretrained``, safetensors + tokenizer) that loads on one
    device. For a peft model: its adapters (``adapter_config.json``, loaded over the base model), or
    with ``merge_lora`` the base model with the adapters merged into its weights, which loads with
    plain ``from_pretrained``. ``merge_lora=None`` takes what :func:`prepare_trained` was told
    (default: adapters). Every rank calls it; rank 0 writes."""
    if merge_lora is None:
        merge_lora = getattr(model, "_proximal_merge_lora", False)
    merge_lora = merge_lora and hasattr(model, "get_base_model")
    sharded = is_sharded(model)
    state = full_state_dict(model) if sharded or merge_lora else None
    if not is_main:
        return
    if merge_lora:
        # The merge is computed on the exported tensors, never in place: merging and unmerging the
        # live weights would leave round-off in the frozen base and the run would no longer resume
        # exactly (a resumed run reloads the pristine base).
        plain = merged_lora_state(model, state)
        unwrap(model).save_pretrained(directory, state_dict=plain, safe_serialization=True)
    elif sharded:
        # save_pretrained(state_dict=d) empties d (transformers 5): hand it a copy.
        model.save_pretrained(directory, state_dict=dict(state), safe_serialization=True)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


#: peft's names inside a wrapped model: the prefix of every key, a LoRA layer's frozen weight and a
#: fully trained copy of a module (``modules_to_save``: a scorer's head) beside its frozen original.
_PEFT_PREFIX = "base_model.model."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def merged_lora_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict:
    """The state dict of the plain model under a peft LoRA ``model``, each adapted weight merged:
    W' = W + s · B A (s = lora_alpha / r, peft's ``scaling``; W (out, in), B (out, r), A (r, in);
    transposed for GPT-2's Conv1D, whose weight is stored (in, out)). ``state`` is ``model``'s full
    state dict (peft's key names); the sum is taken in float32 and stored in W's dtype. A fully
    trained ``modules_to_save`` copy replaces its frozen original. Keys are the plain model's."""
    out = dict(state)
    for name, m in model.named_modules():
        if not (hasattr(m, "lora_A") and hasattr(m, "base_layer") and hasattr(m, "scaling")):
            continue
        prefix = name.replace("_checkpoint_wrapped_module.", "")
        w = out[f"{prefix}.base_layer.weight"]
        merged = w.float()
        for a in m.active_adapters:
            a_key, b_key = f"{prefix}.lora_A.{a}.weight", f"{prefix}.lora_B.{a}.weight"
            if a_key not in out:
                raise ValueError(
                    f"{prefix}: only LoRA on linear layers can be merged into an export "
                    "(set output.merge_lora: false to export the adapters)"
                )
            delta = (out[b_key].float() @ out[a_key].float()) * m.scaling[a]  # (out, in)
            merged = merged + (delta.T if getattr(m, "fan_in_fan_out", False) else delta)
        out[f"{prefix}.base_layer.weight"] = merged.to(w.dtype)
    plain = {}
    for key, value in out.items():
        if ".lora_" in key or ".original_module." in key:
            continue
        key = key.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
        plain[_MODULES_TO_SAVE.sub(".", key)] = value
    return plain
