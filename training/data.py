"""Prompt sets as one ``datasets.Dataset`` schema, with MT-bench kept out of training.

    from treedraft.training.data import load_prompts, first_turn
    ds = load_prompts("sharegpt", limit=1000, purpose="train")
    prompt = first_turn(ds[0]["messages"])

Features:
- One schema for every source (``prompt_features()``): ``id`` (str), ``source`` (str) and
  ``messages`` (list of ``{"role": "system" | "user" | "assistant", "content": str}``).
  Every row has a user message and no empty content.
- Sources, by name (``SOURCES``), read from files shipped inside PyPI packages
  (``embedded.py``; no model hub, no network):
  - ``"mtbench"``: the 80 MT-bench questions, ``messages`` = their 2 user turns in order.
  - ``"sharegpt"``: ShareGPT V3 (unfiltered, cleaned, split). The shipped JSON array is cut
    off at 125 MB, so it is parsed record by record and the truncated tail is dropped.
  - ``"humaneval"``: the 164 HumanEval problems, each one user message asking to complete
    the function.
- Or the path of a ``.jsonl`` file, gzipped or not (source ``"jsonl:<filename>"``): one object per line,
  ``{"prompt": str}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``, optional
  ``"id"`` (str); other keys are ignored, blank lines skipped. Any bad line raises a
  ValueError naming the file, the line number and the expected shape.
- ``limit=N`` keeps the first N rows (deterministic; the ShareGPT parse stops early).
- MT-bench never enters training data: ``purpose="train"`` refuses ``"mtbench"`` and drops
  (with a logged warning) every row whose first user message is an MT-bench turn, compared
  after whitespace normalisation and case folding. The check needs the MT-bench questions,
  so without their package ``purpose="train"`` fails rather than silently skipping it.
  ``assert_no_mtbench(ds)`` re-checks a dataset before training on it.
- ``first_turn(messages)``: the prompt the evaluator sends, i.e. the system messages and
  the first user message.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from .embedded import HUMANEVAL_JSONL, MTBENCH_QUESTIONS, SHAREGPT_JSON

if TYPE_CHECKING:
    import datasets

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
PURPOSES = ("eval", "train")
HUMANEVAL_TEMPLATE = "Complete the following Python function.\n\n```python\n{prompt}```"
# ShareGPT speakers. Records with any other speaker ("chatgpt", "bing", "bard", "user":
# 13 records in V3, mostly pasted transcripts of other assistants) are skipped, not guessed.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
JSONL_SHAPE = (
    'each line must be a JSON object like {"prompt": "..."} or '
    '{"messages": [{"role": "user", "content": "..."}, ...]} (roles: system, user, assistant), '
    'with an optional "id": "..."'
)

Row = dict[str, Any]  # {"id": str, "source": str, "messages": list[Message]}


class Message(TypedDict):
    role: str
    content: str


def prompt_features() -> datasets.Features:
    """The schema every ``load_prompts`` dataset has."""
    import datasets

    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "source": datasets.Value("string"),
            # A list literal is a list of structs in every datasets version (>= 3): rows read
            # back as a list of dicts. `Sequence({...})` would give a dict of lists instead.
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        }
    )


# --- built-in sources ---------------------------------------------------------------------


def _mtbench_rows() -> Iterator[Row]:
    for q in _mtbench_questions():
        yield {
            "id": f"mtbench-{q['question_id']}",
            "source": "mtbench",
            "messages": [{"role": "user", "content": turn} for turn in q["turns"]],
        }


def _humaneval_rows() -> Iterator[Row]:
    with gzip.open(HUMANEVAL_JSONL.locate(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                p = json.loads(line)
                content = HUMANEVAL_TEMPLATE.format(prompt=p["prompt"])
                yield {
                    "id": p["task_id"],
                    "source": "humaneval",
                    "messages": [{"role": "user", "content": content}],
                }


_SEPARATORS = re.compile(r"[\s,]*")


def _iter_json_array(path: Path, chunk_chars: int = 1 << 22) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping quietly at a truncated tail.

    The file is read in chunks of ``chunk_chars`` characters; an element that straddles a
    chunk boundary fails to decode and is retried with the next chunk appended. A failure
    once the whole file is read is the truncated tail: it is logged and dropped.
    """
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8", newline="") as f:
        buf = f.read(chunk_chars)
        pos = _SEPARATORS.match(buf).end()
        if buf[pos : pos + 1] != "[":
            raise ValueError(f"{path} does not start with a JSON array ('[')")
        pos += 1
        eof = False
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if eof:
                    if pos < len(buf):  # not just trailing whitespace
                        logger.info(
                            "%s: dropped the truncated last %d characters (%s)",
                            path.name, len(buf) - pos, e.msg,
                        )
                    return
                more = f.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj


def _sharegpt_messages(conversation: list[dict[str, Any]]) -> list[Message] | None:
    """ShareGPT turns as messages, or None for a record to skip (see SHAREGPT_ROLES)."""
    messages: list[Message] = []
    for turn in conversation:
        role, content = SHAREGPT_ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        if role == "assistant" and not any(m["role"] == "user" for m in messages):
            # The "split" file cuts long chats into chunks; a chunk that opens with the
            # assistant answering a question we do not have starts at the next user turn.
            continue
        messages.append({"role": role, "content": content})
    return messages if any(m["role"] == "user" for m in messages) else None


def _sharegpt_rows() -> Iterator[Row]:
    seen = kept = 0
    for record in _iter_json_array(SHAREGPT_JSON.locate()):
        seen += 1
        messages = _sharegpt_messages(record.get("conversations") or [])
        if messages is not None:
            kept += 1
            yield {"id": f"sharegpt-{record['id']}", "source": "sharegpt", "messages": messages}
    logger.info(
        "ShareGPT: kept %d of %d records (skipped: empty, no user turn, empty turns, "
        "other speakers)", kept, seen,
    )


SOURCES: dict[str, Callable[[], Iterator[Row]]] = {
    "mtbench": _mtbench_rows,
    "sharegpt": _sharegpt_rows,
    "humaneval": _humaneval_rows,
}


# --- user JSONL files ---------------------------------------------------------------------


def _jsonl_messages(obj: Any) -> list[Message]:
    """Messages of one parsed JSONL line; a ValueError says what is wrong with it."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        has = "both" if "prompt" in obj else "neither"
        raise ValueError(f"has {has} of 'prompt' and 'messages' (keys: {sorted(obj)})")
    if "id" in obj and not isinstance(obj["id"], str):
        raise ValueError(f"'id' must be a string, got {type(obj['id']).__name__}")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise ValueError("'prompt' must be a non-empty string")
        return [{"role": "user", "content": obj["prompt"]}]
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has role {m['role']!r}, not one of {ROLES}")
        if not isinstance(m["content"], str) or not m["content"].strip():
            raise ValueError(f"messages[{i}] content must be a non-empty string")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("'messages' has no user message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _jsonl_rows(path: Path) -> list[Row]:
    """All rows of a .jsonl (or gzipped .jsonl.gz) file, validated in full (a bad line fails
    whatever the limit)."""
    import gzip

    source, seen, rows = f"jsonl:{path.name}", {}, []
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}, line {lineno}: invalid JSON ({e.msg}, column {e.colno}); {JSONL_SHAPE}"
                ) from None
            try:
                messages = _jsonl_messages(obj)
            except ValueError as e:
                raise ValueError(f"{path}, line {lineno}: {e}; {JSONL_SHAPE}") from None
            row_id = obj.get("id", f"{path.name}:{lineno}")
            if row_id in seen:
                raise ValueError(
                    f"{path}, line {lineno}: id {row_id!r} already used on line {seen[row_id]}; "
                    "ids must be unique (or leave 'id' out to number rows by line)"
                )
            seen[row_id] = lineno
            rows.append({"id": row_id, "source": source, "messages": messages})
    if not rows:
        raise ValueError(f"{path} has no prompts (it is empty or blank); {JSONL_SHAPE}")
    return rows


def _rows(source: str | os.PathLike[str]) -> Iterator[Row]:
    if isinstance(source, str) and source in SOURCES:
        return SOURCES[source]()
    path = Path(source)
    jsonl = path.name.endswith((".jsonl", ".jsonl.gz"))
    if jsonl and path.is_file():
        return iter(_jsonl_rows(path))
    why = f"no such file: {path.resolve()}" if jsonl else "not a known name"
    raise ValueError(
        f"unknown prompt source {str(source)!r} ({why}): use one of "
        f"{', '.join(map(repr, SOURCES))}, or the path of an existing .jsonl (or .jsonl.gz) file"
    )


# --- MT-bench contamination guard ---------------------------------------------------------


def _normalise(text: str) -> str:
    return " ".join(text.split()).casefold()


@cache
def _mtbench_turns_at(path: Path) -> frozenset[str]:
    return frozenset(_normalise(turn) for q in _mtbench_questions(path) for turn in q["turns"])


def mtbench_turns() -> frozenset[str]:
    """Every MT-bench turn, normalised; raises if the questions cannot be read."""
    try:
        path = MTBENCH_QUESTIONS.locate()
    except FileNotFoundError as e:
        raise RuntimeError(
            "training data is checked against MT-bench so that evaluation prompts never "
            f"leak into training, but the MT-bench questions cannot be read: {e}"
        ) from e
    return _mtbench_turns_at(path)


def _first_user(messages: Iterable[Message]) -> str:
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def _drop_mtbench(rows: Iterable[Row], banned: frozenset[str], dropped: list[str]) -> Iterator[Row]:
    for row in rows:
        if _normalise(_first_user(row["messages"])) in banned:
            dropped.append(row["id"])
        else:
            yield row


def assert_no_mtbench(dataset: datasets.Dataset) -> None:
    """Raise ValueError if any row is from MT-bench or opens with an MT-bench question."""
    banned = mtbench_turns()
    bad = [
        row_id
        for row_id, source, messages in zip(
            dataset["id"], dataset["source"], dataset["messages"], strict=True
        )
        if source == "mtbench" or _normalise(_first_user(messages)) in banned
    ]
    if bad:
        raise ValueError(
            f"{len(bad)} rows are MT-bench questions (e.g. {bad[:5]}), which must never be "
            "trained on; load training data with load_prompts(..., purpose='train'), "
            "which drops them"
        )


# --- public API ---------------------------------------------------------------------------


def load_prompts(
    source: str | os.PathLike[str],
    *,
    limit: int | None = None,
    purpose: Literal["eval", "train"] = "eval",
    stride: int = 1,
) -> datasets.Dataset:
    """Load a prompt set as a Dataset with ``prompt_features()`` (see the module docstring).

    ``source``: "mtbench", "sharegpt", "humaneval", or the path of a .jsonl file.
    ``stride``: keep every ``stride``-th row (MT-bench, 80 questions in 8 categories of 10:
    stride 10 is one question per category, stride 5 two).
    ``limit``: then keep the first ``limit`` rows (after MT-bench filtering for training).
    ``purpose="train"``: refuse MT-bench and drop rows that open with an MT-bench question.
    """
    import datasets

    if purpose not in PURPOSES:
        raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"stride must be an int >= 1 (1 = every prompt), got {stride!r}")
    if purpose == "train" and source == "mtbench":
        raise ValueError(
            "MT-bench is the evaluation set and must never be trained on; "
            "train on 'sharegpt', 'humaneval' or a .jsonl file"
        )
    rows = _rows(source)
    dropped: list[str] = []
    if purpose == "train":
        rows = _drop_mtbench(rows, mtbench_turns(), dropped)
    rows = list(itertools.islice(itertools.islice(rows, None, None, stride), limit))
    if dropped:
        logger.warning(
            "dropped %d training prompts from %s that are MT-bench questions (e.g. %s)",
            len(dropped), source, dropped[:5],
        )
    columns = {name: [row[name] for row in rows] for name in ("id", "source", "messages")}
    return datasets.Dataset.from_dict(columns, features=prompt_features())


def prompt_categories(dataset: datasets.Dataset) -> list[str]:
    """Each row's category: MT-bench's own (writing, roleplay, reasoning, math, coding,
    extraction, stem, humanities), else the row's source (humaneval, sharegpt, a file's name)."""
    mtbench = {f"mtbench-{q['question_id']}": q["category"] for q in _mtbench_questions()}
    return [mtbench.get(i, s) if s == "mtbench" else s
            for i, s in zip(dataset["id"], dataset["source"], strict=True)]


def _mtbench_questions(path: Path | None = None) -> list[dict]:
    """The MT-bench question records (question_id, category, turns), one per line."""
    with (path or MTBENCH_QUESTIONS.locate()).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def first_turn(messages: Iterable[Message]) -> list[Message]:
    """The system messages before the first user message, then that user message.

    This is the prompt the evaluator sends (MT-bench's first turn). Assistant messages
    before the first user message, if any, are left out so that the prompt is valid for
    chat templates that require a user message first.
    """
    prompt: list[Message] = []
    roles = []
    for m in messages:
        roles.append(m["role"])
        if m["role"] == "system":
            prompt.append({"role": "system", "content": m["content"]})
        elif m["role"] == "user":
            prompt.append({"role": "user", "content": m["content"]})
            return prompt
    raise ValueError(f"no user message among roles {roles}; a prompt needs one")
