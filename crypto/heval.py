r"""The transformer's forward pass on feature-major packed values, for any backend.

Layout (rotation-free, research note Sec. 5.1): one value per feature; slot
``b * n + i`` holds token ``i`` of sequence ``b``. Linear layers are sums of
value-times-scalar products; LoRA products are value-times-encrypted-scalar products
(the encrypted factors are replicated across slots). Attention uses ``n`` *rolled*
copies of K and V: copy ``s`` holds token ``(i + s) mod n`` in slot ``i``, so the
Gaussian-kernel scores of shift ``s`` are slot-wise,
:math:`u_s = \\sum_f (q_f - k_{s,f})^2`, and the output is
:math:`\\sum_s p(u_s)\\, v_{s,f}` (Rho et al., 2025, Sec. 4.1, in our layout).

The same code runs on :class:`NumpyBackend` (the HE simulation: exact arithmetic,
optionally CKKS-like Gaussian noise after each operation) and on the TenSEAL backend
of :mod:`crypto.ckks`. :class:`Evaluator` tracks each value's multiplicative level;
before a stage that would exceed the modulus chain it asks the key owner for a
*refresh* (decrypt and re-encrypt, the client-aided stand-in for bootstrapping) and
counts it, or raises :class:`DepthError` when running non-interactively.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from crypto.model import HEFormer

FloatArray = npt.NDArray[np.float64]


class DepthError(RuntimeError):
    """The computation needs more levels than the CKKS parameters provide."""


class Backend(Protocol):
    """Slot-wise arithmetic on opaque handles (plaintext arrays or ciphertexts)."""

    def add(self, a: Any, b: Any) -> Any:
        """A + b."""
        ...

    def sub(self, a: Any, b: Any) -> Any:
        """A - b."""
        ...

    def mul(self, a: Any, b: Any) -> Any:
        """A * b (both operands values: a ciphertext-ciphertext product)."""
        ...

    def square(self, a: Any) -> Any:
        """A * a."""
        ...

    def mul_scalar(self, a: Any, c: float) -> Any:
        """A * c for a public scalar c."""
        ...

    def add_scalar(self, a: Any, c: float) -> Any:
        """A + c for a public scalar c."""
        ...

    def polyval(self, a: Any, coefficients: Sequence[float]) -> Any:
        """Polynomial with low-to-high coefficients evaluated at a."""
        ...

    def neg(self, a: Any) -> Any:
        """-a."""
        ...

    def mul_plain(self, a: Any, mask: FloatArray) -> Any:
        """A * m for a public vector m (slot-wise, one level)."""
        ...

    def sum_slots(self, a: Any) -> Any:
        """The sum of a's slots, replicated over them (rotations, no level)."""
        ...


@dataclass
class NumpyBackend:
    """Plaintext arithmetic on float64 arrays; the HE simulation when ``noise > 0``.

    ``noise`` is the standard deviation of Gaussian noise added after every
    operation (a CKKS-like rounding and encryption error).
    """

    noise: float = 0.0
    rng: np.random.Generator | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.noise) and self.noise >= 0):
            raise ValueError(f"NumpyBackend.noise must be >= 0, got {self.noise!r}")
        if self.noise and self.rng is None:
            raise ValueError("NumpyBackend with noise > 0 needs an rng")

    def _n(self, x: FloatArray) -> FloatArray:
        if self.noise and self.rng is not None:
            return x + self.noise * self.rng.standard_normal(x.shape)
        return x

    def add(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A + b."""
        return a + b

    def sub(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A - b."""
        return a - b

    def mul(self, a: FloatArray, b: FloatArray) -> FloatArray:
        """A * b."""
        return self._n(a * b)

    def square(self, a: FloatArray) -> FloatArray:
        """A * a."""
        return self._n(a * a)

    def mul_scalar(self, a: FloatArray, c: float) -> FloatArray:
        """A * c."""
        return self._n(a * c)

    def add_scalar(self, a: FloatArray, c: float) -> FloatArray:
        """A + c."""
        return a + c

    def neg(self, a: FloatArray) -> FloatArray:
        """-a."""
        return -a

    def mul_plain(self, a: FloatArray, mask: FloatArray) -> FloatArray:
        """A * mask."""
        return self._n(a * mask)

    def sum_slots(self, a: FloatArray) -> FloatArray:
        """Sum of the slots, replicated."""
        return self._n(np.full_like(a, a.sum()))

    def polyval(self, a: FloatArray, coefficients: Sequence[float]) -> FloatArray:
        """Horner evaluation."""
        out = np.zeros_like(a)
        for c in list(coefficients)[::-1]:
            out = out * a + c
        return self._n(out)


@dataclass
class Value:
    """A packed value (array or ciphertext) and the levels it has consumed."""

    handle: Any
    level: int = 0


Refresh = Callable[[list[Value]], list[Value]]
Roll = Callable[[list[Value], int], list[list[Value]]]


@dataclass
class Evaluator:
    """Level-tracking arithmetic on :class:`Value` s.

    Parameters
    ----------
    backend : Backend
        The arithmetic.
    max_level : int
        Multiplications the modulus chain allows before a refresh.
    refresh : callable or None
        Client-aided refresh (decrypt and re-encrypt at level 0); None means
        non-interactive (running out of levels raises :class:`DepthError`).
    """

    backend: Backend
    max_level: int
    refresh: Refresh | None = None
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_level, bool)
            or not isinstance(self.max_level, int)
            or self.max_level < 1
        ):
            raise ValueError(
                f"Evaluator.max_level must be an int >= 1, got {self.max_level!r}"
            )

    def note(self, name: str, amount: int = 1) -> None:
        """Add ``amount`` to the operation counter ``name``."""
        self.counts[name] = self.counts.get(name, 0) + amount

    def ensure(self, values: list[Value], need: int, stage: str) -> list[Value]:
        """Refresh ``values`` if ``need`` more levels would exceed the chain."""
        if need > self.max_level:
            raise DepthError(
                f"stage {stage!r} needs {need} levels in one go; the parameters give "
                f"{self.max_level}"
            )
        top = max(v.level for v in values)
        if top + need <= self.max_level:
            return values
        if self.refresh is None:
            raise DepthError(
                f"stage {stage!r} needs levels {top}+{need} > {self.max_level} and the "
                "configuration is non-interactive; use a larger ring or allow refreshes"
            )
        self.note("refresh_rounds")
        self.note("refreshed_values", len(values))
        return self.refresh(values)

    def add(self, a: Value, b: Value) -> Value:
        """A + b."""
        return Value(self.backend.add(a.handle, b.handle), max(a.level, b.level))

    def sub(self, a: Value, b: Value) -> Value:
        """A - b."""
        return Value(self.backend.sub(a.handle, b.handle), max(a.level, b.level))

    def mul(self, a: Value, b: Value) -> Value:
        """A * b (ciphertext-ciphertext)."""
        self.note("ct_ct_mul")
        return Value(self.backend.mul(a.handle, b.handle), max(a.level, b.level) + 1)

    def square(self, a: Value) -> Value:
        """A * a."""
        self.note("ct_ct_mul")
        return Value(self.backend.square(a.handle), a.level + 1)

    def scale(self, a: Value, c: float) -> Value:
        """A * c."""
        self.note("ct_pt_mul")
        return Value(self.backend.mul_scalar(a.handle, float(c)), a.level + 1)

    def neg(self, a: Value) -> Value:
        """-a (no level)."""
        return Value(self.backend.neg(a.handle), a.level)

    def mask(self, a: Value, m: FloatArray) -> Value:
        """A * m for a public vector m (one level)."""
        self.note("ct_pt_mul")
        return Value(self.backend.mul_plain(a.handle, m), a.level + 1)

    def slot_sum(self, a: Value) -> Value:
        """Sum over the slots, replicated (rotations with Galois keys; no level)."""
        self.note("slot_sums")
        return Value(self.backend.sum_slots(a.handle), a.level)

    def shift(self, a: Value, c: float) -> Value:
        """A + c."""
        return Value(self.backend.add_scalar(a.handle, float(c)), a.level)

    def poly(self, a: Value, coefficients: Sequence[float] | FloatArray) -> Value:
        r"""p(a); consumes :math:`\\lceil\\log_2(\\deg+1)\\rceil` levels."""
        self.note("polyval")
        degree = len(coefficients) - 1
        return Value(
            self.backend.polyval(a.handle, [float(c) for c in coefficients]),
            a.level + math.ceil(math.log2(degree + 1)),
        )

    def total(self, values: Sequence[Value]) -> Value:
        """Sum of values."""
        out = values[0]
        for v in values[1:]:
            out = self.add(out, v)
        return out

    def linear(self, xs: Sequence[Value], W: FloatArray) -> list[Value]:
        r""":math:`y_f = \\sum_g x_g W_{gf}` with public W (zero entries skipped)."""
        if W.shape[0] != len(xs):
            raise ValueError(
                f"linear: {len(xs)} inputs for a weight of shape {W.shape}"
            )
        out = []
        for f in range(W.shape[1]):
            terms = [
                self.scale(xs[g], W[g, f]) for g in range(W.shape[0]) if W[g, f] != 0
            ]
            if not terms:
                raise ValueError(f"linear: output {f} has an all-zero weight column")
            out.append(self.total(terms))
        return out

    def lora(
        self,
        xs: Sequence[Value],
        W: FloatArray,
        A: Sequence[Sequence[Value]],
        B: Sequence[Sequence[Value]],
    ) -> list[Value]:
        """:math:`x W_0 + (x A) B` with public W and encrypted A (d x r), B (r x d)."""
        base = self.linear(xs, W)
        low = [
            self.total([self.mul(xs[g], A[g][r]) for g in range(len(xs))])
            for r in range(len(B))
        ]
        return [
            self.add(
                base[f], self.total([self.mul(low[r], B[r][f]) for r in range(len(B))])
            )
            for f in range(W.shape[1])
        ]


@dataclass(frozen=True)
class HEWeights:
    r"""The public, HE-ready weights of a :class:`~crypto.model.HEFormer`.

    Scales are folded into the public matrices so every polynomial sees inputs in
    [0, 1] or [-1, 1]: :math:`\\kappa = (2\\sqrt{d_h} D)^{-1/2}` into :math:`W_q, W_k`
    (and the client folds it into the LoRA factors it encrypts); the LayerNorm
    centring and :math:`(d\\cdot\\text{div})^{-1/2}` into one matrix; the LayerNorm
    gain, Newton's 1/2 and :math:`1/B_{\\text{ffn}}` into :math:`W_1`;
    :math:`1/B_p` into the pooler. A personal head (``personal_head``) is the
    client's secret and is left out (zeros): it travels encrypted with the LoRA
    factors.
    """

    n_tokens: int
    d: int
    heads: int
    n_classes: int
    embed: FloatArray
    position: FloatArray
    wq: FloatArray
    wk: FloatArray
    wv: FloatArray
    wo: FloatArray
    centre: FloatArray
    w1: FloatArray
    act: FloatArray
    w2: FloatArray
    pool: FloatArray
    classifier: FloatArray
    gk: FloatArray
    isqrt: FloatArray
    tanh: FloatArray
    kappa: float
    ffn_bound: float

    @classmethod
    def from_model(cls, model: HEFormer) -> HEWeights:
        """Extract and fold the weights of a calibrated Gaussian-kernel model."""
        c, cal = model.config, model.calibration
        if c.attention != "gk":
            raise ValueError("encrypted inference needs the Gaussian-kernel model")
        if not cal.calibrated:
            raise ValueError("calibrate the model before extracting HE weights")

        def a(t: torch.Tensor) -> FloatArray:
            return np.asarray(t.detach().numpy(), dtype=np.float64).copy()

        kappa = 1.0 / math.sqrt(2.0 * math.sqrt(c.head_dim) * cal.dist_bound)
        k_ln = 1.0 / math.sqrt(c.d * cal.ln_div)
        centre = (np.eye(c.d) - 1.0 / c.d) * k_ln
        gain = a(model.gamma) / (2.0 * k_ln * math.sqrt(cal.ln_div) * cal.ffn_bound)
        alpha, beta = a(model.act)
        head = 0.0 if c.personal_head else 1.0  # a personal head is the client's
        return cls(
            n_tokens=c.n_tokens,
            d=c.d,
            heads=c.heads,
            n_classes=c.n_classes,
            embed=a(model.embed),
            position=a(model.position),
            wq=a(model.q.weight) * kappa,
            wk=a(model.k.weight) * kappa,
            wv=a(model.v.weight),
            wo=a(model.out),
            centre=centre,
            w1=gain[:, None] * a(model.w1),
            act=np.array([0.0, alpha * cal.ffn_bound, beta * cal.ffn_bound**2]),
            w2=a(model.w2),
            pool=head * a(model.pool) / cal.pool_bound,
            classifier=head * a(model.classifier),
            gk=cal.polys["gk"].coefficients.copy(),
            isqrt=cal.polys["isqrt"].coefficients.copy(),
            tanh=cal.polys["tanh"].coefficients.copy(),
            kappa=kappa,
            ffn_bound=cal.ffn_bound,
        )


def lora_factors(model: HEFormer) -> dict[str, FloatArray]:
    r"""The client's secret weights, with :math:`\\kappa` folded into Q and K.

    The LoRA factors, plus the pooler (divided by :math:`B_p`) and classifier when
    the head is personal.
    """
    kappa = 1.0 / math.sqrt(
        2.0 * math.sqrt(model.config.head_dim) * model.calibration.dist_bound
    )
    out = {}
    for name, layer, s in (
        ("q", model.q, kappa),
        ("k", model.k, kappa),
        ("v", model.v, 1.0),
    ):
        out[f"{name}_a"] = (
            np.asarray(layer.lora_a.detach().numpy(), dtype=np.float64) * s
        )
        out[f"{name}_b"] = np.asarray(
            layer.lora_b.detach().numpy(), dtype=np.float64
        ).copy()
    if model.config.personal_head:
        pool = np.asarray(model.pool.detach().numpy(), dtype=np.float64)
        out["pool"] = pool / model.calibration.pool_bound
        out["classifier"] = np.asarray(
            model.classifier.detach().numpy(), dtype=np.float64
        ).copy()
    return out


def unit(handle_of: Callable[[float], Any], M: FloatArray) -> list[list[Value]]:
    """Wrap a matrix of encrypted (or simulated) scalars, one value per entry."""
    return [[Value(handle_of(float(x))) for x in row] for row in M]


def gk_attention(
    ev: Evaluator,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    heads: int,
    coefficients: FloatArray,
) -> list[Value]:
    """Gaussian-kernel attention on rolled copies (no normalisation)."""
    d = len(q)
    dh = d // heads
    out: list[Value] = []
    for h in range(heads):
        cols = range(h * dh, (h + 1) * dh)
        weights = []
        for s in range(len(ks)):
            sq = [ev.square(ev.sub(q[f], ks[s][f])) for f in cols]
            weights.append(ev.poly(ev.total(sq), coefficients))
        for f in cols:
            out.append(ev.total([ev.mul(weights[s], vs[s][f]) for s in range(len(vs))]))
    return out


@dataclass(frozen=True)
class SoftmaxPolys:
    r"""Polynomials of the HE softmax baseline.

    ``exp`` approximates :math:`c\,e^{R t}` on :math:`t\in[-1,1]` (scores divided by
    ``R``; the constant ``c`` is chosen so that every row sum
    :math:`\sum_s c\,e^{R t_s}` lies in ``[lo, 1]``, where ``recip`` (plus
    ``newton`` steps :math:`y \leftarrow y(2 - s y)`) inverts it; ``c`` cancels in
    the normalised output).
    """

    exp: FloatArray
    recip: FloatArray
    newton: int = 2


def softmax_attention(
    ev: Evaluator,
    q: list[Value],
    ks: list[list[Value]],
    vs: list[list[Value]],
    heads: int,
    polys: SoftmaxPolys,
) -> list[Value]:
    r"""Polynomial softmax attention (the baseline GK attention replaces).

    ``q`` must already carry the factor :math:`1/(\sqrt{d_h} R)`. Depth:
    1 (scores) + 3 (exp) + 2 (reciprocal) + 2 per Newton step + 1 (normalise):
    11 levels with two Newton steps, against 5 for the Gaussian kernel.
    """
    d = len(q)
    dh = d // heads
    n = len(ks)
    out: list[Value] = []
    for h in range(heads):
        cols = list(range(h * dh, (h + 1) * dh))
        qs = ev.ensure([q[f] for f in cols], 1 + 3, "softmax scores")
        e = []
        for s in range(n):
            score = ev.total([ev.mul(qs[i], ks[s][f]) for i, f in enumerate(cols)])
            e.append(ev.poly(score, polys.exp))
        [total] = ev.ensure([ev.total(e)], 2, "softmax reciprocal")
        y = ev.poly(total, polys.recip)
        for _ in range(polys.newton):
            [total, y] = ev.ensure([total, y], 2, "softmax Newton")
            y = ev.mul(y, ev.shift(ev.neg(ev.mul(total, y)), 2.0))
        e = ev.ensure(e, 1, "softmax weights")
        [y] = ev.ensure([y], 1, "softmax weights")
        for f in cols:
            acc = ev.total([ev.mul(e[s], vs[s][f]) for s in range(n)])
            [acc, yy] = ev.ensure([acc, y], 1, "softmax normalise")
            out.append(ev.mul(acc, yy))
    return out


def forward(
    ev: Evaluator,
    w: HEWeights,
    z: list[Value],
    lora: dict[str, list[list[Value]]],
    roll: Roll | None = None,
    rolled_z: list[list[Value]] | None = None,
) -> list[Value]:
    """Encrypted (or simulated) logits on every slot; the CLS slots are the answer.

    Give ``roll`` (interactive: the key owner returns rolled fresh copies of K and V)
    or ``rolled_z`` (non-interactive: the client uploaded rolled copies of the
    embedding, and K, V are projected once per shift).
    """
    if (roll is None) == (rolled_z is None):
        raise ValueError("give exactly one of roll (interactive) or rolled_z")
    d, n = w.d, w.n_tokens
    if len(z) != d:
        raise ValueError(f"expected {d} feature values, got {len(z)}")
    z = ev.ensure(z, 2, "qkv")
    q = ev.lora(z, w.wq, lora["q_a"], lora["q_b"])
    if roll is not None:
        k = ev.lora(z, w.wk, lora["k_a"], lora["k_b"])
        v = ev.lora(z, w.wv, lora["v_a"], lora["v_b"])
        rolled = roll(k + v, n)
        ev.note("roll_rounds")
        ks, vs = [r[:d] for r in rolled], [r[d:] for r in rolled]
    else:
        assert rolled_z is not None
        if len(rolled_z) != n:
            raise ValueError(f"expected {n} rolled copies, got {len(rolled_z)}")
        ks, vs = [], []
        for zs in rolled_z:
            zs = ev.ensure(zs, 2, "qkv")
            ks.append(ev.lora(zs, w.wk, lora["k_a"], lora["k_b"]))
            vs.append(ev.lora(zs, w.wv, lora["v_a"], lora["v_b"]))
    flat = q + [x for r in ks for x in r] + [x for r in vs for x in r]
    flat = ev.ensure(flat, 5, "attention")
    q = flat[:d]
    ks = [flat[d + s * d : d + (s + 1) * d] for s in range(n)]
    vs = [flat[d + n * d + s * d : d + n * d + (s + 1) * d] for s in range(n)]
    attended = gk_attention(ev, q, ks, vs, w.heads, w.gk)
    attended = ev.ensure(attended, 1, "output projection")
    h = [ev.add(a, b) for a, b in zip(z, ev.linear(attended, w.wo), strict=True)]
    h = ev.ensure(h, 2, "LayerNorm statistics")
    centred = ev.linear(h, w.centre)
    s = ev.total([ev.square(c) for c in centred])
    [s] = ev.ensure([s], 2, "LayerNorm inverse sqrt")
    y = ev.poly(s, w.isqrt)
    s, y = ev.ensure([s, y], 3, "LayerNorm Newton")
    y = ev.mul(y, ev.shift(ev.neg(ev.mul(s, ev.square(y))), 3.0))
    both = ev.ensure([*centred, y], 1, "LayerNorm scale")
    u = [ev.mul(c, both[-1]) for c in both[:-1]]
    u = ev.ensure(u, 4, "feed-forward")
    hidden = [ev.poly(a, w.act) for a in ev.linear(u, w.w1)]
    ffn = ev.linear(hidden, w.w2)
    o = [ev.add(a, b) for a, b in zip(h, ffn, strict=True)]
    o = ev.ensure(o, 4, "head")
    pooled = [ev.poly(t, w.tanh) for t in _head(ev, o, w.pool, lora.get("pool"))]
    return _head(ev, pooled, w.classifier, lora.get("classifier"))


def _head(
    ev: Evaluator, xs: list[Value], public: FloatArray, secret: list[list[Value]] | None
) -> list[Value]:
    """A head matrix: public plaintext, or the client's encrypted personal one."""
    if secret is None:
        return ev.linear(xs, public)
    return [
        ev.total([ev.mul(xs[g], secret[g][f]) for g in range(len(xs))])
        for f in range(len(secret[0]))
    ]


def pack(z: FloatArray, slots: int) -> list[FloatArray]:
    """Feature-major packing of embeddings (batch, n, d) into d arrays of ``slots``.

    Slot ``b * n + i`` holds token ``i`` of sequence ``b``; unused slots are zero.
    """
    b, n, d = z.shape
    if b * n > slots:
        raise ValueError(f"{b} sequences of {n} tokens do not fit in {slots} slots")
    out = np.zeros((d, slots))
    out[:, : b * n] = z.reshape(b * n, d).T
    return list(out)


def roll_tokens(values: FloatArray, n: int, shift: int) -> FloatArray:
    """Copy ``shift``: slot ``b n + i`` gets slot ``b n + (i + shift) mod n``."""
    if values.size % n:
        raise ValueError(f"{values.size} slots are not a multiple of {n} tokens")
    return np.roll(values.reshape(-1, n), -shift, axis=1).reshape(-1)


def simulate(
    model: HEFormer,
    X: FloatArray,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
    max_level: int = 10**6,
    interactive: bool = True,
) -> tuple[FloatArray, dict[str, int]]:
    """HE simulation of :func:`forward` in float64: (CLS logits, operation counts)."""
    w = HEWeights.from_model(model)
    backend = NumpyBackend(noise, rng)
    n = w.n_tokens
    with torch.no_grad():
        z = model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
    slots = z.shape[0] * n

    def fresh(values: list[Value]) -> list[Value]:
        return [Value(backend._n(np.asarray(v.handle))) for v in values]

    def roll(values: list[Value], count: int) -> list[list[Value]]:
        return [
            [Value(backend._n(roll_tokens(np.asarray(v.handle), n, s))) for v in values]
            for s in range(count)
        ]

    ev = Evaluator(backend, max_level, fresh if interactive else None)
    factors = lora_factors(model)
    lora = {name: unit(lambda x: x, M) for name, M in factors.items()}
    packed = [Value(p) for p in pack(z, slots)]
    if interactive:
        logits = forward(ev, w, packed, lora, roll=roll)
    else:
        rolled = [
            [Value(roll_tokens(p.handle, n, s)) for p in packed] for s in range(n)
        ]
        logits = forward(ev, w, packed, lora, rolled_z=rolled)
    cls = np.stack([np.asarray(v.handle)[::n] for v in logits], axis=1)
    return cls, dict(ev.counts)
