from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from defenses.s3t import S3T, SISA, StateFileError
from defenses.s3t.attacks import lineage_audit


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_load_round_trip(tiny, fast, tmp_path) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    model.delete([tiny.ids[4]])
    model.save(tmp_path / "m.s3t")
    other = S3T(tiny.backbone, 2, 2, **fast).load(tmp_path / "m.s3t")
    assert _same(model.active_state(), other.active_state())
    assert other.served() == model.served()
    assert other.lineage() == model.lineage()
    np.testing.assert_array_equal(
        other.predict_proba(tiny.test_X), model.predict_proba(tiny.test_X)
    )
    with pytest.raises(KeyError, match="already deleted"):
        other.delete([tiny.ids[4]])


def test_corrupted_or_mismatched_files_leave_the_model_as_it_was(
    tiny, fast, tmp_path
) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    path = tmp_path / "m.s3t"
    model.save(path)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF
    (tmp_path / "bad.s3t").write_bytes(bytes(blob))
    (tmp_path / "short.s3t").write_bytes(path.read_bytes()[:100])
    (tmp_path / "junk.s3t").write_bytes(b"hello")
    target = S3T(tiny.backbone, 2, 2, **fast).fit(
        tiny.X[:100], tiny.y[:100], tiny.ids[:100]
    )
    before = target.active_state()
    for name, match in [
        ("bad.s3t", "checksum"),
        ("short.s3t", "checksum"),
        ("junk.s3t", "magic"),
    ]:
        with pytest.raises(StateFileError, match=match):
            target.load(tmp_path / name)
        assert _same(before, target.active_state())
    for other, match in [
        (SISA(tiny.backbone, 2, 2, **fast), "class"),
        (S3T(tiny.backbone, 2, 2, seed=1, **fast), "seed"),
        (S3T(tiny.backbone, 2, 2, 1, **fast), "orders"),
    ]:
        with pytest.raises(StateFileError, match=match):
            other.load(path)
        assert not other.fitted
    with pytest.raises(FileNotFoundError):
        target.load(tmp_path / "missing.s3t")


def test_a_different_backbone_is_a_mismatch(tiny, fast, tmp_path) -> None:
    model = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    model.save(tmp_path / "m.s3t")
    changed = type(tiny.backbone)(64, 24, 32, 4, 10)
    changed.eval()
    with pytest.raises(StateFileError, match="backbone"):
        S3T(changed, 2, 2, **fast).load(tmp_path / "m.s3t")


def test_deletion_is_atomic_on_disk(tiny, fast, tmp_path, monkeypatch) -> None:
    path = tmp_path / "live.s3t"
    model = S3T(tiny.backbone, 2, 2, store=path, **fast).fit(tiny.X, tiny.y, tiny.ids)
    on_disk = path.read_bytes()
    before = model.active_state()

    def crash(*args: object) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        model.delete([tiny.ids[0]])
    monkeypatch.undo()
    assert path.read_bytes() == on_disk
    assert _same(before, model.active_state())
    assert tiny.ids[0] in model.training_ids()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["live.s3t"]

    model.delete([tiny.ids[0]])
    fresh = S3T(tiny.backbone, 2, 2, **fast).load(path)
    assert tiny.ids[0] not in fresh.training_ids()
    assert lineage_audit(fresh, [tiny.ids[0]]).clean
    row = tiny.X[0].astype(np.float32).tobytes()
    assert row not in path.read_bytes()
    assert _same(fresh.active_state(), model.active_state())


def _files_holding(root, needles: list[bytes]) -> dict[str, int]:
    found = {}
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        blob = file.read_bytes()
        hits = sum(needle in blob for needle in needles)
        if hits:
            found[file.name] = hits
    return found


def _killed_save(model: S3T, path: Path) -> int:
    """Fork; the child dies (``os._exit``, no cleanup runs) after the temporary write.

    A forked child is killed exactly as a separate interpreter would be (no
    ``finally`` or ``except`` clause of the store runs) without paying for a fresh
    interpreter's imports and a second fit. Returns the child's exit code.
    """
    import time
    import warnings

    with warnings.catch_warnings():  # 3.12+: fork of a process with threads; the
        warnings.simplefilter("ignore", DeprecationWarning)  # child only writes
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.replace = lambda *args: os._exit(17)  # die after the temporary write
            model.save(path)
        finally:
            os._exit(1)
    deadline = time.monotonic() + 300
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the killed save hung")
        time.sleep(0.01)


def test_a_save_killed_before_the_rename_leaves_no_copy_of_deleted_rows(
    tiny, tmp_path
) -> None:
    from defenses.s3t import store

    state = tmp_path / "state"
    path = state / "model.s3t"
    writer = S3T(tiny.backbone, 2, 2, store=path, epochs=1, batch_size=32, rank=2)
    writer.fit(tiny.X, tiny.y, tiny.ids)
    assert _killed_save(writer, path) == 17
    stale = store.temporary_files(path)
    assert len(stale) == 1
    assert stale[0].name.endswith(".s3t-tmp")
    forget = tiny.ids[:12]
    rows = [tiny.X[i].astype(np.float32).tobytes() for i in range(12)]
    kept = [tiny.X[i].astype(np.float32).tobytes() for i in range(12, 24)]
    # power: both the state file and the killed save's copy hold the rows
    assert _files_holding(state, rows) == {"model.s3t": 12, stale[0].name: 12}

    model = S3T(tiny.backbone, 2, 2, store=path, epochs=1, batch_size=32, rank=2)
    model.load(path)
    assert store.temporary_files(path) == []  # the load removed the stale copy
    model.delete(forget)
    model.save(path)
    assert sorted(p.name for p in state.rglob("*")) == ["model.s3t"]
    assert _files_holding(state, rows) == {}
    assert _files_holding(state, kept) == {"model.s3t": 12}


def test_stale_copies_are_removed_by_the_next_save_but_live_ones_are_kept(
    tiny, fast, tmp_path
) -> None:
    import fcntl

    from defenses.s3t import store

    path = tmp_path / "m.s3t"
    model = S3T(tiny.backbone, 2, 2, **fast).fit(
        tiny.X[:60], tiny.y[:60], tiny.ids[:60]
    )
    dead = tmp_path / f".m.s3t.999999.deadbeef{store.TEMP_SUFFIX}"
    dead.write_bytes(b"old state")
    live = tmp_path / f".m.s3t.1.cafe{store.TEMP_SUFFIX}"
    live.write_bytes(b"being written")
    other = tmp_path / f".other.s3t.1.cafe{store.TEMP_SUFFIX}"
    other.write_bytes(b"another target")
    with live.open("rb") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        model.save(path)
        assert not dead.exists()
        assert live.exists()
        assert other.exists()
    model.save(path)
    assert not live.exists()
    assert other.exists()


def test_a_failed_write_removes_its_temporary_file(
    tiny, fast, tmp_path, monkeypatch
) -> None:
    from defenses.s3t import store

    model = S3T(tiny.backbone, 2, 2, **fast).fit(
        tiny.X[:60], tiny.y[:60], tiny.ids[:60]
    )

    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        model.save(tmp_path / "m.s3t")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(store, "encode", lambda payload: b"x" * 10)
    monkeypatch.setattr(
        os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt())
    )
    with pytest.raises(KeyboardInterrupt):
        model.save(tmp_path / "m.s3t")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
