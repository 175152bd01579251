r"""The VAE protocol: what CIVET needs of a user's ``torch.nn.Module``.

Any module with two methods is certified (:func:`~defenses.civet.certificate.
certify`), trained (:func:`~defenses.civet.defense.train_vae`) and attacked
(:mod:`defenses.civet.attacks`):

* ``encode(x) -> (mu, logvar)``: the mean and log-variance of the Gaussian
  encoder :math:`q(z \mid x) = \mathcal N(\mu(x), \mathrm{diag}(e^{\log\sigma^2(x)}))`,
  two tensors of shape ``(n, d)``;
* ``decode(z) -> x_hat``: the reconstruction of a batch of latents, with the shape
  of ``x``.

The names are configurable (``encode="..."``, ``decode="..."``). Inputs have any
shape ``(n, *input_shape)`` and lie in a box ``domain`` (default ``[0, 1]``, or the
module's ``domain`` attribute). For the bounds, both methods are traced with
:mod:`torch.fx` and every operation needs a sound interval rule
(:mod:`defenses.civet.graph`); the built-in :class:`~defenses.civet.model.VAE`
container is one implementation of the protocol. :func:`as_vae` checks the contract
on one input row and returns a :class:`VAEInterface`, the view every CIVET function
works with.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import fx, nn
from torch.nn.modules.batchnorm import _BatchNorm

from defenses.checks import check_finite_module, check_real
from defenses.civet.bounds import Box, UnsupportedLayerError
from defenses.civet.fused import FusedVAE, fused_parts
from defenses.civet.graph import output_range, parameter_dtype, propagate, trace
from defenses.civet.state import check_hooks, check_stateless, snapshot

PROTOCOL = (
    "a torch.nn.Module with encode(x) -> (mu, logvar), two tensors of shape "
    "(n, latent_dim), and decode(z) -> x_hat with the shape of x (pass encode=... "
    "and decode=... if the methods have other names)"
)


@contextlib.contextmanager
def evaluation(module: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode for the block, then restore each mode."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def check_inputs(
    x: torch.Tensor | npt.ArrayLike,
    shape: tuple[int, ...] | None,
    domain: tuple[float, float],
    dtype: torch.dtype,
    name: str = "x",
) -> torch.Tensor:
    """Validate a batch of inputs and return it as a detached ``dtype`` tensor.

    Finiteness is checked after the cast (a float64 ``1e39`` is inf in float32).

    Raises
    ------
    TypeError
        If ``x`` does not hold real numbers.
    ValueError
        If ``x`` is not of shape ``(n, *shape)`` with ``n >= 1``, holds NaN or inf,
        or leaves ``[domain[0], domain[1]]``.
    """
    if isinstance(x, torch.Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        t = x.detach()
    else:
        array = np.asarray(x)
        if array.dtype.kind not in "iuf":
            raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
        t = torch.as_tensor(array)
    t = t.to(dtype)
    wanted = "(n, ...)" if shape is None else str((-1, *shape)).replace("-1", "n")
    if t.ndim < 2 or t.shape[0] == 0 or (shape is not None and t.shape[1:] != shape):
        raise ValueError(
            f"{name} must have shape {wanted} with n >= 1, got {tuple(t.shape)}"
        )
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} holds NaN or inf values (in {dtype})")
    low, high = domain
    below, above = float(t.min()), float(t.max())
    if below < low or above > high:
        raise ValueError(
            f"{name} must lie in the input domain [{low}, {high}], "
            f"got values in [{below:.6g}, {above:.6g}]"
        )
    return t


def _as_box(value: Any) -> Box:
    if isinstance(value, Box):
        return value
    if isinstance(value, torch.Tensor):
        return Box(value, value)
    raise UnsupportedLayerError(f"expected a tensor output, got {type(value).__name__}")


@dataclass(frozen=True)
class VAEInterface:
    """A module that follows the VAE protocol, with what CIVET learned about it.

    Build it with :func:`as_vae`, which checks the contract.

    Attributes
    ----------
    module : torch.nn.Module
        The user's model (not copied; training updates it in place).
    encode_name, decode_name : str
        Names of its two methods.
    domain : (float, float)
        The valid input range.
    input_shape : tuple of int
        Shape of one input (without the batch dimension).
    latent_dim : int
        Latent dimension ``d``.
    """

    module: nn.Module
    encode_name: str
    decode_name: str
    domain: tuple[float, float]
    input_shape: tuple[int, ...]
    latent_dim: int
    _graphs: dict[str, fx.GraphModule] = field(
        default_factory=dict, compare=False, repr=False
    )
    _fused: list[FusedVAE | None] = field(
        default_factory=list, compare=False, repr=False
    )

    @property
    def dtype(self) -> torch.dtype:
        """Dtype the module computes in."""
        return parameter_dtype(self.module)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of the encoder."""
        mu, logvar = getattr(self.module, self.encode_name)(x)
        return mu, logvar

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Reconstruction of latents ``z``, shape ``(n, *input_shape)``."""
        out: torch.Tensor = getattr(self.module, self.decode_name)(z)
        return out

    def reconstruct(self, x: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
        r"""Decode :math:`z = \mu(x) + \sigma(x) \odot \nu` for the noise ``nu``."""
        mu, logvar = self.encode(x)
        return self.decode(mu + torch.exp(0.5 * logvar) * nu)

    def inputs(self, x: torch.Tensor | npt.ArrayLike, name: str = "x") -> torch.Tensor:
        """``x`` validated against the input shape and domain, in the module dtype."""
        return check_inputs(x, self.input_shape, self.domain, self.dtype, name)

    def copy(self, dtype: torch.dtype) -> VAEInterface:
        """An interface to an eval-mode deep copy of the module, cast to ``dtype``."""
        module = copy.deepcopy(self.module).to(dtype).eval()
        return VAEInterface(
            module,
            self.encode_name,
            self.decode_name,
            self.domain,
            self.input_shape,
            self.latent_dim,
        )

    def _graph(self, name: str) -> fx.GraphModule:
        if name not in self._graphs:
            with evaluation(self.module):
                self._graphs[name] = trace(self.module, name)
        return self._graphs[name]

    def fused(self) -> FusedVAE | None:
        """The fused interval arithmetic of :mod:`defenses.civet.fused`, if it applies.

        Only for the built-in container whose parts are chains of Linear and
        monotone layers, called through its own ``encode`` / ``decode`` (not
        replaced on the instance); the same rules as the graph path, fewer tensor
        operations.
        """
        if not self._fused:
            plain = (self.encode_name, self.decode_name) == ("encode", "decode")
            patched = {"encode", "decode", "forward"} & set(vars(self.module))
            fast = fused_parts(self.module) if plain and not patched else None
            self._fused.append(fast)
        return self._fused[0]

    def latent_bounds(self, box: Box) -> tuple[Box, Box]:
        """Interval bounds of ``mu`` and ``logvar`` over the input ``box`` (eval)."""
        fast = self.fused()
        if fast is not None:
            return fast.latent_bounds(box)
        with evaluation(self.module):
            out = propagate(self._graph(self.encode_name), box)
        mu, logvar = out
        return _as_box(mu), _as_box(logvar)

    def output_bounds(self, box: Box) -> Box:
        """Interval bounds of the reconstruction over the latent ``box`` (eval mode)."""
        fast = self.fused()
        if fast is not None:
            return fast.output_bounds(box)
        with evaluation(self.module):
            return _as_box(propagate(self._graph(self.decode_name), box))

    def output_range(self) -> tuple[float, float] | None:
        """Range of every reconstruction value if the decoder ends in a bounded map."""
        return output_range(self._graph(self.decode_name))


def _batch_statistics(module: nn.Module) -> None:
    """Refuse BatchNorm layers without running statistics, naming the first one.

    Such a layer normalises every batch by its own statistics, in eval mode too: a
    row's output depends on the other rows (and a single row cannot be normalised),
    so it has no interval rule.
    """
    for name, layer in module.named_modules():
        if isinstance(layer, _BatchNorm) and layer.running_mean is None:
            raise UnsupportedLayerError(
                f"layer {name!r} ({type(layer).__name__}) has no running statistics "
                "(track_running_stats=False): it normalises each batch by its own "
                "mean and variance even in eval mode, so one row's output depends "
                "on the others and a batch of one cannot be normalised; CIVET "
                "needs track_running_stats=True (bounds use the running statistics)"
            )


def _method(module: nn.Module, name: str, role: str) -> None:
    if not isinstance(name, str) or not callable(getattr(module, name, None)):
        raise TypeError(
            f"model ({type(module).__name__}) has no {role} method {name!r}; "
            f"CIVET needs {PROTOCOL}"
        )


def as_vae(
    model: nn.Module | VAEInterface,
    x: torch.Tensor | npt.ArrayLike,
    encode: str = "encode",
    decode: str = "decode",
    domain: tuple[float, float] | None = None,
) -> VAEInterface:
    """Check that ``model`` follows the VAE protocol on one row of ``x``.

    Parameters
    ----------
    model : torch.nn.Module or VAEInterface
        The user's VAE (an interface is returned as it is).
    x : array-like of shape (n, *input_shape)
        Inputs it will see; the first row is encoded and decoded once (eval mode,
        no gradients) to learn the latent dimension and check the shapes.
    encode, decode : str
        Names of the two methods.
    domain : (float, float) or None
        Valid input range; None takes the module's ``domain`` attribute if it has
        one, else ``(0.0, 1.0)``.

    Raises
    ------
    TypeError
        If ``model`` is not a module, lacks a method, or a method breaks the
        contract (the message says which and what it returned).
    UnsupportedLayerError
        If a BatchNorm layer keeps no running statistics, a layer carries a
        forward hook (old-style weight_norm / spectral_norm included), or a
        method writes state on the module (each named; :mod:`defenses.civet.
        state`).
    ValueError
        If ``x`` or ``domain`` is invalid, or a parameter, a buffer or an output on
        the first row holds NaN or inf (named).
    """
    if isinstance(model, VAEInterface):
        return model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be {PROTOCOL}; got {type(model).__name__}")
    _method(model, encode, "encode")
    _method(model, decode, "decode")
    span = domain if domain is not None else getattr(model, "domain", (0.0, 1.0))
    if not isinstance(span, tuple | list) or len(span) != 2:
        raise ValueError(f"domain must be a pair (low, high), got {span!r}")
    low = check_real("domain[0]", span[0])
    high = check_real("domain[1]", span[1], low, open_low=True)
    check_finite_module("model", model)
    _batch_statistics(model)
    check_hooks(model)
    dtype = parameter_dtype(model)
    row = check_inputs(x, None, (low, high), dtype)[:1]
    with torch.no_grad(), evaluation(model):
        before = snapshot(model)
        try:
            out = getattr(model, encode)(row)
        except Exception as error:
            if "more than 1 value per channel" in str(error):
                raise UnsupportedLayerError(
                    f"model.{encode} normalises with batch statistics (BatchNorm in "
                    "training mode or F.batch_norm(..., training=True)), so it cannot "
                    "take a batch of one row and one row's output depends on the "
                    "others; CIVET bounds eval-mode BatchNorm with running statistics "
                    f"only ({error})"
                ) from error
            raise ValueError(
                f"x of shape {tuple(row.shape)} (one row) does not fit "
                f"model.{encode}: {error}"
            ) from error
        pair = isinstance(out, tuple | list) and len(out) == 2
        if not pair or not all(isinstance(t, torch.Tensor) for t in out):
            raise TypeError(
                f"model.{encode}(x) must return (mu, logvar), got "
                f"{type(out).__name__}; CIVET needs {PROTOCOL}"
            )
        check_stateless(model, before, encode)
        mu, logvar = out
        if mu.ndim != 2 or mu.shape != logvar.shape or mu.shape[0] != 1:
            raise TypeError(
                f"model.{encode}(x) must return mu and logvar of shape "
                f"(n, latent_dim); got {tuple(mu.shape)} and {tuple(logvar.shape)} "
                f"for x of shape {tuple(row.shape)}"
            )
        before = snapshot(model)
        x_hat = getattr(model, decode)(mu)
        check_stateless(model, before, decode)
        if not isinstance(x_hat, torch.Tensor) or x_hat.shape != row.shape:
            got = tuple(x_hat.shape) if isinstance(x_hat, torch.Tensor) else x_hat
            raise TypeError(
                f"model.{decode}(z) must return x_hat with the shape of x, "
                f"{tuple(row.shape)}; got {got}"
            )
        for what, value in ((f"{encode}(x)", torch.cat([mu, logvar])), (decode, x_hat)):
            if not bool(torch.isfinite(value).all()):
                raise ValueError(
                    f"model.{what} returns NaN or inf on the first row of x; a "
                    "broken model is refused"
                )
    return VAEInterface(
        model, encode, decode, (low, high), tuple(row.shape[1:]), int(mu.shape[1])
    )
