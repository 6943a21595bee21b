"""Your data, your reward, your model, without Ray: dataset files in every format give
the same prompts, answers, data sources and extra info; the data order is a pure function of
(seed, step); a verl-style ``compute_score`` file is called with the right arguments; bad files,
columns, reward files and model directories are refused before Ray starts with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from asyncrl.pipelines.commands.cli import main
from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import load_config
from asyncrl.pipelines.datasets.data import make_loader, task_pairs
from asyncrl.roles import RewardConfig, RewardFnError
from asyncrl.roles.modeling.models import load_tokenizer, tiny_tokenizer
from asyncrl.roles.scoring.reward import RewardWorker, load_reward_fn
from tests.pipelines.datafiles_util import TEMPLATE, write, write_jsonl, write_model_dir, write_reward_file

FORMATS = ["jsonl", "parquet", "hf_disk"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat")


def _cfg(*overrides: str):
    return load_config(None, ["trainer.batch_size=8", "algorithm.group_size=4", *overrides])


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_same_prompts_answers_and_row_info(fmt, tmp_path, model_dir):
    path = write(fmt, tmp_path)
    cfg = _cfg(f"data.train_files={path}", f"model.path={model_dir}")
    pairs = task_pairs(cfg.data, cfg.trainer.seed)
    assert [tuple(p) for p in pairs] == [(f"what is {i} + {i}?", str(2 * i)) for i in range(6)]
    assert [p.data_source for p in pairs] == ["toy/add", "toy/mul"] * 3
    assert [p.extra_info for p in pairs] == [{"index": i, "split": "train"} for i in range(6)]
    tok = load_tokenizer(str(model_dir))
    loader = make_loader(cfg.data, tok, pairs, prompts_per_step=2, group_size=4, seed=0)
    assert loader.indices(0) == [4, 2]
    b = loader.batch(0)
    assert list(b["prompt"]) == ["what is 4 + 4?"] * 4 + ["what is 2 + 2?"] * 4
    assert list(b["answer"]) == ["8"] * 4 + ["4"] * 4
    assert list(b["data_source"]) == ["toy/add"] * 8
    assert [json.loads(e) for e in b["extra_info"]] == [{"index": 4, "split": "train"}] * 4 + \
        [{"index": 2, "split": "train"}] * 4
    # the prompt the model sees is the chat messages rendered with the model directory's template
    rendered = tok.decode(b["prompt_ids"][0][b["prompt_mask"][0].bool()])
    assert rendered == "<system>be brief\n<user>what is 4 + 4?\n<assistant>"


def test_renamed_columns_plain_string_prompts_and_a_list_of_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"question": "say cat", "label": {"text": "cat"}}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"question": "say dog", "label": {"text": "dog"}, "data_source": "pets"}])
    cfg = _cfg(f"data.train_files=[{a}, {b}]", "data.prompt_key=question", "data.answer_key=label.text")
    pairs = task_pairs(cfg.data, 0)
    assert [tuple(p) for p in pairs] == [("say cat", "cat"), ("say dog", "dog")]
    assert [p.data_source for p in pairs] == ["", "pets"]
    assert [p.messages for p in pairs] == [None, None]  # a plain string is tokenized as it is
    loader = make_loader(cfg.data, tiny_tokenizer(), pairs, prompts_per_step=2, group_size=4, seed=0)
    b = loader.batch(0)
    assert tiny_tokenizer().decode(b["prompt_ids"][0][b["prompt_mask"][0].bool()]) == "say cat"


def test_the_data_order_is_deterministic_across_epochs_and_a_pure_function_of_seed_and_step(tmp_path):
    rows = [{"prompt": f"say {w}", "reward_model": {"ground_truth": w}} for w in ("a", "b", "c", "d", "e", "f")]
    cfg = _cfg(f"data.train_files={write_jsonl(tmp_path / 't.jsonl', rows)}")
    pairs = task_pairs(cfg.data, 0)

    def order(seed: int) -> list[list[int]]:
        loader = make_loader(cfg.data, tiny_tokenizer(), pairs, prompts_per_step=2, group_size=4, seed=seed)
        return [loader.indices(step) for step in range(6)]  # two epochs of three steps

    assert order(0) == [[4, 2], [1, 0], [5, 3], [2, 3], [5, 0], [4, 1]]  # each epoch a permutation of 0-5
    assert order(0) == order(0) and order(1) != order(0)
    # a loader built later (a resumed run) gives step 4 the same prompts without replaying steps 0-3
    late = make_loader(cfg.data, tiny_tokenizer(), pairs, prompts_per_step=2, group_size=4, seed=0)
    assert late.indices(4) == [5, 0]


def test_max_prompt_length_refuses_long_prompts_or_filters_them_with_a_count(tmp_path):
    rows = [{"prompt": "x" * n, "reward_model": {"ground_truth": str(n)}} for n in (2, 40, 3, 50)]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    tok = tiny_tokenizer()
    lens = [len(tok("x" * n, add_special_tokens=False)["input_ids"]) for n in (2, 40, 3, 50)]
    limit = max(lens[0], lens[2])
    assert limit < min(lens[1], lens[3])
    cfg = _cfg(f"data.train_files={path}", f"data.max_prompt_length={limit}")
    pairs = task_pairs(cfg.data, 0)
    with pytest.raises(ConfigError, match=rf"data.max_prompt_length={limit}: 2 of 4 data prompts are longer, e.g. row 1 "
                                          ".*data.filter_overlong_prompts=true"):
        make_loader(cfg.data, tok, pairs, prompts_per_step=2, group_size=4, seed=0)
    cfg = _cfg(f"data.train_files={path}", f"data.max_prompt_length={limit}", "data.filter_overlong_prompts=true")
    loader = make_loader(cfg.data, tok, pairs, prompts_per_step=2, group_size=4, seed=0)
    assert loader.filtered == 2 and [p[1] for p in loader.pairs] == ["2", "3"]
    cfg = _cfg(f"data.train_files={path}", "data.max_prompt_length=1", "data.filter_overlong_prompts=true")
    with pytest.raises(ConfigError, match="every one of the 4 data prompts is longer, so none is left"):
        make_loader(cfg.data, tok, pairs, prompts_per_step=2, group_size=4, seed=0)


# ---- the reward by path ------------------------------------------------------------------------


def _scored_batch(answers: list[str], sources: list[str], extras: list[dict]) -> TensorDict:
    tok = tiny_tokenizer()
    ids = [tok("cat", add_special_tokens=False)["input_ids"] for _ in answers]
    width = max(map(len, ids))
    return TensorDict({
        "response_ids": torch.tensor([r + [0] * (width - len(r)) for r in ids]),
        "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids]),
        "answer": NonTensorStack(*answers), "data_source": NonTensorStack(*sources),
        "extra_info": NonTensorStack(*[json.dumps(e) for e in extras]),
    }, batch_size=[len(answers)])


def test_a_verl_compute_score_file_is_called_once_per_row_with_the_rows_arguments(tmp_path):
    reward = write_reward_file(tmp_path / "my_reward.py")
    log = tmp_path / "calls.jsonl"
    worker = RewardWorker(RewardConfig(fn=f"{reward}:compute_score", fn_kwargs={"log": str(log), "bonus": 0.5}))
    batch = _scored_batch(["4", "8"], ["toy/add", "toy/mul"], [{"index": 2}, {"index": 4}])
    assert worker.compute_reward(batch)["scores"].tolist() == [1.0, 1.5]  # the dict's "score" + bonus
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls == [
        {"data_source": "toy/add", "solution_str": "cat", "ground_truth": "4", "extra_info": {"index": 2}},
        {"data_source": "toy/mul", "solution_str": "cat", "ground_truth": "8", "extra_info": {"index": 4}},
    ]


def test_the_batch_signature_works_by_path_and_the_two_are_told_apart_by_their_parameters(tmp_path):
    reward = write_reward_file(tmp_path / "my_reward.py")
    assert load_reward_fn(f"{reward}:compute_score")[1] == "row"
    assert load_reward_fn(f"{reward}:batch_reward")[1] == "batch"
    assert load_reward_fn("asyncrl.roles.scoring.reward:exact_match")[1] == "batch"  # a module path too
    worker = RewardWorker(RewardConfig(fn=f"{reward}:batch_reward"))
    assert worker.compute_reward(_scored_batch(["4", "16"], ["a", "b"], [{}, {}]))["scores"].tolist() == [1.0, 2.0]


def test_a_reward_that_raises_on_one_row_names_the_rows_data_source_and_index(tmp_path):
    reward = write_reward_file(tmp_path / "my_reward.py")
    worker = RewardWorker(RewardConfig(fn=f"{reward}:explodes"))
    batch = _scored_batch(["4", "8"], ["toy/add", "toy/mul"], [{"index": 2}, {"index": 4}])
    with pytest.raises(RewardFnError, match=r"raised ValueError on row 1 of the batch \(data_source 'toy/mul', "
                                            r"extra_info index 4\): cannot score this"):
        worker.compute_reward(batch)


# ---- bad input: one line naming the key and the fix, exit 2, before Ray starts --------------------


def _bad(tmp_path: Path, model_dir: Path) -> list[tuple[list[str], str]]:
    data = write("jsonl", tmp_path)
    reward = write_reward_file(tmp_path / "my_reward.py")
    (tmp_path / "t.csv").write_text("prompt,answer\n")
    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((model_dir / "config.json").read_text())
    ok = [f"data.train_files={data}", f"reward.fn={reward}:compute_score"]
    return [
        (["data.train_files=/nope/train.parquet"], "data.train_files: '/nope/train.parquet' does not exist"),
        ([f"data.train_files={tmp_path / 't.csv'}"], "has an unknown format (.csv); use .jsonl"),
        ([f"data.train_files={data}", "data.answer_key=answer"],
         "data.answer_key: row 0 of " + repr(str(data)) + " has no column 'answer'; the columns found are "
         "['data_source', 'prompt', 'ability', 'reward_model', 'reward_model.style', 'reward_model.ground_truth', "
         "'extra_info', 'extra_info.index', 'extra_info.split']"),
        ([ok[0], f"reward.fn={tmp_path / 'nope.py'}:compute_score"], f"the file {str(tmp_path / 'nope.py')!r} does "
         "not exist"),
        ([ok[0], f"reward.fn={reward}:score"], "has no function 'score'; its functions are ['batch_reward', "
         "'compute_score', 'explodes', 'two_args']"),
        ([ok[0], f"reward.fn={reward}:two_args"], "has the signature two_args(a, b), which is neither verl's"),
        ([*ok, "reward.fn_kwargs={nope: 1}"], "reward.fn_kwargs ['nope'] are not parameters of compute_score"),
        ([*ok, f"model.path={no_tok}"], f"model.path={str(no_tok)!r} holds no tokenizer"),
    ]


def test_bad_files_columns_reward_files_and_model_dirs_exit_2_with_one_line(tmp_path, model_dir, capsys):
    for overrides, message in _bad(tmp_path, model_dir):
        out = tmp_path / "run"
        assert main(["train", *overrides, f"trainer.output_dir={out}", "--print-config"]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith("asyncrl train: config error: ") and message in err, (overrides, err)
        assert err.count("\n") == 1 and not out.exists()


def test_empty_data_after_filtering_exits_2_before_ray_starts(tmp_path, capsys):
    import ray

    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "write digits:", "reward_model": {"ground_truth": "1"}}])
    out = tmp_path / "run"
    started = ray.is_initialized()
    rc = main(["train", f"data.train_files={path}", "data.max_prompt_length=1", "data.filter_overlong_prompts=true",
               "reward.fn=exact_match", f"trainer.output_dir={out}", "trainer.progress=false"])
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "asyncrl train: config error: data.max_prompt_length=1: every one of the 1 data prompts is longer" in err
    assert ray.is_initialized() == started  # the error came before Ray was started


def test_the_reward_decodes_with_the_policys_tokenizer_unless_told_otherwise(model_dir):
    cfg = _cfg(f"model.path={model_dir}")
    assert cfg.reward.tokenizer is None and cfg.worker_reward().tokenizer == str(model_dir)
    assert _cfg().worker_reward().tokenizer == "tiny"
    assert _cfg("reward.tokenizer=qwen2").worker_reward().tokenizer == "qwen2"


def test_the_template_of_the_model_directory_is_its_own(model_dir):
    assert load_tokenizer(str(model_dir)).chat_template == TEMPLATE


def test_val_files_feed_the_evaluation_set_and_a_val_file_without_train_files_is_refused(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "say a", "reward_model": {"ground_truth": "a"}}])
    val = write_jsonl(tmp_path / "val.jsonl", [{"prompt": f"say {w}", "reward_model": {"ground_truth": w}}
                                               for w in ("x", "y", "z")])
    cfg = _cfg(f"data.train_files={train}", f"data.val_files={val}")
    assert [tuple(p) for p in task_pairs(cfg.data, 0)] == [("say a", "a")]
    assert [tuple(p) for p in task_pairs(cfg.data, 0, split="eval")] == [("say x", "x"), ("say y", "y"), ("say z", "z")]
    assert [tuple(p) for p in task_pairs(cfg.data, 0, split="eval", num_prompts=2)] == [("say x", "x"), ("say y", "y")]
    with pytest.raises(ConfigError, match="data.val_files is set but data.train_files is not"):
        _cfg(f"data.val_files={val}")


def _more_bad(tmp_path: Path) -> list[tuple[list[str], str]]:
    """The rest of the bad inputs: empty and malformed data files, a DatasetDict or a plain directory
    instead of a saved split, a prompt column of the wrong type, reward files that cannot be imported."""
    d = tmp_path / "more"
    d.mkdir()
    (d / "empty.jsonl").write_text("\n")
    (d / "list.jsonl").write_text('{"prompt": "a", "reward_model": {"ground_truth": "1"}}\n[1, 2]\n')
    (d / "broken.jsonl").write_text('{"prompt": "a", \n')
    write_jsonl(d / "int_prompt.jsonl", [{"prompt": 7, "reward_model": {"ground_truth": "1"}}])
    (d / "dd").mkdir()
    (d / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    (d / "plain_dir").mkdir()
    (d / "bad_import.py").write_text("import nope_not_a_module\n\ndef compute_score(data_source, solution_str, "
                                     "ground_truth, extra_info=None):\n    return 0.0\n")
    ok = f"data.train_files={write('jsonl', tmp_path)}"
    return [
        ([f"data.train_files={d / 'empty.jsonl'}"], f"data.train_files: {str(d / 'empty.jsonl')!r} holds no rows; "
         "give a file with at least one prompt"),
        ([f"data.train_files={d / 'list.jsonl'}"], f"data.train_files: line 2 of {str(d / 'list.jsonl')!r} is a "
         "JSON list, not an object; write one {\"prompt\": ..., ...} object per line"),
        ([f"data.train_files={d / 'broken.jsonl'}"], f"data.train_files: cannot read {str(d / 'broken.jsonl')!r} "
         "as jsonl: JSONDecodeError: "),
        ([f"data.train_files={d / 'int_prompt.jsonl'}"], f"data.prompt_key: row 0 of {str(d / 'int_prompt.jsonl')!r}"
         " column 'prompt' is neither a string nor a list of chat messages"),
        ([f"data.train_files={d / 'dd'}"], f"data.train_files: {str(d / 'dd')!r} is a DatasetDict with splits "
         f"['train', 'test']; point data.train_files at one split's directory, e.g. {str(d / 'dd' / 'train')!r}"),
        ([f"data.train_files={d / 'plain_dir'}"], f"data.train_files: directory {str(d / 'plain_dir')!r} has no "
         "state.json, so it is not a dataset saved with datasets.Dataset.save_to_disk"),
        (["data.train_files=[]"], "data.train_files is an empty list; give one path or a list of paths"),
        ([ok, f"reward.fn={d / 'bad_import.py'}:compute_score"],
         f"reward.fn={str(d / 'bad_import.py') + ':compute_score'!r}: importing {str(d / 'bad_import.py')!r} raised "
         "ModuleNotFoundError: No module named 'nope_not_a_module'"),
        ([ok, "reward.fn=nope_not_a_package.scores:compute_score"],
         "reward.fn='nope_not_a_package.scores:compute_score': cannot import module 'nope_not_a_package.scores'"),
    ]


def test_empty_or_malformed_data_files_and_unimportable_reward_files_exit_2_with_one_line(tmp_path, capsys):
    for overrides, message in _more_bad(tmp_path):
        out = tmp_path / "run"
        assert main(["train", *overrides, f"trainer.output_dir={out}", "--print-config"]) == 2, overrides
        err = capsys.readouterr().err
        assert err.startswith("asyncrl train: config error: ") and message in err, (overrides, err)
        assert err.count("\n") == 1 and not out.exists()
