"""The test launcher's report of a crashed worker: a process that dies of a signal shows its stack in the failure's
message, and the whole output is kept in a file (tests/launch.py)."""

from __future__ import annotations

import os

import pytest
from launch import run_torchrun

CRASH = "import os\ndef deep():\n    os.abort()\nprint('x' * 9000)\ndeep()\n"


def test_a_crashed_process_shows_its_stack_and_keeps_its_output():
    with pytest.raises(pytest.fail.Exception) as failed:
        run_torchrun(None, "-c", CRASH, timeout=60)
    message = str(failed.value)
    crash = message.split("--- a rank's crash ---")[1]
    assert "Fatal Python error: Aborted" in crash and "in deep" in crash
    assert "Extension modules:" not in crash
    path = message.rsplit("--- the whole output: ", 1)[1].split(" ---")[0]
    with open(path) as f:
        assert "x" * 9000 in f.read()
    os.remove(path)
