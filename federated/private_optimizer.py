r"""Opacus's ``DPOptimizer`` on the suite's one release path (:mod:`federated.release`).

:class:`SanitizingDPOptimizer` changes four things in Opacus 1.6's optimizer, each
step (``pre_step``: clip, noise, scale):

* **Mask the padding** (``clip_and_accumulate``, with ``masks``): a padded batch of
  the public row count :math:`R` (:mod:`federated.padding`) carries a keep-mask
  :math:`m`; every row with :math:`m_i = 0` gets a zero per-sample gradient before
  clipping, so the clipped sum is the sum over the Poisson sample alone and the
  step's work is :math:`R` rows whatever was sampled. The same ``torch.where`` runs
  over every row each step (no branch on what was sampled or sanitized).

* **Sanitize before clipping** (``clip_and_accumulate``): a sample whose per-sample
  gradient has a non-finite entry in any parameter (its loss overflowed, or the
  server's weights made its activations infinite) gets a zero per-sample gradient
  in every parameter before Opacus computes the norms. Opacus alone computes the
  clip factor :math:`C / (\lVert g\rVert + 10^{-6})`, NaN for a NaN gradient, and
  the noised sum of the whole batch becomes NaN. A zero contribution has norm 0
  :math:`\le C` and depends on that sample alone, so the sensitivity of the clipped
  sum stays :math:`C` (see :mod:`federated.release`). A finite gradient whose norm
  overflows gets clip factor 0.
* **Check the noised sum** (``add_noise``): if any noised gradient is not finite
  (unreachable after sanitizing), every parameter's gradient becomes the noise
  alone, drawn again from the optimizer's generator, which depends on no record.
* **Normalize by a public count**: ``expected_batch_size`` must be given by the
  caller as ``round(q * N)`` for the node's public count :math:`N`
  (``public-num-examples``); Opacus's ``make_private`` computes it from the private
  ``len(dataset)``, which the update's noise scale then reveals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _generate_noise

from .padding import RowMasks

logger = logging.getLogger(__name__)


class SanitizingDPOptimizer(DPOptimizer):  # type: ignore[misc]
    """``DPOptimizer`` that zeroes non-finite per-sample gradients before clipping.

    Takes the same arguments as Opacus's ``DPOptimizer``; ``expected_batch_size``
    is required (the public normalizer, see the module). ``masks``
    (:class:`federated.padding.RowMasks`) hands it the keep-mask of each padded
    batch; without it every row of a batch is a sampled record (Opacus's own
    variable-size Poisson batches).
    """

    def __init__(
        self, *args: Any, masks: RowMasks | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("expected_batch_size") is None:
            raise ValueError(
                "expected_batch_size must be given from a public count (round(q * "
                "public-num-examples)), never from the private data set's size"
            )
        super().__init__(*args, **kwargs)
        self.masks = masks
        self.sanitized = 0
        """Sampled records whose gradient was replaced by zero (the node's own log)."""
        self.rows: list[int] = []
        """Rows whose per-sample gradients each step computed (instrumentation)."""
        self.guard: Callable[[SanitizingDPOptimizer], None] | None = None
        """Called first in every step, before any record's gradient is used (the
        round's step limit)."""

    def pre_step(self, closure: Callable[[], float] | None = None) -> bool | None:
        """The guard, then Opacus's step: clip, noise, scale."""
        if self.guard is not None:
            self.guard(self)
        out: bool | None = super().pre_step(closure)
        return out

    def clip_and_accumulate(self) -> None:
        """Zero every masked or non-finite sample's gradient, then Opacus's clipping."""
        samples = [self._get_flat_grad_sample(p) for p in self.params]
        if samples and len(samples[0]):
            rows = len(samples[0])
            self.rows.append(rows)
            finite = torch.ones(rows, dtype=torch.bool)
            for g in samples:
                finite &= torch.isfinite(g.reshape(rows, -1)).all(dim=1).cpu()
            sampled = (
                torch.ones(rows, dtype=torch.bool)
                if self.masks is None
                else self.masks.take(rows).cpu()
            )
            keep = finite & sampled
            self.sanitized += int((sampled & ~finite).sum())
            for p, g in zip(self.params, samples, strict=True):
                where = keep.to(g.device).reshape(-1, *([1] * (g.dim() - 1)))
                p.grad_sample = torch.where(where, g, torch.zeros_like(g))
        super().clip_and_accumulate()
        for p in self.params:
            if p.summed_grad is not None:
                # A finite gradient with an overflowing norm: factor 0 times a
                # huge value is 0, but 0 * inf cannot occur after sanitizing;
                # keep the release path total regardless (no branch: same work).
                p.summed_grad = torch.nan_to_num(p.summed_grad, 0.0, 0.0, 0.0)

    def add_noise(self) -> None:
        """Opacus's noise; the noise alone everywhere if a sum is not finite."""
        super().add_noise()
        if all(bool(torch.isfinite(p.grad).all()) for p in self.params):
            return
        logger.error("non-finite noised gradient: released the noise alone")
        for p in self.params:
            noise = _generate_noise(
                std=self.noise_multiplier * self.max_grad_norm,
                reference=p.grad,
                generator=self.generator,
                secure_mode=self.secure_mode,
            )
            p.grad = noise.view_as(p)
