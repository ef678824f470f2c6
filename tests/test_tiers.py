"""The fast tier's guard (tests/support/tier_guard.py) catches each way a test can start a process or a
server, also when the code under test swallows the error, and lets the slow tier and the standard
library's `platform` probe through. Run on a small inner suite with pytester, in this process (so
nothing is started here either: each start is refused by the inner guard before it happens)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import multiprocessing, os, platform, socket, subprocess, sys
import pytest

def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])

def test_swallowed():
    try:
        subprocess.check_output(["true"])
    except Exception:
        pass

def test_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()

def test_fork():
    os.fork()

def test_listen():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()

def test_platform_probe():
    platform.architecture()

def test_plain():
    assert sum(range(4)) == 6

@pytest.mark.slow
def test_marked_slow():
    from tests.support import tier_guard
    assert subprocess.Popen._execute_child is tier_guard.OUTER_FOR_TEST  # no guard of the inner run's
'''


def test_the_guard_fails_each_start_and_passes_the_rest(pytester, monkeypatch):
    import subprocess

    from tests.support import tier_guard

    # this process's own Popen._execute_child (its guard, this test being fast), for the inner
    # slow test to find unwrapped by the inner guard
    monkeypatch.setattr(tier_guard, "OUTER_FOR_TEST", subprocess.Popen._execute_child, raising=False)
    pytester.makeconftest("from tests.support.tier_guard import _fast_tier_starts_no_process, pytest_runtest_makereport\n")
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    outcomes = {r.nodeid.split("::")[-1]: (r.when, r.outcome) for r in result.reprec.getreports("pytest_runtest_logreport")
                if r.failed}
    assert set(outcomes) == {"test_subprocess", "test_swallowed", "test_multiprocessing", "test_fork", "test_listen"}
    assert outcomes["test_swallowed"] == ("teardown", "failed")  # caught by the code, still failed
    assert outcomes["test_subprocess"] == ("call", "failed")  # and reported once, not again at teardown
    result.assert_outcomes(passed=4, failed=4, errors=1)
    text = result.stdout.str()
    assert "mark it @pytest.mark.slow" in text and "a server listening on ('127.0.0.1'" in text
