"""`python -m posttrain.stages.launch torchrun ...`: torchrun with its own arguments, plus what the
launchers need of it. It exits with the first failing rank's exit code (torchrun exits 1 whatever
the rank's), dies with the launching thread when started by a local launch (torchrun then stops
its workers), has its ranks die with it (signals.die_with_agent, called by each stage), and
takes `--chdir=DIR` first, for pods. torch is imported only here, in torchrun's process, never in
the launching one."""

from __future__ import annotations

import os
import signal
import sys

from posttrain.stages.launch.signals import AGENT_PID_ENV, LAUNCHER_PID_ENV, die_with_launcher


def torchrun(argv: list[str]) -> int:
    parent = os.environ.pop(LAUNCHER_PID_ENV, None)
    if parent and not die_with_launcher(int(parent)):
        return 128 + signal.SIGTERM
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks inherit it (torchrun copies its env)
    if argv and argv[0].startswith("--chdir="):
        os.chdir(argv.pop(0).split("=", 1)[1])
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        run.run(run.parse_args(argv))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        code = e.get_first_failure()[1].exitcode
        return code if code > 0 else 128 - code if code < 0 else 1
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] != ["torchrun"]:
        sys.exit("usage: python -m posttrain.stages.launch torchrun [torchrun arguments]")
    return torchrun(argv[1:])
