r"""The plain method the paper compares CIVET with: PGD adversarial training.

Standard training is the undefended learner itself (``method="standard"`` of
:func:`defenses.civet.defense.train_vae`). PGD adversarial training (Madry et al.,
2018) replaces the clean input of the robust term by :math:`x^\star`, the
signed-gradient PGD maximiser of the reconstruction error over
:math:`B_\infty(x, \varepsilon) \cap [0, 1]^n` for the step's noise draw; it
improves the attacked error but not the certificate (Xu et al., ICLR 2025).
"""

from __future__ import annotations

import torch

from defenses.civet.model import sse
from defenses.civet.protocol import VAEInterface


def pgd_inputs(
    vae: VAEInterface,
    x: torch.Tensor,
    nu: torch.Tensor,
    eps: float,
    steps: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """Signed-gradient PGD on the squared error to ``x`` for fixed noise ``nu``."""
    low, high = vae.domain
    lower, upper = (x - eps).clamp(low, high), (x + eps).clamp(low, high)
    start = torch.rand(x.shape, generator=generator, dtype=x.dtype)
    adv = lower + (upper - lower) * start
    step = 2.5 * eps / steps
    for _ in range(steps):
        adv.requires_grad_(True)
        loss = sse(vae.reconstruct(adv, nu), x).sum()
        (grad,) = torch.autograd.grad(loss, adv)
        adv = torch.minimum(
            torch.maximum(adv.detach() + step * grad.sign(), lower), upper
        )
    return adv.detach()
