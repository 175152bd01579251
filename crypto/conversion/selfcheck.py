r"""The conversion checks itself: the converted structure must reproduce the source.

Before any polynomial or kernel stands in for a function, :func:`check_faithful`
runs the converted :class:`~crypto.conversion.model.HEBert` with the source's own
functions (softmax attention with the padding mask, each block's installed
activation, exact LayerNorms, tanh; :mod:`~crypto.conversion.functions`) on
sampled token ids, and the source model as it is installed (its classes, hooks,
registered attention and patched functions all included) on the same ids. At
every tap, in the order the data flows,

.. math::

    \max |y^{src} - y^{conv}| \le \tau_{dtype} \cdot \max(1, \max |y^{conv}|)

(:data:`TOLERANCE`: float32 sources ``1e-4``, float64 ``1e-9``) must hold for the
embeddings, each block's attention output, intermediate output and block output,
the pooler's dense output and the logits; otherwise :func:`convert` refuses,
naming the first source module whose output differs. So whatever the source
computes that the copied weights and the identified functions do not (a swapped
function attribute, a patched ``torch`` function, a hook no static rule knows), the
conversion cannot pass in silence on the sampled inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from .errors import ConversionError
from .functions import SourceFunctions
from .model import HEBert

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
"""Largest difference, relative to max(1, the tap's scale), per source dtype."""
SAMPLES = 16
"""Sequences sampled when the user gives none."""


@dataclass(frozen=True)
class SelfCheck:
    """The self-check's result.

    Attributes
    ----------
    sequences : int
        How many sequences ran through both models.
    max_error : float
        The largest scaled difference over every tap (<= ``tolerance``).
    tolerance : float
        :data:`TOLERANCE` of the source's dtype.
    worst : str
        The source module where ``max_error`` was reached.
    """

    sequences: int
    max_error: float
    tolerance: float
    worst: str

    def __str__(self) -> str:
        return (
            f"self-check: the converted structure with the source's functions "
            f"reproduces the source on {self.sequences} sequences (largest scaled "
            f"difference {self.max_error:.1e} at {self.worst}, tolerance "
            f"{self.tolerance:.0e})"
        )


def sample_inputs(
    n: int, n_tokens: int, vocab: int, pad: int, seed: int = 0
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``n`` random sequences of random length (>= 1), padded with ``pad``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, n_tokens))
    lengths = rng.integers(1, n_tokens + 1, n)
    lengths[0] = n_tokens  # one full sequence
    mask = (np.arange(n_tokens)[None, :] < lengths[:, None]).astype(np.int64)
    ids[mask == 0] = pad
    return ids.astype(np.int64), mask


def _taps(base: str, layers: int) -> dict[str, str]:
    """Reference tap -> the source module that produces the same output."""
    taps = {"embeddings": f"{base}.embeddings"}
    for i in range(layers):
        where = f"{base}.encoder.layer.{i}"
        taps[f"layer {i} attention"] = f"{where}.attention"
        taps[f"layer {i} intermediate"] = f"{where}.intermediate"
        taps[f"layer {i}"] = where
    taps["pooler dense"] = "bert.pooler.dense" if base == "bert" else "classifier.dense"
    return taps


def _first(output: Any) -> torch.Tensor:
    while not isinstance(output, torch.Tensor):
        output = output[0]
    return output


def source_outputs(
    model: nn.Module, base: str, layers: int, ids: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every tap's output of the installed source (eval mode, its modes restored)."""
    modules = dict(model.named_modules())
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for tap, name in _taps(base, layers).items():

        def hook(m: nn.Module, a: Any, out: Any, tap: str = tap) -> None:
            seen[tap] = _first(out).detach().clone()

        handles.append(modules[name].register_forward_hook(hook))
    modes = {name: m.training for name, m in modules.items()}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    device = next(model.parameters()).device
    try:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device))
            seen["logits"] = _first(out.logits)
    except Exception as err:  # the user's model: any failure is a refusal
        raise ConversionError(
            f"cannot convert: running the source model on sampled inputs failed "
            f"({type(err).__name__}: {err})"
        ) from err
    finally:
        for handle in handles:
            handle.remove()
        for name, m in modules.items():
            m.training = modes[name]
        moved = _restore(model, state)
    if moved:
        raise ConversionError(
            f"cannot convert: the source's forward changed its own {moved} (restored):"
            " a model whose state moves as it runs has no one function to convert"
        )
    return {k: v.cpu() for k, v in seen.items()}


def _restore(model: nn.Module, state: dict[str, torch.Tensor]) -> str | None:
    """Put back every tensor a forward moved; the first one's name, or None."""
    moved = None
    with torch.no_grad():
        for name, now in model.state_dict().items():
            if name in state and not torch.equal(now, state[name]):
                now.copy_(state[name])
                moved = moved or name
    return moved


def reference_outputs(
    he: HEBert, functions: SourceFunctions, ids: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Every tap of the converted structure run with the source's functions."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, value: torch.Tensor) -> torch.Tensor:
        seen[name] = value.detach()
        return value

    def site(name: str, value: torch.Tensor) -> torch.Tensor:
        return value

    with torch.no_grad():
        z = record("embeddings", he.embed_tokens(ids))
        he.encode(z, mask.to(torch.float64), False, site, functions, record)
    return seen


def check_faithful(
    model: nn.Module,
    he: HEBert,
    functions: SourceFunctions,
    base: str,
    ids: npt.ArrayLike | None = None,
    mask: npt.ArrayLike | None = None,
) -> SelfCheck:
    """Refuse unless ``he`` with ``functions`` reproduces ``model`` (module docstring).

    ``ids`` and ``mask`` are the user's sequences (None: :data:`SAMPLES` random
    ones of random length).
    """
    c = he.config
    if ids is None:
        pad = c.position_padding_idx if c.position_padding_idx is not None else 0
        ids, mask = sample_inputs(SAMPLES, c.n_tokens, c.vocab_size, pad)
    ids_t, mask_t = he.check_ids(ids, mask)
    dtype = next(model.parameters()).dtype
    tolerance = TOLERANCE[dtype]
    source = source_outputs(model, base, c.n_layers, ids_t, mask_t.to(torch.int64))
    mine = reference_outputs(he, functions, ids_t, mask_t)
    names = {**_taps(base, c.n_layers), "logits": "the logits"}
    worst, where = 0.0, names["logits"]
    for tap, module in names.items():
        theirs, ours = source[tap].to(torch.float64), mine[tap]
        if theirs.shape != ours.shape:
            raise ConversionError(
                f"cannot convert: the output of {module} has shape "
                f"{tuple(theirs.shape)}, the converted structure's {tuple(ours.shape)}"
            )
        scale = max(1.0, float(ours.abs().max()))
        error = float((theirs - ours).abs().max()) / scale
        if not error <= tolerance:
            raise ConversionError(
                f"cannot convert: the source's output at {module} differs from the "
                f"converted structure run with the source's own functions by "
                f"{error * scale:.3g} (scaled {error:.2g} > tolerance {tolerance:.0e}) "
                f"on {ids_t.shape[0]} sampled sequences: the installed model computes "
                "something its weights, classes and activations do not say there (a "
                "patched function, a hook or a changed attribute)"
            )
        if error >= worst:
            worst, where = error, module
    return SelfCheck(int(ids_t.shape[0]), worst, tolerance, where)
