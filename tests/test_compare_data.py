"""``proximal compare``'s data section reads what every command reads: a data set name in the local
Hugging Face cache passes its checks, ``data.split`` and ``data.columns`` are checked as the
commands check them and reach every method's config, and a comparison trains on a split of a
``save_to_disk`` directory whose columns have other names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from datasets import Dataset, DatasetDict

from proximal.cli import main
from proximal.compare import CompareData

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "trainers"))
sys.path.insert(0, str(HERE / "data"))
from ppo_support import prompt_texts  # noqa: E402
from test_dpo import count_task, write_jsonl  # noqa: E402
from test_sources import cache_dataset  # noqa: E402

# question/good/bad instead of prompt/chosen/rejected: read only through data.columns.
COLUMNS = {"prompt": "question", "chosen": "good", "rejected": "bad", "answer": "reference"}
PAIR_COLUMNS = {k: v for k, v in COLUMNS.items() if k != "answer"}


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return tmp_path / "hf"


def _data(assets, tmp_path, **fields) -> CompareData:
    eval_prompts = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": p} for p in prompt_texts(2)])
    return CompareData(sft_model=str(assets.policy("llama")), eval_prompts=eval_prompts, **fields)


def test_a_data_set_name_in_the_local_cache_is_accepted(assets, tmp_path, hf_home):
    name = cache_dataset(tmp_path, Dataset.from_list(count_task(4, seed=1)), "someone/prefs")
    assert _data(assets, tmp_path, pairs=name, prompts=name).problems() == []
    [problem] = _data(assets, tmp_path, pairs="someone/missing").problems()
    assert problem == (
        f"data.pairs: 'someone/missing' does not exist (looked in {hf_home / 'datasets'})"
    )


def test_a_column_mapping_is_checked_as_in_every_command(assets, tmp_path):
    data = _data(assets, tmp_path, columns={"prompt": "q", "chosen": "q"})
    assert data.problems() == ["data.columns: column 'q' is mapped to more than one field"]


def _split_dict(path: Path, test_rows: list[dict]) -> str:
    """A save_to_disk DatasetDict whose 'test' split holds ``test_rows`` renamed to COLUMNS's names and
    whose 'train' split has none of the columns (so reading it, not 'test', fails)."""
    renamed = [{COLUMNS.get(k, k): v for k, v in row.items()} for row in test_rows]
    DatasetDict(
        {
            "train": Dataset.from_list([{"other": "x"}] * len(renamed)),
            "test": Dataset.from_list(renamed),
        }
    ).save_to_disk(str(path))
    return str(path)


def test_split_and_columns_reach_every_method(assets, tmp_path, capsys):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "dpo.yaml").write_text(
        yaml.safe_dump(
            {
                "data": {"max_length": 16},
                "train": {"batch_size": 4, "micro_batch_size": 4, "device": "cpu"},
            }
        )
    )
    (configs / "grpo.yaml").write_text(
        yaml.safe_dump(
            {
                "rollout": {"batch_size": 2, "group_size": 2, "max_new_tokens": 4},
                "grpo": {"micro_batch_size": 4},
                "train": {"device": "cpu"},
            }
        )
    )
    out = tmp_path / "out"
    config = {
        "compare": {
            "methods": ["dpo", "grpo"],
            "seeds": 1,
            "responses": 4,
            "pairs": 4,
            "evaluations": 1,
            "eval_samples_per_prompt": 1,
            "max_new_tokens": 4,
            "reward_timeout_s": 30,
            "configs": str(configs),
        },
        "data": {
            "sft_model": str(assets.policy("llama")),
            "prompts": _split_dict(
                tmp_path / "prompts", [{"prompt": p, "answer": p[-1]} for p in prompt_texts(4)]
            ),
            "pairs": _split_dict(tmp_path / "pairs", count_task(8, seed=5)),
            "eval_prompts": write_jsonl(  # read as they are: the canonical names
                tmp_path / "eval.jsonl", [{"prompt": p, "answer": p[-1]} for p in prompt_texts(2)]
            ),
            "verifier": "ppo_support:frac_a_checking_answer",
            "split": "test",
            "columns": COLUMNS,
        },
        "output": {"dir": str(out), "progress": False},
    }
    path = tmp_path / "compare.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["compare", "--config", str(path)]) == 0, capsys.readouterr().err
    runs = sorted((out / "runs").iterdir())
    assert [r.name for r in runs] == ["dpo-seed0", "grpo@verifier-seed0"]
    # the pairs' entries to DPO (its pairs have no 'reference', and a mapping of a column the data
    # lacks is refused); everything but the pairs' own entries to GRPO: its verifier reads each
    # row's 'answer', which the prompts file calls 'reference'
    want = {
        "dpo-seed0": PAIR_COLUMNS,
        "grpo@verifier-seed0": {"prompt": "question", "answer": "reference"},
    }
    for run in runs:
        data = yaml.safe_load((run / "config.yaml").read_text())["data"]
        assert data["split"] == "test" and data["columns"] == want[run.name]
        model = yaml.safe_load((run / "config.yaml").read_text())["model"]
        assert model.get("reward_timeout_s") == (30 if run.name.startswith("grpo") else None)
        assert (run / "eval.json").is_file()
    first = json.loads((out / "runs" / "dpo-seed0" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["data/train_rows"] == 8  # the test split's pairs, read through the mapping
