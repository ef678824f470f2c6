"""configs/data/real/ (the real-model pipeline's instruction data) is what scripts/make_real_data.py
writes, and holds what the pipeline relies on: the sizes, the four tasks in turn, every answer in
its task's format, and no evaluation prompt among the training, preference or GRPO prompts; the
general-text guard is paragraphs of CPython's own pydoc topics, word for word."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("make_real_data", None)
    import make_real_data

    return make_real_data


def test_the_shipped_files_are_the_scripts_output(monkeypatch, capsys):
    assert _script(monkeypatch).main(["--check"]) == 0, capsys.readouterr().err


def test_answers_have_their_tasks_format_and_eval_is_held_out(monkeypatch):
    mod = _script(monkeypatch)
    files = {name: [json.loads(line) for line in (mod.OUT / f"{name}.jsonl").read_text().splitlines()]
             for name in mod.SIZES if name != "general"}
    assert {name: len(rows) for name, rows in files.items()} == {n: k for n, k in mod.SIZES.items() if n != "general"}
    formats = {"convert": r"\d+", "add": r"\d+", "date": r"\d{4}-\d{2}-\d{2}", "json": r"\{.*\}"}

    def prompt_and_answer(name, row):
        if name == "sft":
            return row["messages"][0]["content"], row["messages"][1]["content"]
        if name == "prefs":
            assert row["chosen"] != row["rejected"]
            return row["prompt"][0]["content"], row["chosen"][0]["content"]
        return row["prompt"][0]["content"], row["answer"]

    prompts = {}
    for name, rows in files.items():
        assert [r["task"] for r in rows[:8]] == list(mod.TASKS) * 2, name
        prompts[name] = set()
        for row in rows:
            prompt, answer = prompt_and_answer(name, row)
            assert re.fullmatch(formats[row["task"]], answer), (name, row)
            if row["task"] == "json":
                got = json.loads(answer)
                assert set(got) == {"name", "age"} and got["name"] in prompt and str(got["age"]) in prompt, row
            prompts[name].add(prompt)
        assert len(prompts[name]) == len(rows), name  # no prompt twice in a file
    for name in ("sft", "prefs", "prompts"):
        assert not prompts[name] & prompts["eval"], name


def test_the_general_text_is_pydocs_own_paragraphs(monkeypatch):
    import platform

    from pydoc_data.topics import topics

    mod = _script(monkeypatch)
    rows = [json.loads(line) for line in (mod.OUT / "general.jsonl").read_text().splitlines()]
    assert len(rows) == mod.SIZES["general"]
    for row in rows:
        topic = row["source"].removeprefix("pydoc_data.topics:")
        text = row["completion"][0]["content"]
        assert topic in row["prompt"][0]["content"] and 300 <= len(text) <= 700, row
        if platform.python_version() == mod.PYDOC_PYTHON:
            assert text in " ".join(topics[topic].split()), row
