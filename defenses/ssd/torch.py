"""SSD for torch: a module, or any callable, whose answers pass through the shield.

:class:`ShieldedModule` keeps the defense in its ``state_dict``: the shield's
prototypes, settings and random stream are three buffers (``shield_prototypes``,
``shield_settings``, ``shield_stream``), so ``torch.save(module.state_dict())``,
``torch.load(..., weights_only=True)`` and ``load_state_dict`` into a module built
around an unfitted shield restore a defense that answers exactly as the saved one
would have.

What the wrapped model returns is read from its last layer (``nn.Softmax``:
probabilities, ``nn.LogSoftmax``: log-probabilities, else logits) or given as
``outputs=``; outputs that are already probabilities (non-negative rows summing to
one) are never softmaxed again: ``"auto"`` takes them as probabilities and
``"logits"`` refuses them. Outputs holding NaN or ``+inf`` (or ``-inf`` where it
means no probability) are refused, naming the model: SSD answers only a model that
answers.

**Seeding.** Both wrappers answer with ``seeding="input-hash"`` unless told
otherwise: the pseudo-label of a query is a keyed hash of the query, so the same
input gets the same answer, and an attacker who repeats a query and votes learns
nothing from the repeats. ``seeding="random"`` (a fresh pseudo-label per answer) is
an explicit choice. The wrapper works on its own copy of the shield with that
seeding; the shield handed in is left as it is.

**torch's tools.** The model runs as torch code; the shield (numpy, a compiled row
loop, a keyed hash) runs in a region ``torch.compile`` does not trace
(:func:`torch.compiler.disable`), so ``torch.compile(ShieldedModule(...))`` compiles
the model, breaks the graph at the shield and answers exactly as eager (not with
``fullgraph=True``, which forbids the break). ``torch.jit.trace`` would record the
shield's answers for the example input as constants, and ``torch.jit.script`` cannot
compile numpy: both raise :class:`TorchToolError` at trace or script time, saying
so, instead of returning a module that answers wrongly; so do ``torch.export`` and
``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from defenses.checks import check_choice, check_finite_module
from defenses.ssd.lazy import OUTPUTS as OUTPUTS
from defenses.ssd.lazy import check_outputs as check_outputs
from defenses.ssd.seeding import SEEDINGS, Seeding
from defenses.ssd.state import STATE_KEYS, load_shield_state, shield_state

logger = logging.getLogger(__name__)

BUFFERS = {key: f"shield_{key}" for key in STATE_KEYS}


class Shield(Protocol):
    """What the wrappers need of a shield (a ``StealthyShield``)."""

    @property
    def is_fitted(self) -> bool:
        """Whether the prototypes exist."""
        ...

    @property
    def seeding(self) -> str:
        """``"random"`` or ``"input-hash"``."""
        ...

    def set_params(self, **params: Any) -> Any:
        """Set parameters (validated)."""
        ...

    def __call__(self, probs: Any, inputs: Any = None) -> Any:
        """Defended probabilities."""
        ...


class TorchToolError(RuntimeError):
    """A torch tool (``jit.trace``, ``jit.script``) cannot capture the shield."""


def with_seeding(shield: Shield, seeding: str) -> Shield:
    """A copy of ``shield`` answering with ``seeding`` (the original is untouched).

    A ``hash_resolution`` is kept for ``"input-hash"`` and dropped for
    ``"random"``, which has no input to round.
    """
    check_choice("seeding", seeding, SEEDINGS)
    own = copy.deepcopy(shield)
    if own.seeding != seeding:
        logger.info(
            "the wrapper answers with seeding=%r (the shield had %r)",
            seeding,
            own.seeding,
        )
        params: dict[str, Any] = {"seeding": seeding}
        if seeding == "random":
            params["hash_resolution"] = None
        own.set_params(**params)
    return own


def check_finite(out: torch.Tensor, outputs: str, model: str) -> None:
    """Raise ValueError naming ``model`` if its outputs hold NaN or a bad infinity.

    ``-inf`` is a probability of zero for logits and log-probabilities (a masked
    class) and is accepted there, unless a whole row is ``-inf``; NaN and ``+inf``
    are refused everywhere, and any infinity in probabilities.
    """
    bad = torch.isnan(out) | (out == torch.inf)
    if outputs == "probs":
        bad |= torch.isinf(out)
    rows = bad.flatten(1).any(dim=1) if bad.ndim > 1 else bad.reshape(-1)
    if out.ndim == 2 and outputs != "probs":
        rows |= torch.isneginf(out).all(dim=1)
    if bool(rows.any()):
        index = torch.nonzero(rows).flatten()[:5].tolist()
        raise ValueError(
            f"the wrapped model ({model}) returned NaN or inf for rows {index} "
            f"(of {int(rows.numel())}): SSD defends finite answers only; check the "
            "model's parameters and inputs"
        )


def module_outputs(module: torch.nn.Module) -> str:
    """What a module returns, read from its last layer (nested ``Sequential`` too)."""
    last = module
    while isinstance(last, torch.nn.Sequential) and len(last):
        last = last[-1]
    if isinstance(last, torch.nn.Softmax):
        return "probs"
    if isinstance(last, torch.nn.LogSoftmax):
        return "log-probs"
    return "logits"


def _probability_rows(values: torch.Tensor) -> bool:
    """Whether every row is non-negative and sums to one (within float32 rounding)."""
    if values.ndim != 2 or values.shape[0] == 0 or values.is_complex():
        return False
    tolerance = 1e-6 + 8 * float(torch.finfo(torch.float32).eps) * values.shape[1]
    rows = values.detach().double()
    return bool((rows >= 0).all()) and bool(
        ((rows.sum(1) - 1).abs() <= tolerance).all()
    )


def to_probs(out: torch.Tensor, outputs: str) -> torch.Tensor:
    """The model's outputs as float64 probabilities, softmaxing logits only."""
    if outputs == "log-probs":
        return out.detach().double().exp()
    if outputs == "probs" or (outputs == "auto" and _probability_rows(out)):
        return out.detach().double()
    if outputs == "logits" and _probability_rows(out):
        raise ValueError(
            "outputs='logits', but the model's rows are already probabilities "
            "(non-negative, summing to one): pass outputs='probs' (a softmax of "
            "probabilities would flatten them)"
        )
    return torch.softmax(out.detach().double(), dim=-1)


class ShieldedModule(torch.nn.Module):
    """A torch module whose forward pass answers SSD-defended probabilities.

    Parameters
    ----------
    model : torch.nn.Module
        The deployed model (left unchanged).
    shield : StealthyShield
        Fitted, or unfitted to be filled by :meth:`load_state_dict`. The module
        answers through its own copy (``self.shield``) with ``seeding``.
    outputs : {"auto", "probs", "logits", "log-probs"}
        What ``model`` returns; ``"auto"`` reads its last layer.
    seeding : {"input-hash", "random"}
        ``"input-hash"`` (default): the same input gets the same answer, so
        repeating a query and voting gains nothing. ``"random"``: a fresh
        pseudo-label per answer, an explicit choice. A loaded ``state_dict``
        brings the seeding it was saved with.

    The answer is detached from the autograd graph: it is an API answer. Under
    ``torch.compile`` the model is compiled and the shield runs eagerly (a graph
    break); ``torch.jit.trace`` and ``torch.jit.script`` raise
    :class:`TorchToolError`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        shield: Shield,
        outputs: str = "auto",
        seeding: Seeding = "input-hash",
    ) -> None:
        super().__init__()
        check_outputs(outputs)
        if isinstance(model, torch.nn.Module):  # a broken model is refused by name
            check_finite_module(type(model).__name__, model)
        self.model = model
        self.shield = with_seeding(shield, seeding)
        self.seeding: str = seeding
        self.outputs = module_outputs(model) if outputs == "auto" else outputs
        self.auto = outputs == "auto"
        for name in BUFFERS.values():
            self.register_buffer(name, torch.empty(0))
        if self.shield.is_fitted:
            self._sync()

    def _sync(self) -> None:
        """Write the shield's state into the buffers."""
        for key, array in shield_state(self.shield).items():
            device = getattr(self, BUFFERS[key]).device
            setattr(self, BUFFERS[key], torch.from_numpy(array).to(device))

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's and the shield's state (synced from the shield first)."""
        if self.shield.is_fitted:
            self._sync()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        for name in BUFFERS.values():
            if prefix + name in state_dict:
                incoming = state_dict[prefix + name]
                setattr(self, name, torch.empty_like(incoming, device="cpu"))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        arrays = {
            key: getattr(self, name).cpu().numpy() for key, name in BUFFERS.items()
        }
        if arrays["prototypes"].size:
            load_shield_state(self.shield, arrays)
            self.seeding = self.shield.seeding

    def __prepare_scriptable__(self) -> ShieldedModule:
        """Refuse ``torch.jit.script``: the shield is numpy code TorchScript lacks."""
        raise TorchToolError(
            "torch.jit.script cannot compile a ShieldedModule: the shield runs numpy "
            "code (a compiled row loop and a keyed hash) that TorchScript cannot "
            "express. Script or trace the bare model and wrap the result: "
            "ShieldedModule(torch.jit.script(model), shield), or use torch.compile"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Defended probabilities of shape (N, K), in the model's output dtype."""
        tracing = torch.jit.is_tracing()  # type: ignore[attr-defined,no-untyped-call]
        if tracing:
            raise TorchToolError(
                "torch.jit.trace cannot capture a ShieldedModule: the shield's "
                "answers would be recorded as constants and returned for every "
                "input. Trace the bare model and wrap the result: "
                "ShieldedModule(torch.jit.trace(model, x), shield), or use "
                "torch.compile"
            )
        if torch.compiler.is_exporting() or isinstance(x, torch.fx.Proxy):
            raise TorchToolError(
                "torch.export and torch.fx cannot capture a ShieldedModule: the "
                "shield runs numpy code outside torch's graph. Export the bare "
                "model and wrap the result, or use torch.compile"
            )
        with torch.no_grad():
            out = self.model(x)
        answers: torch.Tensor = _outside_compile()(self, out, x)
        return answers

    def _answer(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The shield's answers to the model's outputs ``out`` (never traced)."""
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"the wrapped model ({type(self.model).__name__}) must return a "
                f"tensor, got {type(out).__name__}"
            )
        check_finite(out, self.outputs, type(self.model).__name__)
        detect = self.auto and self.outputs == "logits"
        probs = to_probs(out, "auto" if detect else self.outputs)
        answers: torch.Tensor = self.shield(probs, inputs=x)
        return answers.to(out.dtype)


@functools.cache
def _outside_compile() -> Callable[..., torch.Tensor]:
    """:meth:`ShieldedModule._answer` in a ``torch.compiler.disable`` region.

    Built on the first forward, not at import: ``torch.compiler.disable`` imports
    ``torch._dynamo``, which costs seconds that a user who never compiles should
    not pay when importing :mod:`defenses.ssd`.
    """
    disable = torch.compiler.disable
    region: Callable[..., torch.Tensor] = disable(ShieldedModule._answer)  # type: ignore[no-untyped-call]
    return region


def _name(model: Any) -> str:
    """A callable's name for messages (``LogisticRegression.predict_proba``)."""
    return str(getattr(model, "__qualname__", type(model).__name__))


class ShieldedCallable:
    """Any callable returning probabilities, logits or log-probabilities, defended.

    ``outputs="auto"`` (what a callable returns cannot be read from it) takes rows
    that are already probabilities as they are and softmaxes anything else (logits,
    or log-probabilities, whose softmax is the probabilities themselves). Like
    :class:`ShieldedModule`, it answers through its own copy of the shield with
    ``seeding`` (default ``"input-hash"``) and refuses non-finite outputs.
    """

    def __init__(
        self,
        model: Callable[[Any], Any],
        shield: Shield,
        outputs: str = "auto",
        seeding: Seeding = "input-hash",
    ) -> None:
        self.model = model
        self.outputs = check_outputs(outputs)
        self.shield = with_seeding(shield, seeding)
        self.seeding: str = seeding

    def __call__(self, x: Any) -> Any:
        """Defended probabilities for the batch ``x``."""
        out = self.model(x)
        if isinstance(out, torch.Tensor):
            check_finite(out, self.outputs, _name(self.model))
            return self.shield(to_probs(out, self.outputs).to(out.dtype), inputs=x)
        array = np.asarray(out)
        if array.dtype.kind not in "fiub":
            raise TypeError(f"the model must return real numbers, got {array.dtype}")
        tensor = torch.from_numpy(array.astype(np.float64))
        check_finite(tensor, self.outputs, _name(self.model))
        probs = to_probs(tensor, self.outputs)
        return self.shield(probs.numpy(), inputs=x)
