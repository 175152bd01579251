"""The settings of an audit: seeds, shadows, attack strengths, the bound's level."""

from __future__ import annotations

from dataclasses import dataclass, field

from defenses.audit.shadows import ShadowConfig
from defenses.checks import check_int, check_real
from defenses.ssd.attacks import BoundaryRepulsion, GeneticInversion


@dataclass(frozen=True)
class AuditConfig:
    """How hard and how often the audit attacks.

    Parameters
    ----------
    seeds : tuple of int
        One paired run of every arm per seed (attack randomness, the defenses'
        randomness, the shadows' data split and seeds, the inversion judge).
    shadows : ShadowConfig
        The offline LiRA's shadow models.
    per_target : int
        Reconstructions per private class.
    brep, mirror : BoundaryRepulsion, GeneticInversion
        The label-only and soft-label inversion attacks (their strengths).
    delta : float
        The delta of the epsilon lower bound, in [0, 1).
    confidence : float
        One-sided confidence of the epsilon lower bound, in (0.5, 1).
    progress : bool
        Show a progress bar over the runs (hidden anyway when not a terminal).
    """

    seeds: tuple[int, ...] = (0, 1, 2)
    shadows: ShadowConfig = field(default_factory=ShadowConfig)
    per_target: int = 5
    brep: BoundaryRepulsion = field(default_factory=BoundaryRepulsion)
    mirror: GeneticInversion = field(default_factory=GeneticInversion)
    delta: float = 1e-5
    confidence: float = 0.95
    progress: bool = True

    def __post_init__(self) -> None:
        seeds = self.seeds
        if isinstance(seeds, int) or not isinstance(seeds, tuple | list) or not seeds:
            raise ValueError(
                f"AuditConfig.seeds must be a non-empty tuple of ints, got {seeds!r}"
            )
        for seed in seeds:
            check_int("AuditConfig.seeds", seed, minimum=0)
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"AuditConfig.seeds must be distinct, got {seeds!r}")
        object.__setattr__(self, "seeds", tuple(int(s) for s in seeds))
        if not isinstance(self.shadows, ShadowConfig):
            raise TypeError("AuditConfig.shadows must be a ShadowConfig")
        if not isinstance(self.brep, BoundaryRepulsion):
            raise TypeError("AuditConfig.brep must be a BoundaryRepulsion")
        if not isinstance(self.mirror, GeneticInversion):
            raise TypeError("AuditConfig.mirror must be a GeneticInversion")
        check_int("AuditConfig.per_target", self.per_target, minimum=1)
        check_real("AuditConfig.delta", self.delta, 0.0, 1.0, open_high=True)
        check_real(
            "AuditConfig.confidence",
            self.confidence,
            0.5,
            1.0,
            open_low=True,
            open_high=True,
        )
