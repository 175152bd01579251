r"""The cost of an encrypted fine-tuning step, from its operation counts.

A step of :func:`crypto.protocol.finetune.encrypted_step` is a fixed program of CKKS
operations whose number depends only on the layer's shape
:math:`s = (d, f, n, h)` (width, feed-forward width, tokens, heads) and the arm. The
model has two parts:

1. **Operation counts.** Every counter :math:`c_k` the evaluator records
   (ciphertext-ciphertext and ciphertext-plaintext multiplications, slot sums,
   polynomial evaluations, client encryptions and decryptions) is a polynomial in
   the shape; :class:`CountModel` fits it on the monomials of degree <= 2 in
   :math:`(d, f, n, h)` from counted (simulated) steps, and is exact when it
   reproduces held-out shapes without error. Rotations follow:
   :math:`\mathrm{rot} = \mathrm{slot\_sums}\cdot\lceil\log_2(Bn)\rceil` (rotate and
   add over the :math:`Bn` packed slots of a batch of :math:`B` sequences).
2. **Unit costs.** At a fixed ring (the step's :math:`N`) each operation costs
   about the same whatever the width. The seconds :math:`t_k` of each operation
   :math:`o_k` of :data:`OPERATIONS` are timed in isolation (a multiplication's
   :math:`t_k` includes its relinearisation and rescale: TenSEAL rescales after
   every product, so the rescalings are the multiplications and are not a
   separate term), and :class:`CostModel` fits the step's time as
   :math:`T = (\alpha + \gamma \log_2 (d / d_0)) \sum_k t_k o_k
   + \sum_{k \in F} \kappa_k o_k + \beta` on measured steps: :math:`\gamma` is
   what a step adds per operation as the width doubles, :math:`\kappa_k` what
   one operation of a named set :math:`F` costs in a real step beyond
   :math:`\alpha t_k` (work the counters do not see that comes with that
   operation; the mix of operations differs between arms and widths, so a
   common :math:`\alpha` cannot carry it). Fitting every :math:`t_k` freely from
   steps is ill-posed at small widths: the counts grow together, and
   non-negative least squares sets some unit costs to zero; one or two named
   operations whose share differs between the arms are determined.

Projecting to the paper's width evaluates both parts at :data:`PAPER` (BERT-base
width, 128 tokens, 12 heads, batch 16) in this package's layout and ring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import check_int

OPERATIONS = (
    "ct_ct_mul",
    "ct_pt_mul",
    "rotations",
    "polyval",
    "replications",
    "encryptions",
    "decryptions",
)
COUNTERS = (
    "ct_ct_mul",
    "ct_pt_mul",
    "slot_sums",
    "polyval",
    "replications",
    "encryptions",
    "decryptions",
    "refreshed_values",
    "refresh_rounds",
)
MONOMIALS = (
    "1",
    "d",
    "f",
    "n",
    "h",
    "d^2",
    "f^2",
    "n^2",
    "h^2",
    "d f",
    "d n",
    "d h",
    "f n",
    "f h",
    "n h",
)


@dataclass(frozen=True)
class Shape:
    """The shape of one fine-tuning step.

    Parameters
    ----------
    d : int
        Model width (a multiple of ``heads``).
    ffn : int
        Feed-forward width.
    n_tokens : int
        Tokens per sequence.
    heads : int
        Attention heads.
    batch : int
        Sequences per step (``batch * n_tokens`` packed slots).
    """

    d: int
    ffn: int
    n_tokens: int
    heads: int = 1
    batch: int = 4

    def __post_init__(self) -> None:
        for name in ("d", "ffn", "n_tokens", "heads", "batch"):
            object.__setattr__(
                self, name, check_int(f"Shape.{name}", getattr(self, name), 1)
            )
        if self.d % self.heads:
            raise ValueError(
                f"Shape.d = {self.d} must be a multiple of Shape.heads = {self.heads}"
            )

    @property
    def slots(self) -> int:
        """Packed slots per ciphertext: batch x tokens."""
        return self.batch * self.n_tokens

    def monomials(self) -> FloatArray:
        """The values of :data:`MONOMIALS` at this shape."""
        d, f, n, h = (float(x) for x in (self.d, self.ffn, self.n_tokens, self.heads))
        linear = [1.0, d, f, n, h]
        squares = [d * d, f * f, n * n, h * h]
        products = [d * f, d * n, d * h, f * n, f * h, n * h]
        return np.array([*linear, *squares, *products], dtype=np.float64)


PAPER = Shape(d=768, ffn=3072, n_tokens=128, heads=12, batch=16)
"""The paper's BERT-base layer (Rho et al., 2025: width 768, FFN 3072, 12 heads,
sequences of 128 tokens, batch 16)."""


def operations(counts: Mapping[str, float], shape: Shape) -> dict[str, float]:
    """The timed operations of one step from its counters (rotations derived).

    ``encryptions`` and ``decryptions`` are the key owner's (uploads, refreshes,
    rolls), each with its serialisation.
    """
    c = {k: float(counts.get(k, 0)) for k in COUNTERS}
    return {
        "ct_ct_mul": c["ct_ct_mul"],
        "ct_pt_mul": c["ct_pt_mul"],
        "rotations": c["slot_sums"] * math.ceil(math.log2(shape.slots)),
        "polyval": c["polyval"],
        "replications": c["replications"],
        "encryptions": c["encryptions"],
        "decryptions": c["decryptions"],
    }


@dataclass(frozen=True)
class CountModel:
    """Per-counter polynomial coefficients on :data:`MONOMIALS` (one arm)."""

    coefficients: Mapping[str, FloatArray]

    @classmethod
    def fit(
        cls, shapes: Sequence[Shape], counts: Sequence[Mapping[str, float]]
    ) -> CountModel:
        """Least squares of every counter of :data:`COUNTERS` on the monomials.

        Raises
        ------
        ValueError
            If fewer shapes than monomials are given, or the shapes do not
            determine the coefficients (rank-deficient design).
        """
        if len(shapes) != len(counts) or len(shapes) < len(MONOMIALS):
            raise ValueError(
                f"CountModel.fit needs as many counts as shapes, at least "
                f"{len(MONOMIALS)}; got {len(shapes)} shapes and {len(counts)} counts"
            )
        A = np.stack([s.monomials() for s in shapes])
        if np.linalg.matrix_rank(A) < len(MONOMIALS):
            raise ValueError(
                "CountModel.fit: the shapes do not determine every monomial "
                "(vary d, ffn, n_tokens and heads independently)"
            )
        out = {}
        for key in COUNTERS:
            y = np.array([float(c.get(key, 0)) for c in counts])
            out[key] = np.linalg.lstsq(A, y, rcond=None)[0]
        return cls(out)

    def predict(self, shape: Shape) -> dict[str, float]:
        """The counters at ``shape``."""
        m = shape.monomials()
        return {k: float(m @ c) for k, c in self.coefficients.items()}

    def max_error(
        self, shapes: Sequence[Shape], counts: Sequence[Mapping[str, float]]
    ) -> float:
        """Largest absolute difference from the counted values at ``shapes``."""
        worst = 0.0
        for shape, c in zip(shapes, counts, strict=True):
            got = self.predict(shape)
            worst = max(worst, *(abs(got[k] - float(c.get(k, 0))) for k in COUNTERS))
        return worst


@dataclass(frozen=True)
class CostModel:
    r"""Step seconds from operation counts and width.

    .. math::

        T = \Big(\alpha + \gamma \log_2 \frac{d}{d_0}\Big) \sum_k t_k o_k
            + \sum_{k \in F} \kappa_k o_k + \beta.

    ``unit_s`` are the seconds :math:`t_k` of each operation of :data:`OPERATIONS`
    timed in isolation (one ring, one machine); ``scale`` (:math:`\alpha`) is what a
    real step adds on top of the bare operations at the reference width
    :math:`d_0` (``reference_d``: level bookkeeping, operand management,
    serialisation), ``growth`` (:math:`\gamma`) how much that share grows per
    doubling of the width, ``extra_s`` (:math:`\kappa_k`, seconds per operation)
    what each named operation :math:`k \in F` costs in a real step beyond
    :math:`\alpha t_k`, ``overhead_s`` (:math:`\beta`) the fixed cost.

    What grows with the width at a fixed ring: the operations themselves (counted
    exactly, :class:`CountModel`), and per operation what the counters do not
    see: the additions of every sum (one per product term), the modulus switches
    TenSEAL makes when a fresh weight meets a deeper activation (an inverse and a
    forward NTT per prime), and the memory traffic of more live ciphertexts. The
    ring dimension and the depth of the step do not grow with the width in this
    layout (one token of a sequence per slot, the same layer program). What the
    counters miss can be common to every operation (:math:`\gamma`) or come with
    one kind of operation, whose share of the step differs between arms and
    widths (:math:`\kappa_k`). :math:`\kappa_k` is empirical: it carries
    whatever work scales with that operation's count, not necessarily the
    operation itself. With ``rotations`` it stands for the work of every
    slot-summed gradient entry of the full arm (its product, scalar step,
    subtraction from the weight, refresh); a profile of that step shows the
    rotations themselves cheaper than in isolation (lower levels), so
    :math:`\kappa` is not a slower rotation. At one packing (fixed
    :math:`Bn`) a cost per rotation and a cost per slot sum fit alike; they
    part where :math:`\lceil\log_2(Bn)\rceil` changes (the paper's 2048 slots:
    11 rotations per slot sum against 4 at 16 slots). :math:`\gamma = 0` and
    :math:`F = \emptyset` is the model without either.
    """

    unit_s: Mapping[str, float]
    scale: float = 1.0
    overhead_s: float = 0.0
    growth: float = 0.0
    reference_d: float = 1.0
    extra_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("scale", "overhead_s", "growth"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"CostModel.{name} must be finite and >= 0, got {value!r}"
                )
        if not (math.isfinite(self.reference_d) and self.reference_d > 0):
            raise ValueError(
                f"CostModel.reference_d must be finite and > 0, got "
                f"{self.reference_d!r}"
            )
        for key, value in self.extra_s.items():
            if key not in OPERATIONS or not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"CostModel.extra_s: {key!r} = {value!r}; keys must be of "
                    f"{OPERATIONS} and values finite and >= 0"
                )

    @classmethod
    def fit(
        cls,
        unit_s: Mapping[str, float],
        ops: Sequence[Mapping[str, float]],
        seconds: Sequence[float],
        widths: Sequence[float] | None = None,
        free: Sequence[str] = (),
    ) -> CostModel:
        r"""Least squares (non-negative) of :math:`(\alpha, \gamma, \kappa, \beta)`.

        Minimises :math:`\sum_j (1 - \hat T_j / T_j)^2` with
        :math:`B_j = \sum_k t_k o_{jk}` the bare-operation seconds of step j. Without
        ``widths`` (or with a single width) :math:`\gamma = 0`; with them
        :math:`d_0` is the narrowest width. ``free`` names the operations
        :math:`F` that get an extra cost :math:`\kappa_k` each (none by default).

        Raises
        ------
        ValueError
            If there are fewer than two measured steps or fewer steps than
            fitted coefficients, a time is not positive and finite, a width is not
            positive, a unit cost is missing or negative, or ``free`` names an
            unknown or repeated operation.
        """
        from scipy.optimize import nnls

        if len(ops) != len(seconds) or len(ops) < 2:
            raise ValueError(
                "CostModel.fit needs one time per step and at least 2 steps, got "
                f"{len(ops)} steps and {len(seconds)} times"
            )
        T = np.asarray(seconds, dtype=np.float64)
        if not np.all(np.isfinite(T) & (T > 0)):
            raise ValueError("CostModel.fit: seconds must be positive and finite")
        if any(not (unit_s.get(k, -1.0) >= 0) for k in OPERATIONS):
            raise ValueError(
                f"CostModel.fit: unit_s needs a cost >= 0 for {OPERATIONS}"
            )
        free = list(free)
        if any(k not in OPERATIONS for k in free) or len(set(free)) < len(free):
            raise ValueError(
                f"CostModel.fit: free must name distinct operations of {OPERATIONS}, "
                f"got {free}"
            )
        bare = cls(unit_s)
        B = np.array([bare.predict(o) for o in ops])
        columns = [B]
        d0 = 1.0
        grows = widths is not None and len(set(widths)) >= 2
        if grows:
            assert widths is not None
            d = np.asarray(widths, dtype=np.float64)
            if len(d) != len(T) or not np.all(np.isfinite(d) & (d > 0)):
                raise ValueError(
                    f"CostModel.fit: widths must be one positive width per step, "
                    f"got {list(widths)}"
                )
            d0 = float(d.min())
            columns.append(B * np.log2(d / d0))
        columns += [np.array([float(o[k]) for o in ops]) for k in free]
        columns.append(np.ones_like(T))
        if len(T) < len(columns):
            raise ValueError(
                f"CostModel.fit: {len(columns)} coefficients need at least as many "
                f"steps, got {len(T)}"
            )
        x, _ = nnls(np.stack(columns, axis=1) / T[:, None], np.ones_like(T))
        coef = [float(v) for v in x]
        scale, overhead = coef[0], coef[-1]
        growth = coef[1] if grows else 0.0
        extra = dict(zip(free, coef[1 + grows : -1], strict=True))
        return cls(dict(unit_s), scale, overhead, growth, d0, extra)

    def predict(self, ops: Mapping[str, float], d: float | None = None) -> float:
        """Seconds of a step with these operations at width ``d``.

        ``d`` is needed when the model has a growth term (``growth > 0``).
        """
        bare = sum(self.unit_s[k] * float(ops[k]) for k in OPERATIONS)
        factor = self.scale
        if self.growth:
            if d is None or not d > 0:
                raise ValueError(
                    f"CostModel.predict: this model grows with the width; give d > 0, "
                    f"got {d!r}"
                )
            factor += self.growth * math.log2(d / self.reference_d)
        extra = sum(v * float(ops[k]) for k, v in self.extra_s.items())
        return float(factor * bare + extra + self.overhead_s)
