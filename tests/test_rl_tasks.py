"""Tokenizer and verifiable-reward tasks: round trips, saved form, splits, the verifier, the registry."""

from __future__ import annotations

import json

import pytest

from tidal.core.errors import TidalError
from tidal.engine.rl_tasks import (
    Addition,
    Multiplication,
    SFTExample,
    Sorting,
    TaskRegistry,
    get_task,
    task_names,
    verify,
)
from tidal.engine.tokenizer import DEFAULT_CHARS, CharTokenizer, check_compatible, default_tokenizer

TOK = default_tokenizer()


# ---- tokenizer ------------------------------------------------------------------------------------
def test_vocab_layout_and_round_trip():
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.vocab_size == 3 + len(DEFAULT_CHARS) == 19
    text = "123+456=975 0*9,1:2"
    ids = TOK.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3
    assert TOK.decode(ids) == text
    assert TOK.encode("12", add_bos=True, add_eos=True) == [1, TOK.encode("1")[0], TOK.encode("2")[0], 2]
    assert TOK.decode([1, 4, 5, 2, 0]) == "<bos>12<eos><pad>"
    assert TOK.decode([1, 4, 5, 2, 0], skip_special_tokens=True) == "12"
    assert TOK.decode(range(TOK.vocab_size))[len("<pad><bos><eos>"):] == DEFAULT_CHARS


def test_unknown_characters_and_ids_are_errors():
    with pytest.raises(ValueError, match=r"'x' at position 2"):
        TOK.encode("12x")
    with pytest.raises(ValueError, match="outside the vocab"):
        TOK.decode([TOK.vocab_size])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("0120")


def test_save_load_hugging_face_shape(tmp_path):
    path = TOK.save(tmp_path / "ckpt")
    assert path == tmp_path / "ckpt" / "tokenizer.json"
    doc = json.loads(path.read_text())
    assert doc["model"]["type"] == "WordLevel"
    assert doc["model"]["vocab"]["<eos>"] == 2 and doc["model"]["vocab"]["+"] == TOK.encode("+")[0]
    assert doc["pre_tokenizer"] == {"type": "Split", "pattern": {"Regex": "."}, "behavior": "Isolated",
                                    "invert": False}
    assert doc["decoder"] == {"type": "Fuse"}
    assert [(t["id"], t["content"], t["special"]) for t in doc["added_tokens"]] == [
        (0, "<pad>", True), (1, "<bos>", True), (2, "<eos>", True)]
    for where in (tmp_path / "ckpt", path):  # a directory or the file itself
        loaded = CharTokenizer.load(where)
        assert loaded == TOK and loaded.encode("98+1=") == TOK.encode("98+1=")
    custom = CharTokenizer("01ab")
    assert CharTokenizer.load(custom.save(tmp_path / "c.json")) == custom


def test_load_rejects_bad_files(tmp_path):
    with pytest.raises(TidalError, match="no tokenizer.json"):
        CharTokenizer.load(tmp_path / "missing")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TidalError, match="not valid JSON"):
        CharTokenizer.load(bad)
    doc = TOK.to_json()
    doc["model"]["vocab"]["ab"] = TOK.vocab_size
    bad.write_text(json.dumps(doc))
    with pytest.raises(TidalError, match="not single characters"):
        CharTokenizer.load(bad)
    doc = TOK.to_json()
    doc["model"]["type"] = "BPE"
    bad.write_text(json.dumps(doc))
    with pytest.raises(TidalError, match="WordLevel"):
        CharTokenizer.load(bad)
    doc = TOK.to_json()
    doc["model"]["vocab"] = {"<bos>": 0, "<pad>": 1, "<eos>": 2, "1": 3}
    bad.write_text(json.dumps(doc))
    with pytest.raises(TidalError, match="first ids"):
        CharTokenizer.load(bad)


def test_check_compatible(tmp_path):
    check_compatible(TOK, TOK.vocab_size)
    other = CharTokenizer.load(CharTokenizer("0123456789").save(tmp_path))
    with pytest.raises(TidalError) as exc:
        check_compatible(other, TOK.vocab_size, source=str(tmp_path))
    err = exc.value
    assert err.field == "model.vocab_size" and err.value == 19
    assert "13 tokens" in str(err) and str(tmp_path) in str(err) and "Fix:" in str(err)


# ---- tasks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, prompt, answer", [
    ("addition", "123+456=", "975"),
    ("addition", "999+999=", "8991"),        # 1998, LSD first
    ("addition", "500+500=", "0001"),        # 1000: the reversed string keeps its zeros
    ("multiplication", "347*8=", "6772"),    # 2776
    ("multiplication", "100*2=", "002"),
    ("sorting", "315926:", "123569"),
    ("sorting", "000000:", "000000"),
])
def test_answers_by_hand(name, prompt, answer):
    task = get_task(name)
    assert task.answer(prompt) == answer
    assert len(answer) <= task.max_answer_chars and task.max_response_tokens == task.max_answer_chars + 1


@pytest.mark.parametrize("name", ["addition", "multiplication", "sorting"])
def test_extreme_prompts_fit_the_answer_length(name):
    task = get_task(name)
    for idx in (0, task.num_prompts - 1):
        assert len(task.answer(task.prompt_at(idx))) <= task.max_answer_chars
    task.check_tokenizer(TOK)


def test_verifier_right_wrong_malformed():
    task = get_task("addition")
    p = "123+456="
    assert task.reward(p, "975<eos>") == 1.0
    assert task.reward(p, "975<eos>12<pad>") == 1.0     # nothing after <eos> is read
    assert task.reward(p, "975") == 0.0                  # truncated at the cap: no <eos>
    assert task.reward(p, "579<eos>") == 0.0             # MSD first
    assert task.reward(p, "976<eos>") == 0.0
    assert task.reward(p, "9750<eos>") == 0.0            # extra digit
    assert task.reward(p, " 975<eos>") == 0.0            # extra space
    assert task.reward(p, "<eos>") == 0.0
    assert task.reward(p, "") == 0.0
    assert verify("975", "97<eos>5<eos>") == 0.0
    ids = TOK.encode("975", add_eos=True)                 # the rollout path: decode with specials
    assert task.reward(p, TOK.decode(ids)) == 1.0
    assert task.reward(p, TOK.decode(ids, skip_special_tokens=True)) == 0.0
    for bad in ("123+456", "12+456=", "023+456=", "123*4=", "abc"):
        with pytest.raises(ValueError, match="not an addition prompt"):
            task.answer(bad)
    with pytest.raises(ValueError, match="not a multiplication prompt"):
        get_task("multiplication").answer("123*1=")    # x1 is not in the task


@pytest.mark.parametrize("name", ["addition", "multiplication", "sorting"])
def test_streams_are_deterministic_and_random_access(name):
    task = get_task(name)
    a = task.train_prompts(40, seed=7)
    assert a == task.train_prompts(40, seed=7)
    assert task.train_prompts(15, seed=7, start=25) == a[25:]  # the data position is just `start`
    assert a != task.train_prompts(40, seed=8)
    h = task.heldout_prompts(60, seed=7)
    assert h == task.heldout_prompts(60, seed=7) and len(set(h)) == 60
    assert task.heldout_prompts(20, seed=7) == h[:20]
    s = task.sft_examples(30, seed=7)
    assert s == task.sft_examples(30, seed=7) and len({e.prompt for e in s}) == 30
    assert all(e.response == task.answer(e.prompt) for e in s)


@pytest.mark.parametrize("name", ["addition", "multiplication", "sorting"])
def test_splits_are_disjoint(name):
    task = get_task(name)
    held = set(task.heldout_prompts(200, seed=3))
    train = set(task.train_prompts(3000, seed=3)) | {e.prompt for e in task.sft_examples(300, seed=3)}
    assert not held & train
    assert task.heldout_prompts(200, seed=3) != task.heldout_prompts(200, seed=4)  # the split moves with the seed


def test_split_partition_is_exact_on_a_whole_space():
    task = get_task("multiplication")                    # 7200 prompts: check every one
    side = {task.prompt_at(i): task.is_heldout(i, 0) for i in range(task.num_prompts)}
    frac = sum(side.values()) / len(side)
    assert 0.08 < frac < 0.12                            # heldout_fraction 0.1
    assert all(side[p] for p in task.heldout_prompts(300, seed=0))
    assert not any(side[p] for p in task.train_prompts(2000, seed=0))


def test_addition_keeps_commuted_problems_on_one_side():
    task = get_task("addition")
    for p in task.heldout_prompts(100, seed=1):
        a, b = p[:-1].split("+")
        commuted = (int(b) - 100) * 900 + (int(a) - 100)
        assert task.prompt_at(commuted) == f"{b}+{a}=" and task.is_heldout(commuted, 1)


def test_heldout_request_larger_than_the_split_is_a_clear_error():
    tiny = Multiplication(digits=1, name="tiny")          # 9 x 8 = 72 prompts, about 7 held out
    with pytest.raises(TidalError) as exc:
        tiny.heldout_prompts(50, seed=0)
    assert exc.value.field == "data.eval_size" and "held-out prompts" in str(exc.value)


def test_sft_examples_token_layout():
    ex = SFTExample("12+34=", "64")
    p, r = ex.token_ids(TOK)
    assert p[0] == TOK.bos_id and TOK.decode(p[1:]) == "12+34="
    assert r[-1] == TOK.eos_id and TOK.decode(r) == "64<eos>"
    assert get_task("sorting").prompt_ids("012345:", TOK) == p[:1] + TOK.encode("012345:")


# ---- registry -------------------------------------------------------------------------------------
def test_registry_names_and_errors():
    assert {"addition", "multiplication", "sorting"} <= set(task_names())
    with pytest.raises(TidalError) as exc:
        get_task("additon")
    assert exc.value.field == "data.task" and "did you mean 'addition'" in str(exc.value)
    assert "multiplication" in exc.value.fix
    with pytest.raises(TidalError, match="not a known task"):
        get_task("zzz")
    reg = TaskRegistry()
    reg.register(Addition(digits=2, name="add2"))
    assert reg.get("add2").answer("12+34=") == "64"
    with pytest.raises(TidalError, match="already registered"):
        reg.register(Sorting(length=3, name="add2"))


def test_tokenizer_check_names_missing_characters():
    with pytest.raises(TidalError, match=r"lacks characters \['\*'"):
        get_task("multiplication").check_tokenizer(CharTokenizer("0123456789+="))
