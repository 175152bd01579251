"""Where a ClientApp runs, and what it takes from its own side: mode, ledger, entropy.

* :func:`in_simulation` tells Flower's simulation (the ClientApp runs inside one of
  Flower's Ray actors, ``ClientAppActor``) from a deployment (a SuperNode runs it).
  It reads the process the code runs in, never a value of the run: a server cannot
  make a SuperNode believe it is simulated.
* :func:`ledger_file` is the node's lifetime ledger (:class:`federated.store.
  LedgerFile`): ``ledger-path`` from the node config, else
  ``<state dir>/ledger-partition-<partition-id>.json`` (or ``ledger.json`` without a
  partition id), the state dir being ``$DEFENSE_SUITE_STATE_DIR``, else
  ``$XDG_STATE_HOME/defense-suite/federated``, else
  ``~/.local/state/defense-suite/federated``. In deployment a missing ledger is
  created only with ``ledger-init = true`` in the node config. In Flower's
  simulation, unless the user names a folder (``$DEFENSE_SUITE_STATE_DIR``, or
  ``ledger-path``), the ledgers are scoped to the simulation's run:
  ``<state dir>/simulations/run-<run id>/``, so running the same simulation twice
  starts from an empty ledger each time (simulated partitions are a function of
  the run config, not a node's lifetime data).
* :func:`round_rng` is the generator of one round's Poisson sampling and DP noise:
  128 bits of operating-system entropy (:func:`secrets.randbits`), fresh per client
  per round, unknown to the server. A research run gets a reproducible seed only
  when the node opts in (``research-seed`` in its node config, or the
  ``DEFENSE_SUITE_RESEARCH_SEED`` environment variable of the node's process), only
  in simulation: a deployment refuses it, since the server knows every value such a
  seed is mixed with (round, node and partition ids).
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path

import numpy as np
from flwr.app import Context

from ..store import LedgerFile

logger = logging.getLogger(__name__)

STATE_ENV = "DEFENSE_SUITE_STATE_DIR"
SEED_ENV = "DEFENSE_SUITE_RESEARCH_SEED"
LEDGER_PATH = "ledger-path"
LEDGER_INIT = "ledger-init"
RESEARCH_SEED = "research-seed"


class NodeConfigError(ValueError):
    """The node's own configuration is missing a key or has a bad value."""


def in_simulation() -> bool:
    """True inside Flower's simulation (a Ray actor), False on a SuperNode."""
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        if not ray.is_initialized():
            return False
        return ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # any doubt means: not simulated
        return False


def state_dir() -> Path:
    """The folder of the node's ledgers (see the module docstring)."""
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "defense-suite" / "federated"


def ledger_file(context: Context, simulated: bool | None = None) -> LedgerFile:
    """The node's lifetime ledger (created when missing only as allowed)."""
    simulated = in_simulation() if simulated is None else simulated
    node = context.node_config
    if LEDGER_PATH in node:
        value = node[LEDGER_PATH]
        if not isinstance(value, str) or not value:
            raise NodeConfigError(f"node config {LEDGER_PATH!r} must be a path string")
        path = Path(value).expanduser()
    else:
        folder = state_dir()
        if simulated and not os.environ.get(STATE_ENV):
            folder = folder / "simulations" / f"run-{int(context.run_id)}"
        if "partition-id" in node:
            path = folder / f"ledger-partition-{node['partition-id']}.json"
        else:
            path = folder / "ledger.json"
    init = node.get(LEDGER_INIT, False)
    if not isinstance(init, bool):
        raise NodeConfigError(f"node config {LEDGER_INIT!r} must be true or false")
    return LedgerFile(path, create=simulated or init)


def research_seed(context: Context, simulated: bool | None = None) -> int | None:
    """The node's opt-in research seed (simulation only), else None.

    Raises
    ------
    NodeConfigError
        For a research seed in a deployment, or one that is not an integer >= 0.
    """
    value: object = context.node_config.get(RESEARCH_SEED)
    if value is None and os.environ.get(SEED_ENV):
        text = os.environ[SEED_ENV]
        value = int(text) if text.isdigit() else text
    if value is None:
        return None
    simulated = in_simulation() if simulated is None else simulated
    if not simulated:
        raise NodeConfigError(
            f"{RESEARCH_SEED!r} makes the DP noise predictable to the server; it is "
            "refused in a deployment (simulation only)"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NodeConfigError(
            f"{RESEARCH_SEED!r} must be an integer >= 0, got {value!r}"
        )
    return int(value)


def round_rng(
    context: Context, server_round: int, seed: int | None = None
) -> np.random.Generator:
    """One round's generator of sampling and noise: OS entropy unless opted out.

    Without a research seed, ``default_rng(secrets.randbits(128))``: 128 fresh bits
    per client per round. With one (the node's opt-in, or ``seed`` passed by the
    node's own code; simulation only), ``default_rng([seed, partition-id, round])``.

    Raises
    ------
    NodeConfigError
        For a research seed outside the simulation.
    """
    if seed is not None and not in_simulation():
        raise NodeConfigError(
            "a research seed is refused in a deployment (the server could replay "
            "the noise); simulation only"
        )
    chosen = research_seed(context) if seed is None else seed
    if chosen is None:
        return np.random.default_rng(secrets.randbits(128))
    pid = context.node_config.get("partition-id", context.node_id)
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise NodeConfigError(f"'partition-id' must be an integer, got {pid!r}")
    logger.warning("research seed in use: the DP noise is reproducible by anyone")
    return np.random.default_rng([int(chosen), int(pid), int(server_round)])
