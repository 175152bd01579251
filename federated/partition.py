r"""Non-IID splits of a data set across clients (label skew by Dirichlet draws).

For every class :math:`c`, client shares :math:`p_c \sim \mathrm{Dir}(\alpha
\mathbf 1_N)` cut that class's (shuffled) records among the :math:`N` clients (Hsu et
al., 2019); small :math:`\alpha` gives each client few labels. Every client is
guaranteed ``min_size`` records (classes are re-drawn until it holds), so no client
ends up without data.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from defenses.arrays import IntArray
from defenses.checks import check_int, check_real


def dirichlet_split(
    y: npt.ArrayLike,
    n_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 4,
    max_tries: int = 100,
) -> list[IntArray]:
    """Indices of each client's records (sorted), label-skewed by Dirichlet(alpha).

    Raises
    ------
    ValueError
        For bad parameters, or if no draw gives every client ``min_size`` records.
    """
    labels = np.asarray(y)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"y must be a non-empty 1-D array, got shape {labels.shape}")
    n_clients = check_int("n_clients", n_clients, 1)
    alpha = check_real("alpha", alpha, 0.0, open_low=True)
    if n_clients * min_size > labels.size:
        raise ValueError(
            f"n_clients={n_clients}: {labels.size} records cannot give every client "
            f"{min_size}"
        )
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(n_clients)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            shares = rng.dirichlet(np.full(n_clients, alpha))
            cuts = np.round(np.cumsum(shares)[:-1] * members.size).astype(int)
            for part, chunk in zip(parts, np.split(members, cuts), strict=True):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split in {max_tries} draws gave every one of "
        f"{n_clients} clients {min_size} records; raise alpha or lower n_clients"
    )
