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

The whole call is one compiled row loop
(:func:`~defenses.ssd.kernels.shield.shield_rows`): each row is read once into a
row scratch that stays in cache while its budget, pseudo-label and projection are
computed, and the answer is written once in the input's dtype, so the only memory
beyond the input is the answer itself. At :math:`K \le 16` the same answers, bit for
bit, come from a kernel that takes blocks of rows as its SIMD lanes
(:func:`~defenses.ssd.kernels.small.shield_rows_small`). Large batches are split
into blocks of rows shared among threads (``n_threads``). Every row's uniform
number comes from a counter-based stream (SplitMix64 at the row's index) or from
the hash of its query, so the answers are the same, bit for bit, whatever the
number of threads or blocks.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray
from defenses.checks import check_choice, check_int, check_real
from defenses.ssd.batch import as_rows, check_stats, frozen, run_blocks
from defenses.ssd.budget import default_temperature, entropy
from defenses.ssd.lazy import check_outputs, is_module, is_tensor, loaded_torch
from defenses.ssd.seeding import SEEDINGS, Seeding, input_uniforms
from defenses.ssd.waterfill import (
    FLOOR,
    MAX_NEWTON_STEPS,
    check_probabilities,
    sum_tolerance,
)

if TYPE_CHECKING:
    import torch

__all__ = ["StealthyShield", "default_temperature", "entropy"]

EPSILON_WARN = 10.0
"""Above this epsilon a warning says that most answers become bare prototypes."""

PARAMS = ("epsilon", "temperature", "seed", "seeding", "hash_resolution", "n_threads")


class StealthyShield:
    r"""SSD post-processor: fit on validation outputs, then defend probabilities.

    Parameters
    ----------
    epsilon : float
        Distortion controller :math:`\varepsilon > 0`; the L1 budget of a query is
        :math:`\varepsilon H(f)`. The paper uses 0.35 to 1.5 (default 0.5). Any
        finite positive value is valid; as :math:`\lVert p - f \rVert_1 \le 2`, a
        row with :math:`H(f) \ge 2 / \varepsilon` gets the bare prototype
        :math:`q_y`, and above :data:`EPSILON_WARN` a UserWarning says so.
    temperature : float or None
        Temperature :math:`T > 0` on the probabilities for sampling the pseudo-label;
        None picks :func:`default_temperature` of the number of classes.
    seed : int or None
        Seed of the key of the random stream (``"random"``) or of the input hash
        (``"input-hash"``), drawn at :meth:`fit`. None draws fresh entropy.
    seeding : {"random", "input-hash"}
        ``"random"``: a fresh pseudo-label per answer. ``"input-hash"``: the
        pseudo-label of a query is a keyed hash of the query, so repeating a query
        returns the same answer (the paper's App. H).
    hash_resolution : float or None
        With ``"input-hash"``, round the input to this grid before hashing.
    n_threads : int or None
        Threads for large batches (None: every core this process may use; 1: one).

    Parameters are stored as given (scikit-learn style: :meth:`get_params`,
    :meth:`set_params`); the key and the prototypes are made by :meth:`fit`.

    Examples
    --------
    >>> import numpy as np
    >>> val = np.array([[.9, .05, .05], [.1, .8, .1], [.05, .15, .8]])
    >>> shield = StealthyShield(epsilon=1.0, seed=0).fit(val, np.array([0, 1, 2]))
    >>> shield(np.array([[.4, .35, .25]])).sum().round(6)
    np.float64(1.0)
    """

    draws_from_probs: ClassVar[bool] = False
    """Ablation switch: draw the pseudo-label from ``f`` itself (no temperature)."""
    constant_budget: ClassVar[bool] = False
    """Ablation switch: the budget is ``epsilon`` instead of ``epsilon * H(f)``."""

    def __init__(
        self,
        epsilon: float = 0.5,
        temperature: float | None = None,
        seed: int | None = None,
        seeding: Seeding = "random",
        hash_resolution: float | None = None,
        n_threads: int | None = None,
    ) -> None:
        self.epsilon = epsilon
        self.temperature = temperature
        self.seed = seed
        self.seeding = seeding
        self.hash_resolution = hash_resolution
        self.n_threads = n_threads
        self._validate()
        self.prototypes_: FloatArray | None = None
        self.key_ = np.uint64(0)
        self.counter_ = np.uint64(0)

    def _validate(self, warn: bool = True) -> None:
        epsilon = check_real("epsilon", self.epsilon, 0.0, open_low=True)
        if warn and epsilon > EPSILON_WARN:
            warnings.warn(
                f"epsilon={self.epsilon!r} is far above the paper's 0.35-1.5: every "
                f"row whose entropy exceeds 2 / epsilon = {2.0 / epsilon:.3g} nats "
                "gets a budget epsilon * H >= 2, the largest L1 distance between two "
                "distributions, so it is answered by the prototype of its "
                "pseudo-label alone and the model's output is discarded. SSD's "
                "epsilon is a distortion controller, not a differential-privacy "
                "epsilon.",
                UserWarning,
                stacklevel=3,
            )
        if self.temperature is not None:
            check_real("temperature", self.temperature, 0.0, open_low=True)
        check_choice("seeding", self.seeding, SEEDINGS)
        if self.hash_resolution is not None:
            check_real("hash_resolution", self.hash_resolution, 0.0, open_low=True)
            if self.seeding != "input-hash":
                raise ValueError("hash_resolution needs seeding='input-hash'")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(
                self.seed, int | np.integer
            ):
                raise ValueError(f"seed must be an int or None, got {self.seed!r}")
            check_int("seed", self.seed, 0)
        if self.n_threads is not None:
            check_int("n_threads", self.n_threads, 1, 1024)

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's parameters (scikit-learn's protocol)."""
        return {name: getattr(self, name) for name in PARAMS}

    def set_params(self, **params: Any) -> StealthyShield:
        """Set parameters (validated; a new ``seed`` takes effect at :meth:`fit`)."""
        unknown = sorted(set(params) - set(PARAMS))
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}; accepted: {PARAMS}")
        before = self.get_params()
        for name, value in params.items():
            setattr(self, name, value)
        try:
            self._validate()
        except ValueError:
            for name, value in before.items():
                setattr(self, name, value)
            raise
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in PARAMS)
        return f"{type(self).__name__}({args})"

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
            return float(self.temperature)
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
            True labels, integers in ``[0, K)``; every class needs a sample.

        Returns
        -------
        StealthyShield
            ``self``, fitted: prototype entries floored at
            :data:`~defenses.ssd.waterfill.FLOOR`, renormalised and floored again
            (rows then sum to one within ``K * FLOOR``), and a fresh key drawn from
            ``seed``.
        """
        self._validate(warn=False)  # warned when set
        if is_tensor(val_labels):
            val_labels = val_labels.detach().cpu().numpy()
        rows, given = as_rows(val_probs, "val_probs")
        probs = rows.astype(np.float64)
        labels = np.asarray(val_labels)
        if probs.ndim != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
            raise ValueError(
                f"val_probs must have shape (N, K) with N, K >= 1, got {probs.shape}"
            )
        k = probs.shape[1]
        check_probabilities("val_probs", probs, self._tolerance(given, k))
        if labels.shape != (probs.shape[0],) or labels.dtype.kind not in "iu":
            raise ValueError(
                f"val_labels must be integers of shape ({probs.shape[0]},), got "
                f"{labels.dtype} {labels.shape}"
            )
        if labels.min() < 0 or labels.max() >= k:
            raise ValueError(
                f"val_labels must lie in [0, {k}), got [{labels.min()}, {labels.max()}]"
            )
        counts = np.bincount(labels.astype(np.int64), minlength=k)
        if np.any(counts == 0):
            raise ValueError(
                f"val_labels: classes {np.flatnonzero(counts == 0).tolist()} have no "
                "validation sample, so their prototypes are undefined"
            )
        sums = np.zeros((k, k))
        np.add.at(sums, labels.astype(np.int64), probs)
        prototypes = np.maximum(sums / counts[:, None], FLOOR)
        prototypes /= prototypes.sum(axis=1, keepdims=True)
        self.prototypes_ = np.maximum(prototypes, FLOOR)
        seed = None if self.seed is None else int(self.seed)
        self.key_ = np.random.default_rng(seed).integers(
            0, 2**64, dtype=np.uint64, endpoint=False
        )
        self.counter_ = np.uint64(0)
        return self

    def sampling_probs(self, f: FloatArray) -> FloatArray:
        r"""The pseudo-label distribution :math:`\operatorname{softmax}(f / T)`.

        Computed as :math:`e^{(f_i - \max f)/T}` normalised, which stays finite for
        any :math:`T > 0` (``f / T`` alone overflows for a subnormal ``T``).
        """
        f = np.asarray(f, dtype=np.float64)
        if self.draws_from_probs:
            out: FloatArray = f / f.sum(axis=1, keepdims=True)
            return out
        with np.errstate(over="ignore"):  # -inf below a subnormal T: weight 0
            weights = np.exp((f - f.max(axis=1, keepdims=True)) / self.temperature_)
        out = weights / weights.sum(axis=1, keepdims=True)
        return out

    def budgets(self, f: FloatArray) -> FloatArray:
        r"""The L1 budgets :math:`\varepsilon H(f)` (nats)."""
        if self.constant_budget:
            return np.full(np.shape(f)[0], float(self.epsilon))
        return float(self.epsilon) * entropy(f)

    @staticmethod
    @functools.cache
    def _tolerance(given: np.dtype[Any] | torch.dtype, k: int) -> float:
        return max(sum_tolerance(np.dtype(np.float32), k), sum_tolerance(given, k))

    def _run(
        self, probs: Any, inputs: Any, answers: bool
    ) -> tuple[npt.NDArray[np.floating[Any]], npt.NDArray[np.int64], Any]:
        """Run the fused kernel; returns the answers (or none) and the labels."""
        prototypes = self._prototypes()
        rows, given = as_rows(probs)
        if rows.ndim != 2 or rows.shape[1] != prototypes.shape[0]:
            raise ValueError(
                f"probs must have shape (N, {prototypes.shape[0]}), got {rows.shape}"
            )
        n, k = rows.shape
        uniforms = np.empty(0)
        if self.seeding == "input-hash":
            uniforms = input_uniforms(
                probs if inputs is None else inputs, n, self.hash_resolution, self.key_
            )
        temperature = 0.0 if self.draws_from_probs else self.temperature_
        constant = float(self.epsilon) if self.constant_budget else -1.0
        settings = np.array([float(self.epsilon), constant, temperature, FLOOR])
        out = np.empty((n if answers else 0, k), dtype=rows.dtype)
        labels = np.empty(0 if answers else n, dtype=np.int64)

        from defenses.ssd.kernels.calls import shield_kernel  # imports numba

        args = (
            frozen(rows), frozen(prototypes), frozen(uniforms), self.key_,
            self.counter_, settings, MAX_NEWTON_STEPS, 0, n, out, labels,
        )  # fmt: skip
        kernel = shield_kernel(args)

        def block(bounds: tuple[int, int]) -> FloatArray:
            result: FloatArray = kernel(*args[:7], bounds[0], bounds[1], *args[9:])
            return result

        results = run_blocks(block, n, k, self.n_threads)
        check_stats(results, self._tolerance(given, k))
        if self.seeding == "random":
            self.counter_ = self.counter_ + np.uint64(n)
        return out, labels, given

    def pseudo_labels(
        self, probs: npt.ArrayLike, inputs: Any = None
    ) -> npt.NDArray[np.int64]:
        """Sample one pseudo-label per row (advances the random stream)."""
        return self._run(probs, inputs, answers=False)[1]

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
            The model's probabilities (real; float16/32/64 or integers).
        inputs : array, DataFrame, sparse matrix or tensor with N rows, optional
            The queries, hashed under ``seeding="input-hash"`` (the probabilities are
            hashed when omitted).

        Returns
        -------
        array or torch.Tensor of shape (N, K)
            Defended probabilities, same type, floating dtype (and device) as
            ``probs`` (float64 for integer input).
        """
        out, _, given = self._run(probs, inputs, answers=True)
        if is_tensor(probs):
            torch_module = loaded_torch()
            assert torch_module is not None  # a tensor means torch is loaded
            dtype = probs.dtype if probs.is_floating_point() else torch_module.float64
            answer_tensor: torch.Tensor = torch_module.from_numpy(out).to(
                device=probs.device, dtype=dtype
            )
            return answer_tensor
        answer: npt.NDArray[np.floating[Any]] = out.astype(given, copy=False)
        return answer

    def predict_label(
        self, probs: npt.ArrayLike, inputs: Any = None
    ) -> npt.NDArray[np.int64]:
        """The hard label a label-only API returns: arg-max of the defended output."""
        out: npt.NDArray[np.int64] = np.argmax(np.asarray(self(probs, inputs)), axis=1)
        return out.astype(np.int64)

    def wrap(
        self,
        model: Any,
        outputs: Literal["auto", "probs", "logits", "log-probs"] = "auto",
    ) -> Any:
        """Protect a deployed model (the model itself is left unchanged).

        Parameters
        ----------
        model : torch.nn.Module, fitted scikit-learn classifier, or callable
            A module gives a :class:`~defenses.ssd.torch.ShieldedModule`, an object
            with ``predict_proba`` a fitted
            :class:`~defenses.ssd.sklearn.ShieldedClassifier`, any other callable a
            :class:`~defenses.ssd.torch.ShieldedCallable`.
        outputs : {"auto", "probs", "logits", "log-probs"}
            What the model returns. ``"auto"`` reads it from a module's last layer
            (``nn.Softmax``: probabilities, ``nn.LogSoftmax``: log-probabilities,
            else logits), and never softmaxes outputs that are already
            probabilities: it raises instead.
        """
        check_outputs(outputs)
        if is_module(model):
            from defenses.ssd.torch import ShieldedModule

            return ShieldedModule(model, self, outputs=outputs)
        if hasattr(model, "predict_proba"):
            if outputs not in ("auto", "probs"):
                raise ValueError(
                    f"outputs: a predict_proba model returns probabilities, not "
                    f"{outputs}"
                )
            from defenses.ssd.sklearn import ShieldedClassifier

            return ShieldedClassifier.prefitted(model, self)
        if callable(model):
            from defenses.ssd.torch import ShieldedCallable

            return ShieldedCallable(model, self, outputs=outputs)
        raise TypeError(
            "model must be a torch.nn.Module, have predict_proba, or be callable; got "
            f"{type(model).__name__}"
        )
