"""Deployed systems and the learners that build them.

The personalised model is served in plaintext, with client noise, or under CKKS.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from defenses.arrays import FloatArray
from defenses.cost import phase

from .he.ckks import CKKSParams
from .he.evaluator import Evaluator, NumpyBackend, Value
from .he.packing import pack, roll_tokens, unit
from .models.heformer import HEFormer, ModelConfig
from .models.train import TrainConfig, personalise, predict_logits, pretrain
from .program.heformer import HEWeights, forward, lora_factors
from .tasks import Sequences


@dataclass(frozen=True)
class CryptoTask:
    """Public pretraining data and the client's private personalisation data."""

    public: Sequences
    client_train: Sequences
    client_test: Sequences


@dataclass
class Deployment:
    """A personalised model served through the plaintext protocol.

    The server evaluates :func:`crypto.program.heformer.forward` on plaintext packed
    embeddings (what it receives is recorded in ``received``); the client's optional
    Gaussian ``noise`` on the embeddings is the non-cryptographic baseline.
    """

    model: HEFormer
    accuracy_frozen: float
    accuracy_softmax: float
    noise: float = 0.0
    rng: np.random.Generator | None = None
    received: Any = None
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def weights(self) -> HEWeights:
        """The public weights."""
        return HEWeights.from_model(self.model)

    def encode(self, X: FloatArray) -> Any:
        """What the client uploads for ``X``: packed (noisy) embeddings."""
        n = self.model.config.n_tokens
        with torch.no_grad():
            z = self.model.embed_tokens(torch.as_tensor(X, dtype=torch.float64)).numpy()
        if self.noise:
            assert self.rng is not None
            z = z + self.noise * self.rng.standard_normal(z.shape)
        return np.stack(pack(z, X.shape[0] * n))

    def serve(self, X: FloatArray) -> FloatArray:
        """Logits for ``X`` (the server computes on what it received)."""
        predict_logits(self.model, X, guard=True)
        n = self.model.config.n_tokens
        self.received = self.encode(X)
        w = self.weights
        ev = Evaluator(NumpyBackend(), 10**6)
        lora = {k: unit(lambda x: x, M) for k, M in lora_factors(self.model).items()}
        z = [Value(r) for r in self.received]
        rolled = [[Value(roll_tokens(v.handle, n, s)) for v in z] for s in range(n)]
        out = forward(ev, w, z, lora, rolled_z=rolled)
        return np.stack([np.asarray(v.handle)[::n] for v in out], axis=1)

    def plaintext_logits(self, X: FloatArray) -> FloatArray:
        """Reference logits of the personalised model (no protocol)."""
        return predict_logits(self.model, X, guard=False)


@dataclass(frozen=True)
class PersonalisedLearner:
    """Pretrain on public data, LoRA-personalise on the client's data.

    Parameters
    ----------
    config : ModelConfig
        Model shape.
    pretrain_epochs, lora_epochs : int
        Training lengths.
    twin : bool
        Also train the softmax-attention twin and record its accuracy.
    """

    config: ModelConfig
    pretrain_epochs: int = 15
    lora_epochs: int = 20
    twin: bool = True

    def _pretrain(
        self, config: ModelConfig, task: CryptoTask, g: torch.Generator
    ) -> HEFormer:
        return pretrain(
            task.public,
            config,
            g,
            TrainConfig(epochs=self.pretrain_epochs, batch=128),
            TrainConfig(
                epochs=max(1, self.pretrain_epochs // 3),
                lr=3e-3,
                batch=128,
                penalty=10.0,
            ),
        )

    def fit(self, task: CryptoTask, rng: np.random.Generator) -> Deployment:
        """Train and return the plaintext deployment."""
        g = torch.Generator().manual_seed(int(rng.integers(2**62)))
        model = self._pretrain(self.config, task, g)
        test = task.client_test
        frozen = float(
            np.mean(predict_logits(model, test.X, guard=False).argmax(1) == test.y)
        )
        personalise(
            model,
            task.client_train,
            g,
            TrainConfig(epochs=self.lora_epochs, penalty=10.0),
        )
        softmax = 0.0
        if self.twin:
            twin_cfg = ModelConfig(**{**self.config.__dict__, "attention": "softmax"})
            twin = self._pretrain(twin_cfg, task, g)
            personalise(
                twin, task.client_train, g, TrainConfig(epochs=self.lora_epochs)
            )
            softmax = float(
                np.mean(predict_logits(twin, test.X, guard=False).argmax(1) == test.y)
            )
        return Deployment(model, frozen, softmax)


@dataclass
class EncryptedDeployment(Deployment):
    """The same model served under CKKS between a Client and a Server.

    A :class:`Deployment` (the model, its accuracies, the plaintext reference
    logits) whose ``serve`` runs the encrypted protocol with ``params``.
    """

    params: CKKSParams = field(kw_only=True)
    interactive: bool = field(default=True, kw_only=True)
    _client: Any = field(default=None, init=False, repr=False)

    def client(self) -> Any:
        """The key owner (created once)."""
        from .protocol.client import Client

        if self._client is None:
            with phase("keygen"):
                self._client = Client(self.model, self.params)
        return self._client

    def encode(self, X: FloatArray) -> Any:
        """Ciphertext bytes of ``X``'s upload, under the client's (public) key."""
        return self.client().encrypt_inputs(X).blobs

    def serve(self, X: FloatArray) -> FloatArray:
        """Encrypted inference; records the uploads and error statistics."""
        from .protocol.client import Server

        client = self.client()
        server = Server.for_model(client.public_context(), self.model, self.params)
        first = len(client.exchanges)
        with phase("encrypted_inference"):
            logits = client.predict(server, X, self.interactive)
        exchanges = client.exchanges[first:]
        self.received = next(
            m.blobs for kind, m in server.transcript.inbound if kind == "infer"
        )
        plain = self.plaintext_logits(X)
        top2 = np.sort(plain, axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        error = float(np.max(np.abs(logits - plain)))
        flipped = logits.argmax(1) != plain.argmax(1)
        self.stats = {
            "max_logit_error": error,
            "min_margin": float(np.min(margin)),
            "flips": float(np.sum(flipped)),
            "flips_above_2x_error": float(np.sum(flipped & (margin > 2 * error))),
            "refresh_rounds": float(server.counts.get("refresh_rounds", 0)),
            "seconds_per_sequence": sum(e.server_s for e in exchanges) / X.shape[0],
            "round_trips": float(sum(e.round_trips for e in exchanges)),
            "kb_up_per_sequence": sum(e.bytes_up for e in exchanges) / 1e3 / X.shape[0],
            "kb_down_per_sequence": (
                sum(e.bytes_down for e in exchanges) / 1e3 / X.shape[0]
            ),
        }
        out: FloatArray = logits
        return out


@dataclass(frozen=True)
class EncryptedLearner:
    """Fit the inner learner, then serve under CKKS."""

    inner: Any
    params: CKKSParams
    interactive: bool = True

    def fit(self, task: CryptoTask, rng: np.random.Generator) -> EncryptedDeployment:
        """Train, then serve the deployment's model under CKKS."""
        system = self.inner.fit(task, rng)
        return EncryptedDeployment(
            system.model,
            system.accuracy_frozen,
            system.accuracy_softmax,
            params=self.params,
            interactive=self.interactive,
        )


@dataclass(frozen=True)
class NoisyLearner:
    """Fit the inner learner, then add Gaussian noise to the uploaded embeddings."""

    inner: Any
    noise: float

    def fit(self, task: CryptoTask, rng: np.random.Generator) -> Deployment:
        """Train, then set the client's noise."""
        system: Deployment = self.inner.fit(task, rng)
        noise_rng = np.random.default_rng(int(rng.integers(2**62)))
        return replace(system, noise=self.noise, rng=noise_rng)
