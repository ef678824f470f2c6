import random
from collections import Counter

import pytest

from posttrain.core.tasks import TASKS, make_suite, verify


def test_answers_are_correct_and_wrong_answers_are_wrong():
    for ex in make_suite(400, seed=3):
        args = ex.prompt.split()[1:]
        expected = {
            "copy": lambda a: " ".join(a),
            "reverse": lambda a: " ".join(reversed(a)),
            "sort": lambda a: " ".join(sorted(a, key=int)),
            "max": lambda a: str(max(map(int, a))),
        }[ex.task](args)
        assert verify(expected, ex.answer) == 1.0, ex
        assert verify(ex.answer, ex.wrong) == 0.0, ex
        # a near miss: the same kind and number of symbols as the answer
        assert len(ex.wrong.split()) == len(ex.answer.split()), ex
        assert ex.wrong.replace(" ", "").isdigit() == ex.answer.replace(" ", "").isdigit(), ex


def test_every_symbol_is_its_own_word():
    """One letter or digit per word, so each is a token of its own (see registry tests)."""
    for ex in make_suite(200, seed=5):
        for text in (ex.prompt.split()[1:], ex.answer.split(), ex.wrong.split()):
            assert all(len(w) == 1 for w in text), ex


def test_max_answers_are_spread_out():
    answers = Counter(e.answer for e in make_suite(4000, seed=0, tasks=("max",)))
    assert set(answers) == {str(d) for d in range(1, 10)}
    assert max(answers.values()) < 0.2 * sum(answers.values())


def test_suite_is_reproducible_and_balanced():
    a, b = make_suite(40, seed=1), make_suite(40, seed=1)
    assert a == b and a != make_suite(40, seed=2)
    assert {e.task for e in a} == set(TASKS)
    with pytest.raises(ValueError, match="unknown task"):
        make_suite(4, tasks=("copy", "fly"))


def test_verify_normalizes_whitespace_only():
    assert verify("1 2 3", " 1  2 3\n") == 1.0
    assert verify("12", "12.") == 0.0


def test_rows_have_trl_formats():
    ex = TASKS["reverse"](random.Random(0))
    sft = ex.sft_row()
    assert [m["role"] for m in sft["messages"]] == ["user", "assistant"]
    pref = ex.preference_row()
    assert pref["chosen"][0]["content"] != pref["rejected"][0]["content"]
