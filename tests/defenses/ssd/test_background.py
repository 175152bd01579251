"""Background compilation (:mod:`defenses.ssd.kernels.background`) in fresh processes.

A tiny kernel (a scalar function, about a second to compile) and a twin that
answers differently, so the probe can tell which one answered; each case runs in a
fresh interpreter with its own empty cache folder and reads the suite's log lines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("numba")

KERNEL = """
from defenses.jit import compiled

@compiled
def twice(x):
    return 2.0 * x

def twin(x):
    return -1.0
"""
PROBE = """
import json, os, sys, time
import numba
import kern
from defenses.ssd.kernels import background

def call():
    return background.pick(kern.twice, kern.twin, (3.0,))(3.0)

{before}
first = call()
{between}
ended = background.wait(300)
second = call()
print(json.dumps([first, ended, second]))
"""
BACKGROUND = "in a background process"
IN_CALL = "float64: first call with these types"  # the in-call notice


def probe(root: Path, cache: Path, before: str = "", between: str = "", **env: str):
    """Run the probe in ``root``; its answers and its stderr."""
    code = PROBE.format(before=textwrap.dedent(before), between=between)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=dict(os.environ, DEFENSE_SUITE_CACHE_DIR=str(cache), **env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "pkg"
    folder.mkdir()
    (folder / "kern.py").write_text(textwrap.dedent(KERNEL))
    return folder


def test_a_cold_call_is_answered_by_the_twin_then_by_the_kernel(root, tmp_path):
    cache = tmp_path / "cache"
    answers, err = probe(root, cache)
    assert answers == [-1.0, True, 6.0]
    assert err.count(BACKGROUND) == 1
    assert IN_CALL not in err
    assert not list(cache.rglob("*.compiling"))  # the lock is gone
    # a later process loads the cached code: the kernel answers its first call
    answers, err = probe(root, cache)
    assert answers == [6.0, True, 6.0]
    assert BACKGROUND not in err
    assert IN_CALL not in err


def test_inline_mode_compiles_in_the_call(root, tmp_path):
    answers, err = probe(root, tmp_path / "cache", DEFENSE_SUITE_JIT="inline")
    assert answers == [6.0, True, 6.0]
    assert IN_CALL in err
    assert BACKGROUND not in err


LOCK = """
lock = background.lock_path(kern.twice, (numba.types.float64,))
lock.parent.mkdir(parents=True, exist_ok=True)
lock.write_text(str({pid}))
"""


def test_a_compilation_another_process_holds_is_awaited(root, tmp_path):
    # the lock names a live process (the test runner): no second compilation
    # starts; once the lock is gone the call compiles (nothing was cached)
    between = "lock.unlink(); time.sleep(2 * background.POLL_S)"
    answers, err = probe(
        root, tmp_path / "cache", before=LOCK.format(pid=os.getpid()), between=between
    )
    assert answers == [-1.0, True, 6.0]
    assert BACKGROUND not in err
    assert IN_CALL in err


def test_a_lock_left_by_a_dead_process_is_taken_over(root, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    answers, err = probe(root, tmp_path / "cache", before=LOCK.format(pid=dead.pid))
    assert answers == [-1.0, True, 6.0]
    assert err.count(BACKGROUND) == 1


def test_with_no_writable_cache_folder_the_call_compiles(root, tmp_path):
    # a file where the cache folder would be: no one (root included) can make it
    blocked = tmp_path / "cache"
    blocked.write_text("")
    answers, err = probe(root, blocked)
    assert answers == [6.0, True, 6.0]
    assert IN_CALL in err
    assert BACKGROUND not in err


@pytest.mark.slow
def test_the_ahead_of_time_step_compiles_in_its_own_process(tmp_path):
    # run as ``python -m defenses.jit`` (the file is ``__main__`` there): every
    # kernel compiles in that process, none in a background one, and a later
    # process's first calls find them all
    env = dict(os.environ, DEFENSE_SUITE_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "defenses.jit"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr
    assert BACKGROUND not in done.stderr
    assert "defenses.ssd.kernels.warmup" in done.stdout
    code = "import numpy as np\nfrom defenses.ssd.kernels import warmup\nwarmup.run()\n"
    later = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert later.returncode == 0, later.stderr
    assert "compiling" not in later.stderr
