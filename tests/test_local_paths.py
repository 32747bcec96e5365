"""A local path that does not exist is named at once, with the closest existing one, and never taken
for a hub id (issue 37 item 5): ``model.path: runs/stf`` where ``runs/sft`` exists cost 52 s of hub
retries offline. Every test here fails if anything asks the hub (a recorder in place of transformers'
``from_pretrained`` and huggingface_hub's download), not on time.
"""

from __future__ import annotations

import json

import huggingface_hub
import pytest
import transformers
import yaml

from proximal.cli import main
from proximal.config import close_path, could_be_local, missing_path
from proximal.models import loading
from proximal.models.loading import ModelLoadError, load_causal_lm, load_tokenizer


@pytest.fixture
def hub_calls(monkeypatch):
    """Every request to the hub that would have been made, recorded instead of made."""
    calls = []

    def recorder(name):
        def record(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} was called")

        return record

    for cls in (
        transformers.AutoConfig,
        transformers.AutoTokenizer,
        transformers.AutoModelForCausalLM,
        transformers.AutoModelForSequenceClassification,
    ):
        monkeypatch.setattr(cls, "from_pretrained", recorder(f"{cls.__name__}.from_pretrained"))
    for name in ("hf_hub_download", "file_exists", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, recorder(name))
    monkeypatch.setattr(transformers.utils.hub, "cached_files", recorder("cached_files"))
    return calls


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """A working directory with runs/sft (a checkpoint directory) and data/train.jsonl."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft").mkdir(parents=True)
    (tmp_path / "runs" / "sft" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps({"text": "ab"}) + "\n")
    return tmp_path


def test_which_strings_could_be_local_paths(runs):
    assert could_be_local("runs/stf")  # runs/ is a directory here: not the hub user 'runs'
    assert could_be_local("./stf") and could_be_local("/abs/stf") and could_be_local("~/stf")
    assert could_be_local("a/b/c")  # a hub id has one '/'
    assert not could_be_local("Qwen/Qwen2-0.5B")  # no directory Qwen here: a hub id
    assert not could_be_local("gpt2")


def test_the_message_names_the_closest_existing_path(runs):
    assert missing_path("runs/stf") == "no directory runs/stf (did you mean runs/sft?)"
    assert missing_path("./runs/stf") == "no directory ./runs/stf (did you mean runs/sft?)"
    # the first missing component is replaced, the rest kept
    assert close_path("runs/stf/checkpoints") == "runs/sft/checkpoints"
    assert missing_path("runs/zzzzzz") == "no directory runs/zzzzzz"  # nothing close
    # a checkpoint is a directory: a file is not offered for it, but is for data
    assert missing_path("data/trian.jsonl") == "no directory data/trian.jsonl"
    assert missing_path("data/trian.jsonl", "file or directory") == (
        "no file or directory data/trian.jsonl (did you mean data/train.jsonl?)"
    )


@pytest.mark.parametrize("load", [load_causal_lm, load_tokenizer])
def test_a_loader_names_a_missing_local_path_without_asking_the_hub(runs, hub_calls, load):
    with pytest.raises(ModelLoadError) as e:
        load("runs/stf", role="model.path")
    assert str(e.value) == "model.path: no directory runs/stf (did you mean runs/sft?)"
    assert hub_calls == []


def test_offline_a_hub_id_missing_from_the_cache_is_named_without_asking_the_hub(
    runs, hub_calls, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(runs / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with pytest.raises(ModelLoadError) as e:
        load_causal_lm("someone/model", role="model.path")
    assert str(e.value) == (
        "model.path: no directory someone/model, and the hub is switched off (HF_HUB_OFFLINE) "
        f"with no someone/model in its cache ({runs / 'hf' / 'hub'})"
    )
    assert hub_calls == []
    # one in the cache is left to from_pretrained, which reads the cache
    (runs / "hf" / "hub" / "models--someone--model").mkdir(parents=True)
    loading.check_path("someone/model", "model.path")


def _sft_config(path, **fields):
    cfg = {
        "model": {"path": "runs/sft"},
        "data": {"train_file": "data/train.jsonl"},
        "train": {"device": "cpu", "steps": 1},
        "output": {"dir": "runs/out"},
    }
    for dotted, value in fields.items():
        section, key = dotted.split(".")
        cfg[section][key] = value
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_the_command_names_every_missing_path_at_once_exit_2(runs, hub_calls, capsys):
    config = _sft_config(
        runs / "sft.yaml", **{"model.path": "runs/stf", "data.eval_file": "data/trian.jsonl"}
    )
    assert main(["sft", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "proximal sft: invalid configuration:",
        "  - model.path: no directory runs/stf (did you mean runs/sft?)",
        "  - data.eval_file: no file or directory data/trian.jsonl (did you mean "
        "data/train.jsonl?)",
    ]
    assert hub_calls == [] and not (runs / "runs" / "out").exists()


def test_resume_from_a_directory_that_does_not_exist_says_so(runs, capsys):
    (runs / "runs" / "does_exist").mkdir()
    assert main(["sft", "--resume", "runs/does_not_exist"]) == 2
    assert capsys.readouterr().err.strip() == (
        "proximal sft: --resume runs/does_not_exist: no directory runs/does_not_exist (did you "
        "mean runs/does_exist?)"
    )


def test_a_config_checked_before_the_stage_that_writes_its_input_leaves_paths_for_later(runs):
    """The demo checks every stage's config before the first trains, when out/sft does not exist
    yet: ``paths=False`` leaves the paths out of that check, and the trainer's check_valid names the
    missing one when the stage runs."""
    from proximal.config import ConfigError, check_valid, load_config
    from proximal.trainers.grpo_config import GRPOConfig

    values = {
        "model.path": "runs/stf",
        "model.reward_functions": ["tests:reward"],
        "data.prompts": "data/train.jsonl",
    }
    cfg = load_config(GRPOConfig, None, values, paths=False)
    assert cfg.model.path == "runs/stf"
    with pytest.raises(ConfigError, match=r"model\.path: no directory runs/stf \(did you mean"):
        check_valid(cfg)
    with pytest.raises(ConfigError, match=r"model\.path: no directory runs/stf"):
        load_config(GRPOConfig, None, values)
