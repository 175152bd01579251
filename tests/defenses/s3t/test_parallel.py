from __future__ import annotations

import pytest
import torch

from defenses.s3t import S3T


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["process", "ray"])
def test_parallel_executors_give_the_serial_bits(tiny, fast, executor) -> None:
    serial = S3T(tiny.backbone, 2, 2, **fast).fit(tiny.X, tiny.y, tiny.ids)
    parallel = S3T(tiny.backbone, 2, 2, executor=executor, n_jobs=2, **fast)
    parallel.fit(tiny.X, tiny.y, tiny.ids)
    assert _same(serial.active_state(), parallel.active_state())
    assert parallel.lineage() == serial.lineage()
    if executor == "ray":
        import ray

        ray.shutdown()
