"""``proximal.data.sources.read_rows``: every format gives the same rows, and every command trains on
them alike.

The fixtures are the same rows written in each format (JSONL, JSON, Parquet, CSV, Arrow,
``save_to_disk`` and a data set name prepared in a temporary Hugging Face cache); the expected records
are those rows themselves, and the expected loss of each format is the JSONL run's.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from proximal.cli import main
from proximal.config import PythonObject
from proximal.data.jsonl import DataError
from proximal.data.preferences import load_preference_pairs
from proximal.data.prompts import load_prompts, load_texts
from proximal.data.sft import load_sft_examples
from proximal.data.sources import read_rows, same_rows
from proximal.logging import read_metrics

datasets = pytest.importorskip("datasets")

# digits only in answers: CSV must keep "12" a string, not read it as the integer 12
SFT_ROWS = [
    {"prompt": "ab ", "response": "12"},
    {"prompt": "ba ", "response": "21"},
    {"prompt": "cd ", "response": "340"},
    {"prompt": "dc ", "response": "43"},
]
PAIR_ROWS = [
    {"prompt": "ab ", "chosen": "12", "rejected": "9"},
    {"prompt": "ba ", "chosen": "21", "rejected": "88"},
    {"prompt": "cd ", "chosen": "340", "rejected": "0"},
    {"prompt": "dc ", "chosen": "43", "rejected": "777"},
]
FORMATS = ["jsonl", "json", "parquet", "csv", "arrow", "saved", "saved_dict", "cached"]


def write_all(root: Path, rows: list[dict], name: str) -> dict[str, str]:
    """The same rows in every format: format → the path (or data set name) to give."""
    root.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_list(rows)
    out = {
        "jsonl": root / "rows.jsonl",
        "json": root / "rows.json",
        "parquet": root / "rows.parquet",
        "csv": root / "rows.csv",
        "arrow": root / "rows.arrow",
        "saved": root / "saved",
        "saved_dict": root / "saved_dict",
    }
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["json"].write_text(json.dumps(rows, indent=2))  # a list over several lines
    ds.to_parquet(str(out["parquet"]))
    ds.to_csv(str(out["csv"]), index=False)
    ds.save_to_disk(str(out["saved"]))
    shutil.copy(out["saved"] / "data-00000-of-00001.arrow", out["arrow"])
    reversed_rows = datasets.Dataset.from_list(rows[::-1])
    datasets.DatasetDict(train=reversed_rows, test=ds).save_to_disk(str(out["saved_dict"]))
    paths = {k: str(v) for k, v in out.items()}
    paths["cached"] = cache_dataset(root, ds, name)
    return paths


def cache_dataset(root: Path, ds, name: str) -> str:
    """``owner/name`` prepared in ``$HF_HOME/datasets`` the way ``load_dataset`` leaves a hub data set
    after its first download (``owner___name/default/<version>/<hash>/``), built offline from a local
    Parquet file."""
    # lazy: a builder class of the optional datasets package, used only here
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, short = name.split("/")
    src = root / f"{short}.parquet"
    ds.to_parquet(str(src))
    build = root / "build"
    Parquet(
        data_files={"train": str(src)}, dataset_name=short, hash="0123abcd", cache_dir=str(build)
    ).download_and_prepare()
    (prepared,) = glob.glob(str(build / short / "*" / "*" / "0123abcd"))
    dest = (
        Path(datasets_cache_root()) / f"{owner}___{short}" / "default" / Path(prepared).parent.name
    )
    dest.mkdir(parents=True)
    shutil.move(prepared, dest / "0123abcd")
    return name


def datasets_cache_root() -> str:
    return os.path.join(os.environ["HF_HOME"], "datasets")


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)
    return tmp_path / "hf"


@pytest.fixture
def sft_files(tmp_path, hf_home):
    return write_all(tmp_path / "sft", SFT_ROWS, "someone/tiny-sft")


# ----------------------------------------------------------------------------------------------
# read_rows
# ----------------------------------------------------------------------------------------------


def test_every_format_yields_the_same_records_with_its_own_where(sft_files):
    expect_where = {
        "jsonl": [f"{sft_files['jsonl']}:{i}" for i in (1, 2, 3, 4)],
        "saved_dict": [f"{sft_files['saved_dict']}[train][row {i}]" for i in range(4)],
        "cached": [f"someone/tiny-sft[train][row {i}]" for i in range(4)],
    }
    for fmt, path in sft_files.items():
        got = list(read_rows(path))
        rows = SFT_ROWS[::-1] if fmt == "saved_dict" else SFT_ROWS  # its train split is reversed
        assert [r for _, r in got] == rows, fmt
        where = expect_where.get(fmt, [f"{path}[row {i}]" for i in range(4)])
        assert [w for w, _ in got] == where, fmt
    # the other split of the DatasetDict
    assert [r for _, r in read_rows(sft_files["saved_dict"], split="test")] == SFT_ROWS


def test_columns_map_names_and_can_swap_them(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text('{"question": "q1", "answer": "a1", "id": 7}\n')
    assert list(read_rows(p, columns={"prompt": "question", "response": "answer"})) == [
        (f"{p}:1", {"prompt": "q1", "response": "a1", "id": 7})
    ]
    p.write_text('{"prompt": "x", "response": "y"}\n')
    assert list(read_rows(p, columns={"prompt": "response", "response": "prompt"}))[0][1] == {
        "prompt": "y",
        "response": "x",
    }


def test_bad_sources_are_one_message_naming_the_file(tmp_path, sft_files, hf_home):
    def error(path, **kw) -> str:
        with pytest.raises(DataError) as e:
            list(read_rows(path, **kw))
        assert "\n" not in str(e.value)
        return str(e.value)

    assert error(sft_files["parquet"], columns={"prompt": "question"}) == (
        f"{sft_files['parquet']}[row 0]: data.columns names column 'question', which the data lacks "
        "(columns present: prompt, response)"
    )
    assert error(sft_files["saved_dict"], split="dev").startswith(
        f"{sft_files['saved_dict']}: no split 'dev' (splits: train, test)"
    )
    assert "no split 'test' in a single file" in error(sft_files["csv"], split="test")
    txt = tmp_path / "rows.txt"
    txt.write_text("hello\n")
    assert error(txt).startswith(f"{txt}: unknown data format '.txt'; expected JSONL (.jsonl)")
    assert error(tmp_path / "gone.parquet") == f"{tmp_path / 'gone.parquet'}: file not found"
    looked = hf_home / "datasets" / "nobody___nothing"
    assert (
        f"nobody/nothing: file not found, and not a data set in the local Hugging Face cache (looked in {looked};"
        in error("nobody/nothing")
    )
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "a"}, 3]')
    assert error(bad) == f"{bad}[row 1]: expected a JSON object, got int"


def test_jsonl_and_json_need_no_datasets_and_the_others_say_how_to_install_it(
    sft_files, monkeypatch
):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets → ImportError
    assert [r for _, r in read_rows(sft_files["jsonl"])] == SFT_ROWS
    assert [r for _, r in read_rows(sft_files["json"])] == SFT_ROWS
    for fmt in ("parquet", "saved"):
        with pytest.raises(DataError, match=r"pip install 'proximal-rlhf\[datasets\]'"):
            list(read_rows(sft_files[fmt]))


# ----------------------------------------------------------------------------------------------
# The loaders
# ----------------------------------------------------------------------------------------------


def test_every_loader_gives_the_same_tokens_from_every_format(assets, tmp_path, hf_home):
    tok = assets.tokenizer
    sft = write_all(tmp_path / "sft", SFT_ROWS, "someone/tiny-sft")
    pairs = write_all(tmp_path / "pairs", PAIR_ROWS, "someone/tiny-pairs")
    prompts = write_all(tmp_path / "prompts", [{"prompt": r["prompt"]} for r in SFT_ROWS], "o/p")
    texts = write_all(tmp_path / "texts", [{"text": r["response"]} for r in SFT_ROWS], "o/t")

    def sft_ids(path, **kw):
        return [e.input_ids for e in load_sft_examples(path, tok, max_length=16, **kw)[0]]

    def pair_ids(path, **kw):
        got = load_preference_pairs(path, tok, max_length=16, **kw)[0]
        return [(p.chosen_ids, p.rejected_ids) for p in got]

    split = {"saved_dict": "test"}  # its test split holds the rows in order
    for fmt in FORMATS:
        kw = {"split": split[fmt]} if fmt in split else {}
        assert sft_ids(sft[fmt], **kw) == sft_ids(sft["jsonl"]), fmt
        assert pair_ids(pairs[fmt], **kw) == pair_ids(pairs["jsonl"]), fmt
        assert (
            load_prompts(prompts[fmt], tok, max_length=8, **kw).token_ids
            == load_prompts(prompts["jsonl"], tok, max_length=8).token_ids
        ), fmt
        assert load_texts(texts[fmt], **kw) == [r["response"] for r in SFT_ROWS], fmt
    # the expected ids by hand for one row: BOS? no — prompt chars then response chars then EOS
    first = sft_ids(sft["jsonl"])[0]
    assert first[-1] == tok.eos_token_id
    assert tok.decode(first[:-1]) == "ab 12"


# ----------------------------------------------------------------------------------------------
# Through the command line
# ----------------------------------------------------------------------------------------------


def _argv(command, assets, train_file, out, *extra):
    return [
        command,
        "--model.path",
        str(assets.policy("llama")),
        "--data.train_file",
        str(train_file),
        "--data.max_length",
        "16",
        "--train.batch_size",
        "4",
        "--train.micro_batch_size",
        "2",
        "--train.steps",
        "1",
        "--train.device",
        "cpu",
        "--optim.lr",
        "1e-3",
        "--output.dir",
        str(out),
        "--output.progress",
        "false",
        *extra,
    ]


def _first_loss(out: Path) -> float:
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 1]
    return row["train/loss"]


@pytest.mark.parametrize("command", ["sft", "rm", "dpo"])
def test_every_format_trains_to_the_same_first_step_loss(
    command, assets, tmp_path, hf_home, capsys
):
    rows = SFT_ROWS if command == "sft" else PAIR_ROWS
    files = write_all(tmp_path / "data", rows, f"someone/tiny-{command}")
    loss = {}
    for fmt in FORMATS:
        extra = ["--data.split", "test"] if fmt == "saved_dict" else []
        code = main(_argv(command, assets, files[fmt], tmp_path / fmt, *extra))
        assert code == 0, (fmt, capsys.readouterr().err)
        loss[fmt] = _first_loss(tmp_path / fmt)
    # the same rows in the same order, the same seed: the same batch, to the bit
    assert loss == {fmt: loss["jsonl"] for fmt in FORMATS}


def test_a_column_mapping_on_the_command_line_reads_other_column_names(assets, tmp_path, capsys):
    renamed = [{"question": r["prompt"], "answer": r["response"]} for r in SFT_ROWS]
    qa = tmp_path / "qa.csv"
    datasets.Dataset.from_list(renamed).to_csv(str(qa), index=False)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    mapping = "{prompt: question, response: answer}"
    assert main(_argv("sft", assets, qa, tmp_path / "qa", "--data.columns", mapping)) == 0
    assert main(_argv("sft", assets, plain, tmp_path / "plain")) == 0
    assert _first_loss(tmp_path / "qa") == _first_loss(tmp_path / "plain")


def test_bad_input_is_one_line_and_exit_status_2(assets, tmp_path, hf_home, capsys):
    files = write_all(tmp_path / "data", SFT_ROWS, "someone/tiny")
    txt = tmp_path / "rows.txt"
    txt.write_text("ab 12\n")
    cases = [
        (txt, [], f"{txt}: unknown data format '.txt'"),
        (
            files["parquet"],
            ["--data.columns", "{prompt: question}"],
            "data.columns names column 'question', which the data lacks (columns present: prompt, "
            "response)",
        ),
        (files["saved_dict"], ["--data.split", "dev"], "no split 'dev' (splits: train, test)"),
    ]
    for i, (path, extra, message) in enumerate(cases):
        capsys.readouterr()
        assert main(_argv("sft", assets, path, tmp_path / f"bad{i}", *extra)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and message in err[0], err


# ----------------------------------------------------------------------------------------------
# Data with no rows
# ----------------------------------------------------------------------------------------------


def test_an_empty_saved_data_set_or_parquet_file_has_no_records(tmp_path):
    """datasets' load_from_disk fails on an empty Dataset with an IndexError, pyarrow reads an empty
    Parquet file as damaged (ArrowInvalid): both are "no records", one DataError."""
    empty = datasets.Dataset.from_dict({"prompt": [], "response": []})
    empty.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict(train=empty).save_to_disk(str(tmp_path / "saved_dict"))
    empty.to_parquet(str(tmp_path / "rows.parquet"))
    (tmp_path / "zero.parquet").write_bytes(b"")
    cases = {
        tmp_path / "saved": f"{tmp_path / 'saved'}: no records (an empty data set)",
        tmp_path
        / "saved_dict": f"{tmp_path / 'saved_dict'}[train]: no records (an empty data set)",
        tmp_path
        / "rows.parquet": f"{tmp_path / 'rows.parquet'}: the file has no records (it is empty)",
        tmp_path
        / "zero.parquet": f"{tmp_path / 'zero.parquet'}: the file has no records (it is empty)",
    }
    for path, message in cases.items():
        with pytest.raises(DataError) as e:
            list(read_rows(path))
        assert str(e.value) == message


def test_a_split_of_a_saved_data_set_dict_reads_even_when_another_split_is_empty(tmp_path):
    rows = datasets.Dataset.from_list(SFT_ROWS)
    empty = datasets.Dataset.from_dict({"prompt": [], "response": []})
    datasets.DatasetDict(train=rows, test=empty).save_to_disk(str(tmp_path / "d"))
    got = [r for _, r in read_rows(tmp_path / "d")]
    assert got == SFT_ROWS
    with pytest.raises(DataError, match=r"d\[test\]: no records"):
        list(read_rows(tmp_path / "d", split="test"))


def test_no_records_from_python_names_the_field_not_a_file(assets):
    tok = AutoTokenizer.from_pretrained(assets.policy("llama"))
    rows = PythonObject([], "data.train_file", "data")
    with pytest.raises(DataError) as e:
        load_sft_examples(rows, tok, max_length=16)
    assert str(e.value) == "data.train_file: no records (list of 0 rows given from Python)"
    with pytest.raises(DataError) as e:
        load_preference_pairs(PythonObject([], "data.eval_file", "data"), tok, max_length=16)
    assert str(e.value) == "data.eval_file: no records (list of 0 rows given from Python)"


def test_an_empty_saved_data_set_is_one_line_and_exit_status_2(assets, tmp_path, capsys):
    datasets.Dataset.from_dict({"prompt": [], "response": []}).save_to_disk(str(tmp_path / "e"))
    capsys.readouterr()  # datasets' own progress line
    assert main(_argv("sft", assets, tmp_path / "e", tmp_path / "run")) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"proximal sft: {tmp_path / 'e'}: no records (an empty data set)"]


# ----------------------------------------------------------------------------------------------
# The held-out split: data.eval_split
# ----------------------------------------------------------------------------------------------

HELD_OUT_ROWS = [{"prompt": "xy ", "response": "7"}, {"prompt": "yx ", "response": "80"}]


def test_same_rows_knows_a_split_however_it_is_given(tmp_path):
    d = tmp_path / "d"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(SFT_ROWS), test=datasets.Dataset.from_list(HELD_OUT_ROWS)
    ).save_to_disk(str(d))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    rows = [dict(r) for r in SFT_ROWS]
    assert same_rows(d, None, d, None) and same_rows(d, None, d, "train")
    assert same_rows(d, "test", d / "test", None)  # a split's subdirectory is that split
    assert same_rows(str(d), "test", f"{tmp_path}/./d/test", "train")
    assert not same_rows(d, None, d, "test") and not same_rows(d, None, d / "test", None)
    assert same_rows(tmp_path / "rows.jsonl", None, tmp_path / "rows.jsonl", None)
    same, other = (
        PythonObject(rows, "data.train_file", "data"),
        PythonObject(list(rows), "x", "data"),
    )
    assert same_rows(same, None, PythonObject(rows, "data.eval_file", "data"), None)
    assert not same_rows(same, None, other, None)  # equal rows, another object: not known equal


def _eval_loss(out: Path) -> float:
    (row,) = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 0]
    return row["eval/loss"]


def test_eval_split_reads_the_held_out_split_and_the_same_rows_are_said(assets, tmp_path, capsys):
    d = tmp_path / "d"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(SFT_ROWS), test=datasets.Dataset.from_list(HELD_OUT_ROWS)
    ).save_to_disk(str(d))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in HELD_OUT_ROWS))
    note = "data.eval_file reads the very rows data.train_file reads"

    def run(name, *extra):
        capsys.readouterr()
        assert main(_argv("sft", assets, d, tmp_path / name, *extra)) == 0
        return _eval_loss(tmp_path / name), capsys.readouterr().out

    by_split, out = run("split", "--data.eval_file", str(d), "--data.eval_split", "test")
    assert note not in out
    by_file, _ = run("file", "--data.eval_file", str(held_out))
    by_subdirectory, out = run("subdirectory", "--data.eval_file", str(d / "test"))
    assert note not in out
    assert by_split == by_file == by_subdirectory  # the same two rows, the same weights at step 0
    on_train, out = run("same", "--data.eval_file", str(d))
    assert on_train != by_file
    assert (
        f"proximal sft: {note} ({d}, split 'train'): the held-out metrics measure training rows; "
        "set data.eval_split (its splits: train, test) or another data.eval_file"
    ) in out.splitlines()
