"""Loading Hugging Face checkpoints for the four PPO models (Ouyang et al. 2022) and for SFT / reward training.

Every loader takes a local directory or a hub id and goes through ``from_pretrained``; nothing here
downloads unless the user points at a hub id on a machine that has the network. From Python a
loader also takes a model given in the config itself (a :class:`proximal.config.PythonObject`: a
``PreTrainedModel``, or ``(model, tokenizer)``) and returns a copy of it, as ``from_pretrained``
returns fresh weights: the run trains and freezes its own copies, never the caller's object.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from proximal.config import PythonObject, could_be_local, missing_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(ValueError):
    """A model or tokenizer could not be loaded; the message names the role and the path."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``
    in the environment, read at each call as transformers reads it)."""
    return any(
        os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_cache() -> Path:
    """Where huggingface_hub keeps downloaded models: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def check_path(path: str, role: str) -> None:
    """ModelLoadError, before any request to the hub, for a path that cannot load: none given; a
    local path that does not exist (:func:`proximal.config.could_be_local`: ``runs/stf`` where
    ``runs/`` exists), named with the closest existing one; or, with the hub switched off
    (:func:`hub_offline`), a hub id that is not in the hub's cache either. Another name that does not
    exist here is left to ``from_pretrained`` as a hub id."""
    if isinstance(path, PythonObject):
        return
    if not path:
        raise ModelLoadError(f"{role}: no model path given")
    if Path(path).expanduser().exists():
        return
    if could_be_local(path):
        raise ModelLoadError(f"{role}: {missing_path(path)}")
    cached = hub_cache() / ("models--" + path.replace("/", "--"))
    if hub_offline() and not cached.is_dir():
        raise ModelLoadError(
            f"{role}: {missing_path(path)}, and the hub is switched off (HF_HUB_OFFLINE) with no "
            f"{path} in its cache ({hub_cache()})"
        )


def _given(source) -> tuple[object, object | None] | None:
    """``(model, tokenizer or None)`` of a model given from Python; None for a path."""
    if not isinstance(source, PythonObject):
        return None
    value = source.value
    return (value[0], value[1]) if isinstance(value, (tuple, list)) else (value, None)


def _copy_of(source: PythonObject, model, role: str, dtype: str):
    """A copy of a model given from Python, in ``dtype``, every weight trainable (as
    ``from_pretrained`` gives it): the run's own, so training it leaves the caller's untouched."""
    if hasattr(model, "peft_config"):
        raise ModelLoadError(
            f"{role}: {source} has LoRA adapters (peft); give model.merge_and_unload(), or save it "
            "with save_pretrained and give the directory"
        )
    model = copy.deepcopy(model).to(resolve_dtype(dtype))
    model.requires_grad_(True)
    if not getattr(model.config, "architectures", None):  # built with from_config
        model.config.architectures = [type(model).__name__]
    return model


def load_tokenizer(path: str, *, role: str = "tokenizer", padding_side: str = "left"):
    """The tokenizer saved with a checkpoint, with a pad token guaranteed.

    A tokenizer without a pad token (common for base LMs) gets its EOS token as pad; this is safe
    here because every loss is masked by ``response_mask``/``attention_mask``, never by token id.
    A model given from Python: a copy of the tokenizer given with it, or the one saved where the
    model was loaded from (its ``name_or_path``).
    """
    given = _given(path)
    if given is not None and given[1] is not None:
        tok = copy.deepcopy(given[1])
    else:
        if given is not None:
            name = getattr(given[0], "name_or_path", "") or ""
            if not name:
                raise ModelLoadError(
                    f"{role}: {path} comes without a tokenizer, and it was not loaded from a "
                    "checkpoint that holds one; give (model, tokenizer)"
                )
            path = name
        check_path(path, role)
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # transformers raises many types: name the role and path once
            raise ModelLoadError(f"{role}: cannot load a tokenizer from {path!r}: {e}") from e
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(
                f"{role}: tokenizer at {path!r} has neither a pad nor an EOS token"
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = padding_side
    return tok


def load_causal_lm(path: str, *, role: str = "policy", dtype: str = "float32"):
    """An ``AutoModelForCausalLM`` from ``path`` (from Python: a copy of the model given)."""
    given = _given(path)
    if given is not None:
        return _checked_language_model(_copy_of(path, given[0], role, dtype), path, role)
    check_path(path, role)
    try:
        if (Path(path) / "adapter_config.json").is_file():
            model = _merged_adapters(path, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{role}: cannot load a causal LM from {path!r}: {e}") from e
    return _checked_language_model(model, path, role)


def _checked_language_model(model, path, role: str):
    architectures = getattr(model.config, "architectures", None) or []
    if architectures and all(a.endswith(_NOT_LANGUAGE_MODELS) for a in architectures):
        # transformers would load the backbone and initialise a fresh output layer, silently
        raise ModelLoadError(
            f"{role}: {path!r} is a {architectures[0]} (a classifier, such as the output of "
            "`proximal rm`), not a language model; give a causal LM checkpoint (the SFT model)"
        )
    return model


def _merged_adapters(path: str, dtype: str):
    """A LoRA run's output (peft adapters over the base checkpoint their config names) as one plain
    model, the adapters merged into the weights: the next stage trains and exports it like any other
    checkpoint (loaded unmerged, transformers would train the adapters on top and save only them)."""
    # lazy: peft loads only for LoRA (it takes a second to import)
    from peft import AutoPeftModelForCausalLM, PeftConfig

    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    if base and not Path(base).exists() and Path(base).is_absolute():
        raise ModelLoadError(
            f"{path!r} holds LoRA adapters over {base!r}, which does not exist (any more)"
        )
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        model = AutoPeftModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype)
        ).merge_and_unload()
    # peft before 0.19 leaves its adapter config on the merged model: a plain model has none, and
    # transformers would take it for an adapter to load and save again
    if hasattr(model, "peft_config"):
        del model.peft_config
    # peft loads adapters for inference, every weight frozen; a plain from_pretrained model trains
    model.requires_grad_(True)
    return model


def _merged_scorer_adapters(path: str, dtype: str):
    """A LoRA reward model's output exported as adapters (``proximal rm`` with ``output.merge_lora:
    false``: adapters over a base checkpoint, often a causal LM, and the one-label head saved whole)
    as one plain one-label classifier, the adapters merged into the weights."""
    # lazy: peft loads only for LoRA (it takes a second to import)
    from peft import AutoPeftModelForSequenceClassification, PeftConfig

    base = PeftConfig.from_pretrained(path).base_model_name_or_path
    if base and not Path(base).exists() and Path(base).is_absolute():
        raise ModelLoadError(
            f"{path!r} holds LoRA adapters over {base!r}, which does not exist (any more)"
        )
    # A causal-LM base has no one-label head: transformers makes a random one (num_labels=1, said in
    # its load report, silenced) that the saved head then replaces.
    with warnings.catch_warnings(), _quiet_load_report(True):
        warnings.simplefilter("ignore")
        model = AutoPeftModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype), num_labels=1
        ).merge_and_unload()
    if hasattr(model, "peft_config"):
        del model.peft_config
    model.requires_grad_(True)  # as from_pretrained's (peft loads adapters frozen, for inference)
    model.config.architectures = [type(model).__name__]
    return model


#: Architecture-name endings of checkpoints that are not language models.
_NOT_LANGUAGE_MODELS = (
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
)


def load_sequence_scorer(
    path: str,
    *,
    role: str = "reward model",
    dtype: str = "float32",
    pad_token_id: int | None = None,
    new_head: bool = False,
):
    """An ``AutoModelForSequenceClassification`` with exactly one label (a scalar score).

    With ``new_head=True`` (a critic initialised from a policy checkpoint) the one-label head is
    created fresh and zero-initialised, so the initial value estimate is 0 everywhere.
    """
    given = _given(path)
    if given is not None and not type(given[0]).__name__.endswith("ForSequenceClassification"):
        if not new_head:
            raise ModelLoadError(
                f"{role}: {path} is not a reward model; a reward model is an "
                "AutoModelForSequenceClassification with one label, such as the output of "
                "`proximal rm`"
            )
        return scorer_from_causal_lm(load_causal_lm(path, role=role, dtype=dtype), pad_token_id)
    if given is None:
        check_path(path, role)
    kwargs = {"num_labels": 1} if new_head else {}
    task = adapter_task(path)
    # a language model's LoRA adapters (sft's adapters-only export)
    if task not in (None, "SEQ_CLS"):
        if not new_head:
            raise ModelLoadError(
                f"{role}: {path!r} holds a language model's LoRA adapters ({task}), not a reward "
                "model; a reward model is an AutoModelForSequenceClassification with one label, "
                "such as the output of `proximal rm`"
            )
        return scorer_from_causal_lm(load_causal_lm(path, role=role, dtype=dtype), pad_token_id)
    try:
        if given is not None:
            model = _copy_of(path, given[0], role, dtype)
        elif task == "SEQ_CLS":
            model = _merged_scorer_adapters(path, dtype)
        else:
            with warnings.catch_warnings(), _quiet_load_report(new_head):
                warnings.simplefilter("ignore")
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, dtype=resolve_dtype(dtype), **kwargs
                )
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"{role}: cannot load a sequence-classification model from {path!r}: {e}"
        ) from e
    architectures = getattr(model.config, "architectures", None) or []
    if (
        not new_head
        and architectures
        and not any(a.endswith("ForSequenceClassification") for a in architectures)
    ):
        raise ModelLoadError(
            f"{role}: {path!r} is a {architectures[0]} (a language model), not a reward model; a "
            "reward model is an AutoModelForSequenceClassification with one label, such as the "
            "output of `proximal rm`"
        )
    if model.config.num_labels != 1:
        raise ModelLoadError(
            f"{role}: {path!r} has {model.config.num_labels} labels; a reward model must "
            "have exactly one (a scalar score)"
        )
    if new_head:
        with torch.no_grad():
            head = score_head(model)
            head.weight.zero_()  # a plain Linear here: peft wraps later
            if head.bias is not None:
                head.bias.zero_()
    if model.config.pad_token_id is None and pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


def adapter_task(path: str) -> str | None:
    """The peft ``task_type`` of a LoRA adapters-only export at ``path`` ('CAUSAL_LM', 'SEQ_CLS'), or
    None when ``path`` is not one (a plain checkpoint, a hub id, a model given from Python)."""
    if isinstance(path, PythonObject):
        return None
    config = Path(path) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text()).get("task_type") or "CAUSAL_LM"
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path!r}: cannot read {config}: {e}") from e


def scorer_from_causal_lm(causal, pad_token_id: int | None = None):
    """A one-label sequence classifier with the backbone of the causal LM ``causal`` (its tensors
    copied, the LM head dropped) and a zero-initialised head: what :func:`load_sequence_scorer` with
    ``new_head=True`` makes of a causal-LM checkpoint, for a causal LM that exists only in memory
    (LoRA adapters merged into their base)."""
    config = copy.deepcopy(causal.config)
    config.num_labels, config.architectures = 1, None
    scorer = AutoModelForSequenceClassification.from_config(config, dtype=causal.dtype)
    # The same backbone module in both heads (base_model_prefix): strict, so no tensor is left behind.
    backbone(scorer).load_state_dict(backbone(causal).state_dict())
    with torch.no_grad():
        head = score_head(scorer)
        head.weight.zero_()
        if head.bias is not None:
            head.bias.zero_()
    scorer.config.architectures = [type(scorer).__name__]
    if scorer.config.pad_token_id is None and pad_token_id is not None:
        scorer.config.pad_token_id = pad_token_id
    return scorer


@contextlib.contextmanager
def _quiet_load_report(expected: bool):
    """Silence transformers' load report when its findings are expected: a causal-LM checkpoint loaded
    as a scorer has an unused ``lm_head`` and no ``score`` head, and that is the point of ``new_head``."""
    if not expected:
        yield
        return

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def score_head(model) -> torch.nn.Module:
    """The scalar output layer of a sequence-classification model (``score`` or ``classifier``).

    Under peft the head is wrapped (``modules_to_save``) and is returned wrapped, so it stays trainable.
    """
    for name in ("score", "classifier", "v_head"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Linear) or hasattr(head, "modules_to_save"):
            return head
    raise ModelLoadError(
        f"{type(model).__name__}: no scalar head found (looked for score, classifier)"
    )


def backbone(model):
    """The transformer under a task head (``model.model`` for Llama/Qwen2, ``model.transformer`` for GPT-2)."""
    base = getattr(model, model.base_model_prefix, None)
    return base if base is not None else model.base_model


def unwrap(model):
    """The Hugging Face model under a peft wrapper (the model itself otherwise); LoRA layers live inside it."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def check_fits(model, tokenizer, max_length: int, path: str, field: str = "model.path") -> None:
    """ConfigError-like ModelLoadError if ``max_length`` exceeds the model's context, or the tokenizer's
    ids exceed its embedding."""
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None
    )
    if limit is not None and max_length > limit:
        raise ModelLoadError(
            f"data.max_length = {max_length} is longer than the context of {field} = {path} "
            f"({limit} positions)"
        )
    n_embed = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embed:
        raise ModelLoadError(
            f"{field} = {path}: the tokenizer has {len(tokenizer)} tokens but the model's "
            f"embedding has only {n_embed} rows"
        )


def accepts_logits_to_keep(model) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (compute the output layer for the last N
    positions only; every causal LM of recent ``transformers`` does)."""
    return "logits_to_keep" in inspect.signature(type(unwrap(model)).forward).parameters


def cache_argument(model) -> str:
    """The name of the KV-cache argument (and output field) of the model's forward: ``cache`` from
    ``transformers`` 5.24, ``past_key_values`` before."""
    params = inspect.signature(type(unwrap(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def freeze(model) -> None:
    """Eval mode, gradients off: the reference and the reward model are never updated (Ouyang et al. 2022)."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
