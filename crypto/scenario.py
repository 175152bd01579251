r"""Harness wiring: private inference with a personalised HE-friendly transformer.

The game (Rho et al., 2025, threat model of Sec. 3): a client LoRA-personalises a
public pretrained model on its private data and asks a server to run it on private
test sequences. The server is malicious without integrity (it chooses every message;
the client's rule in ``docs/crypto.md`` keeps what it observes independent of the
client's secrets); it observes every upload (traffic), has public labelled data and
tries to recover the client's inputs and labels. Utility is the accuracy of the
served predictions (and, as context, the frozen model's and the softmax twin's
accuracy); success is the server's label advantage over a uniform guess,
:math:`(\\text{acc} - 1/K) / (1 - 1/K)`, and the fraction of inputs it recovers
exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from defenses.checks import check_choice, check_int
from defenses.metrics import accuracy
from defenses.registry import register, register_package
from defenses.threat import Capability, ThreatModel

from .arms import CryptoTask, PersonalisedLearner
from .attacks import DistinguisherAttack, Guess, InversionAttack, ServerView
from .benchmark.attention import attention_benchmark
from .benchmark.byo import byo_benchmark
from .benchmark.convert_error import convert_error_benchmark
from .benchmark.finetune import finetune_benchmark
from .benchmark.layer import layer_benchmark
from .benchmark.lora import lora_benchmark
from .benchmark.sweep import finetune_sweep
from .defense import CKKSDefense, EmbeddingNoise
from .figures import figures
from .models.heformer import ModelConfig
from .tasks import client_transform, digit_sequences, negation_sentiment

TASKS = ("digits", "negation")

register_package(
    attacks=[InversionAttack, DistinguisherAttack],
    defenses=[CKKSDefense, EmbeddingNoise],
    benchmarks={
        "crypto-attention": attention_benchmark,
        "crypto-lora": lora_benchmark,
        "crypto-finetune": finetune_benchmark,
        "crypto-layer": layer_benchmark,
        "crypto-finetune-sweep": finetune_sweep,
        "crypto-byo": byo_benchmark,  # transformers is imported when it runs
        "crypto-convert-error": convert_error_benchmark,
    },
    figures={"crypto": figures},
)


@register("scenarios", "crypto-private-inference")
@dataclass(frozen=True)
class PrivateInference:
    """A malicious server against a client's personalised private inference.

    Parameters
    ----------
    task : {"digits", "negation"}
        Digits as 8 row tokens (client images mirrored) or synthetic negation
        sentiment (client lexicon shifted).
    d, heads, ffn : int
        Model shape.
    test_size : int
        Client test sequences served (>= 10).
    pretrain_epochs, lora_epochs : int
        Training lengths.
    twin : bool
        Also train the softmax-attention twin.
    personal_head : bool
        Personalisation trains the head too (as in the paper); the client then
        sends it encrypted with the LoRA factors.
    """

    name: ClassVar[str] = "crypto-private-inference"
    headline: ClassVar[tuple[str, str]] = ("accuracy", "label_advantage")
    chance: ClassVar[Mapping[str, float]] = {
        "label_advantage": 0.0,
        "recovery_rate": 0.0,
    }
    task: str = "digits"
    d: int = 8
    heads: int = 1
    ffn: int = 16
    test_size: int = 200
    pretrain_epochs: int = 15
    lora_epochs: int = 20
    twin: bool = True
    personal_head: bool = True

    def __post_init__(self) -> None:
        check_choice("PrivateInference.task", self.task, TASKS)
        check_int("PrivateInference.test_size", self.test_size, 10)
        for name in ("pretrain_epochs", "lora_epochs"):
            check_int(f"PrivateInference.{name}", getattr(self, name), 1)
        self.config  # noqa: B018 - validates the model shape

    @property
    def config(self) -> ModelConfig:
        """The model shape for this task."""
        token_dim, classes = (8, 10) if self.task == "digits" else (24, 2)
        return ModelConfig(
            token_dim=token_dim,
            d=self.d,
            heads=self.heads,
            ffn=self.ffn,
            n_classes=classes,
            personal_head=self.personal_head,
        )

    @property
    def threat(self) -> ThreatModel:
        """A malicious server without integrity: sees the traffic, holds public data.

        It chooses every message it sends (and may return crafted logits or
        weights); the confidentiality claim rests on the client's rule of
        ``docs/crypto.md`` (*Threat model*, rules 1-6): nothing the client sends
        or refuses depends on a decrypted value or on weights the server shaped.
        The capabilities granted are the ones this scenario's attacks use.
        """
        return ThreatModel.granting(
            "confidentiality",
            Capability.OBSERVE_TRAFFIC,
            Capability.AUX_DATA,
            knowledge="gray-box",
        )

    def setup(self, rng: np.random.Generator) -> CryptoTask:
        """Public half, client half (shifted), client test split."""
        if self.task == "digits":
            data = digit_sequences()
            order = rng.permutation(len(data))
            half = len(data) // 2
            public = data.subset(order[:half])
            client = client_transform(data.subset(order[half:]))
        else:
            public = negation_sentiment(rng, 800)
            client = negation_sentiment(rng, 400 + self.test_size, lexicon_shift=True)
        test = min(self.test_size, len(client) // 2)
        return CryptoTask(
            public,
            client.subset(np.arange(test, len(client))),
            client.subset(np.arange(test)),
        )

    def learner(self) -> PersonalisedLearner:
        """Pretrain + LoRA personalisation, served in plaintext."""
        return PersonalisedLearner(
            self.config, self.pretrain_epochs, self.lora_epochs, self.twin
        )

    def utility(self, system: Any, task: CryptoTask) -> dict[str, float]:
        """Served accuracy, agreement with plaintext, frozen and twin accuracy."""
        test = task.client_test
        served = system.serve(test.X).argmax(1)
        plain = system.plaintext_logits(test.X).argmax(1)
        return {
            "accuracy": accuracy(served, test.y),
            "agreement": float(np.mean(served == plain)),
            "accuracy_plaintext": accuracy(plain, test.y),
            "accuracy_frozen": float(system.accuracy_frozen),
            "accuracy_softmax": float(system.accuracy_softmax),
        }

    def expose(
        self, system: Any, task: CryptoTask, known_defense: object | None
    ) -> ServerView:
        """What the server received for the test batch, plus public knowledge."""
        if system.received is None:
            system.serve(task.client_test.X)
        return ServerView(
            received=system.received,
            batch=len(task.client_test),
            weights=system.weights,
            aux_X=task.public.X,
            aux_y=task.public.y,
            encode=system.encode,
        )

    def judge(
        self, system: Any, task: CryptoTask, guess: Guess | None
    ) -> dict[str, float]:
        """Label advantage over uniform, label accuracy, exact input recovery."""
        if guess is None:
            raise ValueError("the private-inference game needs a guess")
        test = task.client_test
        if guess.labels.shape != test.y.shape:
            raise ValueError(
                f"guess has {guess.labels.shape} labels, expected {test.y.shape}"
            )
        k = test.n_classes
        acc = accuracy(guess.labels, test.y)
        recovered = 0.0
        if guess.inputs is not None:
            err = np.abs(guess.inputs - test.X).reshape(len(test), -1).max(axis=1)
            recovered = float(np.mean(err < 1e-6))
        return {
            "label_advantage": float(
                np.clip((acc - 1.0 / k) / (1.0 - 1.0 / k), 0.0, 1.0)
            ),
            "label_accuracy": acc,
            "recovery_rate": recovered,
        }

    def random_guess(self, task: CryptoTask, rng: np.random.Generator) -> Guess:
        """Uniform random labels."""
        return Guess(rng.integers(0, task.client_test.n_classes, len(task.client_test)))
