"""``python -m <module> ...`` commands run in forks of one interpreter that has already imported the third-party
packages they all import first (torch, transformers, pyarrow, Hydra, Ray): each command does its own work, from its own
``__main__`` on, without paying a fresh interpreter's start and imports. For a matrix of commands that are refused
within a second of their imports, that start is most of their cost.

A forked command is the command as ``python -m`` runs it: its own working directory (also ``sys.path[0]``),
environment, argv, stdin (no controlling terminal, as a process started with its stdin on a terminal it does not
own), stdout and stderr files, its own session (a timeout kills its whole process group), an exit code with the
interpreter's meaning (``SystemExit``'s code, 1 and a traceback for an uncaught exception), and the interpreter's
shutdown: its non-daemon threads joined, then ``atexit``. Its peak memory (``wait4``'s ``ru_maxrss``) starts at the
server's resident memory, so ``Outcome.grown_mb`` is what the command added over a fork that runs nothing. The
project's own modules are never preloaded: every command imports them itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_PRELOADED = ("torch", "torch.distributed.checkpoint", "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto", "pyarrow.parquet", "hydra", "omegaconf", "ray")

# The server: answers "<peak RSS in KiB>" of a fork that runs nothing, then reads one job a line from the pipe it was
# given as stdin, forks the command, answers its pid, then "<exit code> <peak RSS in KiB>". Its own stdin and stdout
# point at /dev/null once the pipes are kept aside, so a fork's ``sys.stdin``/``sys.stdout`` hold no protocol bytes.
_SERVER = r"""
import atexit, gc, importlib, json, os, runpy, sys, threading, traceback
for name in sys.argv[1:]:
    importlib.import_module(name)
gc.collect()
jobs, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w", buffering=1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)
os.dup2(null, 1)


def command(job):
    code = 1
    try:
        os.setsid()
        jobs.close()
        replies.close()
        os.chdir(job["cwd"])
        sys.path[0] = job["cwd"]
        os.environ.clear()
        os.environ.update(job["env"])
        for fd, path, flags in ((0, job["stdin"], os.O_RDWR | os.O_NOCTTY), (1, job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            os.dup2(os.open(path, flags, 0o644), fd)
        sys.argv = [job["module"], *job["args"]]
        try:
            runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                code = stop.code or 0
            else:
                print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def wait(pid):
    _, status, usage = os.wait4(pid, 0)
    return os.waitstatus_to_exitcode(status), usage.ru_maxrss


pid = os.fork()
if pid == 0:
    os._exit(0)
replies.write(f"{wait(pid)[1]}\n")
for line in jobs:
    pid = os.fork()
    if pid == 0:
        command(json.loads(line))
    replies.write(f"{pid}\n")
    replies.write("%d %d\n" % wait(pid))
"""


class ServerGone(RuntimeError):
    """The server interpreter exited (its imports failed, or it was killed)."""


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(pid, signal.SIGKILL)


@dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    grown_mb: float  # its peak memory over that of a fork of the server that runs nothing


class PreloadedCommands:
    """One server interpreter; ``run`` one command at a time through it (use one server per thread)."""

    def __init__(self, env: dict) -> None:
        self._server = subprocess.Popen(
            [sys.executable, "-c", _SERVER, *_PRELOADED], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._baseline_kib = int(self._reply())

    def _reply(self) -> str:
        line = self._server.stdout.readline()
        if not line:
            raise ServerGone(f"the preloaded interpreter exited (status {self._server.wait(10)}) before it answered")
        return line

    def run(self, argv: list[str], cwd: Path, env: dict, stdin: str, timeout_s: float) -> Outcome:
        """``python <argv>`` (``argv`` starts ``-m <module>``) in ``cwd`` with ``env``, its stdin the file or terminal
        at ``stdin``; stdout and stderr captured apart. Past ``timeout_s`` its process group is killed: exit code -9."""
        if argv[:1] != ["-m"]:
            raise ValueError(f"only `python -m <module> ...` commands run preloaded, not {argv}")
        job = {"module": argv[1], "args": [str(arg) for arg in argv[2:]], "cwd": str(cwd), "env": env, "stdin": stdin,
               "stdout": str(cwd / "stdout.txt"), "stderr": str(cwd / "stderr.txt")}  # fmt: skip
        self._server.stdin.write(json.dumps(job) + "\n")
        pid = int(self._reply())
        overdue = threading.Timer(timeout_s, _kill_group, (pid,))
        overdue.start()
        try:
            code, peak_kib = (int(n) for n in self._reply().split())
        except ServerGone:
            _kill_group(pid)
            raise
        finally:
            overdue.cancel()
        read = lambda name: (cwd / name).read_text(errors="replace")  # noqa: E731
        return Outcome(code, read("stdout.txt"), read("stderr.txt"), (peak_kib - self._baseline_kib) / 1024)

    def close(self) -> None:
        self._server.stdin.close()
        self._server.wait(60)

    def __enter__(self) -> PreloadedCommands:
        return self

    def __exit__(self, *_) -> None:
        self.close()
