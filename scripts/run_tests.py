"""Run the test suite as `make test` / `make test-fast` and CI do, and end with a report a red CI
can be read by from its last lines.

    .venv/bin/python scripts/run_tests.py [--fast] [-- PYTEST ARGS...]

Two pytest processes: the Triton kernels' tests run under the interpreter (TRITON_INTERPRET=1,
which must be set before triton is imported: tests/kernels/conftest.py), everything else in the
first. `--fast` runs the fast tier, `-m "not slow"` (docs/testing.md). Each process writes a JUnit
XML report; from the two, the last lines printed are the 25 slowest tests, the 15 files that took
longest, the tests that failed, and pytest's own time against the tier's budget:

    full suite: a warning past 25 minutes, a failure (exit 3) past 75 (CI stops at 90: a readable
                report instead of a kill; 60 once the suite is under 25, issue 38);
    fast tier:  a warning past 4 minutes.

Exit status: the first failing pytest's (a pytest that collected nothing, exit 5, counts as
passed: PYTEST ARGS may select no kernel test), else 3 when over the hard budget, else 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

NO_TESTS_COLLECTED = 5
OVER_BUDGET = 3
# (warn past, fail past) in seconds of pytest time, per tier
BUDGETS = {"full": (25 * 60, 75 * 60), "fast": (4 * 60, None)}
SLOWEST = 25
COSTLIEST_FILES = 15
WORKERS = 2  # pytest-xdist workers of the main process (docs/testing.md, "Two workers")


def read_junit(path: Path) -> tuple[list[tuple[float, str]], list[str]]:
    """(seconds, test id) of every test case, and the ids of those that failed or errored."""
    if not path.exists():
        return [], []
    times, failed = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        # JUnit's classname is the dotted module path (plus a class); pytest's id uses the file
        parts = cls.split(".")
        mod = next((i for i in range(len(parts), 0, -1) if Path(*parts[:i]).with_suffix(".py").exists()), len(parts))
        tid = "::".join(["/".join(parts[:mod]) + ".py", *parts[mod:], name])
        times.append((float(case.get("time", 0.0)), tid))
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(tid)
    return times, failed


def costliest_files(times: list[tuple[float, str]]) -> list[tuple[str, float, int]]:
    """(file, seconds, tests) per test file, the costliest first."""
    per_file: dict[str, list[float]] = {}
    for secs, tid in times:
        per_file.setdefault(tid.split("::")[0], []).append(secs)
    return sorted(((f, sum(t), len(t)) for f, t in per_file.items()), key=lambda r: -r[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fast", action="store_true", help='the fast tier: -m "not slow"')
    p.add_argument("--workers", type=int, default=int(os.environ.get("POSTTRAIN_TEST_WORKERS", WORKERS)),
                   help="pytest-xdist workers for the main process, whole files to a worker "
                        f"(default {WORKERS}, or $POSTTRAIN_TEST_WORKERS; 1: no xdist)")
    p.add_argument("pytest_args", nargs="*", help="passed to both pytest processes (after --)")
    args = p.parse_args(argv)
    tier = "fast" if args.fast else "full"
    warn_s, fail_s = BUDGETS[tier]
    common = ["-q", "-ra", f"--durations={SLOWEST}", *(["-m", "not slow"] if args.fast else []), *args.pytest_args]
    reports = Path(tempfile.mkdtemp(prefix="posttrain-junit-"))
    xdist = ["-n", str(args.workers), "--dist", "loadfile"] if args.workers > 1 else []
    runs = [("main", ["--ignore=tests/kernels", *xdist], {}),
            ("kernels", ["tests/kernels"], {"TRITON_INTERPRET": "1"})]
    spent, rc, times, failed = 0.0, 0, [], []
    for name, where, env in runs:
        xml = reports / f"{name}.xml"
        cmd = [sys.executable, "-m", "pytest", *where, *common, f"--junitxml={xml}"]
        print("+", *(f"{k}={v}" for k, v in env.items()), *cmd[1:], flush=True)
        start = time.monotonic()
        code = subprocess.call(cmd, env={**os.environ, **env})
        spent += time.monotonic() - start
        if code not in (0, NO_TESTS_COLLECTED) and rc == 0:
            rc = code
        t, f = read_junit(xml)
        times += t
        failed += f
        if code not in (0, NO_TESTS_COLLECTED) and not f:
            failed.append(f"(pytest {name} exited {code} with no failing test in its report: see above)")

    print(f"\n==== run_tests: the {SLOWEST} slowest tests ({tier} tier, set-up and teardown included) ====")
    for secs, tid in sorted(times, reverse=True)[:SLOWEST]:
        print(f"{secs:8.2f}s  {tid}")
    print(f"==== run_tests: the {COSTLIEST_FILES} costliest files (seconds, tests) ====")
    for path, secs, n in costliest_files(times)[:COSTLIEST_FILES]:
        print(f"{secs:8.1f}s  {n:4d}  {path}")
    print(f"==== run_tests: {len(times)} tests, {len(failed)} failed ====")
    for tid in failed:
        print(f"FAILED {tid}")
    print(f"run_tests: pytest took {spent / 60:.1f} min ({tier} tier: warning past {warn_s / 60:.0f} min"
          + (f", failure past {fail_s / 60:.0f} min)" if fail_s else ")"), flush=True)
    if spent > warn_s:
        print(f"run_tests: WARNING: the {tier} tier took longer than {warn_s / 60:.0f} min: mark slow tests, "
              "merge overlapping ones or share their set-up (docs/testing.md)", flush=True)
    if rc == 0 and fail_s is not None and spent > fail_s:
        print(f"run_tests: FAILED: over the {fail_s / 60:.0f}-minute budget", flush=True)
        return OVER_BUDGET
    return rc


if __name__ == "__main__":
    sys.exit(main())
