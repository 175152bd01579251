r"""Recover the accuracy the HE-friendly substitutions cost: distillation.

:func:`distill` fine-tunes a converted :class:`~crypto.conversion.model.HEBert` on the
user's token ids against the original model's outputs (Hinton et al., 2015), and
the labels when given, through the polynomials themselves (the deployed function):

.. math::

    \mathcal L = T^2\,\mathrm{KL}\big(\sigma(t/T)\,\Vert\,\sigma(s/T)\big)
      + \lambda\,\mathrm{CE}(s, y) + \mu\,R(s)

with teacher logits :math:`t`, student logits :math:`s`, temperature :math:`T`,
label weight :math:`\lambda` (0 without labels) and the range penalty :math:`R`
that keeps every polynomial input inside its calibrated range (Rho et al., 2025,
Sec. 4.2). The ranges are calibrated on the data before training and again after
it. The report gives the original, converted-before and converted-after accuracy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from tqdm.auto import tqdm

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int, check_real
from defenses.threads import torch_threads

from ..tasks import check_labels
from .model import HEBert

logger = logging.getLogger(__name__)

SCOPES = ("lora", "lora+head", "all")
CLIP_NORM = 1.0
"""Gradient-norm clipping of every distillation step."""


@dataclass(frozen=True)
class DistillConfig:
    r"""Distillation settings.

    Parameters
    ----------
    epochs, batch : int
        Passes over the data and mini-batch size (>= 1).
    lr : float
        Adam learning rate (> 0).
    temperature : float
        Softening temperature :math:`T` (> 0).
    label_weight : float
        :math:`\lambda`, weight of the label cross-entropy when labels are given
        (>= 0).
    penalty : float
        :math:`\mu`, weight of the range penalty (>= 0).
    margin : float
        Calibration margin (> 1) before and after training.
    scope : {"lora", "lora+head", "all"}
        What trains: the LoRA factors only; LoRA, LayerNorms, pooler and
        classifier; or every weight except the client-side embeddings.
    """

    epochs: int = 30
    batch: int = 32
    lr: float = 3e-3
    temperature: float = 2.0
    label_weight: float = 0.5
    penalty: float = 1.0
    margin: float = 1.5
    scope: str = "all"

    def __post_init__(self) -> None:
        check_int("DistillConfig.epochs", self.epochs, 1)
        check_int("DistillConfig.batch", self.batch, 1)
        check_real("DistillConfig.lr", self.lr, 0.0, open_low=True)
        check_real("DistillConfig.temperature", self.temperature, 0.0, open_low=True)
        check_real("DistillConfig.label_weight", self.label_weight, 0.0)
        check_real("DistillConfig.penalty", self.penalty, 0.0)
        check_real("DistillConfig.margin", self.margin, 1.0, open_low=True)
        check_choice("DistillConfig.scope", self.scope, SCOPES)


@dataclass(frozen=True)
class DistillReport:
    """Accuracy of the original and the converted model before and after.

    ``*_accuracy`` are on the evaluation set (the training data when none is
    given); ``*_agreement`` is the fraction of argmax equal to the original's.
    ``out_of_range_*`` counts evaluation sequences that leave the calibrated ranges
    (the deployed model refuses them).
    """

    original_accuracy: float
    before_accuracy: float
    after_accuracy: float
    before_agreement: float
    after_agreement: float
    out_of_range_before: int
    out_of_range_after: int
    losses: tuple[float, ...]


def teacher_logits(
    teacher: nn.Module, ids: npt.ArrayLike, mask: npt.ArrayLike | None = None
) -> FloatArray:
    """The original ``transformers`` classifier's logits (eval mode, no dropout)."""
    ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.int64)
    mask_t = None if mask is None else torch.as_tensor(np.asarray(mask))
    was = teacher.training
    teacher.eval()
    try:
        with torch.no_grad():
            out = teacher(input_ids=ids_t, attention_mask=mask_t)
    finally:
        teacher.train(was)
    logits = out.logits if hasattr(out, "logits") else out
    return np.asarray(logits.detach().to(torch.float64).numpy(), dtype=np.float64)


def _scope(student: HEBert, scope: str) -> list[nn.Parameter]:
    if scope == "lora":
        return student.lora_parameters()
    frozen = {
        id(p)
        for m in (student.word_embeddings, student.token_type_embeddings)
        for p in m.parameters()
    }
    frozen |= {id(student.position_embeddings)}
    frozen |= {id(p) for p in student.embedding_norm.parameters()}
    if scope == "all":
        return [p for p in student.parameters() if id(p) not in frozen]
    head = [*student.pooler.parameters(), *student.classifier.parameters()]
    norms = [
        p
        for layer in student.block_list()
        for m in (layer.attention_norm, layer.output_norm)
        for p in m.parameters()
    ]
    return student.lora_parameters() + norms + head


def _evaluate(
    student: HEBert, ids: npt.ArrayLike, mask: npt.ArrayLike | None
) -> tuple[npt.NDArray[np.int64], int]:
    out = student.out_of_range(ids, mask)
    logits = student.predict_logits(ids, mask, guard=False)
    return logits.argmax(1), int(out.sum())


def distill(
    student: HEBert,
    teacher: nn.Module,
    ids: npt.ArrayLike,
    labels: npt.ArrayLike | None = None,
    mask: npt.ArrayLike | None = None,
    config: DistillConfig = DistillConfig(),
    evaluation: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike | None] | None = None,
    generator: torch.Generator | None = None,
) -> DistillReport:
    """Distil ``teacher`` into the converted ``student`` in place, then calibrate.

    Parameters
    ----------
    student : HEBert
        The output of :func:`~crypto.conversion.convert`.
    teacher : transformers model
        The original classifier (read only).
    ids, mask : array
        The user's token ids (n, n_tokens) and 0/1 attention mask.
    labels : array, optional
        Their labels; without them the student learns the teacher's outputs only.
    config : DistillConfig
        Optimiser and loss settings.
    evaluation : (ids, labels, mask), optional
        Held-out data for the report (default: the training data, which then needs
        ``labels``).
    generator : torch.Generator, optional
        Shuffles the mini-batches.
    """
    with torch_threads(1):  # tiny models: one thread is many times faster
        return _distill(
            student, teacher, ids, labels, mask, config, evaluation, generator
        )


def _distill(
    student: HEBert,
    teacher: nn.Module,
    ids: npt.ArrayLike,
    labels: npt.ArrayLike | None,
    mask: npt.ArrayLike | None,
    config: DistillConfig,
    evaluation: tuple[npt.ArrayLike, npt.ArrayLike, npt.ArrayLike | None] | None,
    generator: torch.Generator | None,
) -> DistillReport:
    ids_t, mask_t = student.check_ids(ids, mask)
    n, k = ids_t.shape[0], student.config.n_classes
    y = None if labels is None else torch.as_tensor(check_labels(labels, n, k))
    if evaluation is None:
        if labels is None:
            raise ValueError("distill: give labels or an evaluation set for the report")
        evaluation = (ids, labels, mask)
    e_ids, e_labels, e_mask = evaluation
    e_ids_t, e_mask_t = student.check_ids(e_ids, e_mask)
    e_y = check_labels(e_labels, e_ids_t.shape[0], k)
    target = torch.as_tensor(teacher_logits(teacher, ids_t, mask_t))
    if target.shape != (n, k):
        raise ValueError(
            f"teacher: expected logits of shape {(n, k)}, got {tuple(target.shape)}"
        )
    original = teacher_logits(teacher, e_ids_t, e_mask_t).argmax(1)
    student.calibrate(ids_t.numpy(), mask_t.numpy(), margin=config.margin)
    before, out_before = _evaluate(student, e_ids_t.numpy(), e_mask_t.numpy())
    parameters = _scope(student, config.scope)
    trainable = {id(p) for p in parameters}
    for p in student.parameters():
        p.requires_grad_(id(p) in trainable)
    optimiser = torch.optim.Adam(parameters, lr=config.lr)
    g = generator or torch.Generator().manual_seed(0)
    T = config.temperature
    soft = torch.softmax(target / T, dim=-1)
    losses = []
    try:
        for _ in tqdm(range(config.epochs), disable=None, desc="distill", leave=False):
            order = torch.randperm(n, generator=g)
            total = 0.0
            for start in range(0, n, config.batch):
                index = order[start : start + config.batch]
                trace: dict[str, torch.Tensor] = {}
                logits = student(
                    ids_t[index], mask_t[index], poly=True, trace=trace, clip=True
                )
                log_p = torch.log_softmax(logits / T, dim=-1)
                loss = nn.functional.kl_div(log_p, soft[index], reduction="batchmean")
                loss = loss * T * T
                if y is not None and config.label_weight:
                    ce = nn.functional.cross_entropy(logits, y[index])
                    loss = loss + config.label_weight * ce
                if config.penalty:
                    loss = loss + config.penalty * student.range_penalty(trace)
                if not torch.isfinite(loss):
                    raise FloatingPointError(
                        "distill: the loss is not finite (a polynomial left its range);"
                        " lower DistillConfig.lr or raise penalty or margin"
                    )
                optimiser.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                nn.utils.clip_grad_norm_(parameters, CLIP_NORM)
                optimiser.step()
                total += float(loss.detach()) * index.numel()
            losses.append(total / n)
    finally:
        for p in student.parameters():
            p.requires_grad_(True)
    student.calibrate(ids_t.numpy(), mask_t.numpy(), margin=config.margin)
    after, out_after = _evaluate(student, e_ids_t.numpy(), e_mask_t.numpy())
    report = DistillReport(
        original_accuracy=float(np.mean(original == e_y)),
        before_accuracy=float(np.mean(before == e_y)),
        after_accuracy=float(np.mean(after == e_y)),
        before_agreement=float(np.mean(before == original)),
        after_agreement=float(np.mean(after == original)),
        out_of_range_before=out_before,
        out_of_range_after=out_after,
        losses=tuple(losses),
    )
    logger.info("distilled: %s", report)
    return report
