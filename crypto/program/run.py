r"""What one evaluation of the program brings, and the refresh policy it follows.

A :class:`Run` carries the evaluator, the client's encrypted values (``lora``: LoRA
factors ``f"{prefix}q_a"`` ..., HEFormer's full matrices ``f"{prefix}wq"`` ...,
the head's ``"pool"`` and ``"classifier"``), the key owner's ``roll`` or the
client's ``rolled_z``, the optional key weights ``masks``, the optional ``trace``
a backward pass reads, and the :class:`Policy` that decides which refreshes the one
forward program (:mod:`crypto.program.forward`) requests.

Every stage asks :meth:`Run.fit` for the levels it needs next. The two policies
differ only in how these requests are grouped and answered, so the public schedule
(the stages, sizes and order of the round trips) is a function of the program, the
policy and the chain:

- :data:`INFERENCE` fuses: the attention's 5 levels in one ``"attention"`` group
  (after which every finer request of the attention is already met), and
  :math:`p(xW + b)` in one refresh when the chain allows; a request refreshes all
  its values when any one lacks the levels
  (:meth:`~crypto.he.evaluator.Evaluator.ensure`).
- :data:`TRAINING` *fits* each stage: a request refreshes only the values that lack
  the levels (:func:`fit`), stage by stage, so the backward pass reads each
  intermediate as the forward pass used it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..he.evaluator import Evaluator, Roll, Value
from .spec import Program

Lora = dict[str, list[list[Value]]]
Trace = dict[str, list[Value]]

TANH_STAGE = {"heformer": "pooler", "bert": "tanh"}
"""The training schedule's name of the pre-tanh refresh in each family."""


def fit(
    ev: Evaluator, groups: Sequence[Sequence[Value]], need: int, stage: str
) -> list[list[Value]]:
    """Refresh (in one counted round trip) the values that lack ``need`` levels."""
    flat = [v for g in groups for v in g]
    stale = [i for i, v in enumerate(flat) if v.level + need > ev.max_level]
    if stale:
        fresh = ev.ensure([flat[i] for i in stale], need, stage)
        for i, v in zip(stale, fresh, strict=True):
            flat[i] = v
    return _regroup(flat, groups)


def _regroup(flat: list[Value], groups: Sequence[Sequence[Value]]) -> list[list[Value]]:
    """``flat`` cut into the lengths of ``groups``."""
    out, at = [], 0
    for g in groups:
        out.append(flat[at : at + len(g)])
        at += len(g)
    return out


@dataclass(frozen=True)
class Policy:
    r"""How the forward program's refresh requests are grouped and answered.

    ``stale_only``: a request refreshes only the values lacking the levels
    (:func:`fit`), else all of them when one lacks them. ``fused``: the attention's
    levels in one ``"attention"`` group and :math:`p(xW+b)` in one refresh when the
    chain allows. ``residual_refreshed``: a residual adds the input as refreshed for
    the stage it skips (else as it came). ``newton_refits``: each Newton step of a
    LayerNorm fits :math:`\sigma` as the inverse square root read it (else the
    previous step's refreshed one). ``stages``: the names of the refreshes before a
    polynomial and after the feed-forward's (``{pre}`` the block's prefix,
    ``{head}`` the head's stage, ``{tanh}`` :data:`TANH_STAGE` of the family).
    """

    name: str
    stale_only: bool
    fused: bool
    residual_refreshed: bool
    newton_refits: bool
    activation: str
    hidden: str
    tanh: str

    def __post_init__(self) -> None:
        for flag in ("stale_only", "fused", "residual_refreshed", "newton_refits"):
            value = getattr(self, flag)
            if not isinstance(value, bool):
                raise ValueError(f"Policy.{flag} must be a bool, got {value!r}")
        for name in ("activation", "hidden", "tanh"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"Policy.{name} must be a non-empty stage template, got {value!r}"
                )

    def stage(self, template: str, p: Program, prefix: str = "") -> str:
        """A stage name of this policy for program ``p`` (class docstring)."""
        return template.format(
            pre=prefix, head=p.head.stage, tanh=TANH_STAGE.get(p.family, "tanh")
        )


INFERENCE = Policy(
    "inference",
    stale_only=False,
    fused=True,
    residual_refreshed=False,
    newton_refits=False,
    activation="{pre}feed-forward polynomial",
    hidden="{pre}feed-forward output",
    tanh="{head} polynomial",
)
"""The inference schedule (:func:`crypto.protocol.schedule.schedule`)."""

TRAINING = Policy(
    "training",
    stale_only=True,
    fused=False,
    residual_refreshed=True,
    newton_refits=True,
    activation="{pre}activation",
    hidden="{pre}feed-forward out",
    tanh="{tanh}",
)
"""The trained blocks' and head's schedule in a fine-tuning step."""


@dataclass
class Run:
    """What one evaluation brings besides the weights and the embeddings.

    The evaluator, the client's encrypted values, the key owner's ``roll`` or the
    client's ``rolled_z``, the optional key weights ``masks``, the optional
    ``trace`` to fill, the refresh ``policy`` (module docstring).
    """

    ev: Evaluator
    lora: Lora
    roll: Roll | None = None
    rolled_z: list[list[Value]] | None = None
    masks: list[Value] | None = None
    trace: Trace | None = None
    policy: Policy = INFERENCE

    def keep(self, name: str, values: Sequence[Value]) -> None:
        """Record ``values`` in the trace (if any) under ``name``."""
        if self.trace is not None:
            self.trace[name] = list(values)

    def fit(
        self, groups: Sequence[Sequence[Value]], need: int, stage: str
    ) -> list[list[Value]]:
        """``need`` more levels for every value of ``groups``, as the policy answers."""
        if self.policy.stale_only:
            return fit(self.ev, groups, need, stage)
        flat = self.ev.ensure([v for g in groups for v in g], need, stage)
        return _regroup(flat, groups)
