r"""The packed network of one HEFormer fine-tuning arm, and its program.

:class:`Net` holds the arm's folded matrices, plaintext (frozen, public) or one
encrypted replicated value per entry (trained); :meth:`Net.program` is the same
network as a :class:`~crypto.program.spec.Program` (the trained matrices are the
client's, read from ``Run.lora``), which :mod:`crypto.program.backward`
differentiates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from defenses.arrays import FloatArray

from ..he.evaluator import Value
from .heformer import SoftmaxPolys
from .spec import Affine, Block, Head, Norm, Program

Matrix = FloatArray | list[list[Value]]
LORA_TRAINED = ("q_a", "q_b", "k_a", "k_b", "v_a", "v_b", "pool", "classifier")
FULL_TRAINED = ("wq", "wk", "wv", "wo", "w1", "w2", "pool", "classifier")


def _public(M: Matrix) -> Affine:
    """A public matrix, or zeros of a secret one's shape (never read: Run.lora is)."""
    if isinstance(M, np.ndarray):
        return Affine(M)
    return Affine(np.zeros((len(M), len(M[0]))))


@dataclass
class Net:
    """HE-ready weights of one fine-tuning arm (scales folded as in ``HEWeights``).

    Parameters
    ----------
    attention : {"gk", "softmax"}
        Gaussian kernel or the polynomial-softmax baseline.
    heads, n_tokens : int
        Attention heads and sequence length.
    mats : dict
        ``wq, wk, wv, wo, w1, w2, pool, classifier`` and, in the LoRA arm,
        ``q_a, q_b, k_a, k_b, v_a, v_b``; a trained matrix holds encrypted (or
        simulated) entries, one replicated value each, a frozen one a public array.
    trained : tuple of str
        Names of the trained matrices.
    centre, act, isqrt, tanh, gk : arrays
        Public LayerNorm centring matrix and polynomial coefficients.
    softmax : SoftmaxPolys or None
        Polynomials of the softmax baseline (``attention == "softmax"``).
    """

    attention: str
    heads: int
    n_tokens: int
    mats: dict[str, Matrix]
    trained: tuple[str, ...]
    centre: FloatArray
    act: FloatArray
    isqrt: FloatArray
    tanh: FloatArray
    gk: FloatArray
    softmax: SoftmaxPolys | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("gk", "softmax"):
            raise ValueError(
                f"Net.attention must be gk or softmax, not {self.attention}"
            )
        if self.attention == "softmax" and self.softmax is None:
            raise ValueError("the softmax arm needs its SoftmaxPolys")
        missing = [t for t in self.trained if t not in self.mats]
        if missing:
            raise ValueError(f"trained matrices {missing} are not in Net.mats")

    @property
    def lora(self) -> bool:
        """Whether Q, K, V carry LoRA factors."""
        return "q_a" in self.mats

    def program(self) -> Program:
        r"""The network as a one-block program without biases (``"heformer"``).

        Its one LayerNorm, on the feed-forward branch, has one Newton step
        :math:`y(3 - \sigma y^2)` (the 1/2 and the gain folded into :math:`W_1`).
        """
        m = self.mats
        qkv = (_public(m[x]) for x in ("wq", "wk", "wv", "wo", "w1", "w2"))
        q, k, v, o, w1, w2 = qkv
        norm = Norm(self.centre, None, None, self.isqrt, 1, 3.0, "LayerNorm")
        block = Block("", q, k, v, o, w1, self.act, w2, self.gk, ffn_norm=norm)
        pool, classifier = _public(m["pool"]), _public(m["classifier"])
        head = Head(pool, self.tanh, classifier, "head")
        d, classes = len(self.centre), classifier.weight.shape[1]
        return Program(
            "heformer", self.n_tokens, d, self.heads, classes, (block,), head, "kind"
        )

    def secrets(self) -> dict[str, list[list[Value]]]:
        """The trained matrices (the client's encrypted values), by name."""
        out = {}
        for name in self.trained:
            M = self.mats[name]
            if isinstance(M, np.ndarray):
                raise TypeError(f"Net.mats[{name!r}] is trained but not encrypted")
            out[name] = M
        return out
