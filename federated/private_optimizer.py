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
from opacus.optimizers.optimizer import (
    _check_processed_flag,
    _generate_noise,
    _mark_as_processed,
)

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
        self.sampled: list[int] = []
        """Sampled records among them, each step (the node's own instrumentation)."""
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
        r"""Opacus's clipping with masked and non-finite samples at factor 0.

        Per row :math:`i`: :math:`\nu_i = \lVert (g_i^p)_p\rVert` over every
        parameter :math:`p`; :math:`k_i = m_i \wedge (\nu_i\ \text{finite})` (a NaN
        or infinite entry, or a norm that overflows, makes :math:`\nu_i`
        non-finite); :math:`f_i = \min(1, C / (\nu_i + 10^{-6}))` if :math:`k_i`
        else 0. Rows not kept are set to zero in place (so that
        :math:`0 \cdot \mathrm{NaN}` never occurs) and :math:`\sum_i f_i g_i` is
        accumulated, as Opacus does. Every step makes the same passes over all
        rows, whatever was sampled or sanitized.
        """
        samples = [self._get_flat_grad_sample(p) for p in self.params]
        rows = len(samples[0])
        self.rows.append(rows)
        sampled = (
            torch.ones(rows, dtype=torch.bool)
            if self.masks is None
            else self.masks.take(rows).cpu()
        )
        if rows:
            device = samples[0].device
            norms = torch.stack(
                [g.reshape(rows, -1).norm(2, dim=-1).to(device) for g in samples],
                dim=1,
            ).norm(2, dim=1)
        else:  # an empty Poisson batch (Opacus's own loader, no padding)
            device, norms = samples[0].device, torch.zeros(0)
        finite = torch.isfinite(norms).cpu()
        keep = finite & sampled
        self.sampled.append(int(sampled.sum()))
        self.sanitized += int((sampled & ~finite).sum())
        on = keep.to(device)
        factor = torch.where(
            on, (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0), 0.0
        )
        for p, g in zip(self.params, samples, strict=True):
            _check_processed_flag(p.grad_sample)
            g = g.to(p.dtype)
            g.masked_fill_(~on.to(g.device).reshape(-1, *([1] * (g.dim() - 1))), 0.0)
            grad = torch.einsum("i,i...", factor.to(g.device).to(p.dtype), g)
            # 0 * inf cannot occur after zeroing; nan_to_num keeps the release
            # path total regardless (no branch: the same work every step).
            grad = torch.nan_to_num(grad, 0.0, 0.0, 0.0)
            p.summed_grad = grad if p.summed_grad is None else p.summed_grad + grad
            _mark_as_processed(p.grad_sample)

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
