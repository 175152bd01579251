r"""The Stealthy Shield Defense (SSD): a training-free output post-processor.

Zhuang, Yu, Qiu, Fang, Chen, Xia, *Stealthy Shield Defense: A Conditional Mutual
Information-Based Approach against Black-Box Model Inversion Attacks*, ICLR 2025.

SSD lowers the conditional mutual information :math:`I(X; \hat Y \mid Y) = I(X;\hat Y)
- I(\hat Y; Y)` (Theorem 1: an information bottleneck with :math:`\beta = 1`) of a
deployed classifier. For each query :math:`x` with softmax output :math:`f = f(x)`:

1. sample a pseudo-label :math:`y \sim \operatorname{softmax}(f / T)` (the temperature
   divides the *probabilities*, not the logits);
2. take the class prototype :math:`q_y`, the mean softmax output over the validation
   samples of class :math:`y` (the :math:`K \times K` matrix fitted by
   :meth:`StealthyShield.fit`);
3. answer :math:`p^\star = \arg\min_{p \in \Delta} \mathrm{KL}(p \| q_y)` subject to
   :math:`\lVert p - f \rVert_1 \le \varepsilon H(f)`, with :math:`H` the entropy in
   nats (the "adaptive rate-distortion" budget), solved in closed form by
   :func:`~defenses.ssd.waterfill.water_filling`.

Confident answers (low entropy, typical of real test inputs) are barely moved;
uncertain answers (typical of an inversion attack's queries) are pulled towards a
randomly chosen class prototype, which randomizes their arg-max.

The paper's :math:`T = 0.1` is tuned for about 1,000 classes: the odds between two
classes are at most :math:`e^{1/T}`, so the randomness of :math:`y` depends on
:math:`K`. The default temperature :func:`default_temperature` is
:math:`T_K = 0.9 / \ln(9 (K - 1))`, which gives 0.10 at :math:`K = 1000` and 0.20 at
:math:`K = 10`.

Appendix H of the paper suggests seeding the sampling from a hash of the input, so that
repeating a query returns the same answer (``seeding="input-hash"``); a
``hash_resolution`` rounds the input before hashing, so that tiny perturbations of a
query also share its answer (a coarse stand-in for locality-sensitive hashing).
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
import torch
from scipy.special import entr

from defenses.checks import check_int, check_real
from defenses.ssd.seeding import hash_uniforms, input_keys
from defenses.ssd.sklearn import ShieldedClassifier
from defenses.ssd.solver import solve_reference
from defenses.ssd.torch import ShieldedCallable, ShieldedModule
from defenses.ssd.waterfill import (
    FLOOR,
    check_probabilities,
    sum_tolerance,
    water_filling,
)

__all__ = [
    "ShieldedCallable",
    "ShieldedClassifier",
    "ShieldedModule",
    "StealthyShield",
    "default_temperature",
    "entropy",
    "solve_reference",
    "water_filling",
]

FloatArray = npt.NDArray[np.float64]
Seeding = Literal["random", "input-hash"]
SEEDINGS: tuple[str, ...] = ("random", "input-hash")


def default_temperature(n_classes: int) -> float:
    r"""The temperature rule :math:`T_K = 0.9 / \ln(9 (K - 1))` (1.0 when K < 3).

    With probabilities in [0, 1], :math:`P(y = \text{top})` under
    :math:`\operatorname{softmax}(f/T)` depends on K; this rule reproduces the
    paper's :math:`T = 0.1` at K = 1000 and keeps the pseudo-label about as random at
    small K (0.15 at K = 50, 0.20 at K = 10, 0.25 at K = 5).
    """
    check_int("n_classes", n_classes, 1)
    if n_classes < 3:
        return 1.0
    return 0.9 / math.log(9.0 * (n_classes - 1))


@overload
def entropy(f: torch.Tensor) -> torch.Tensor: ...


@overload
def entropy(f: npt.ArrayLike) -> FloatArray: ...


def entropy(f: torch.Tensor | npt.ArrayLike) -> torch.Tensor | FloatArray:
    r"""Row entropy :math:`H(f) = -\sum_i f_i \ln f_i` in nats (:math:`0 \ln 0 = 0`)."""
    if isinstance(f, torch.Tensor):
        value: torch.Tensor = torch.special.entr(f).sum(dim=-1)
        return value
    out: FloatArray = entr(np.asarray(f, dtype=np.float64)).sum(axis=-1)
    return out


def _softmax_rows(z: FloatArray) -> FloatArray:
    shifted = z - z.max(axis=1, keepdims=True)
    np.exp(shifted, out=shifted)
    shifted /= shifted.sum(axis=1, keepdims=True)
    out: FloatArray = shifted
    return out


class StealthyShield:
    r"""SSD post-processor: fit on validation outputs, then defend probabilities.

    Parameters
    ----------
    epsilon : float
        Distortion controller :math:`\varepsilon > 0`; the L1 budget of a query is
        :math:`\varepsilon H(f)`. The paper uses 0.35 to 1.5 (default 0.5).
    temperature : float or None
        Temperature :math:`T > 0` on the probabilities for sampling the pseudo-label;
        None picks :func:`default_temperature` of the number of classes.
    seed : int or None
        Seed of the sampling (``"random"``) or key of the input hash
        (``"input-hash"``). None draws fresh entropy from the OS.
    seeding : {"random", "input-hash"}
        ``"random"``: a fresh pseudo-label per answer. ``"input-hash"``: the
        pseudo-label of a query is a keyed hash of the query, so repeating a query
        returns the same answer (the paper's App. H).
    hash_resolution : float or None
        With ``"input-hash"``, round the input to this grid before hashing.

    Examples
    --------
    >>> import numpy as np
    >>> val = np.array([[.9, .05, .05], [.1, .8, .1], [.05, .15, .8]])
    >>> shield = StealthyShield(epsilon=1.0, seed=0).fit(val, np.array([0, 1, 2]))
    >>> shield(np.array([[.4, .35, .25]])).sum().round(6)
    np.float64(1.0)
    """

    def __init__(
        self,
        epsilon: float = 0.5,
        temperature: float | None = None,
        seed: int | None = None,
        seeding: Seeding = "random",
        hash_resolution: float | None = None,
    ) -> None:
        check_real("epsilon", epsilon, 0.0, open_low=True)
        if temperature is not None:
            check_real("temperature", temperature, 0.0, open_low=True)
        if seeding not in SEEDINGS:
            raise ValueError(f"seeding must be one of {SEEDINGS}, got {seeding!r}")
        if hash_resolution is not None:
            check_real("hash_resolution", hash_resolution, 0.0, open_low=True)
        if hash_resolution is not None and seeding != "input-hash":
            raise ValueError("hash_resolution needs seeding='input-hash'")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int | np.integer)
        ):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        self.epsilon = float(epsilon)
        self.temperature = None if temperature is None else float(temperature)
        self.seed = seed
        self.seeding: Seeding = seeding
        self.hash_resolution = (
            None if hash_resolution is None else float(hash_resolution)
        )
        self._rng = np.random.default_rng(seed)
        self._key = np.random.default_rng(seed).bytes(32)
        self.prototypes_: FloatArray | None = None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(epsilon={self.epsilon}, "
            f"temperature={self.temperature},"
            f" seed={self.seed}, seeding={self.seeding!r}, "
            f"hash_resolution={self.hash_resolution})"
        )

    @property
    def is_fitted(self) -> bool:
        """Whether :meth:`fit` has built the class prototypes."""
        return self.prototypes_ is not None

    @property
    def n_classes(self) -> int:
        """Number of classes K of the fitted prototypes."""
        return int(self._prototypes().shape[0])

    @property
    def temperature_(self) -> float:
        """The temperature in use (the given one, or the K rule)."""
        if self.temperature is not None:
            return self.temperature
        return default_temperature(self.n_classes)

    def _prototypes(self) -> FloatArray:
        if self.prototypes_ is None:
            raise RuntimeError(
                f"this {type(self).__name__} is not fitted: "
                "call fit(val_probs, val_labels)"
            )
        return self.prototypes_

    def fit(
        self, val_probs: npt.ArrayLike, val_labels: npt.ArrayLike
    ) -> StealthyShield:
        r"""Build the prototypes :math:`q_y = \operatorname{mean}_{x \in D_y} f(x)`.

        Parameters
        ----------
        val_probs : array of shape (N, K)
            The undefended model's probabilities on a held-out validation split (not
            the training split: training outputs are over-confident).
        val_labels : array of shape (N,)
            True labels in ``[0, K)``; every class needs at least one sample.

        Returns
        -------
        StealthyShield
            ``self``, fitted. Prototype entries are floored at
            :data:`~defenses.ssd.waterfill.FLOOR` and renormalised.
        """
        if isinstance(val_probs, torch.Tensor):
            val_probs = val_probs.detach().cpu().numpy()
        if isinstance(val_labels, torch.Tensor):
            val_labels = val_labels.detach().cpu().numpy()
        probs = np.asarray(val_probs, dtype=np.float64)
        labels = np.asarray(val_labels)
        if probs.ndim != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
            raise ValueError(
                f"val_probs must have shape (N, K) with N, K >= 1, got {probs.shape}"
            )
        check_probabilities(
            "val_probs", probs, sum_tolerance(np.dtype(np.float32), probs.shape[1])
        )
        if labels.shape != (probs.shape[0],) or not np.issubdtype(
            labels.dtype, np.integer
        ):
            raise ValueError(
                f"val_labels must be integers of shape ({probs.shape[0]},), got "
                f"{labels.dtype} {labels.shape}"
            )
        k = probs.shape[1]
        if labels.min() < 0 or labels.max() >= k:
            raise ValueError(
                f"val_labels must lie in [0, {k}), got [{labels.min()}, {labels.max()}]"
            )
        counts = np.bincount(labels, minlength=k)
        if np.any(counts == 0):
            raise ValueError(
                f"classes {np.flatnonzero(counts == 0).tolist()} have no validation "
                "sample, so their prototypes are undefined"
            )
        sums = np.zeros((k, k))
        np.add.at(sums, labels, probs)
        prototypes = np.maximum(sums / counts[:, None], FLOOR)
        self.prototypes_ = prototypes / prototypes.sum(axis=1, keepdims=True)
        return self

    def sampling_probs(self, f: FloatArray) -> FloatArray:
        r"""The pseudo-label distribution :math:`\operatorname{softmax}(f / T)`."""
        return _softmax_rows(f / self.temperature_)

    def budgets(self, f: FloatArray) -> FloatArray:
        r"""The L1 budgets :math:`\varepsilon H(f)` (nats)."""
        return self.epsilon * entropy(f)

    def _uniforms(self, n: int, inputs: Any, probs: FloatArray) -> FloatArray:
        if self.seeding == "random":
            return self._rng.random(n)
        keys = input_keys(probs if inputs is None else inputs, n, self.hash_resolution)
        return hash_uniforms(keys, self._key)

    def pseudo_labels(
        self, probs: npt.ArrayLike, inputs: Any = None
    ) -> npt.NDArray[np.int64]:
        """Sample one pseudo-label per row (advances the random stream)."""
        f = np.asarray(probs, dtype=np.float64)
        self._check(f)
        return self._sample(f, inputs)

    def _sample(self, f: FloatArray, inputs: Any) -> npt.NDArray[np.int64]:
        u = self._uniforms(f.shape[0], inputs, f)
        cdf = np.cumsum(self.sampling_probs(f), axis=1)
        labels = np.count_nonzero(cdf <= (u * cdf[:, -1])[:, None], axis=1)
        out: npt.NDArray[np.int64] = np.minimum(labels, f.shape[1] - 1).astype(np.int64)
        return out

    def _check(self, f: FloatArray) -> None:
        k = self._prototypes().shape[0]
        if f.ndim != 2 or f.shape[1] != k:
            raise ValueError(f"probs must have shape (N, {k}), got {f.shape}")
        check_probabilities("probs", f, sum_tolerance(np.dtype(np.float32), k))

    @overload
    def __call__(self, probs: torch.Tensor, inputs: Any = None) -> torch.Tensor: ...

    @overload
    def __call__(
        self, probs: npt.ArrayLike, inputs: Any = None
    ) -> npt.NDArray[np.floating]: ...

    def __call__(
        self, probs: torch.Tensor | npt.ArrayLike, inputs: Any = None
    ) -> torch.Tensor | npt.NDArray[np.floating]:
        """Defend a batch of probability rows (Alg. 1 of the paper, batched).

        Parameters
        ----------
        probs : array or torch.Tensor of shape (N, K)
            The model's probabilities.
        inputs : array or torch.Tensor with N rows, optional
            The queries, hashed under ``seeding="input-hash"`` (the probabilities are
            hashed when omitted).

        Returns
        -------
        array or torch.Tensor of shape (N, K)
            Defended probabilities, same type, dtype (and device) as ``probs``.
        """
        prototypes = self._prototypes()
        if isinstance(probs, torch.Tensor):
            f_np = probs.detach().cpu().numpy().astype(np.float64)
            self._check(f_np)
            picked = torch.from_numpy(self._sample(f_np, inputs)).to(probs.device)
            f_t = probs.detach().to(torch.float64)
            q_t = torch.from_numpy(prototypes).to(probs.device)[picked]
            return water_filling(f_t, q_t, self.budgets(f_np)).to(probs.dtype)
        arr = np.asarray(probs)
        f = np.asarray(arr, dtype=np.float64)
        self._check(f)
        labels = self._sample(f, inputs)
        out = water_filling(f, prototypes[labels], self.budgets(f))
        dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.float64
        return out.astype(dtype, copy=False)

    def predict_label(
        self, probs: npt.ArrayLike, inputs: Any = None
    ) -> npt.NDArray[np.int64]:
        """The hard label a label-only API returns: arg-max of the defended output."""
        out: npt.NDArray[np.int64] = np.argmax(np.asarray(self(probs, inputs)), axis=1)
        return out.astype(np.int64)

    def wrap(
        self, model: Any, outputs: Literal["auto", "probs", "logits"] = "auto"
    ) -> Any:
        """Protect a deployed model.

        Parameters
        ----------
        model : torch.nn.Module, object with ``predict_proba``, or callable
            The model to protect. A module returns a :class:`ShieldedModule`
            (``outputs="auto"`` treats its outputs as logits), a scikit-learn
            classifier a :class:`ShieldedClassifier`, and any callable returning
            probabilities a :class:`ShieldedCallable`.
        outputs : {"auto", "probs", "logits"}
            What the model returns; logits are turned into probabilities by softmax.

        Returns
        -------
        ShieldedModule, ShieldedClassifier or ShieldedCallable
            The protected model; ``model`` itself is left unchanged.
        """
        if outputs not in ("auto", "probs", "logits"):
            raise ValueError(
                f"outputs must be 'auto', 'probs' or 'logits', got {outputs!r}"
            )
        if isinstance(model, torch.nn.Module):
            return ShieldedModule(model, self, logits=outputs != "probs")
        if hasattr(model, "predict_proba"):
            if outputs == "logits":
                raise ValueError(
                    "a predict_proba model returns probabilities, not logits"
                )
            return ShieldedClassifier(model, self)
        if callable(model):
            return ShieldedCallable(model, self, logits=outputs == "logits")
        raise TypeError(
            "model must be a torch.nn.Module, have predict_proba, or be callable; got "
            f"{type(model).__name__}"
        )
