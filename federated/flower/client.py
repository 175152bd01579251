r"""The client-side API for the user's own training loop.

A ClientApp creates a :class:`TimeAdaptiveClient` from its own privacy agreement
(:class:`federated.ledger.ClientPrivacy`) and its ``Context``. For each train message
:meth:`TimeAdaptiveClient.round` checks the requested round against the client's
ledger and charges it (or returns the round that
:class:`~federated.flower.mod.TimeAdaptiveMod` already granted for this message),
giving a :class:`PrivateRound`: the sampling rate
:math:`q`, noise multiplier :math:`\sigma` and step count :math:`k` of the round, and
:meth:`PrivateRound.make_private`, which makes the user's ``nn.Module``, optimizer and
data set private with Opacus (record-level DP-SGD: Poisson sampling at rate
:math:`q`, per-example clipping to :math:`C`, Gaussian noise :math:`\sigma C` on the
clipped sum; every batch padded to the public row count of
:mod:`federated.padding`, so a step's work does not depend on the private
records). The optimizer refuses a step past the :math:`k` granted. The ledger is
the one the mod enforces: one implementation (:class:`federated.ledger.PrivacyLedger`),
kept durably in the node's own storage (:class:`federated.store.LedgerFile`, checked
and charged under a file lock). The round's sampling and noise come from
:attr:`PrivateRound.rng`, seeded with operating-system entropy per client per round
(:func:`federated.flower.runtime.round_rng`), never from a value the server knows.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

import numpy as np
from flwr.app import Context, Message

from ..ledger import ClientPrivacy, Grant, PrivacyLedger, RoundRefused
from . import records, runtime

logger = logging.getLogger(__name__)
T = TypeVar("T")

if TYPE_CHECKING:
    import torch


class _Granted(Generic[T]):
    """A read-only attribute of a :class:`PrivateRound` that is its grant's own."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, round_: None, owner: type | None = None) -> _Granted[T]: ...

    @overload
    def __get__(self, round_: PrivateRound, owner: type | None = None) -> T: ...

    def __get__(
        self, round_: PrivateRound | None, owner: type | None = None
    ) -> T | _Granted[T]:
        if round_ is None:
            return self
        return cast(T, getattr(round_.grant, self.name))


@dataclass
class PrivateRound:
    """One granted round: ``steps`` DP-SGD steps at ``rate`` and ``sigma``.

    ``rng`` draws the round's Poisson sampling and noise (operating-system entropy
    unless the node opted into a research seed in simulation).
    """

    grant: Grant
    ledger: PrivacyLedger
    rng: np.random.Generator = field(
        default_factory=lambda: np.random.default_rng(secrets.randbits(128))
    )
    taken: int = 0
    public_count: int | None = None
    """The node's ``public-num-examples`` (its node config), if it declares one."""

    server_round = _Granted[int]("The round number.")
    rate = _Granted[float]("Poisson sampling rate q of every step.")
    sigma = _Granted[float]("Noise multiplier of every step.")
    steps = _Granted[int]("Steps granted (the optimizer refuses more).")

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far, this round included (the ledger's)."""
        return self.ledger.epsilon

    def _guard(self, _: object) -> None:
        """Before a step's clipping: refuse a step past the grant."""
        if self.taken >= self.grant.steps:
            self._count(_)

    def _count(self, _: object) -> None:
        self.taken += 1
        if self.taken > self.grant.steps:
            raise RoundRefused(
                f"round {self.server_round}: step {self.taken} exceeds the "
                f"{self.grant.steps} steps granted (rate={self.rate:.6g}, "
                f"sigma={self.sigma:g}); the client's "
                f"{self.ledger.privacy.describe()}",
                "steps-exceeded",
            )

    def make_private(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: torch.utils.data.Dataset[Any],
        *,
        max_grad_norm: float,
        public_examples: int | None = None,
    ) -> tuple[Any, Any, Any]:
        r"""The module, optimizer and a padded Poisson data loader made private.

        Returns ``(GradSampleModule, SanitizingDPOptimizer, PaddedPoissonLoader)``.
        The loss must be a mean over the batch (Opacus' default
        ``loss_reduction="mean"``); the optimizer divides the noisy clipped sum by
        the *public* expected batch size :math:`\mathrm{round}(q N)`, with
        :math:`N` = ``public_examples``, else the node config's
        ``public-num-examples`` (never ``len(dataset)``, which the noise scale
        would reveal). Every batch has the public row count
        :math:`R` = :func:`federated.padding.padded_rows` ``(q, N)``: the Poisson
        sample (Opacus's draw) padded with zero-weight rows, whose per-sample
        gradients the optimizer zeroes before clipping, so a step's work does not
        depend on the private record count or on the sample; step once per batch,
        in order (as :meth:`batches` does). Non-finite per-sample gradients
        contribute zero before clipping and the noised sum is checked finite
        (:class:`federated.private_optimizer.SanitizingDPOptimizer`). Sampling and
        noise share one ``torch.Generator`` seeded from :attr:`rng` (there is no
        generator argument: a seed the server can guess would let it subtract the
        noise).

        Raises
        ------
        ValueError
            Without a public count (``public_examples`` or the node config's
            ``public-num-examples``), or for a bad ``max_grad_norm``.
        """
        import torch
        from opacus import GradSampleModule

        from defenses.checks import check_int, check_real

        from ..padding import ETA, PaddedPoissonLoader, RowMasks, padded_rows, tail
        from ..private_optimizer import SanitizingDPOptimizer
        from ..release import expected_batch

        check_real("max_grad_norm", max_grad_norm, 0.0, open_low=True)
        count = self.public_count if public_examples is None else public_examples
        if count is None:
            raise ValueError(
                "make_private needs the node's public record count: pass "
                "public_examples=... or set public-num-examples in the node config "
                "(the private len(dataset) would be readable from the noise scale)"
            )
        check_int("public_examples", count, 1)
        generator = torch.Generator().manual_seed(int(self.rng.integers(2**63 - 1)))
        rows, masks = padded_rows(self.rate, count), RowMasks()
        loader = PaddedPoissonLoader(
            dataset, sample_rate=self.rate, rows=rows, generator=generator, masks=masks
        )
        held = len(dataset)  # type: ignore[arg-type]
        beyond = tail(rows, self.rate, held)  # computed always: no branch on held
        if held > count and beyond > 1e3 * ETA:
            logger.warning(  # the node's own log: its public count is too small
                "%d records but public-num-examples %d: a step's batch exceeds the "
                "%d padded rows with probability %.2g, and its reply time then "
                "shows it; declare a public count >= the records",
                held,
                count,
                rows,
                beyond,
            )
        model = (
            module
            if isinstance(module, GradSampleModule)
            else GradSampleModule(module, loss_reduction="mean")
        )
        dp_optimizer = SanitizingDPOptimizer(
            optimizer,
            noise_multiplier=self.sigma,
            max_grad_norm=max_grad_norm,
            expected_batch_size=max(1, round(expected_batch(self.rate, count))),
            loss_reduction="mean",
            generator=generator,
            masks=masks,
        )
        dp_optimizer.attach_step_hook(self._count)
        dp_optimizer.guard = self._guard
        return model, dp_optimizer, loader

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Exactly :attr:`steps` Poisson batches from ``loader`` (cycled if short)."""
        return islice(cycle_fresh(loader), self.steps)


def cycle_fresh(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader`` again and again (a new Poisson draw every pass)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            return


class TimeAdaptiveClient:
    """A client's privacy in its own ClientApp: its agreement, ledger and rounds.

    Parameters
    ----------
    privacy : ClientPrivacy
        The client's own budget and spending (never from a server message).
    context : Context
        The ClientApp's context; the ledger is the node's file
        (:func:`federated.flower.runtime.ledger_file`).
    research_seed : int, optional
        A reproducible seed from the node's own code, accepted in simulation only
        (:func:`federated.flower.runtime.round_rng`); default: OS entropy.
    """

    def __init__(
        self,
        privacy: ClientPrivacy,
        context: Context,
        research_seed: int | None = None,
    ) -> None:
        self.privacy = privacy
        self.context = context
        self.research_seed = research_seed

    @property
    def ledger(self) -> PrivacyLedger:
        """The client's lifetime ledger as stored on the node's disk."""
        store = runtime.ledger_file(self.context)
        return store.ledger(self.privacy, int(self.context.run_id))

    def _rng(self, server_round: int) -> np.random.Generator:
        return runtime.round_rng(self.context, server_round, self.research_seed)

    @property
    def epsilon(self) -> float:
        """Epsilon spent so far (the ledger's)."""
        return self.ledger.epsilon

    def public_count(self) -> int | None:
        """The node config's ``public-num-examples`` (None when it sets none)."""
        value = self.context.node_config.get(records.PUBLIC_EXAMPLES)
        if value is None:
            return None
        return int(records.typed(records.PUBLIC_EXAMPLES, value, int))

    def grant(self, msg: Message, charged: Sequence[str] = ()) -> PrivateRound:
        """Check the message's round against the ledger and charge it.

        ``charged`` are the fingerprints of the records the round trains on
        (:func:`federated.store.fingerprints`), recorded with the grant.

        Raises
        ------
        RoundRefused
            If the client refuses the round (see
            :meth:`federated.ledger.PrivacyLedger.check`).
        """
        asked = records.request(msg)

        def decide(ledger: PrivacyLedger) -> Grant:
            return ledger.check(
                asked[records.ROUND],
                asked[records.RATE],
                asked[records.SIGMA],
                asked[records.STEPS],
            )

        self._rng(1)  # a research seed a deployment refuses: refused before charging
        store = runtime.ledger_file(self.context)
        grant, ledger = store.charge(
            self.privacy, int(self.context.run_id), decide, charged
        )
        records.save_grant(self.context, grant, msg)
        return PrivateRound(
            grant, ledger, self._rng(grant.server_round), 0, self.public_count()
        )

    def round(self, msg: Message) -> PrivateRound:
        """The round for ``msg``: the one the mod granted for it, or granted now.

        A grant is tied to the message it answered (its object id), so a replayed
        message, even with the same values, goes through :meth:`grant` and is
        refused.
        """
        done = records.last_grant(self.context, msg)
        if done is not None:
            rng = self._rng(done.server_round)
            return PrivateRound(done, self.ledger, rng, 0, self.public_count())
        return self.grant(msg)
