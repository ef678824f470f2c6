"""scripts/run_tests.py's report, read from a JUnit XML that pytest itself wrote (an inner suite
run in this process with pytester): test ids as pytest names them, the failed ones, and the
seconds per file, costliest first."""

from __future__ import annotations

import sys
from pathlib import Path

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_names_failures_and_sums_time_per_file(pytester, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    sys.modules.pop("run_tests", None)
    import run_tests

    pytester.makepyfile(**{
        "test_a": "import time\ndef test_one():\n    time.sleep(0.3)\ndef test_two():\n    assert 1 == 2\n",
        "sub/test_b": "class TestK:\n    def test_three(self):\n        pass\n",
    })
    (pytester.path / "sub" / "__init__.py").write_text("")
    xml = pytester.path / "report.xml"
    pytester.runpytest_inprocess("-p", "no:cacheprovider", f"--junitxml={xml}").assert_outcomes(passed=2, failed=1)

    times, failed = run_tests.read_junit(xml)
    assert sorted(tid for _, tid in times) == ["sub/test_b.py::TestK::test_three", "test_a.py::test_one",
                                               "test_a.py::test_two"]
    assert failed == ["test_a.py::test_two"]
    files = run_tests.costliest_files(times)
    assert [(f, n) for f, _, n in files] == [("test_a.py", 2), ("sub/test_b.py", 1)]
    assert files[0][1] >= 0.3 and files[0][1] == sum(s for s, tid in times if tid.startswith("test_a.py"))
    assert run_tests.read_junit(pytester.path / "absent.xml") == ([], [])
