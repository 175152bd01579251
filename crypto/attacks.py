r"""What an honest-but-curious server can learn, and the audit that bounds it.

* :func:`audit` - checks the server's view: every received object is a ciphertext
  message under the client's key, its context holds no secret key, and decryption
  and Galois-key generation fail on the server (research note, Sec. 8.1).
* :class:`InversionAttack` - when the server sees plaintext embeddings
  :math:`z = x W_e + P` (no HE), it inverts the public embedding by least squares,
  :math:`\\hat x_i = (z_i - P_i) W_e^{+}` (or, for one-hot tokens, by
  nearest-neighbour lookup in the embedding table), and labels the recovered input
  with a classifier trained on public data. Against ciphertexts it has nothing to
  invert and answers its prior.
* :class:`DistinguisherAttack` - a learned distinguisher: it encrypts public data
  under the client's *public* key (which CKKS allows), trains a classifier from
  per-sequence features of what it sees (plaintext slots, or ciphertext bytes) to
  labels, and predicts the client's labels. IND-CPA security of CKKS (under RLWE)
  says it must stay at chance on ciphertexts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.neighbors import KNeighborsClassifier

from defenses.arrays import FloatArray, IntArray
from defenses.checks import check_fraction, check_int
from defenses.cost import count
from defenses.metrics import clopper_pearson
from defenses.threat import Capability

from .program.heformer import HEWeights


@dataclass(frozen=True)
class ServerView:
    """The server's view: what it received, the public model and public data.

    Attributes
    ----------
    received : list
        The uploaded inputs, one entry per request: a float array (d, slots) in the
        plaintext protocol, or a tuple of ciphertext bytes under CKKS.
    batch : int
        Sequences in the (single) request.
    weights : HEWeights
        The public frozen weights.
    aux_X, aux_y : ndarray
        Public labelled data (the pretraining split).
    encode : callable
        What the server can produce itself for an input batch (it holds the public
        key): the same kind of object as ``received``.
    """

    received: Any
    batch: int
    weights: HEWeights
    aux_X: FloatArray
    aux_y: IntArray
    encode: Callable[[FloatArray], Any]


@dataclass(frozen=True)
class Guess:
    """Per-sequence label guesses and reconstructed inputs (or None)."""

    labels: IntArray
    inputs: FloatArray | None = None


def _prior(view: ServerView) -> Guess:
    counts = np.bincount(view.aux_y)
    return Guess(np.full(view.batch, int(np.argmax(counts)), dtype=np.int64))


def _is_plain(received: Any) -> bool:
    return isinstance(received, np.ndarray)


def _one_hot(X: FloatArray) -> bool:
    return bool(np.all((X == 0) | (X == 1)) and np.all(X.sum(-1) == 1))


def _label_model(view: ServerView) -> KNeighborsClassifier:
    X = view.aux_X.reshape(view.aux_X.shape[0], -1)
    return KNeighborsClassifier(n_neighbors=3).fit(X, view.aux_y)


@dataclass(frozen=True)
class InversionAttack:
    """Invert the public embedding from plaintext uploads (least squares)."""

    name: ClassVar[str] = "crypto-inversion"
    requires: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.OBSERVE_TRAFFIC, Capability.AUX_DATA}
    )

    def run(self, view: ServerView, rng: np.random.Generator) -> Guess:
        """Recovered inputs and their labels; the prior if only ciphertexts are seen."""
        if not _is_plain(view.received):
            return _prior(view)
        w = view.weights
        n = w.n_tokens
        z = np.asarray(view.received, dtype=np.float64)[:, : view.batch * n].T
        z = z.reshape(view.batch, n, w.d) - w.position[None]
        if _one_hot(view.aux_X):
            # discrete tokens: nearest row of the embedding table (exact lookup)
            dist = ((z[:, :, None, :] - w.embed[None, None]) ** 2).sum(-1)
            x = np.eye(w.embed.shape[0])[dist.argmin(-1)]
        else:
            x = z @ np.linalg.pinv(w.embed)
        labels = _label_model(view).predict(x.reshape(view.batch, -1))
        return Guess(np.asarray(labels, dtype=np.int64), x)


def _byte_features(blob: bytes, parts: int, bins: int = 16) -> FloatArray:
    data = np.frombuffer(blob, dtype=np.uint8)
    chunks = np.array_split(data, parts)
    return np.stack(
        [np.bincount(c >> 4, minlength=bins) / max(c.size, 1) for c in chunks]
    )


def _features(received: Any, batch: int, n: int) -> FloatArray:
    if _is_plain(received):
        arr = np.asarray(received, dtype=np.float64)[:, : batch * n]
        return np.asarray(arr.T.reshape(batch, -1), dtype=np.float64)
    return np.concatenate([_byte_features(ct, batch) for ct in received], axis=1)


@dataclass(frozen=True)
class DistinguisherAttack:
    """Learn labels from per-sequence features of the uploads.

    Parameters
    ----------
    train_size : int
        Public sequences the server encodes itself to train on (>= 20).
    confidence : float
        Level of the Clopper-Pearson interval on held-out accuracy, in (0, 1): when
        its lower end does not exceed chance, the features carry no detectable
        signal and the attack answers its prior.
    """

    name: ClassVar[str] = "crypto-distinguisher"
    requires: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.OBSERVE_TRAFFIC, Capability.AUX_DATA}
    )
    train_size: int = 200
    confidence: float = 0.95

    def __post_init__(self) -> None:
        check_int("DistinguisherAttack.train_size", self.train_size, 20)
        check_fraction("DistinguisherAttack.confidence", self.confidence)

    def run(self, view: ServerView, rng: np.random.Generator) -> Guess:
        """Per-sequence label guesses."""
        n = view.weights.n_tokens
        pick = rng.choice(
            view.aux_X.shape[0],
            min(self.train_size, view.aux_X.shape[0]),
            replace=False,
        )
        X, y = view.aux_X[pick], view.aux_y[pick]
        half = X.shape[0] // 2
        feats = _features(view.encode(X), X.shape[0], n)
        model = LogisticRegression(max_iter=500).fit(feats[:half], y[:half])
        held = int(np.sum(model.predict(feats[half:]) == y[half:]))
        trials = X.shape[0] - half
        low, high = clopper_pearson(held, trials, self.confidence)
        chance = float(np.max(np.bincount(y[half:]))) / trials
        count("distinguisher_heldout_accuracy", held / trials)
        count("distinguisher_ci_low", low)
        count("distinguisher_ci_high", high)
        if low <= chance:
            return _prior(view)
        model = LogisticRegression(max_iter=500).fit(feats, y)
        target = _features(view.received, view.batch, n)
        return Guess(np.asarray(model.predict(target), dtype=np.int64))


@dataclass(frozen=True)
class AuditReport:
    """Outcome of :func:`audit` (every field must be True for a clean view)."""

    only_ciphertexts: bool
    context_public: bool
    decrypt_fails: bool
    galois_keygen_fails: bool
    no_secret_reachable: bool

    @property
    def clean(self) -> bool:
        """All checks passed."""
        return all(
            (
                self.only_ciphertexts,
                self.context_public,
                self.decrypt_fails,
                self.galois_keygen_fails,
                self.no_secret_reachable,
            )
        )


def secrets_reachable(root: object, limit: int = 200_000) -> list[str]:
    """What, among the objects reachable from ``root``, could decrypt.

    Walks instance attributes and containers (not modules, classes or functions) and
    reports every :class:`~crypto.protocol.client.Client`, every TenSEAL context that
    holds a secret key and every ciphertext whose context does.
    """
    import types

    import tenseal as ts

    from .protocol.client import Client

    found: list[str] = []
    seen: set[int] = set()
    stack: list[object] = [root]
    skip = (
        types.ModuleType,
        type,
        types.FunctionType,
        types.BuiltinFunctionType,
        str,
        bytes,
        np.ndarray,
    )
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, Client):
            found.append("a Client")
            continue
        if isinstance(obj, ts.Context):
            if obj.has_secret_key() or obj.is_private():
                found.append("a private context")
            continue
        if isinstance(obj, ts.CKKSVector):
            if obj.context().has_secret_key():
                found.append("a ciphertext under a private context")
            continue
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif isinstance(obj, types.MethodType):
            stack.append(obj.__self__)
        if hasattr(obj, "__dict__"):
            stack.append(vars(obj))
        for slot in getattr(type(obj), "__slots__", ()):
            if hasattr(obj, slot):
                stack.append(getattr(obj, slot))
        if type(obj).__name__ == "deque":
            stack.extend(list(obj))  # type: ignore[call-overload]
    return found


def audit(server: Any) -> AuditReport:
    """Check a :class:`~crypto.protocol.server.Server`'s transcript, context, reach."""
    from .he.ckks import load_ciphertext, load_public

    only = bool(server.transcript.inbound)
    sample = None
    for kind, payload in server.transcript.inbound:
        blobs = getattr(payload, "blobs", None)
        if not isinstance(blobs, tuple) or not all(isinstance(c, bytes) for c in blobs):
            only = False
            continue
        for blob in blobs:
            try:
                if kind == "context":
                    load_public(blob)
                else:
                    sample = load_ciphertext(server.context, blob, kind)
            except ValueError:
                only = False
    ctx = server.context
    public = (not ctx.is_private()) and (not ctx.has_secret_key())
    decrypt_fails = False
    if sample is not None:
        try:
            sample.decrypt()
        except ValueError:
            decrypt_fails = True
    galois_fails = False
    try:
        ctx.generate_galois_keys()
    except ValueError:
        galois_fails = True
    reachable = secrets_reachable(server)
    return AuditReport(only, public, decrypt_fails, galois_fails, not reachable)
