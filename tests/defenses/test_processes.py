import os
import subprocess
import sys

import pytest

from defenses.processes import pid_alive


def test_a_running_process_is_alive_and_a_reaped_one_is_not() -> None:
    assert pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_a_process_that_cannot_be_probed_counts_as_alive() -> None:
    if os.geteuid() == 0:
        pytest.skip("root may signal every process: nothing refuses the probe")
    assert pid_alive(1)
