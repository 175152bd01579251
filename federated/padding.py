r"""Constant-work DP-SGD steps on the Opacus backend: a public number of rows per step.

A Poisson sample :math:`B` of a node's :math:`n` private records has
:math:`|B| \sim \mathrm{Binomial}(n, q)` rows. A step that computes the per-sample
gradients of :math:`B` alone takes a time that grows with :math:`|B|`, hence with the
private :math:`n` (and with which records were sampled): a timing channel the server
reads from its reply times. Here every step processes :math:`R` rows, with :math:`R`
a function of public values only, the rate :math:`q` and the node's public count
:math:`N` (``public-num-examples``):

.. math::

    R = \min\{r \ge 1 : P[\mathrm{Binomial}(N, q) > r] \le \eta\}, \quad
    \eta = 10^{-15}.

A batch holds the sampled records first, then :math:`R - |B|` padding rows (records
in index order, cycling: public positions, any content), and a keep-mask that is 1
on the sampled rows. The optimizer
(:class:`federated.private_optimizer.SanitizingDPOptimizer`) sets the per-sample
gradient of every masked row to zero *before* clipping; a zero gradient gets clip
factor 1 and contributes 0, so

.. math::

    \sum_{i < R} m_i\, \tilde g_i \min(1, C/\lVert \tilde g_i\rVert)
    = \sum_{i\in B} \tilde g_i \min(1, C/\lVert \tilde g_i\rVert)

exactly (up to float summation order): the same mechanism, the same sensitivity
:math:`C`, the same :math:`q` and :math:`\sigma`, so the accountant's epsilon is
unchanged, and the normalizer :math:`qN` is unchanged.

If :math:`|B| > R` (probability at most :math:`\eta` per step when :math:`n \le N`,
about :math:`2\eta` for :math:`n = N + 1`), the batch holds all of :math:`B`: the
release is still the charged mechanism and only the time shows that event. Releasing
the indicator of an event :math:`E` with :math:`P[E] \le T\eta` under both
neighbours (over :math:`T` steps) on top of an :math:`(\varepsilon,\delta)`-DP
release is :math:`(\varepsilon, \delta + (1 + e^\varepsilon) T \eta)`-DP: at
:math:`\varepsilon = 8` and :math:`T = 10^4` steps that adds :math:`3 \cdot 10^{-8}`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from defenses.checks import check_int, check_real

logger = logging.getLogger(__name__)

ETA = 1e-15
"""Per-step probability (for ``n <= N``) that a Poisson batch exceeds the rows."""


def tail(rows: int, rate: float, records: int) -> float:
    r"""The tail :math:`P[\mathrm{Binomial}(records, rate) > rows]`."""
    from scipy.stats import binom

    return float(binom.sf(rows, records, rate))


def padded_rows(rate: float, public_count: int, eta: float = ETA) -> int:
    r"""The public rows per step, a function of the rate and public count only.

    The least :math:`r \ge 1` with :math:`P[\mathrm{Binomial}(N, q) > r] \le \eta`.

    Raises
    ------
    ValueError
        For a rate outside (0, 1], a count below 1 or ``eta`` outside (0, 1).
    """
    check_real("rate", rate, 0.0, 1.0, open_low=True)
    check_int("public_count", public_count, 1)
    check_real("eta", eta, 0.0, 1.0, open_low=True, open_high=True)
    from scipy.stats import binom

    rows = max(1, int(binom.isf(eta, public_count, rate)))
    while rows > 1 and tail(rows - 1, rate, public_count) <= eta:
        rows -= 1
    while tail(rows, rate, public_count) > eta:
        rows += 1
    return rows


def padded(sampled: Sequence[int], rows: int, n: int) -> tuple[list[int], torch.Tensor]:
    """Indices of one padded batch and its keep-mask (True on the sampled rows).

    The sampled indices come first; padding takes records ``0, 1, ...`` (cycling over
    ``n``) up to ``rows`` rows. A sample larger than ``rows`` is kept whole.
    """
    size = len(sampled)
    pad = max(0, rows - size)
    index = [int(i) for i in sampled] + [j % n for j in range(pad)]
    mask = torch.zeros(size + pad, dtype=torch.bool)
    mask[:size] = True
    return index, mask


class RowMasks:
    """The keep-masks of padded batches, handed from the loader to the optimizer.

    The loader pushes a batch's mask when it yields the batch; the optimizer takes it
    at that batch's step. A step is refused (``RuntimeError``) unless exactly one
    batch was yielded since the last step: a mask is never applied to another
    batch's rows, and no batch is stepped twice. The error depends on the caller's
    loop only, never on a record.
    """

    def __init__(self) -> None:
        self._pending: deque[torch.Tensor] = deque()

    def push(self, mask: torch.Tensor) -> None:
        """The mask of the batch just yielded."""
        self._pending.append(mask)

    def take(self, rows: int) -> torch.Tensor:
        """The mask of the batch being stepped (``rows`` rows)."""
        if len(self._pending) != 1:
            raise RuntimeError(
                f"{len(self._pending)} padded batches were yielded since the last "
                "step; step once per batch, in order (fetch one batch, backward, "
                "optimizer.step())"
            )
        mask = self._pending.popleft()
        if mask.numel() != rows:
            raise RuntimeError(
                f"the step's batch has {rows} rows, its loader yielded "
                f"{mask.numel()}: step on the loader's batches as they come"
            )
        return mask


class PaddedPoissonSampler(Sampler[list[int]]):
    """Poisson batches at ``rate`` over ``n`` records, each padded to ``rows`` rows.

    Draws the sample as Opacus's ``UniformWithReplacementSampler`` does
    (``torch.rand(n, generator) < rate``, ``int(1 / rate)`` batches per pass), so
    with the same generator the sampled records are Opacus's.
    """

    def __init__(
        self, n: int, rate: float, rows: int, generator: torch.Generator
    ) -> None:
        check_int("n", n, 1)
        check_real("rate", rate, 0.0, 1.0, open_low=True)
        check_int("rows", rows, 1)
        self.n, self.rate, self.rows, self.generator = n, rate, rows, generator
        self.steps = int(1 / rate)
        self.pending: deque[torch.Tensor] = deque()

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        pending: deque[torch.Tensor] = deque()
        self.pending = pending  # one queue per pass: a dropped pass's masks go too
        return self._draw(pending)

    def _draw(self, pending: deque[torch.Tensor]) -> Iterator[list[int]]:
        for _ in range(self.steps):
            keep = torch.rand(self.n, generator=self.generator) < self.rate
            index, mask = padded(keep.nonzero().reshape(-1).tolist(), self.rows, self.n)
            pending.append(mask)
            yield index


class PaddedPoissonLoader(DataLoader[Any]):
    """A data loader of padded Poisson batches; hands each batch's mask to ``masks``.

    Same data, collate function and workers as a ``DataLoader`` over ``dataset``;
    every batch has ``rows`` rows (more only in the event of probability
    :data:`ETA` per step described in the module).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        sample_rate: float,
        rows: int,
        generator: torch.Generator,
        masks: RowMasks,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        sampler = PaddedPoissonSampler(n, sample_rate, rows, generator)
        super().__init__(
            dataset,
            batch_sampler=sampler,
            collate_fn=collate_fn,
            generator=generator,
            **kwargs,
        )
        self.sample_rate = sample_rate
        self.rows = rows
        self.masks = masks

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        batches = super().__iter__()  # draws nothing yet; opens the pass's queue
        sampler = self.batch_sampler
        assert isinstance(sampler, PaddedPoissonSampler)
        pending = sampler.pending
        return self._yield(batches, pending)

    def _yield(
        self, batches: Iterator[Any], pending: deque[torch.Tensor]
    ) -> Iterator[Any]:
        for batch in batches:
            self.masks.push(pending.popleft())
            yield batch
