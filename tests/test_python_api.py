"""The Python API (docs/python.md): the names ``proximal`` lends lazily, configs holding models and
rows given from Python, the loaders that copy them, and the training functions end to end.

The strongest check is :func:`test_a_model_given_from_python_trains_as_its_checkpoint_does`: the
same model given as an object and as the directory it was saved to gives bitwise the same fine-tuned
weights, so the object path is the checkpoint path and nothing else.
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
)

import proximal
from proximal.cli import main
from proximal.config import (
    ConfigError,
    PythonObject,
    check_valid,
    load_config,
    python_objects,
    save_config,
    to_dict,
)
from proximal.data.jsonl import DataError
from proximal.data.prompts import load_texts
from proximal.data.sources import read_rows
from proximal.logging import read_metrics
from proximal.models.loading import (
    ModelLoadError,
    load_causal_lm,
    load_sequence_scorer,
    load_tokenizer,
)
from proximal.models.tiny import build_char_tokenizer, tiny_config

ROOT = Path(__file__).resolve().parents[1]
LETTERS = "abcdefgh"
ROWS = [{"prompt": f"{x}=", "completion": x * 3} for x in "abcdefghabcdefgh"]


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Llama built in memory (no checkpoint behind it) and its tokenizer."""
    tok = build_char_tokenizer(LETTERS + "=")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tok)))
    return model, tok


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def model_field(value) -> PythonObject:
    return PythonObject(value, "model.path", "model")


def sft_config(path, rows, out: Path, steps: int = 2):
    cfg = proximal.SFTConfig()
    cfg.model.path = path
    cfg.data.train_file = rows
    cfg.data.max_length = 16
    cfg.train.steps = steps
    cfg.train.batch_size = cfg.train.micro_batch_size = 4
    cfg.train.device = "cpu"
    cfg.optim.lr = 1e-2
    cfg.output.dir = out  # a pathlib.Path: written to config.yaml as its string
    cfg.output.progress = False
    return cfg


# --------------------------------------------------------------------------------------------------
# The names, lent lazily
# --------------------------------------------------------------------------------------------------


def test_import_proximal_loads_no_torch_until_a_name_is_used():
    code = (
        "import sys, proximal\n"
        "heavy = lambda: sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert heavy() == [], heavy()\n"
        "import proximal.config\n"
        "assert heavy() == [], heavy()\n"
        "proximal.load_config, proximal.ConfigError  # lent one by one: these need no torch\n"
        "assert heavy() == [], heavy()\n"
        "assert 'train_sft' not in vars(proximal) and 'proximal.api' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_name_is_lent_and_is_what_it_says():
    from proximal import api
    from proximal.trainers import dpo_config, grpo_config, ppo_config, reward_config, sft_config

    assert set(proximal.__all__) == {"__version__", *proximal._LAZY}
    assert set(proximal.__all__) <= set(dir(proximal))
    for name in proximal.__all__:
        assert getattr(proximal, name) is not None, name
    assert (
        proximal.SFTConfig is sft_config.SFTConfig and proximal.RMConfig is reward_config.RMConfig
    )
    assert proximal.PPOConfig is ppo_config.PPOConfig
    assert proximal.GRPOConfig is grpo_config.GRPOConfig
    assert (proximal.DPOConfig, proximal.SimPOConfig) == (
        dpo_config.DPOConfig,
        dpo_config.SimPOConfig,
    )
    assert [proximal.train_sft, proximal.train_dpo, proximal.train_simpo] == [
        api.train_sft,
        api.train_dpo,
        api.train_simpo,
    ]
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        proximal.nothing_here  # noqa: B018


def test_a_training_function_takes_its_own_config_class_or_a_yaml_file(tmp_path):
    with pytest.raises(TypeError, match="train_sft: expected a SFTConfig .*, got PPOConfig"):
        proximal.train_sft(proximal.PPOConfig())
    with pytest.raises(TypeError, match="train_dpo: expected a DPOConfig .*, got SimPOConfig"):
        proximal.train_dpo(proximal.SimPOConfig())
    (tmp_path / "sft.yaml").write_text("train: {steps: 0}\n")
    with pytest.raises(ConfigError) as e:  # read as `proximal sft --config sft.yaml` reads it
        proximal.train_sft(tmp_path / "sft.yaml")
    assert "model.path is required" in str(e.value) and "train.steps = 0" in str(e.value)


# --------------------------------------------------------------------------------------------------
# Configs holding objects
# --------------------------------------------------------------------------------------------------


def test_a_config_wraps_models_and_rows_given_from_python(tiny, tmp_path):
    model, tok = tiny
    cfg = sft_config((model, tok), ROWS, tmp_path / "run")
    assert python_objects(cfg) == []
    assert isinstance(cfg.model.path, PythonObject) and cfg.model.path.value[0] is model
    assert str(cfg.model.path) == "<python object: LlamaForCausalLM with its tokenizer>"
    assert str(cfg.data.train_file) == "<python object: list of 16 rows>"
    assert cfg.output.dir == str(tmp_path / "run")
    assert python_objects(cfg) == [] and cfg.model.path.value[0] is model  # wrapped once
    check_valid(cfg)


def test_an_object_a_field_cannot_take_is_one_config_error(tiny):
    cfg = proximal.SFTConfig()
    cfg.model.path = (tiny[0], "not a tokenizer")
    cfg.data.train_file = {"prompt": "a="}
    cfg.data.eval_file = 3.5
    with pytest.raises(ConfigError) as e:
        check_valid(cfg)
    rows = "rows: a list of dicts, a datasets.Dataset or DatasetDict, or a pandas DataFrame"
    assert str(e.value).splitlines()[1:] == [
        "  - model.path: expected a path or, from Python, a loaded model (a transformers "
        "PreTrainedModel) or a (model, tokenizer) pair; got (LlamaForCausalLM, str)",
        f"  - data.train_file: expected a path or, from Python, {rows}; got dict",
        f"  - data.eval_file: expected a path or, from Python, {rows}; got float",
    ]
    with pytest.raises(ConfigError, match=r"model.lora_alpha: <python object: LlamaForCausalLM> "):
        load_config(proximal.SFTConfig, overrides={"model.lora_alpha": tiny[0]})


def test_load_config_takes_objects_in_its_overrides(tiny):
    model, tok = tiny
    cfg = load_config(
        proximal.SFTConfig,
        overrides={"model.path": (model, tok), "data.train_file": ROWS, "train.steps": "3"},
    )
    assert cfg.model.path.value == (model, tok) and cfg.data.train_file.value is ROWS
    assert cfg.train.steps == 3


def correct(prompts, completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def test_config_yaml_holds_placeholders_and_a_config_file_with_one_is_refused(tiny, tmp_path):
    model, tok = tiny
    cfg = sft_config((model, tok), ROWS, tmp_path / "run")
    check_valid(cfg)
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["model"]["path"] == "<python object: LlamaForCausalLM with its tokenizer>"
    assert saved["data"]["train_file"] == "<python object: list of 16 rows>"
    assert saved["output"]["dir"] == str(tmp_path / "run") and saved["train"]["steps"] == 2
    with pytest.raises(ConfigError) as e:
        load_config(proximal.SFTConfig, tmp_path / "config.yaml")
    assert str(e.value).splitlines()[1:] == [
        f"  - {field} = '<python object: {what}>': the run was given a Python object here, which "
        "a config file cannot hold; continue it from Python with the same objects "
        "(docs/python.md), or save the object (save_pretrained, a data file) and give its path"
        for field, what in (
            ("model.path", "LlamaForCausalLM with its tokenizer"),
            ("data.train_file", "list of 16 rows"),
        )
    ]
    grpo = proximal.GRPOConfig()
    grpo.model.reward_functions = ["my_rewards:length", correct]
    grpo.data.prompts = grpo.eval.prompts = ROWS
    assert python_objects(grpo) == [] and grpo.eval.prompts.value is ROWS
    saved = to_dict(grpo)
    assert saved["model"]["reward_functions"] == [
        "my_rewards:length",
        f"<python object: function {__name__}.correct>",
    ]
    assert (
        saved["data"]["prompts"] == saved["eval"]["prompts"] == "<python object: list of 16 rows>"
    )


# --------------------------------------------------------------------------------------------------
# The loaders: copies of what was given
# --------------------------------------------------------------------------------------------------


def test_a_given_model_is_copied_never_trained_or_changed(tiny):
    model, tok = tiny
    model.requires_grad_(False)  # the caller's model frozen: the copy trains as from_pretrained's
    try:
        before = state(model)
        copy = load_causal_lm(model_field((model, tok)), role="policy (model.path)")
        assert copy is not model and same_state(state(copy), before)
        assert all(p.requires_grad for p in copy.parameters())
        with torch.no_grad():
            next(copy.parameters()).add_(1.0)
        assert same_state(state(model), before)
        assert not any(p.requires_grad for p in model.parameters())
        half = load_causal_lm(model_field(model), dtype="bfloat16")
        assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    finally:
        model.requires_grad_(True)
    side = tok.padding_side
    other = "left" if side == "right" else "right"
    tok_copy = load_tokenizer(model_field((model, tok)), padding_side=other)
    assert tok_copy is not tok and tok_copy.padding_side == other
    assert tok_copy.get_vocab() == tok.get_vocab() and tok.padding_side == side


def test_a_model_alone_takes_the_tokenizer_it_was_loaded_with(tiny, assets):
    loaded = AutoModelForCausalLM.from_pretrained(assets.policy())
    tok = load_tokenizer(model_field(loaded))
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(assets.policy()).get_vocab()
    with pytest.raises(ModelLoadError) as e:
        load_tokenizer(model_field(tiny[0]), role="policy tokenizer (model.path)")
    assert str(e.value) == (
        "policy tokenizer (model.path): <python object: LlamaForCausalLM> comes without a "
        "tokenizer, and it was not loaded from a checkpoint that holds one; give (model, tokenizer)"
    )


def test_scorers_from_given_models(tiny):
    model, tok = tiny
    given = model_field((model, tok))
    critic = load_sequence_scorer(given, role="critic (from model.path)", new_head=True)
    assert type(critic).__name__ == "LlamaForSequenceClassification"
    assert not critic.score.weight.any()
    assert torch.equal(critic.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert critic.model.embed_tokens.weight is not model.model.embed_tokens.weight
    with pytest.raises(ModelLoadError, match="reward model .*: <python object: LlamaForCausalLM "):
        load_sequence_scorer(given, role="reward model (model.reward_model)")

    classifier = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", len(tok), num_labels=1)
    )
    rm = load_sequence_scorer(model_field(classifier))
    assert rm is not classifier and same_state(state(rm), state(classifier))
    with pytest.raises(ModelLoadError, match="is a LlamaForSequenceClassification"):
        load_causal_lm(model_field(classifier), role="policy (model.path)")


def test_a_model_with_lora_adapters_is_refused(tiny):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(
        copy.deepcopy(tiny[0]), LoraConfig(r=2, target_modules="all-linear")
    )
    with pytest.raises(ModelLoadError, match=r"has LoRA adapters \(peft\); give model.merge_and_"):
        load_causal_lm(model_field(peft_model))


def test_rows_given_from_python_are_read_as_a_files_rows():
    datasets = pytest.importorskip("datasets")

    def rows(value, split=None, columns=None):
        return list(
            read_rows(PythonObject(value, "data.prompts", "data"), split=split, columns=columns)
        )

    given = [{"question": "a=", "answer": "aaa"}, {"question": "b=", "answer": "bbb"}]
    want = [
        ("data.prompts[row 0]", {"prompt": "a=", "answer": "aaa"}),
        ("data.prompts[row 1]", {"prompt": "b=", "answer": "bbb"}),
    ]
    assert rows(given, columns={"prompt": "question"}) == want
    assert given[0] == {"question": "a=", "answer": "aaa"}  # the caller's rows as they were
    ds = datasets.Dataset.from_list(given)
    assert rows(ds, columns={"prompt": "question"}) == want
    both = datasets.DatasetDict({"train": ds, "test": ds.select([1])})
    assert rows(both, split="test", columns={"prompt": "question"}) == [
        ("data.prompts[test][row 0]", {"prompt": "b=", "answer": "bbb"})
    ]
    assert rows(ds.to_pandas(), columns={"prompt": "question"}) == want
    with pytest.raises(DataError, match=r"^data.prompts: no split 'dev' \(splits: train, test\)"):
        rows(both, split="dev")
    with pytest.raises(DataError, match=r"^data.prompts: no split 'test' \(rows given from Py"):
        rows(given, split="test")
    with pytest.raises(DataError, match=r"^data.prompts\[row 1\]: expected a dict .* got str 'b='"):
        rows([{"prompt": "a="}, "b="])
    ptx = PythonObject([{"text": "abc"}, {"text": "de"}], "data.ptx_file", "data")
    assert load_texts(ptx) == ["abc", "de"]


# --------------------------------------------------------------------------------------------------
# The training functions end to end
# --------------------------------------------------------------------------------------------------


def test_a_model_given_from_python_trains_as_its_checkpoint_does(tiny, tmp_path, capsys):
    model, tok = tiny
    before = state(model)
    model.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")

    from_object = proximal.train_sft(sft_config((model, tok), ROWS, tmp_path / "object"))
    from_disk = proximal.train_sft(sft_config(str(tmp_path / "base"), ROWS, tmp_path / "disk"))

    assert from_object == tmp_path / "object"
    trained = load_file(from_object / "model.safetensors")
    assert same_state(trained, load_file(from_disk / "model.safetensors"))
    assert trained.keys() <= before.keys()
    assert any(not torch.equal(trained[k], before[k]) for k in trained)  # it did train
    assert same_state(state(model), before)  # the caller's model was never trained
    reloaded = AutoModelForCausalLM.from_pretrained(from_object)
    assert reloaded.generate(torch.tensor([[tok.bos_token_id]]), max_new_tokens=2).shape[1] == 3

    # The run resumes from Python with the same objects; from the command line it is refused.
    capsys.readouterr()
    assert main(["sft", "--resume", str(from_object)]) == 2
    err = capsys.readouterr().err
    assert (
        "model.path = '<python object: LlamaForCausalLM with its tokenizer>': the run was " in err
    )
    assert "data.train_file = '<python object: list of 16 rows>'" in err
    cfg = sft_config((model, tok), ROWS, tmp_path / "object", steps=3)
    proximal.train_sft(cfg, resume_dir=from_object)
    steps = [r["step"] for r in read_metrics(from_object / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3]


def test_a_run_that_fails_puts_the_signal_handlers_back(tiny, tmp_path):
    before = signal.getsignal(signal.SIGINT)
    bad = [*ROWS[:3], {"prompt": "a="}]
    with pytest.raises(DataError, match=r"^data.train_file\[row 3\]: "):
        proximal.train_sft(sft_config(tiny, bad, tmp_path / "run"))
    assert signal.getsignal(signal.SIGINT) is before


def test_ppo_from_a_policy_and_a_reward_model_given_from_python(tiny, tmp_path):
    """The online path: the policy, the reference and the critic copied from objects (the critic from
    the reward model object, as model.critic: reward_model does), prompts as a datasets.Dataset."""
    datasets = pytest.importorskip("datasets")
    model, tok = tiny
    torch.manual_seed(1)
    rm = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", len(tok), num_labels=1)
    )
    rm_before = state(rm)
    cfg = proximal.PPOConfig()
    cfg.model.path = (model, tok)
    cfg.model.reward_model = (rm, tok)
    cfg.data.prompts = datasets.Dataset.from_list([{"prompt": f"{x}="} for x in LETTERS])
    cfg.data.max_prompt_length = 8
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 4, 4
    cfg.ppo.epochs, cfg.ppo.mini_batch_size, cfg.ppo.micro_batch_size = 1, 4, 4
    cfg.train.steps, cfg.train.device = 1, "cpu"
    cfg.output.dir, cfg.output.progress = str(tmp_path / "ppo"), False
    run_dir = proximal.train_ppo(cfg)

    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert saved["path"] == "<python object: LlamaForCausalLM with its tokenizer>"
    assert saved["reward_model"] == "<python object: LlamaForSequenceClassification with its " + (
        "tokenizer>"
    )
    assert saved["critic"] == "reward_model"
    assert same_state(state(rm), rm_before)  # neither frozen in place nor trained as the critic
    assert all(p.requires_grad for p in rm.parameters())
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "score/mean" in r] == [1]
    critic = AutoModelForSequenceClassification.from_pretrained(run_dir / "critic")
    trained = state(critic)
    assert trained.keys() == rm_before.keys()
    assert any(not torch.equal(trained[k], rm_before[k]) for k in trained)  # trained from r_psi
