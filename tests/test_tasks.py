import random

import pytest

from core.tasks import TASKS, make_suite, verify


def test_answers_are_correct_and_wrong_answers_are_wrong():
    for ex in make_suite(400, seed=3):
        args = ex.prompt.split()[1:]
        expected = {
            "add": lambda a: str(int(a[0]) + int(a[1])),
            "sort": lambda a: " ".join(sorted(a, key=int)),
            "reverse": lambda a: a[0][::-1],
            "max": lambda a: str(max(map(int, a))),
        }[ex.task](args)
        assert verify(expected, ex.answer) == 1.0, ex
        assert verify(ex.answer, ex.wrong) == 0.0, ex


def test_suite_is_reproducible_and_balanced():
    a, b = make_suite(40, seed=1), make_suite(40, seed=1)
    assert a == b and a != make_suite(40, seed=2)
    assert {e.task for e in a} == set(TASKS)
    with pytest.raises(ValueError, match="unknown task"):
        make_suite(4, tasks=("add", "fly"))


def test_verify_normalizes_whitespace_only():
    assert verify("1 2 3", " 1  2 3\n") == 1.0
    assert verify("12", "12.") == 0.0


def test_rows_have_trl_formats():
    ex = TASKS["add"](random.Random(0))
    sft = ex.sft_row()
    assert [m["role"] for m in sft["messages"]] == ["user", "assistant"]
    pref = ex.preference_row()
    assert pref["chosen"][0]["content"] != pref["rejected"][0]["content"]
