"""S3T: exact unlearning with sequence-aware sharded sliced training.

Chowdhury et al., "Towards Scalable Exact Machine Unlearning Using Parameter-Efficient
Fine-Tuning", ICLR 2025. The estimator :class:`S3T` (fit, predict, delete, retrain,
lineage) on any ``torch.nn.Module`` with ``target_modules`` (the layers that get the
sliced adapters, :mod:`defenses.s3t.adapters`), the baselines :class:`SISA` and
:class:`FullRetrain`, and the exactness audits in :mod:`defenses.s3t.attacks`.
"""

from defenses.s3t.attacks import lineage_audit, twin_test
from defenses.s3t.backbone import ResidualMLP, pretrain
from defenses.s3t.baselines import SISA, FullRetrain
from defenses.s3t.defense import (
    S3T,
    AllShardsDeadError,
    DeletionReceipt,
    NotFittedError,
    RetrainReceipt,
    Unlearner,
)
from defenses.s3t.defense.state import UnknownIdError
from defenses.s3t.store import StateFileError

__all__ = [
    "S3T",
    "SISA",
    "AllShardsDeadError",
    "DeletionReceipt",
    "FullRetrain",
    "NotFittedError",
    "ResidualMLP",
    "RetrainReceipt",
    "StateFileError",
    "UnknownIdError",
    "Unlearner",
    "lineage_audit",
    "pretrain",
    "twin_test",
]
