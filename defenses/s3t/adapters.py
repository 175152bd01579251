r"""Low-rank adapters on the chosen layers of any torch module, held outside it.

S3T needs, for every stage, a set of adapter tensors that it can train in isolation,
stack with the frozen adapters of earlier stages, erase, persist and replay bit for
bit. The adapters are therefore plain tensors owned by the unlearner, never
parameters of the model: :class:`AdaptedModel` keeps one frozen copy of the user's
module and, for one forward pass at a time, binds a mapping ``target name -> (A, B)``
to the target layers through forward hooks (the module's structure and
``state_dict`` are untouched).

A LoRA adapter of rank ``r`` on a layer ``f`` adds a low-rank update (Hu et al.,
2022):

.. math::

    \text{Linear } W:\ y = W x + b + B (A x), \qquad
    A \in \mathbb{R}^{r \times d_{in}},\ B \in \mathbb{R}^{d_{out} \times r};

    \text{Conv2d } W:\ y = W * x + b + B \cdot (A * x), \qquad
    A \in \mathbb{R}^{r \times c_{in} \times k_h \times k_w},\
    B \in \mathbb{R}^{c_{out} \times r}

(``A * x`` a convolution with the layer's stride, padding and dilation, ``B`` a
1x1 convolution). ``A`` is drawn from ``N(0, 1/fan_in)`` with the stage's own
``torch.Generator`` and ``B`` starts at zero, so a fresh adapter leaves the network
unchanged.

Targets are chosen as peft's ``LoraConfig(target_modules=...)`` does: a list of
names (a module matches when its qualified name equals an entry or ends with
``"." + entry``), a regular expression (full match), or a predicate
``(name, module) -> bool``. A target must be an ``nn.Linear`` or an ungrouped
``nn.Conv2d``, and its ``forward`` must actually run: layers whose weights a parent
reads directly (``nn.MultiheadAttention.out_proj``) are refused, since a hook on
them would never fire. Torch's fused fast path of ``nn.TransformerEncoderLayer``
(which also reads the weights directly, in eval mode) is switched off while
adapters are bound.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from defenses.s3t.eligibility import admit
from defenses.s3t.snapshot import capture

LoRA = tuple[Tensor, Tensor]
"""``(A, B)`` of one target layer."""
Targets = Sequence[str] | str | Callable[[str, nn.Module], bool]
"""Target layers: names (suffix match), a regular expression, or a predicate."""


def select_targets(model: nn.Module, target_modules: Targets) -> tuple[str, ...]:
    """Qualified names of the layers that get adapters, in registration order.

    Raises
    ------
    ValueError
        Nothing matches, or a match is not an ``nn.Linear`` / ungrouped
        ``nn.Conv2d`` (the message names ``target_modules``).
    TypeError
        ``target_modules`` is none of the three accepted forms.
    """
    if callable(target_modules):
        chosen = [n for n, m in model.named_modules() if n and target_modules(n, m)]
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        chosen = [n for n, _ in model.named_modules() if n and pattern.fullmatch(n)]
    elif isinstance(target_modules, Sequence) and all(
        isinstance(k, str) for k in target_modules
    ):
        keys = tuple(target_modules)
        chosen = [
            n
            for n, _ in model.named_modules()
            if n and any(n == k or n.endswith(f".{k}") for k in keys)
        ]
    else:
        raise TypeError(
            "target_modules must be a list of layer names, a regular expression or "
            f"a predicate (name, module) -> bool, got {type(target_modules).__name__}"
        )
    if not chosen:
        layers = [
            n for n, m in model.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)
        ]
        raise ValueError(
            f"target_modules={target_modules!r} matches no layer of the "
            f"{type(model).__name__}; its Linear/Conv2d layers are {layers[:12]}"
        )
    modules = dict(model.named_modules())
    for name in chosen:
        layer = modules[name]
        if isinstance(layer, nn.Conv2d) and layer.groups != 1:
            raise ValueError(
                f"target_modules: {name} is a grouped Conv2d (groups={layer.groups}); "
                "adapters support ungrouped convolutions only"
            )
        if not isinstance(layer, nn.Linear | nn.Conv2d):
            raise ValueError(
                f"target_modules: {name} is a {type(layer).__name__}; adapters go on "
                "nn.Linear and nn.Conv2d layers only"
            )
    return tuple(chosen)


def target_groups(targets: Sequence[str], n_groups: int) -> list[tuple[str, ...]]:
    """Split the targets into ``n_groups`` contiguous groups counted from the top.

    Registration order stands for depth: group 0 holds the last-registered targets
    (trained first by S3T), group ``n_groups - 1`` the first ones; sizes differ by at
    most one (larger groups on top).
    """
    if n_groups > len(targets):
        raise ValueError(
            f"slices={n_groups} exceeds the {len(targets)} target layers; every "
            "slice needs its own adapter group (target more layers or use fewer "
            "slices)"
        )
    top_down = list(reversed(targets))
    size, extra = divmod(len(top_down), n_groups)
    groups, start = [], 0
    for g in range(n_groups):
        stop = start + size + (1 if g < extra else 0)
        groups.append(tuple(sorted(top_down[start:stop], key=targets.index)))
        start = stop
    return groups


def running_stats(model: nn.Module) -> bool:
    """Whether a forward pass in training mode updates buffers (BatchNorm stats)."""
    return any(
        isinstance(m, _NormBase) and m.track_running_stats for m in model.modules()
    )


def updating_stats(model: nn.Module) -> list[str]:
    """Normalization layers whose own mode would update running statistics."""
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, _NormBase) and m.track_running_stats and m.training
    ]


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of the module's parameters and buffers (names, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def output_logits(output: Any) -> Tensor:
    """The logits in a model's output: a tensor, ``.logits``, or the first item."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], Tensor):
        return output[0]
    raise TypeError(
        f"model: its output ({type(output).__name__}) is neither a tensor of "
        "logits, an object with .logits, nor a tuple starting with the logits"
    )


def _delta(layer: nn.Module, x: Tensor, lora: LoRA) -> Tensor:
    a, b = lora
    if isinstance(layer, nn.Conv2d):
        z = F.conv2d(x, a, None, layer.stride, layer.padding, layer.dilation)
        return F.conv2d(z, b[:, :, None, None])
    return F.linear(F.linear(x, a), b)


class AdaptedModel:
    """A frozen copy of the user's module that runs with bound adapters and head.

    Parameters
    ----------
    model : nn.Module
        The user's model (copied; the copy's parameters are frozen). Its output for a
        batch must be class logits of shape ``(n, K)`` (or carry them, see
        :func:`output_logits`).
    target_modules : list of str, str or callable
        The layers that get adapters (see :func:`select_targets`).
    head : str or None
        Name of the module (e.g. ``"classifier"``) whose parameters every stage
        trains and stores with its prefix; None trains adapters only.
    keep_mode : bool
        Keep the copy in training mode (only for the shared-state negative control);
        otherwise it is put in eval mode (no dropout, frozen normalization).
    """

    def __init__(
        self,
        model: nn.Module,
        target_modules: Targets,
        head: str | None,
        keep_mode: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        model = admit(model)
        self.module = copy.deepcopy(model)
        self.module.requires_grad_(False)
        if not keep_mode:
            self.module.eval()
        self.targets = select_targets(self.module, target_modules)
        layers = dict(self.module.named_modules())
        self.layers: dict[str, nn.Module] = {t: layers[t] for t in self.targets}
        self.head = head
        self.head_names: tuple[str, ...] = ()
        if head is not None:
            if not isinstance(head, str) or head not in layers or not head:
                raise ValueError(
                    f"head={head!r} is not a module of the {type(model).__name__}"
                )
            self.head_names = tuple(
                f"{head}.{n}" for n, _ in layers[head].named_parameters()
            )
            if not self.head_names:
                raise ValueError(f"head={head!r} has no parameters to train")
            clash = [t for t in self.targets if t == head or t.startswith(f"{head}.")]
            if clash:
                raise ValueError(
                    f"target_modules: {clash} lie inside head={head!r}, which every "
                    "stage trains in full; leave them out"
                )
        params = dict(self.module.named_parameters())
        self.base_head: dict[str, Tensor] = {n: params[n] for n in self.head_names}
        self.pristine = capture(self.module)
        """The copy's state before S3T ran anything (see :mod:`.conformance`)."""

    def fresh(
        self, targets: Sequence[str], rank: int, gen: torch.Generator
    ) -> dict[str, LoRA]:
        """New adapters on ``targets``: ``A ~ N(0, 1/fan_in)``, ``B = 0``."""
        out = {}
        for name in targets:
            layer = self.layers[name]
            if isinstance(layer, nn.Conv2d):
                shape = (rank, layer.in_channels, *layer.kernel_size)
                out_dim = layer.out_channels
            elif isinstance(layer, nn.Linear):
                shape, out_dim = (rank, layer.in_features), layer.out_features
            else:
                raise TypeError(f"target {name} is a {type(layer).__name__}")
            fan_in = math.prod(shape[1:])
            a = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            out[name] = (a, torch.zeros(out_dim, rank))
        return out

    @contextlib.contextmanager
    def bound(
        self, adapters: Mapping[str, LoRA], head: Mapping[str, Tensor] | None = None
    ) -> Iterator[dict[str, int]]:
        """Bind ``adapters`` (and the head tensors ``head``) for the block.

        Yields the number of times each adapter's layer ran. The head tensors stand
        in for the head module's parameters (by qualified name) until the block ends.
        """
        calls = dict.fromkeys(adapters, 0)
        handles = []

        def hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Tensor], Tensor]:
            def add(layer: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
                calls[name] += 1
                return out + _delta(layer, args[0], adapters[name])

            return add

        owners = dict(self.module.named_modules()) if head else {}
        swapped = []
        fast = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            for name in adapters:
                handles.append(self.layers[name].register_forward_hook(hook(name)))
            for name, tensor in (head or {}).items():
                owner, _, leaf = name.rpartition(".")
                module = owners[owner]
                swapped.append((module, leaf, module._parameters[leaf]))
                module._parameters[leaf] = tensor
            yield calls
        finally:
            for module, leaf, original in reversed(swapped):
                module._parameters[leaf] = original
            for handle in handles:
                handle.remove()
            torch.backends.mha.set_fastpath_enabled(fast)

    def run(self, x: Tensor) -> Tensor:
        """The logits on ``x`` (inside :meth:`bound`)."""
        return output_logits(self.module(x))

    def logits(
        self, x: Tensor, adapters: Mapping[str, LoRA], head: Mapping[str, Tensor]
    ) -> Tensor:
        """The model's logits on ``x`` with ``adapters`` and the head ``head``."""
        with self.bound(adapters, head):
            return self.run(x)

    def embeddings(self) -> dict[str, nn.Embedding]:
        """The model's ``nn.Embedding`` layers by qualified name."""
        return {
            n: m for n, m in self.module.named_modules() if isinstance(m, nn.Embedding)
        }

    def vocabulary(self, shape: tuple[int, ...]) -> int | None:
        """Vocabulary size if inputs of one-sample ``shape`` are token ids, else None.

        The inputs are token ids when an ``nn.Embedding`` reads the model's input
        tensor itself, probed with one eval-mode forward pass on two rows of zeros
        (``int64``, valid ids for any vocabulary); a positional embedding reads
        ``torch.arange`` instead, so its model takes float features.
        """
        layers = self.embeddings()
        if not layers:
            return None
        probe = torch.zeros((2, *shape), dtype=torch.long)
        readers: list[int] = []

        def pre(layer: nn.Module, args: tuple[Any, ...]) -> None:
            first = args[0] if args else None
            if isinstance(first, Tensor) and first.data_ptr() == probe.data_ptr():
                readers.append(int(getattr(layer, "num_embeddings", 0)))

        handles = [m.register_forward_pre_hook(pre) for m in layers.values()]
        mode = self.module.training
        self.module.eval()
        try:
            with torch.no_grad(), contextlib.suppress(Exception):
                self.module(probe)
        finally:
            self.module.train(mode)
            for handle in handles:
                handle.remove()
        return min(readers) if readers else None

    def check(self, x: Tensor, n_classes: int, rank: int) -> None:
        """A trial forward pass: logits of width ``n_classes``, every target used.

        Raises
        ------
        ValueError
            The model cannot take ``x`` (message names ``X``), returns logits of
            another shape (names ``model``), or never calls a target's ``forward``
            (names ``target_modules``).
        """
        probe = self.fresh(self.targets, rank, torch.Generator().manual_seed(0))
        mode = self.module.training
        self.module.eval()  # no running statistics move during the probe
        try:
            with torch.no_grad(), self.bound(probe) as calls:
                output = self.module(x)
        except (RuntimeError, IndexError, TypeError) as error:
            hint = ""
            if self.embeddings() and x.is_floating_point():
                hint = (
                    f"; X holds floats and the model has nn.Embedding layers "
                    f"{list(self.embeddings())}: pass integer token ids if its "
                    "input goes into one (float features are fine when the "
                    "embedding reads positions, e.g. torch.arange)"
                )
            raise ValueError(
                f"X: the {type(self.module).__name__} cannot take a batch of shape "
                f"{tuple(x.shape)} and dtype {x.dtype} ({type(error).__name__}: "
                f"{error}){hint}"
            ) from error
        finally:
            self.module.train(mode)
        logits = output_logits(output)
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(
                "model: its logits hold NaN or inf on the first rows of X; a broken "
                "model is refused"
            )
        if logits.shape != (x.shape[0], n_classes):
            raise ValueError(
                f"model: its logits have shape {tuple(logits.shape)} for a batch of "
                f"{x.shape[0]}, but y has {n_classes} classes; give it a head with "
                f"{n_classes} outputs (logits of shape (n, {n_classes}))"
            )
        silent = [name for name, n in calls.items() if n == 0]
        if silent:
            raise ValueError(
                f"target_modules: the forward of {silent} never runs (its parent "
                "reads the weights directly, e.g. nn.MultiheadAttention.out_proj); "
                "target other layers"
            )
