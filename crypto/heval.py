r"""The transformer's forward pass on feature-major packed values, for any backend.

Layout (rotation-free, research note Sec. 5.1): one value per feature; slot
``b * n + i`` holds token ``i`` of sequence ``b``. Linear layers are sums of
value-times-scalar products; LoRA products are value-times-encrypted-scalar products
(the encrypted factors are replicated across slots). Attention uses ``n`` *rolled*
copies of K and V: copy ``s`` holds token ``(i + s) mod n`` in slot ``i``, so the
Gaussian-kernel scores of shift ``s`` are slot-wise,
:math:`u_s = \\sum_f (q_f - k_{s,f})^2`, and the output is
:math:`\\sum_s p(u_s)\\, v_{s,f}` (Rho et al., 2025, Sec. 4.1, in our layout).

The same code runs on the plaintext :class:`~crypto.evaluator.NumpyBackend` (the HE
simulation) and on the TenSEAL backend of :mod:`crypto.ckks`, through the
level-tracking :class:`~crypto.evaluator.Evaluator` of :mod:`crypto.evaluator`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from defenses.arrays import FloatArray
from defenses.checks import check_int

from .evaluator import Evaluator, NumpyBackend, Roll, Value
from .packing import pack, roll_tokens, unit

if TYPE_CHECKING:
    import torch

    from .model import HEFormer


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


def simulate(
    model: HEFormer,
    X: FloatArray,
    noise: float = 0.0,
    rng: np.random.Generator | None = None,
    max_level: int = 10**6,
    interactive: bool = True,
) -> tuple[FloatArray, dict[str, int]]:
    """HE simulation of :func:`forward` in float64: (CLS logits, operation counts).

    Inputs outside the model's calibrated ranges are refused (``RangeError``), as
    the client refuses them before encrypting.
    """
    import torch

    from .train import predict_logits

    predict_logits(model, X, guard=True)  # refuses bad shapes, values and ranges
    X = np.asarray(X, dtype=np.float64)
    check_int("max_level", max_level, 1)
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
