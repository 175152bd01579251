"""Digits splits and pretrained backbones shared by the scenario and the benchmarks.

Scikit-learn's bundled digits (1,797 8x8 images) are split into

* a **public** split of ``public`` images of digits 0-4 only, on which the backbone
  is pretrained and then frozen (a backbone that meets new classes when fine-tuned);
* the remaining images, split stratified into the deletable fine-tuning **pool** and
  an i.i.d. **test** set; for the canary audit, ``2 c`` images drawn at random from
  the pool become **canaries** (mislabelled: half are planted and deleted, half are
  never trained on, the reference).

Pool, test and canaries come from one stratified split of the same images, so they
are i.i.d. (a shifted hold-out set would masquerade as leakage).

Two pretrained models: the built-in :class:`~defenses.s3t.backbone.ResidualMLP`
(``kind="residual"``), and a user-style :class:`RowTransformer`
(``kind="transformer"``), a ``torch.nn.TransformerEncoder`` over the eight pixel rows
of a digit that S3T adapts on each encoder layer's ``linear1`` and ``linear2`` (the
"bring your own model" path).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor, nn

from defenses.arrays import IntArray
from defenses.checks import check_choice, check_int, check_real
from defenses.data import Dataset, load_digits, stratified_split
from defenses.fields import Key
from defenses.s3t.backbone import frozen_copy, pretrain, train_module

Kind = Literal["residual", "transformer"]

CANARY_ID_BASE = 100_000
CANARY_GROUP = -1


KINDS: tuple[Kind, ...] = ("residual", "transformer")


@dataclass(frozen=True)
class BackboneSpec:
    """Size and pretraining of the frozen backbone (the pretrained cache's key).

    Made by :meth:`ModelSettings.backbone_spec` from settings whose owner checked
    them (:meth:`ModelSettings.check_model_settings`, or a benchmark's ``parse``).
    """

    public: int
    width: int
    hidden: int
    blocks: int
    epochs: int
    kind: Kind

    @property
    def targets(self) -> list[str] | None:
        """The layers S3T adapts (None: the ResidualMLP's default)."""
        return None if self.kind == "residual" else ["linear1", "linear2"]

    @property
    def head(self) -> str | None:
        """The module every stage trains in full (None: the default)."""
        return None if self.kind == "residual" else "head"


@dataclass(frozen=True)
class ModelSettings:
    """The backbone's size and pretraining and the adapters' training.

    The fields the canary scenario and both S3T benchmarks (deletion cost, and S3T
    under RPS) size a run with; the defaults are the scenario's.

    Parameters
    ----------
    public, width, hidden, blocks : int
        The backbone (:class:`BackboneSpec`), each >= 1.
    pretrain_epochs : int
        Epochs of backbone pretraining (``BackboneSpec.epochs``), >= 1.
    rank : int
        LoRA rank of the adapters, >= 1.
    epochs : int
        Epochs of adapter training, >= 1.
    lr : float
        Adapter learning rate, in (0, 1).
    """

    public: int = 300
    width: int = 64
    hidden: int = 128
    blocks: int = 6
    pretrain_epochs: int = 20
    rank: int = 8
    epochs: int = 10
    lr: float = 5e-3

    def backbone_spec(self, kind: Kind = "residual") -> BackboneSpec:
        """The frozen backbone these settings describe."""
        size = (self.public, self.width, self.hidden, self.blocks)
        return BackboneSpec(*size, self.pretrain_epochs, kind)

    def check_model_settings(self, key: Key, kind: Kind = "residual") -> None:
        """Raise ValueError, naming a field by ``key``, unless every field is valid.

        ``kind`` (the owner's ``model`` field) is one of :data:`KINDS`.
        """
        sizes = ("public", "width", "hidden", "blocks", "pretrain_epochs", "rank")
        for name in (*sizes, "epochs"):
            check_int(key(name), getattr(self, name), minimum=1)
        check_real(key("lr"), self.lr, 0.0, 1.0, open_low=True, open_high=True)
        check_choice(key("model"), kind, KINDS)


class RowTransformer(nn.Module):
    r"""A small transformer encoder classifying a digit from its 8 pixel rows.

    ``h = Encoder(E x_rows + P)``; ``logits = W_o LN(mean_t h_t) + b_o``, with a
    linear row embedding ``E``, learned positions ``P``, ``layers`` post-norm
    ``nn.TransformerEncoderLayer`` blocks (ReLU feed-forward of width ``ff``, no
    dropout). Takes flat ``(n, 64)`` images. Every parameter is drawn from
    ``generator``: matrices ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, biases zero,
    positions ``N(0, 0.02^2)``, norms at one.
    """

    def __init__(
        self,
        n_classes: int = 10,
        d_model: int = 32,
        heads: int = 2,
        layers: int = 3,
        ff: int = 64,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.position = nn.Parameter(torch.zeros(8, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, heads, ff, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, n_classes)
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name == "position":
                    p.normal_(0.0, 0.02, generator=gen)
                elif p.ndim >= 2:
                    bound = 1.0 / math.sqrt(p.shape[1])
                    p.uniform_(-bound, bound, generator=gen)
                elif name.endswith("bias"):
                    p.zero_()

    def forward(self, x: Tensor) -> Tensor:
        """Logits of flat 8x8 images, shape ``(n, 64) -> (n, n_classes)``."""
        rows = x.reshape(x.shape[0], 8, 8)
        h: Tensor = self.encoder(self.embed(rows) + self.position)
        logits: Tensor = self.head(self.norm(h.mean(dim=1)))
        return logits


@dataclass(frozen=True)
class DigitsSplit:
    """Indices into digits, and the canaries' flipped labels."""

    data: Dataset
    public: IntArray
    pool: IntArray
    test: IntArray
    canaries_in: IntArray
    canaries_out: IntArray
    flipped_in: IntArray
    flipped_out: IntArray


def split_digits(
    rng: np.random.Generator, public: int, test_fraction: float, canaries: int
) -> DigitsSplit:
    """Draw the public split (digits 0-4), then pool / test / canaries (stratified)."""
    if not 0.05 <= test_fraction <= 0.5:
        raise ValueError(
            f"test_fraction must lie in [0.05, 0.5], got {test_fraction!r}"
        )
    data = load_digits()
    low = np.flatnonzero(data.y < 5)
    if not 1 <= public <= low.size // 2:
        raise ValueError(f"public must lie in [1, {low.size // 2}], got {public!r}")
    if isinstance(canaries, bool) or not 0 <= canaries <= 100:
        raise ValueError(f"canaries must lie in [0, 100], got {canaries!r}")
    public_idx = np.sort(rng.choice(low, public, replace=False)).astype(np.int64)
    rest = np.setdiff1d(np.arange(len(data)), public_idx)
    parts = stratified_split(data.y[rest], [1 - test_fraction, test_fraction], rng)
    pool, test = rest[parts[0]], rest[parts[1]]
    spare = rng.choice(pool, 2 * canaries, replace=False)
    pool = np.setdiff1d(pool, spare)
    c_in, c_out = np.sort(spare[:canaries]), np.sort(spare[canaries:])
    flip_in = (data.y[c_in] + rng.integers(1, 10, c_in.size)) % 10
    flip_out = (data.y[c_out] + rng.integers(1, 10, c_out.size)) % 10
    return DigitsSplit(
        data,
        public_idx,
        pool.astype(np.int64),
        test.astype(np.int64),
        c_in.astype(np.int64),
        c_out.astype(np.int64),
        flip_in.astype(np.int64),
        flip_out.astype(np.int64),
    )


@functools.lru_cache(maxsize=8)
def _pretrained(seed: int, public: tuple[int, ...], spec: BackboneSpec) -> nn.Module:
    data = load_digits()
    index = np.asarray(public, dtype=np.int64)
    if spec.kind == "transformer":
        gen = torch.Generator().manual_seed(seed)
        model = RowTransformer(10, spec.width, 2, spec.blocks, spec.hidden, gen)
        X = data.X[index].astype(np.float32)
        train_module(model, X, data.y[index], gen, spec.epochs, 3e-3, 64)
        return frozen_copy(model.eval())
    return pretrain(
        data.X[index],
        data.y[index],
        np.random.default_rng(seed),
        n_classes=10,
        width=spec.width,
        hidden=spec.hidden,
        n_blocks=spec.blocks,
        epochs=spec.epochs,
    )


def pretrained_backbone(seed: int, public: IntArray, spec: BackboneSpec) -> nn.Module:
    """The backbone pretrained on ``public`` (cached: arms of one seed share it).

    Callers must not modify it (S3T and the learners here work on frozen copies).
    """
    return _pretrained(int(seed), tuple(int(i) for i in public), spec)
