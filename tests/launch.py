"""The processes a test starts: the distributed workers and the `slimopt` command under torchrun, and Python
workers of their own (Triton's interpreter, a fresh interpreter's threads). One launcher, so that every launch
keeps its timeout the same way: a process that runs past it is killed with its whole process group (torchrun's
ranks too) and the test fails; no worker outlives its test (docs/design.md, section 5)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DISTRIBUTED = os.path.join(HERE, "distributed")


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun launch."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_process(args: list[str], timeout: float, env: dict | None = None,
                input: str | None = None) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, input=input)`, but in a
    session of its own: past the timeout (or on any interrupt) its whole process group is killed, not only the
    process started, and TimeoutExpired is raised with what it printed."""
    proc = subprocess.Popen(args, stdin=subprocess.PIPE if input is not None else None, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err) from None
    except BaseException:  # a failed test run interrupted (Ctrl-C): its ranks go with it
        _kill_group(proc)
        proc.wait()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session's group: torchrun and every rank it started
    except ProcessLookupError:
        pass


def run_python(*args: str, timeout: float, env: dict | None = None, input: str | None = None):
    """This Python interpreter on `args` (a script or ``-c code``) through run_process."""
    return run_process([sys.executable, *args], timeout, env=env, input=input)


def run_torchrun(nproc: int | None, *args: str, timeout: int = 900) -> str:
    """Run `args` (a script and its options, or ``-m module ...``) under ``torch.distributed.run`` with nproc ranks
    (None: one plain process), one thread a process; fail the test with the errors and the output's tail unless it
    exits 0. Returns its stdout and stderr."""
    head = []
    if nproc is not None:
        head += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
                 "--master_port", str(free_port())]
    # a rank that dies of a signal prints its Python stack (faulthandler), not only its exit code
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    res = run_python(*head, *args, timeout=timeout, env=env)
    text = res.stdout + res.stderr
    if res.returncode != 0:
        errors = [line for line in text.splitlines() if "Error" in line or "assert" in line.lower()]
        pytest.fail(f"{' '.join(args[:3])} at {nproc or 1} ranks failed ({res.returncode}):\n"
                    + "\n".join(errors[-20:]) + crashes(text) + "\n--- tail ---\n" + text[-4000:]
                    + f"\n--- the whole output: {keep_output(text)} ---")
    return text


def crashes(text: str) -> str:
    """The stacks of the ranks that died of a signal, as faulthandler prints them (each from the line before
    "Fatal Python error", where a C++ exception's "terminate called ..." stands, to its module list, which is
    left out), so that a crash's cause is in the failure's message and not only past the output's tail."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            end = next((j for j in range(i, len(lines)) if lines[j].startswith("Extension modules:")), len(lines))
            blocks.append("\n".join(lines[max(0, i - 3):end][:60]))
    return "".join(f"\n--- a rank's crash ---\n{b}" for b in blocks)


def keep_output(text: str) -> str:
    """Write a failed launch's whole output to a file of its own (the temporary folder) and return its path."""
    fd, path = tempfile.mkstemp(prefix="slimopt-launch-", suffix=".log")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def run_worker(nproc: int | None, worker: str, out, *extra: str, phase: str | None = None,
               timeout: int = 900) -> str:
    """tests/distributed/`worker` under run_torchrun, with ``--phase phase`` (if given), ``--out out`` and the
    worker's `extra` options. Returns the launch's output."""
    return run_torchrun(nproc, os.path.join(DISTRIBUTED, worker), *(["--phase", phase] if phase else []),
                        "--out", str(out), *extra, timeout=timeout)


def read_report(out, name: str) -> dict:
    """The JSON report `name` a worker wrote into its folder `out`."""
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def interpreted_worker(script: str) -> dict:
    """Run tests/`script` in a process of its own with Triton's interpreter on and CPU tensors routed as CUDA ones
    (both chosen when triton is imported) and return the JSON object it prints last; skips where triton is not
    installed."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "SLIMOPT_TRITON_CPU": "1", "OMP_NUM_THREADS": "1"}
    res = run_python(os.path.join(HERE, script), timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])
