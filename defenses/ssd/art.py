"""SSD for IBM ART: a post-processor an ART estimator accepts.

:class:`SSDPostprocessor` subclasses ``art.defences.postprocessor.Postprocessor``, so
``SklearnClassifier(model, postprocessing_defences=[SSDPostprocessor(shield)])`` (or
``PyTorchClassifier(..., postprocessing_defences=[...])``) answers every
``predict`` through the shield, and ART's attacks query the defended model. ART is
imported when this module is, not by :mod:`defenses.ssd`.

ART applies post-processors to ``predict`` only, never to loss or class gradients,
so white-box attacks (e.g. ``MIFace``) bypass any of them; SSD is a black-box
defense. ART hands the post-processor the model's predictions without the inputs,
so under ``seeding="input-hash"`` the probabilities themselves are hashed.

Seeding. The post-processor defaults to ``seeding="input-hash"``: the same
prediction always gets the same answer, so an attacker who repeats a query and takes
the majority vote gains nothing. ``seeding="random"`` (an explicit choice) draws fresh
pseudo-labels at every call, and such a vote averages them away. The post-processor
works on a copy of the given shield with its ``seeding`` replaced (the given shield is
never changed).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from art.defences.postprocessor import Postprocessor

from defenses.checks import check_choice
from defenses.ssd.defense import StealthyShield
from defenses.ssd.lazy import check_outputs
from defenses.ssd.seeding import SEEDINGS, Seeding
from defenses.ssd.torch import to_probs


class SSDPostprocessor(Postprocessor):  # type: ignore[misc]
    """The Stealthy Shield Defense as an ART post-processor.

    Parameters
    ----------
    shield : StealthyShield
        Fitted, or fitted later by :meth:`fit` (the post-processor holds a copy,
        ``self.shield``, whose ``seeding`` is ``seeding``).
    outputs : {"auto", "probs", "logits", "log-probs"}
        What the estimator's ``predict`` returns (a ``PyTorchClassifier`` usually
        returns logits); ``"auto"`` takes probability rows as they are and softmaxes
        anything else.
    apply_fit, apply_predict : bool
        ART's switches: SSD defends answers, so by default only at prediction.
    seeding : {"input-hash", "random"}
        ``"input-hash"`` (default): the same prediction row always gets the same
        answer. ``"random"``: fresh pseudo-labels at every call.
    """

    params = ["shield", "outputs", "seeding"]  # noqa: RUF012  (ART's own attribute)

    def __init__(
        self,
        shield: StealthyShield,
        outputs: str = "auto",
        apply_fit: bool = False,
        apply_predict: bool = True,
        *,
        seeding: Seeding = "input-hash",
    ) -> None:
        if not isinstance(shield, StealthyShield):
            raise TypeError(
                f"shield must be a StealthyShield, got {type(shield).__name__}"
            )
        check_choice("seeding", seeding, SEEDINGS)
        if seeding == "random" and shield.hash_resolution is not None:
            raise ValueError(
                f"seeding='random' draws fresh pseudo-labels, but the shield has "
                f"hash_resolution={shield.hash_resolution!r}, which needs "
                "seeding='input-hash'"
            )
        super().__init__(
            is_fitted=shield.is_fitted, apply_fit=apply_fit, apply_predict=apply_predict
        )
        self.shield = copy.deepcopy(shield).set_params(seeding=seeding)
        self.seeding = seeding
        self.outputs = check_outputs(outputs)

    def __call__(self, preds: npt.NDArray[Any]) -> npt.NDArray[np.floating[Any]]:
        """Defended probabilities for ART's predictions (same dtype)."""
        array = np.asarray(preds)
        if array.dtype.kind not in "fiub":
            raise TypeError(f"preds must be real numbers, got {array.dtype}")
        probs = to_probs(torch.from_numpy(array.astype(np.float64)), self.outputs)
        out: npt.NDArray[np.floating[Any]] = self.shield(probs.numpy())
        return out.astype(array.dtype if array.dtype.kind == "f" else np.float64)

    def fit(self, preds: npt.NDArray[Any], y: Any = None, **kwargs: Any) -> None:
        """Fit the prototypes on validation predictions and labels (int or one-hot)."""
        if y is None:
            raise ValueError("y: SSD's prototypes need the validation labels")
        labels = np.asarray(y)
        if labels.ndim == 2:
            labels = labels.argmax(axis=1)
        array = np.asarray(preds, dtype=np.float64)
        probs = to_probs(torch.from_numpy(array), self.outputs).numpy()
        self.shield.fit(probs, labels)
        self._is_fitted = True

    def _check_params(self) -> None:
        if hasattr(self, "outputs"):
            check_outputs(self.outputs)
        if hasattr(self, "seeding") and hasattr(self, "shield"):
            seeding = check_choice("seeding", self.seeding, SEEDINGS)
            if not isinstance(self.shield, StealthyShield):
                raise TypeError(
                    f"shield must be a StealthyShield, got {type(self.shield).__name__}"
                )
            if self.shield.seeding != seeding:  # ART's set_params: copy, then set
                self.shield = copy.deepcopy(self.shield).set_params(seeding=seeding)
