"""The compiled kernels' disk cache (:mod:`defenses.jit`): where, trust, freshness.

Each process test runs a tiny kernel (a scalar function, about a second to compile)
in a fresh interpreter, from a package written in a temporary folder, and reads the
one line the suite logs when a call has to compile. A read-only install is a
read-only bind mount in a private mount namespace when the tests run as root (whom
file modes do not stop), and file modes otherwise.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

jit = pytest.importorskip("defenses.jit")

KERNEL = """
from defenses.jit import compiled, inlined
from helper import SCALE, shift

@compiled
def affine(x):
    return SCALE * shift(x)
"""
HELPER = """
from defenses.jit import inlined

SCALE = 2.0

@inlined
def shift(x):
    return x + 1.0
"""
CALL = "import kern; print(kern.affine(3.0))"
NOTICE = "compiling kern.affine"


@pytest.fixture
def package() -> Iterator[Path]:
    """A folder holding the tiny kernel module and its helper (readable by all)."""
    root = Path(tempfile.mkdtemp(prefix="kernel-cache-"))
    root.chmod(0o755)
    (root / "kern.py").write_text(textwrap.dedent(KERNEL))
    (root / "helper.py").write_text(textwrap.dedent(HELPER))
    yield root
    for path in root.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)
    shutil.rmtree(root, ignore_errors=True)


def can_make_read_only() -> bool:
    """Whether this process can make a folder read-only for a child."""
    if os.getuid() != 0:
        return True
    if shutil.which("unshare") is None:
        return False
    probe = tempfile.mkdtemp()
    try:
        done = subprocess.run(
            ["unshare", "-m", "sh", "-c", _ro_script([probe]) + "exit 0"],
            capture_output=True,
        )
        return done.returncode == 0
    finally:
        os.rmdir(probe)


def _ro_script(folders: list[str]) -> str:
    lines = [
        f"mount --bind '{f}' '{f}' && mount -o remount,bind,ro '{f}' && "
        for f in folders
    ]
    return "".join(lines)


def run_call(
    package: Path, home: Path, tmp: Path, read_only: tuple[Path, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """Run the tiny kernel in a fresh interpreter, ``read_only`` not writable."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (jit.CACHE_ENV, "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")
    }
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=_pythonpath(package))
    argv = [sys.executable, "-c", CALL]
    folders = [str(p) for p in read_only]
    if folders and os.getuid() == 0:
        script = _ro_script(folders) + 'exec "$@"'
        argv = ["unshare", "-m", "sh", "-c", script, "sh", *argv]
    elif folders:
        for p in read_only:
            p.chmod(0o555)
    try:
        done = subprocess.run(
            argv, env=env, capture_output=True, text=True, cwd=package
        )
        assert done.returncode == 0, done.stderr
        return done
    finally:
        if os.getuid() != 0:
            for p in read_only:
                p.chmod(0o755)


def _pythonpath(package: Path) -> str:
    here = Path(jit.__file__).resolve().parents[1]
    return os.pathsep.join([str(package), str(here)])


def notices(done: subprocess.CompletedProcess[str]) -> int:
    assert done.stdout.strip() == "8.0"  # 2 * (3 + 1)
    return done.stderr.count(NOTICE)


needs_read_only = pytest.mark.skipif(
    not can_make_read_only(), reason="cannot make a folder read-only here"
)


@needs_read_only
def test_cache_built_at_install_is_used_read_only(package, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    temp = tmp_path / "tmp"
    temp.mkdir()
    assert notices(run_call(package, home, temp)) == 1  # the install step
    assert list((package / "__pycache__").glob("kern.affine*.nbi"))
    done = run_call(package, home, temp, read_only=(package, home))
    assert notices(done) == 0
    assert not list(temp.rglob("*.nb*"))  # loaded, nothing compiled or written


@needs_read_only
def test_read_only_install_and_home_cache_in_a_private_temp_folder(package, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    temp = tmp_path / "tmp"
    temp.mkdir()
    first = run_call(package, home, temp, read_only=(package, home))
    assert notices(first) == 1
    private = temp / f"defense-suite-{os.getuid()}"
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert list(private.rglob("kern.affine*.nbc"))
    assert not (package / "__pycache__").exists()
    second = run_call(package, home, temp, read_only=(package, home))
    assert notices(second) == 0


@pytest.mark.skipif(
    os.getuid() != 0 or not can_make_read_only(),
    reason="needs a private mount namespace to make the temporary folders read-only",
)
def test_nothing_writable_still_answers(package, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    temp = tmp_path / "tmp"
    temp.mkdir()
    system = tuple(Path(p) for p in ("/tmp", "/var/tmp") if os.path.isdir(p))
    done = run_call(package, home, temp, read_only=(package, home, temp, *system))
    assert notices(done) == 1
    assert "not cached" in done.stderr


def _private_chain(root: Path, *parts: str) -> Path:
    path = root
    for part in parts:
        path = path / part
        path.mkdir(mode=0o700)
        path.chmod(0o700)
    return path


def test_a_folder_others_can_write_is_never_read(tmp_path, monkeypatch):
    source = tmp_path / "pkg" / "kern.py"
    source.parent.mkdir()
    source.write_text("")
    sub = jit.caching._CacheLocator.get_suitable_cache_subpath(str(source))
    monkeypatch.delenv(jit.CACHE_ENV, raising=False)
    monkeypatch.setattr(jit, "_numba_cache_dir", lambda: "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "xdg").mkdir()
    (tmp_path / "tmp").mkdir()
    user = _private_chain(tmp_path / "xdg", "defense-suite", "numba", sub)
    planted = _private_chain(
        tmp_path / "tmp", f"defense-suite-{os.getuid()}", "numba", sub
    )
    planted.parents[1].chmod(0o777)  # e.g. made by another user in a shared /tmp
    jit._FOLDERS.clear()
    try:
        read, _ = jit.cache_folders(str(source))
        assert user in read
        assert planted not in read
        planted.parents[1].chmod(0o700)
        jit._FOLDERS.clear()
        assert planted in jit.cache_folders(str(source))[0]
        planted.chmod(0o770)  # group-writable: refused too
        jit._FOLDERS.clear()
        assert planted not in jit.cache_folders(str(source))[0]
    finally:
        jit._FOLDERS.clear()


def test_explicit_folder_replaces_the_list(tmp_path, monkeypatch):
    monkeypatch.setenv(jit.CACHE_ENV, str(tmp_path / "mine"))
    jit._FOLDERS.clear()
    read, write = jit.cache_folders(jit.__file__)
    assert len(read) == 1
    assert read[0] == write
    assert (tmp_path / "mine") in write.parents
    jit._FOLDERS.clear()


def test_stamp_covers_helpers_in_other_files_and_their_constants(package):
    sys.path.insert(0, str(package))
    try:
        import helper
        import kern

        before = jit._stamp(kern.affine.py_func)
        original = (package / "helper.py").read_text()
        (package / "helper.py").write_text(original.replace("x + 1.0", "x + 2.0"))
        edited = jit._stamp(kern.affine.py_func)
        (package / "helper.py").write_text(original)
        assert jit._stamp(kern.affine.py_func) == before
        helper.SCALE = 3.0
        kern.SCALE = 3.0
        rescaled = jit._stamp(kern.affine.py_func)
    finally:
        sys.path.remove(str(package))
        sys.modules.pop("kern", None)
        sys.modules.pop("helper", None)
    assert len({before, edited, rescaled}) == 3


@pytest.mark.slow
def test_the_warm_up_compiles_every_path_a_call_takes():
    """After ``warmup.run()`` no public call compiles another version of a kernel."""
    import numpy as np

    from defenses.ssd import StealthyShield, water_filling
    from defenses.ssd.kernels import blake2b, projection, shield, small, warmup

    kernels = (
        shield.shield_rows,
        small.shield_rows_small,
        blake2b.blake2b_rows,
        projection.project_rows,
    )
    # in the call, so that a path the warm-up missed compiles here and is counted
    # (elsewhere a cold call is answered by the twin while another process compiles)
    scope = jit.compile_in_call()
    scope.__enter__()
    warmup.run()
    warmed = [len(kernel.signatures) for kernel in kernels]
    assert warmed == [2, 2, 1, 1]  # float32 and float64 rows; bytes; float64
    rng = np.random.default_rng(1)
    for k in (2, 10, 16, 17, 100):
        val = rng.dirichlet(np.ones(k), size=3 * k)
        fitted = StealthyShield(seed=0, seeding="input-hash")
        fitted.fit(val, np.arange(3 * k) % k)
        read_only = val.copy()
        read_only.flags.writeable = False  # e.g. a memory map or a pandas buffer
        for rows in (val, val.astype(np.float32), read_only):
            fitted(rows, inputs=rows)
            fitted.pseudo_labels(rows)
        water_filling(read_only, read_only[::-1].copy(), np.ones(3 * k))
    scope.__exit__(None, None, None)
    assert [len(kernel.signatures) for kernel in kernels] == warmed
