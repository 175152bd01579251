r"""The attacker's image prior: PCA of its public (unlabelled) data.

A scaled-down stand-in for the GANs of model-inversion attacks (the notes' World A
and B): :math:`G(z) = \operatorname{clip}(\mu + z\, \operatorname{diag}(\sqrt\lambda)
U^\top, \text{lo}, \text{hi})` with :math:`z \sim \mathcal N(0, I_m)`, where
:math:`U, \lambda` are the top-``m`` principal directions and variances of the
public data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray


@dataclass(frozen=True, eq=False)
class PCAPrior:
    """A linear-Gaussian generator fitted to public data.

    Attributes
    ----------
    mean : ndarray of shape (d,)
        Mean of the public data.
    basis : ndarray of shape (m, d)
        Principal directions scaled by their standard deviations.
    bounds : tuple of (float, float) or None
        Pixel range the decoded images are clipped to.
    """

    mean: FloatArray
    basis: FloatArray
    bounds: tuple[float, float] | None

    @classmethod
    def fit(
        cls, public: FloatArray, n_components: int, bounds: tuple[float, float] | None
    ) -> PCAPrior:
        """Fit the top ``n_components`` directions of ``public`` (n, d)."""
        data = np.asarray(public, dtype=np.float64)
        if data.ndim != 2 or data.shape[0] < 2:
            raise ValueError(
                f"public data must have shape (n >= 2, d), got {data.shape}"
            )
        if not 1 <= n_components <= min(data.shape):
            raise ValueError(
                f"n_components must lie in [1, {min(data.shape)}], got {n_components}"
            )
        mean = data.mean(axis=0)
        centred = data - mean
        variances, vectors = np.linalg.eigh(centred.T @ centred / (data.shape[0] - 1))
        top = np.argsort(variances)[::-1][:n_components]
        scale = np.sqrt(np.maximum(variances[top], 0.0))
        return cls(mean, scale[:, None] * vectors[:, top].T, bounds)

    @property
    def dim(self) -> int:
        """Latent dimension m."""
        return int(self.basis.shape[0])

    def decode(self, z: FloatArray) -> FloatArray:
        """Images of the latents ``z`` (n, m)."""
        x = self.mean + np.asarray(z) @ self.basis
        if self.bounds is not None:
            np.clip(x, self.bounds[0], self.bounds[1], out=x)
        return x

    def sample(self, n: int, rng: np.random.Generator) -> FloatArray:
        """``n`` latents from the standard normal prior."""
        return rng.standard_normal((n, self.dim))
