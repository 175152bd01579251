"""Encrypted inference between a key-holding client and a public-context server.

The client (Rho et al., 2025, Fig. 1) embeds its sequences with the public embedding,
encrypts them in the feature-major layout of :mod:`crypto.heval` together with its
secret LoRA factors, and sends only ciphertexts. The server holds the public context
(no secret key) and the frozen plaintext weights; it evaluates the layer and returns
encrypted logits. Without bootstrapping (TenSEAL has none), the server asks the
client for *refreshes* (decrypt and re-encrypt, counted as bootstrap stand-ins) and
for the rolled copies of K and V (the interactive configuration), or runs the whole
layer in a larger ring from client-rolled inputs (the non-interactive configuration).

Every object the server receives is recorded in its :class:`Transcript`; the audit of
:mod:`crypto.attacks` checks it holds only ciphertexts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from crypto.ckks import (
    CKKSParams,
    TenSEALBackend,
    fingerprint,
    load_public,
    make_context,
    public_bytes,
)
from crypto.evaluator import Evaluator, Value
from crypto.heval import HEWeights, forward, lora_factors
from crypto.packing import pack, roll_tokens
from defenses.cost import count

if TYPE_CHECKING:
    from crypto.model import HEFormer

logger = logging.getLogger(__name__)
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Message:
    """Ciphertexts in transit, tagged with the key fingerprint they were made under."""

    key: str
    ciphertexts: tuple[bytes, ...]

    @property
    def nbytes(self) -> int:
        """Total serialised size."""
        return sum(len(c) for c in self.ciphertexts)


@dataclass
class Transcript:
    """Everything the server received, in order, with the time it spent."""

    inbound: list[tuple[str, Any]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def record(self, kind: str, payload: Any) -> None:
        """Append one received object."""
        self.inbound.append((kind, payload))


class Client:
    """The data owner: holds the secret key, the data and the LoRA factors.

    Parameters
    ----------
    model : HEFormer
        The calibrated Gaussian-kernel model (its base weights are public, its LoRA
        factors are the client's secret).
    params : CKKSParams
        The modulus chain.
    """

    def __init__(self, model: HEFormer, params: CKKSParams):
        self.model = model
        self.params = params
        self.context = make_context(params)
        self.key = fingerprint(self.context)
        self.refreshes = 0
        self.refreshed = 0

    def public_context(self) -> bytes:
        """Serialised context without the secret key."""
        return public_bytes(self.context)

    def _encrypt(self, values: list[FloatArray]) -> Message:
        import tenseal as ts

        cts = tuple(ts.ckks_vector(self.context, list(v)).serialize() for v in values)
        return Message(self.key, cts)

    def _decrypt(self, message: Message) -> list[FloatArray]:
        import tenseal as ts

        if message.key != self.key:
            raise ValueError("ciphertexts were made under another key")
        return [
            np.asarray(ts.ckks_vector_from(self.context, c).decrypt(), dtype=np.float64)
            for c in message.ciphertexts
        ]

    def embed(self, X: FloatArray) -> FloatArray:
        """Public embedding z = x W_e + P, after the range guard on the plaintext."""
        import torch

        from crypto.train import predict_logits

        predict_logits(self.model, X, guard=True)
        with torch.no_grad():
            z = self.model.embed_tokens(torch.as_tensor(X, dtype=torch.float64))
        return np.asarray(z.numpy(), dtype=np.float64)

    def encrypt_inputs(self, X: FloatArray, rolled: bool = False) -> Message:
        """Encrypt a batch (feature-major); with ``rolled`` also its n rolled copies."""
        n = self.model.config.n_tokens
        packed = pack(self.embed(X), self.params.slots - self.params.slots % n)
        if rolled:
            packed = packed + [roll_tokens(p, n, s) for s in range(n) for p in packed]
        return self._encrypt(packed)

    def encrypt_lora(self) -> dict[str, Message]:
        """The secret LoRA factors, one replicated ciphertext per entry."""
        slots = self.params.slots - self.params.slots % self.model.config.n_tokens
        return {
            name: self._encrypt([np.full(slots, x) for x in M.ravel()])
            for name, M in lora_factors(self.model).items()
        }

    def refresh(self, message: Message) -> Message:
        """Decrypt and re-encrypt fresh (the bootstrapping stand-in)."""
        self.refreshes += 1
        self.refreshed += len(message.ciphertexts)
        return self._encrypt(self._decrypt(message))

    def roll(self, message: Message, copies: int) -> Message:
        """Decrypt, return ``copies`` rolled fresh copies of every ciphertext."""
        n = self.model.config.n_tokens
        self.refreshes += 1
        values = self._decrypt(message)
        self.refreshed += len(values)
        return self._encrypt(
            [roll_tokens(v, n, s) for s in range(copies) for v in values]
        )

    def decrypt_logits(self, message: Message, batch: int) -> FloatArray:
        """Decrypt the logits and read the CLS slot of each sequence."""
        n = self.model.config.n_tokens
        values = self._decrypt(message)
        return np.stack([v[: batch * n : n] for v in values], axis=1)

    def predict(
        self, server: Server, X: FloatArray, interactive: bool = True
    ) -> FloatArray:
        """Encrypted logits for ``X`` via ``server`` (batched to fill the slots)."""
        X = np.asarray(X, dtype=np.float64)
        c = self.model.config
        if X.ndim != 3 or X.shape[1:] != (c.n_tokens, c.token_dim):
            raise ValueError(
                f"expected sequences of shape (batch, {c.n_tokens}, {c.token_dim}), "
                f"got {X.shape}"
            )
        per_batch = self.params.slots // c.n_tokens
        lora = self.encrypt_lora()
        out = []
        for start in range(0, X.shape[0], per_batch):
            chunk = X[start : start + per_batch]
            message = self.encrypt_inputs(chunk, rolled=not interactive)
            answer = server.infer(message, lora, self if interactive else None)
            out.append(self.decrypt_logits(answer, chunk.shape[0]))
        return np.concatenate(out)


class Server:
    """The honest-but-curious server: public context and frozen plaintext weights.

    Raises
    ------
    ValueError
        If the context holds a secret key.
    """

    def __init__(self, context: bytes, weights: HEWeights, params: CKKSParams):
        self.context = load_public(context)
        self.key = fingerprint(self.context)
        self.weights = weights
        self.params = params
        self.transcript = Transcript()
        self.counts: dict[str, int] = {}

    @classmethod
    def for_model(cls, context: bytes, model: HEFormer, params: CKKSParams) -> Server:
        """A server for the public part of ``model``."""
        return cls(context, HEWeights.from_model(model), params)

    def _load(self, message: Message, kind: str) -> list[Value]:
        import tenseal as ts

        if not isinstance(message, Message):
            raise TypeError(
                f"the server accepts only Message objects, got {type(message)!r}"
            )
        if message.key != self.key:
            raise ValueError(
                "ciphertexts from another context: their key fingerprint "
                f"{message.key} is not this server's {self.key}"
            )
        self.transcript.record(kind, message)
        count("ciphertext_bytes_up", message.nbytes)
        return [
            Value(ts.ckks_vector_from(self.context, c)) for c in message.ciphertexts
        ]

    @staticmethod
    def _dump(values: list[Value], key: str) -> Message:
        return Message(key, tuple(v.handle.serialize() for v in values))

    def infer(
        self, message: Message, lora: dict[str, Message], client: Client | None
    ) -> Message:
        """Evaluate the layer; ``client`` refreshes (None: non-interactive)."""
        start = time.perf_counter()
        w = self.weights
        d, n = w.d, w.n_tokens
        values = self._load(message, "inputs")
        factors: dict[str, list[list[Value]]] = {}
        for name, m in lora.items():
            flat = self._load(m, f"lora {name}")
            cols = w.d if name.endswith("_b") else len(flat) // w.d
            rows = len(flat) // cols
            factors[name] = [flat[r * cols : (r + 1) * cols] for r in range(rows)]

        def refresh(vals: list[Value]) -> list[Value]:
            assert client is not None
            return self._load(client.refresh(self._dump(vals, self.key)), "refresh")

        def roll(vals: list[Value], copies: int) -> list[list[Value]]:
            assert client is not None
            fresh = self._load(client.roll(self._dump(vals, self.key), copies), "roll")
            m = len(vals)
            return [fresh[s * m : (s + 1) * m] for s in range(copies)]

        ev = Evaluator(
            TenSEALBackend(), self.params.levels, refresh if client else None
        )
        if client is not None:
            if len(values) != d:
                raise ValueError(f"expected {d} input ciphertexts, got {len(values)}")
            logits = forward(ev, w, values, factors, roll=roll)
        else:
            if len(values) != d * (n + 1):
                raise ValueError(
                    f"non-interactive inference expects {d * (n + 1)} ciphertexts "
                    f"(inputs and {n} rolled copies), got {len(values)}"
                )
            rolled = [values[d + s * d : d + (s + 1) * d] for s in range(n)]
            logits = forward(ev, w, values[:d], factors, rolled_z=rolled)
        for k, v in ev.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
            count(k, v)
        answer = self._dump(logits, self.key)
        count("ciphertext_bytes_down", answer.nbytes)
        self.transcript.seconds.append(time.perf_counter() - start)
        return answer
