r"""The certificate checks itself against the user's module before it is returned.

Interval bounds follow the module's traced graph (:mod:`defenses.civet.graph`); a
module can compute something else than its graph says (an aliasing the alias rule
missed, Python state read at trace time, a random draw frozen into the graph), and a
rule can be wrong. :func:`cross_check` therefore evaluates the module's own
``encode`` / ``decode`` (its Python code, not the graph) and refuses the certificate,
raising :class:`CrossCheckError` naming the first disagreement, if

1. the bounds propagated through the graph for the point box :math:`[x, x]` (and for
   the point :math:`z = \mu(x)` of the decoder) differ from the module's outputs
   there: then the graph is not the module;
2. the module's output for one row alone differs from that row's output in the
   batch (rows coupled by batch statistics or a batch mean: a per-input
   certificate would not apply), or the user's module in its own dtype and
   mode-as-certified (eval) differs at the centre from the float64 copy the bounds
   were computed on;
3. any evaluated output is NaN or inf, in float64 or in the user's own dtype;
4. at sampled points :math:`(x', \nu)` of the input ball
   :math:`B_\infty(x, \varepsilon) \cap \text{domain}` (uniform and corners) and of
   the noise boxes :math:`|\nu_i| \le w_{j,i}` of the support levels (uniform and
   corners), or at the strongest point of a short joint signed-gradient ascent over
   the level-:math:`p` box, the squared error
   :math:`\ell = \|D(\mu(x') + \sigma(x') \odot \nu) - x\|^2` exceeds the bound of the
   smallest level whose box holds :math:`\nu`;
5. at the same sampled points and the attack's point, the user's module itself,
   run in its own dtype and eval mode, gives a NaN or inf output (refused naming
   the row, the point and the dtype: a model that overflows in float32 where its
   float64 copy does not is not what the bound describes) or an error above the
   bound by more than ``1e3`` units in the last place of that dtype.

A point's check is exact in float64 up to a relative slack ``tolerance`` (interval
arithmetic here rounds to nearest, not outwards). Passing the check does not prove
the bound (only the interval argument does); failing it proves the bound wrong for
this module, which is why a failure is a refusal, never a number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from defenses.arrays import FloatArray
from defenses.checks import check_int, check_real
from defenses.civet.attacks import projected_ascent
from defenses.civet.bounds import Box
from defenses.civet.model import sse
from defenses.civet.protocol import VAEInterface, evaluation


class CrossCheckError(ValueError):
    """The certificate disagrees with the module it certifies (it is not returned)."""


@dataclass(frozen=True)
class CheckConfig:
    """How hard :func:`cross_check` looks for a disagreement.

    Parameters
    ----------
    samples : int
        Sampled (input, noise) points per row, >= 0 (half with uniform inputs, half
        with corners of the input ball; noise uniform or at corners of the level
        boxes). The centre is always checked.
    steps : int
        Steps of the short joint ascent, >= 0 (0: no attack).
    tolerance : float
        Relative slack of every comparison in float64, in [0, 1e-3].
    seed : int
        Seed of the check's own ``torch.Generator`` (same seed, same points).
    """

    samples: int = 16
    steps: int = 10
    tolerance: float = 1e-9
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("CheckConfig.samples", self.samples, 0)
        check_int("CheckConfig.steps", self.steps, 0)
        check_real("CheckConfig.tolerance", self.tolerance, 0.0, 1e-3)
        check_int("CheckConfig.seed", self.seed, 0)


@dataclass(frozen=True)
class CheckReport:
    """What the cross-check evaluated and how close it came to the bound.

    Attributes
    ----------
    points : int
        (input, noise) points evaluated on the module (centre, samples, attack).
    worst_ratio : float
        Largest error / bound over all points (<= 1 + tolerance when it passed).
    attack_loss : ndarray of shape (n,)
        Error at the strongest point the short ascent found, per row.
    seconds : float
        Wall time of the check.
    """

    points: int
    worst_ratio: float
    attack_loss: FloatArray
    seconds: float


def _close(reference: torch.Tensor, value: torch.Tensor, slack: float) -> torch.Tensor:
    """Per-row flag: ``value`` equals ``reference`` up to ``slack`` relative."""
    gap = (value - reference).abs() - slack * (1.0 + reference.abs())
    return ~(gap > 0).reshape(gap.shape[0], -1).any(dim=1)


def _first(flags: torch.Tensor) -> int:
    return int(torch.nonzero(~flags)[0, 0])


def _refuse_unless(ok: torch.Tensor, message: Callable[[int], str]) -> None:
    """Raise :class:`CrossCheckError` with ``message(i)``, ``i`` the first bad row."""
    if not bool(ok.all()):
        raise CrossCheckError(message(_first(ok)))


def _finite_rows(value: torch.Tensor) -> torch.Tensor:
    """Per-row flag: every entry of the row is finite."""
    return torch.isfinite(value).reshape(value.shape[0], -1).all(dim=1)


def _agree(
    what: str, reference: torch.Tensor, bound: Box, slack: float, owner: str
) -> None:
    for end, name in ((bound.lower, "lower"), (bound.upper, "upper")):

        def differs(row: int, end: torch.Tensor = end, name: str = name) -> str:
            gap = float((end[row] - reference[row]).abs().max())
            return (
                f"{owner}: the traced graph of {what} differs from the module at the "
                f"centre of row {row} (the {name} point bound is off by {gap:.6g}); "
                "the module does not compute what its torch.fx graph says (an "
                "in-place update, state read at trace time, randomness): no "
                "certificate"
            )

        _refuse_unless(_close(reference, end, slack), differs)


def _finite(what: str, value: torch.Tensor, owner: str) -> None:
    _refuse_unless(
        _finite_rows(value),
        lambda row: f"{owner}: {what} is NaN or inf at row {row}: no certificate",
    )


def _centre(
    exact: VAEInterface, user: VAEInterface, x: torch.Tensor, slack: float
) -> torch.Tensor:
    """Checks 1-3 at the centre; returns the module's error there (noise 0)."""
    enc, dec = f"model.{exact.encode_name}", f"model.{exact.decode_name}"
    mu, logvar = exact.encode(x)
    _finite(f"{enc}(x)", torch.cat([mu, logvar], 1), "model")
    mu_box, logvar_box = exact.latent_bounds(Box(x, x))
    _agree(f"{enc} (mean)", mu, mu_box, slack, "model")
    _agree(f"{enc} (log-variance)", logvar, logvar_box, slack, "model")
    out = exact.decode(mu)
    _finite(f"{dec}(mu)", out, "model")
    _agree(dec, out, exact.output_bounds(Box(mu, mu)), slack, "model")
    low, high = exact.domain
    others = torch.cat([x, low + high - x])  # row 0 among the batch and its mirror
    with_mu, with_logvar = exact.encode(others)
    batched = torch.cat([with_mu, with_logvar, exact.decode(with_mu).flatten(1)], 1)
    alone_mu, alone_logvar = exact.encode(x[:1])
    alone = torch.cat([alone_mu, alone_logvar, exact.decode(alone_mu).flatten(1)], 1)
    if not bool(_close(batched[:1], alone, slack).all()):
        raise CrossCheckError(
            "model: its output for row 0 alone differs from its output for row 0 "
            "in a batch: the module couples the rows of a batch (batch "
            "statistics, a mean over the batch), so a per-input certificate "
            "does not apply to it: no certificate"
        )
    dtype = user.dtype
    loose = max(slack, 1e3 * torch.finfo(dtype).eps)
    with evaluation(user.module):
        mu_user, _ = user.encode(x.to(dtype))
        out_user = user.decode(mu_user)
    for name, mine, theirs in ((enc, mu, mu_user), (dec, out, out_user)):

        def differs(row: int, name: str = name) -> str:
            return (
                f"model: {name} in its own dtype ({dtype}, eval mode) differs from "
                f"its float64 copy at row {row} by more than {loose:.3g} relative; "
                "the copy the bounds were computed on is not the model: no "
                "certificate"
            )

        _finite(f"{name} in {dtype}", theirs, "model")
        _refuse_unless(_close(mine, theirs.to(mine.dtype), loose), differs)
    return sse(out, x)


ATTACK_POINT = "the short joint attack's point"


def _place(rows: torch.Tensor, names: Sequence[str], i: int) -> str:
    """Where point ``i`` is, for a message: its row and its kind."""
    if names[i] == ATTACK_POINT:
        return f"{ATTACK_POINT} of row {int(rows[i])}"
    return f"a sampled point of row {int(rows[i])} ({names[i]})"


def _user_loss(
    user: VAEInterface,
    xs: torch.Tensor,
    nus: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor,
    names: Sequence[str],
) -> torch.Tensor:
    """The user's module's own error (its dtype, eval mode) at the given points.

    Raises :class:`CrossCheckError` naming the row, the point and the dtype if an
    output is NaN or inf there.
    """
    dtype = user.dtype
    with evaluation(user.module):
        out = user.reconstruct(xs.to(dtype), nus.to(dtype))
    _refuse_unless(
        _finite_rows(out),
        lambda i: (
            f"model: its reconstruction in its own dtype ({dtype}) is NaN or inf at "
            f"{_place(rows, names, i)} inside the input "
            "ball and the noise box: the certificate would bound a float64 copy, "
            "not the model as it runs; no certificate"
        ),
    )
    return sse(out.to(targets.dtype), targets)


def _within(
    loss: torch.Tensor,
    required: torch.Tensor,
    rows: torch.Tensor,
    names: Sequence[str],
    slack: float,
    dtype: torch.dtype | None = None,
) -> None:
    """Refuse if an error exceeds its bound beyond the relative slack.

    ``dtype`` names the user's module's own dtype (its slack is at least ``1e3``
    units in its last place); None is the float64 copy the bounds describe.
    """
    loose = slack if dtype is None else max(slack, 1e3 * torch.finfo(dtype).eps)
    whose = "" if dtype is None else f"in its own dtype ({dtype}) "
    what = "this module" if dtype is None else "the model as it runs"
    _refuse_unless(
        ~_over(loss, required, loose),
        lambda i: (
            f"model: {whose}its error at {_place(rows, names, i)}, "
            f"{float(loss[i]):.6g}, exceeds the certified bound "
            f"{float(required[i]):.6g}: the bound is wrong for {what}; "
            "no certificate"
        ),
    )


def _inside(nu: torch.Tensor, widths: torch.Tensor, slack: float) -> torch.Tensor:
    """``(levels, m)`` flags: point ``i`` lies in level ``j``'s noise box."""
    return (nu.abs()[None] <= widths * (1.0 + slack)).all(dim=2)


def _required(
    nu: torch.Tensor,
    widths: torch.Tensor,
    bounds: torch.Tensor,
    ceiling: torch.Tensor,
    slack: float,
) -> torch.Tensor:
    """The bound each point must meet: that of the smallest level holding it."""
    inside = _inside(nu, widths, slack)  # (levels, m)
    candidates = torch.where(inside, bounds, torch.inf)
    return torch.minimum(candidates.min(dim=0).values, ceiling)


def _over(loss: torch.Tensor, required: torch.Tensor, slack: float) -> torch.Tensor:
    """Flags: ``loss`` exceeds ``required`` beyond the relative slack."""
    return ~(loss <= required + slack * (1.0 + required.abs()))


def _check_points(
    exact: VAEInterface,
    user: VAEInterface,
    point: tuple[torch.Tensor, torch.Tensor],
    targets: torch.Tensor,
    required: torch.Tensor,
    rows: torch.Tensor,
    names: Sequence[str],
    slack: float,
) -> torch.Tensor:
    """Checks 3-5 at evaluated points ``(x', nu)``: the ratios error / bound.

    The float64 copy's error must be finite and within ``required`` (else the
    bound is wrong for the module), then the user's module's own error in its own
    dtype (:func:`_user_loss`, :func:`_within`). ``names[i]`` says which
    point of row ``rows[i]`` it was (a sampled kind, or the attack's point).
    """
    xs, nus = point
    loss = sse(exact.reconstruct(xs, nus), targets)
    _finite("the reconstruction at an evaluated point", loss[:, None], "model")
    _within(loss, required, rows, names, slack)
    theirs = _user_loss(user, xs, nus, targets, rows, names)
    _within(theirs, required, rows, names, slack, user.dtype)
    return torch.cat([loss / required, theirs / required])


def _samples(
    ball: Box, widths: torch.Tensor, p_index: int, count: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``count`` points per row: inputs in the ball, noise in the level boxes."""
    n = ball.lower.shape[0]
    dtype = ball.lower.dtype
    rows = torch.arange(n).repeat(count)
    t = torch.rand((count * n, *ball.lower.shape[1:]), generator=g, dtype=dtype)
    corner = torch.arange(count).repeat_interleave(n) % 2 == 1
    t = torch.where(corner.reshape(-1, *[1] * (t.ndim - 1)), t.round(), t)
    x = ball.lower[rows] + (ball.upper[rows] - ball.lower[rows]) * t
    d = widths.shape[-1]
    u = 2 * torch.rand((count * n, d), generator=g, dtype=dtype) - 1
    kind = torch.arange(count).repeat_interleave(n) % 4
    u = torch.where((kind >= 2)[:, None], u.sign(), u)  # noise corners
    level = torch.where(kind % 2 == 0, p_index, widths.shape[0] - 1)
    nu = u * widths[level, rows]
    names = [
        ("input corner" if c else "uniform input")
        + (", noise corner" if k >= 2 else ", uniform noise")
        + (" of the top level" if k % 2 else "")
        for c, k in zip(corner.tolist(), kind.tolist(), strict=True)
    ]
    return x, nu, names


def cross_check(
    exact: VAEInterface,
    user: VAEInterface,
    x: torch.Tensor,
    eps: float,
    levels: Sequence[float],
    bounds: torch.Tensor,
    ceiling: torch.Tensor,
    widths: torch.Tensor,
    p_index: int,
    config: CheckConfig,
) -> CheckReport:
    """Refuse (raise :class:`CrossCheckError`) if the certificate fails on the module.

    Parameters
    ----------
    exact : VAEInterface
        The float64 eval-mode copy the bounds were computed on.
    user : VAEInterface
        The user's module (compared with the copy at the centre, in eval mode).
    x : torch.Tensor
        Validated float64 inputs, also the targets.
    eps : float
        Input radius.
    levels : sequence of float
        Support levels of ``bounds`` (increasing).
    bounds : torch.Tensor of shape (levels, n)
        Certified bounds per level (non-decreasing along the levels).
    ceiling : torch.Tensor of shape (n,)
        Largest error any output reaches.
    widths : torch.Tensor of shape (levels, n, d)
        Noise half-widths of each level's support box.
    p_index : int
        Index of the certified level ``p`` in ``levels``.
    config : CheckConfig
        Sizes of the check.
    """
    began = time.perf_counter()
    slack = config.tolerance
    n = x.shape[0]
    g = torch.Generator().manual_seed(config.seed)
    ball = Box.linf_ball(x, eps, exact.domain)
    with torch.no_grad():
        centre = _centre(exact, user, x, slack)
        zeros = torch.zeros(n, exact.latent_dim, dtype=x.dtype)
        worst = centre / torch.minimum(bounds[0], ceiling)
        _refuse_unless(
            ~_over(centre, _required(zeros, widths, bounds, ceiling, slack), slack),
            lambda row: (
                f"model: its error at the centre of row {row} with zero noise, "
                f"{float(centre[row]):.6g}, exceeds the certified bound "
                f"{float(bounds[0, row]):.6g}: no certificate"
            ),
        )
        if config.samples:
            xs, nus, names = _samples(ball, widths, p_index, config.samples, g)
            rows = torch.arange(n).repeat(config.samples)
            required = _required(
                nus, widths[:, rows], bounds[:, rows], ceiling[rows], slack
            )
            ratios = _check_points(
                exact, user, (xs, nus), x[rows], required, rows, names, slack
            )
            worst = torch.cat([worst, ratios])
    attack = centre
    if config.steps:
        attack, point = _attack(exact, x, ball, widths[p_index], config.steps, g)
        _finite("the reconstruction at the attack's point", attack[:, None], "model")
        required = torch.minimum(bounds[p_index], ceiling)
        what = [ATTACK_POINT] * n
        with torch.no_grad():
            ratios = _check_points(
                exact, user, point, x, required, torch.arange(n), what, slack
            )
        worst = torch.cat([worst, ratios])
    ratios = worst[torch.isfinite(worst)]
    return CheckReport(
        points=n * (1 + config.samples + (1 if config.steps else 0)),
        worst_ratio=float(ratios.max()) if ratios.numel() else 0.0,
        attack_loss=attack.detach().numpy(),
        seconds=time.perf_counter() - began,
    )


def _attack(
    exact: VAEInterface,
    x: torch.Tensor,
    ball: Box,
    widths: torch.Tensor,
    steps: int,
    g: torch.Generator,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Error at the best point of a joint signed-gradient ascent, and the point."""
    corner = torch.randint(0, 2, widths.shape, generator=g).to(x.dtype) * 2 - 1

    def objective(v: Sequence[torch.Tensor]) -> torch.Tensor:
        return sse(exact.reconstruct(v[0], v[1]), x)

    span = float((ball.upper - ball.lower).max()) / 2
    with torch.enable_grad():
        point, best = projected_ascent(
            objective,
            [x, widths * corner],
            [(ball.lower, ball.upper), (-widths, widths)],
            [2.5 * span / steps, 2.5 * float(widths.max()) / steps],
            steps,
        )
    return best.detach(), (point[0].detach(), point[1].detach())
