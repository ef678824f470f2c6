"""The fast tier's rule, enforced (docs/testing.md): a test that starts a process (subprocess,
multiprocessing, torchrun, a Prefect or MLflow server, a browser) or listens on a socket is marked
`slow`. In a test without the mark, starting a process or listening on a socket raises
`SpawnInFastTier`, and the test fails naming what it started (at teardown too, in case the code
under test caught the error). tests/conftest.py installs the fixture and the hook;
tests/test_tiers.py checks that they catch each kind of start."""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess
import sys

import pytest


class SpawnInFastTier(RuntimeError):
    """A test outside the slow tier started a process or a server."""


# What a fast-tier test may not do: (owner, attribute, how to name the call from its arguments).
_GUARDED = (
    (subprocess.Popen, "_execute_child", lambda a, k: f"subprocess {a[1] if len(a) > 1 else k.get('args')!r}"),
    (multiprocessing.process.BaseProcess, "start", lambda a, k: f"multiprocessing {a[0]!r}"),
    (os, "fork", lambda a, k: "os.fork()"),
    (os, "posix_spawn", lambda a, k: f"os.posix_spawn {a[0] if a else ''!r}"),
    (socket.socket, "listen", lambda a, k: f"a server listening on {a[0].getsockname()!r}"),
)


def _from_platform_probe() -> bool:
    """The standard library's `platform` runs `file -b` on the interpreter to learn its
    architecture (libraries call it to describe the host): a probe, not the test's own process."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.sep + "platform.py"):
            return True
        frame = frame.f_back
    return False


def _guarded(real, describe, seen):
    def guarded(*args, **kwargs):
        if _from_platform_probe():
            return real(*args, **kwargs)
        what = describe(args, kwargs)
        seen.append(what)
        raise SpawnInFastTier(f"{what}: a test that starts a process or a server belongs to the slow tier; "
                              "mark it @pytest.mark.slow (docs/testing.md)")

    return guarded


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.when == "call":
        item._call_failed = report.failed
    return report


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request):
    """Hold a test without the `slow` mark to the fast tier's rule (module docstring)."""
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    seen: list[str] = []
    patched = []
    for owner, name, describe in _GUARDED:
        real = getattr(owner, name)
        setattr(owner, name, _guarded(real, describe, seen))
        patched.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in patched:
            setattr(owner, name, real)
    if seen and not getattr(request.node, "_call_failed", False):
        pytest.fail(f"fast-tier test started {seen[0]} ({len(seen)} in all); mark it @pytest.mark.slow "
                    "(docs/testing.md)", pytrace=False)
