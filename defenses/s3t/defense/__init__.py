r"""S3T: exact unlearning with sequence-aware sharded sliced training.

Chowdhury, Choromanski, Sehanobish, Dubey, Chaturvedi, "Towards Scalable Exact
Machine Unlearning Using Parameter-Efficient Fine-Tuning", ICLR 2025
(arXiv:2406.16257).

The fine-tuning data are split into ``m`` shards of ``L`` slices each (by a salted
hash of the sample ids, so removing a point never moves another). A frozen backbone
(any ``torch.nn.Module``) gets ``L`` groups of LoRA adapters on its target layers,
counted from the top. For each of ``B`` slice
orders ``pi`` per shard, stage ``k`` trains adapter group ``k`` and a stage head on
``S_{pi_1} u ... u S_{pi_k}`` (see :mod:`defenses.s3t.training`); stages are cached
by ordered prefix.

Deleting a point of slice ``j`` switches off, in every order of its shard, the stages
from the position of ``j`` on, and erases their tensors: what is left of an order is
exactly its stage ``pos(j) - 1`` model, a function of data without the point. Each
shard serves the surviving model with the longest prefix; the shards' class
probabilities are averaged. The served system is thus a data-independent
post-processing of ``A(D \ {x})`` (exact unlearning in the sense of Cao and Yang,
2015, and Bourtoule et al., 2021); :meth:`Unlearner.retrain` brings it back to
exactly ``A(D \ {x})``, bit for bit, by retraining the switched-off stages.

Expected deletions before every shard is dead (uniform deletions, cyclic orders):
``m L H_{m B'}`` with ``B' = min(B, L)``, against ``m L H_m`` for SISA
(:mod:`defenses.s3t.sequences`).

:class:`S3T` (:mod:`.s3t`) is the method, on the engine :class:`Unlearner`
(:mod:`.unlearner`: fit, serve, delete, retrain); the deletion bookkeeping is in
:mod:`.state`, the held state, its audits and its file in :mod:`.holder` and
:mod:`.persist`; the input checks are in :mod:`defenses.s3t.inputs` and the user's
model with its adapters in :mod:`defenses.s3t.adapters`. The baselines with the
same API, SISA and full retraining, are in :mod:`defenses.s3t.baselines`.
"""

from defenses.s3t.defense.s3t import S3T, Selection
from defenses.s3t.defense.state import (
    AllShardsDeadError,
    DeletionReceipt,
    NotFittedError,
    RetrainReceipt,
    Slot,
)
from defenses.s3t.defense.unlearner import Unlearner

__all__ = [
    "S3T",
    "AllShardsDeadError",
    "DeletionReceipt",
    "NotFittedError",
    "RetrainReceipt",
    "Selection",
    "Slot",
    "Unlearner",
]
