from __future__ import annotations

import os

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
