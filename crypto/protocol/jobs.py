r"""The public job of an encrypted fine-tuning session, for either model family.

A :class:`TuningJob` is what the server may know: the step it runs (a
:class:`StepProgram`, a public value) and the update bounds of the agreement
(:mod:`crypto.program.bounds`). The model family is a value of the program, not a class
of server, client or schedule:

* :class:`SGDProgram` (an HEFormer arm, ``lora`` or ``full``): the packed network
  with its trained matrices zeroed (shapes only), the public fold factors
  :math:`c`, the learning rate, the step count and the batch size. The server
  runs :func:`crypto.program.sgd.sgd_reply`,
  :math:`W \leftarrow W - \eta c^2\odot\bar W`, and replies with the updated
  trained weights;
* :class:`GradientProgram` (a converted BERT): the public folded weights, every
  block's LoRA factor shapes and how many of the last blocks are trained. The
  server runs :func:`crypto.program.qkv_grad.lora_gradients` and replies with the
  trained factors' gradient sums :math:`\bar A_x, \bar B_x` (the learning rate
  never leaves the client).

Both lay out a ``train`` upload as *inputs* (features, and for BERT the ``n`` key
weights of the mask), *targets* (one-hot on the CLS slots) and every *uploaded*
secret entry (one replicated ciphertext each), and answer through one function,
:meth:`StepProgram.run`, ``(ev, values, meta, slots, services) -> replied
values``: the same call the server makes on ciphertexts and the public schedule
makes on zeros (:func:`crypto.protocol.tuning.tuning_schedule`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from defenses.arrays import FloatArray

from ..he.ckks import CKKSParams
from ..he.evaluator import Evaluator, Value
from ..program.bounds import DEFAULT_BOUNDS, UpdateBounds
from ..program.encoder import BertWeights, lora_factors
from ..program.net import Net
from ..program.qkv_step import lora_gradients
from ..program.sgd import cls_mask, sgd_reply
from .serving import Services
from .wire import ProtocolError

if TYPE_CHECKING:
    from ..conversion.model import HEBert

Shape = tuple[str, int, int]
"""A secret matrix's name, rows and columns (one ciphertext per entry)."""


def step_slots(params: CKKSParams, n_tokens: int) -> int:
    """Slots of every ciphertext: the chain's slots, whole sequences only."""
    return params.slots - params.slots % n_tokens


def entries(shapes: tuple[Shape, ...]) -> int:
    """The number of entries of ``shapes``."""
    return sum(r * c for _, r, c in shapes)


class Host(NamedTuple):
    """Where a program runs: its evaluator, the slot count, the key owner's trips."""

    ev: Evaluator
    slots: int
    services: Services


@dataclass
class Upload:
    """A ``train`` upload in its parts: inputs, targets, each secret matrix."""

    inputs: list[Value]
    targets: list[Value]
    secrets: dict[str, list[list[Value]]]


class StepProgram(ABC):
    """What the server of a fine-tuning session runs: public values only.

    A ``train`` upload is :attr:`inputs` ciphertexts, :attr:`classes` targets and
    the entries of every :attr:`uploaded` matrix (row-major); the reply is the
    entries of every :attr:`returned` matrix. :meth:`run` is the one step
    boundary: the server calls it on ciphertexts, the schedule on :meth:`zeros`.
    """

    stage = "reply"
    """The stage name of the ``weights`` reply (for the client's messages)."""

    @property
    @abstractmethod
    def n_tokens(self) -> int:
        """Sequence length (rolls and unrolls move whole tokens)."""

    @property
    @abstractmethod
    def inputs(self) -> int:
        """Input ciphertexts of an upload (features, and any key weights)."""

    @property
    @abstractmethod
    def classes(self) -> int:
        """Target ciphertexts of an upload (one-hot rows)."""

    @property
    @abstractmethod
    def uploaded(self) -> tuple[Shape, ...]:
        """The secret matrices of a ``train`` upload, in order."""

    @property
    @abstractmethod
    def returned(self) -> tuple[Shape, ...]:
        """The matrices of the ``weights`` reply, in order."""

    @abstractmethod
    def slots(self, params: CKKSParams) -> int:
        """The slot count of every uploaded ciphertext."""

    def uploads(self) -> int:
        """Ciphertexts of a ``train`` message: inputs, targets, secret entries."""
        return self.inputs + self.classes + entries(self.uploaded)

    def zeros(self, slots: int) -> tuple[list[FloatArray], dict[str, Any]]:
        """A public upload and its metadata the schedule is derived on: zeros."""
        return [np.zeros(slots) for _ in range(self.uploads())], {}

    def run(self, values: list[Value], meta: dict[str, Any], host: Host) -> list[Value]:
        """The step on a ``train`` upload: the reply's values, row-major.

        Takes ``values`` apart (emptying the list, so that each ciphertext lives
        only as long as the step holds it) and runs :meth:`step`.
        """
        if len(values) != self.uploads():
            raise ProtocolError(
                f"train message: expected {self.uploads()} ciphertexts ({self.inputs} "
                f"inputs, {self.classes} targets, {entries(self.uploaded)} secret "
                f"entries), got {len(values)}"
            )
        at, secrets = self.inputs + self.classes, {}
        for name, rows, cols in self.uploaded:
            secrets[name] = [
                values[at + r * cols : at + (r + 1) * cols] for r in range(rows)
            ]
            at += rows * cols
        targets = values[self.inputs : self.inputs + self.classes]
        upload = Upload(values[: self.inputs], targets, secrets)
        values.clear()
        return self.step(upload, meta, host)

    @abstractmethod
    def step(self, upload: Upload, meta: dict[str, Any], host: Host) -> list[Value]:
        """The program on the upload's parts: the reply's values, row-major."""


@dataclass(frozen=True)
class SGDProgram(StepProgram):
    """``steps`` SGD steps of an HEFormer arm; the reply is the updated weights.

    ``net`` holds the frozen public matrices; its trained matrices are zeros (their
    shapes only: the values are the client's secret).
    """

    net: Net
    fold: dict[str, Any]
    lr: float
    steps: int
    batch: int
    stage: str = "updated weights"

    @property
    def n_tokens(self) -> int:
        """Sequence length."""
        return self.net.n_tokens

    @property
    def inputs(self) -> int:
        """Feature width."""
        return len(self.net.centre)

    @property
    def classes(self) -> int:
        """The classifier's outputs."""
        return int(np.asarray(self.net.mats["classifier"]).shape[1])

    @property
    def uploaded(self) -> tuple[Shape, ...]:
        """The trained matrices, in ``net.trained`` order."""
        out = []
        for name in self.net.trained:
            rows, cols = np.asarray(self.net.mats[name]).shape
            out.append((name, int(rows), int(cols)))
        return tuple(out)

    @property
    def returned(self) -> tuple[Shape, ...]:
        """The same matrices, updated."""
        return self.uploaded

    @property
    def mask(self) -> FloatArray:
        """``1/B`` on the CLS slots (the mean over the batch), 0 elsewhere."""
        return cls_mask(self.batch, self.n_tokens)

    def slots(self, params: CKKSParams) -> int:
        """Batch x tokens (the chain's slots are not all used)."""
        return self.batch * self.n_tokens

    def step(self, upload: Upload, meta: dict[str, Any], host: Host) -> list[Value]:
        """:func:`~crypto.program.sgd.sgd_reply` on the upload: the updated weights."""
        parts = (upload.inputs, upload.targets, upload.secrets)
        ev, lr, trips = host.ev, self.lr, host.services
        return sgd_reply(
            ev, self.net, self.fold, parts, self.mask, lr, self.steps, trips
        )


@dataclass(frozen=True)
class GradientProgram(StepProgram):
    """A converted BERT's Q/K/V LoRA gradients; the reply is their gradient sums.

    ``shapes`` lists every block's LoRA factor (name, rows, cols) in the order of
    :func:`crypto.program.encoder.lora_factors` (every block's factors are uploaded:
    the forward pass runs them all); ``blocks`` is how many of the last blocks
    are trained. The upload's inputs are the features, then the ``n`` key
    weights of the mask; its metadata carries the batch size (``sequences``).
    """

    weights: BertWeights
    shapes: tuple[Shape, ...]
    blocks: int
    stage: str = "LoRA gradient sums"

    @property
    def n_tokens(self) -> int:
        """Sequence length."""
        return self.weights.n_tokens

    @property
    def inputs(self) -> int:
        """Features and key weights."""
        return self.weights.d + self.weights.n_tokens

    @property
    def classes(self) -> int:
        """The classifier's outputs."""
        return self.weights.n_classes

    @property
    def uploaded(self) -> tuple[Shape, ...]:
        """Every block's factors."""
        return self.shapes

    @property
    def trained(self) -> tuple[str, ...]:
        """The trained factors' names, in the order of the reply."""
        first = len(self.weights.blocks) - self.blocks
        return tuple(k for k, _, _ in self.shapes if int(k.split()[1]) >= first)

    @property
    def returned(self) -> tuple[Shape, ...]:
        """The trained blocks' factors."""
        return tuple(s for s in self.shapes if s[0] in self.trained)

    def slots(self, params: CKKSParams) -> int:
        """The chain's slots, whole sequences only."""
        return step_slots(params, self.n_tokens)

    def zeros(self, slots: int) -> tuple[list[FloatArray], dict[str, Any]]:
        """Zeros, key weights ``1/n``; one sequence."""
        values, _ = super().zeros(slots)
        d, n = self.weights.d, self.n_tokens
        values[d : d + n] = [np.full(slots, 1.0 / n) for _ in range(n)]
        return values, {"sequences": 1}

    def step(self, upload: Upload, meta: dict[str, Any], host: Host) -> list[Value]:
        """:func:`~crypto.program.qkv_grad.lora_gradients` on the upload, flattened."""
        from ..program.qkv_step import loss_mask

        batch, n = meta.get("sequences"), self.n_tokens
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise ProtocolError("train message: meta 'sequences' must be an int")
        if not 1 <= batch <= host.slots // n:
            raise ProtocolError(
                f"train message: {batch} sequences do not fit {host.slots}"
            )
        d = self.weights.d
        grads = lora_gradients(
            host.ev,
            self.weights,
            upload.inputs[:d],
            upload.inputs[d:],
            upload.secrets,
            host.services.roll,
            host.services.unroll,
            upload.targets,
            loss_mask(batch, n, host.slots),
            self.blocks,
        )
        return [v for name in self.trained for row in grads[name] for v in row]


@dataclass(frozen=True)
class TuningJob:
    """What the fine-tuning server may know: the public step and the bounds.

    ``program`` is the step the server runs (:class:`SGDProgram`,
    :class:`GradientProgram`); ``bounds`` the public bounds the client clips the
    returned update's change to (:mod:`crypto.program.bounds`), part of the agreement:
    the client takes them from its own configuration and refuses a job or a
    server stating others. The schedule does not depend on them.
    """

    program: StepProgram
    bounds: UpdateBounds = DEFAULT_BOUNDS

    @classmethod
    def sgd(
        cls,
        net: Net,
        fold: dict[str, Any],
        lr: float,
        steps: int,
        batch: int,
        bounds: UpdateBounds = DEFAULT_BOUNDS,
    ) -> TuningJob:
        """The job of an HEFormer arm, every trained matrix replaced by zeros."""
        mats = dict(net.mats)
        for name in net.trained:
            mats[name] = np.zeros(np.asarray(net.mats[name]).shape)
        program = SGDProgram(replace(net, mats=mats), dict(fold), lr, steps, batch)
        return cls(program, bounds)

    public = sgd  # the name before the two families shared one job

    @classmethod
    def qkv(
        cls, model: HEBert, blocks: int = 1, bounds: UpdateBounds = DEFAULT_BOUNDS
    ) -> TuningJob:
        """The job of a converted BERT's Q/K/V step on its last ``blocks`` blocks."""
        from ..program.qkv_step import trained_layers

        trained_layers(model, blocks)  # a clear error for a bad count
        shapes = tuple(
            (k, int(M.shape[0]), int(M.shape[1]))
            for k, M in lora_factors(model).items()
        )
        program = GradientProgram(BertWeights.from_model(model), shapes, blocks)
        return cls(program, bounds)


class QKVJob:
    """The converted BERT's job by its former name.

    ``QKVJob.public(model, blocks, bounds)`` is :meth:`TuningJob.qkv`.
    """

    public = staticmethod(TuningJob.qkv)
