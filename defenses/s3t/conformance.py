r"""The conformance pass S3T runs on the user's module at ``fit``, before training.

S3T's exactness (a retrained model equals, bit for bit, a fresh fit on the
surviving data; a deactivated stage leaves exactly its parent) rests on two
properties of the frozen backbone that nothing else enforces:

1. **Determinism.** The forward pass is a function of its input, the bound adapters
   and the head: two passes on the same batch give identical outputs, and the
   forward draws no random numbers. ``F.dropout(h, 0.2)`` breaks it in eval mode too
   (its ``training`` defaults to True), as does noise drawn inside ``forward``.
2. **Nothing moves.** No state a step can reach changes: every parameter and
   buffer, every plain attribute of every submodule (numbers, strings, containers,
   objects: a call counter in a list, a list of floats, a dict cache, a float
   updated in forward), the hooks' closures, the module classes' attributes and
   the globals their code names, and the global random generators (the full
   list is in :mod:`defenses.s3t.snapshot`). Otherwise every stage writes into
   state all stages share (a leak across deletions S3T's records do not see), or
   a retrained model runs with state a fresh fit never had.

:class:`Conformance` watches S3T's first contact with the module. The module's
own state is compared with its snapshot taken when S3T copied it (so a
data-dependent initialisation that ran in S3T's very first forward, Glow-style
ActNorm, is seen), shared state with a snapshot taken when ``fit`` began. While
it watches, a torch dispatch mode records every ATen operation that writes in
place into a tensor of that state (``embedding_renorm_`` of
``nn.Embedding(max_norm=...)``, ``copy_`` of a lazy initialisation, the running
statistics of ``F.batch_norm(..., training=True)``), whether or not the value
changed on the probe's rows, and every operation tagged as drawing random
numbers; a torch function mode names the Python-level call (functional dropout,
``randn_like``). The probe runs two forward passes on the first rows, one
forward pass over every training row (so state written only for some inputs is
seen on the data S3T trains on) and one training step (forward, backward, Adam
step on probe adapters and the head). Each failure raises ``ValueError`` naming
the cause and the state's qualified name, before any stage is trained.
:func:`defenses.s3t.attacks.lineage_audit` stays as the after-the-fact check
(the backbone's fingerprint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from defenses.s3t.adapters import AdaptedModel
from defenses.s3t.snapshot import Snapshot, capture, differences

_DROPOUTS: Mapping[str, tuple[int, bool]] = {
    "dropout": (2, True),
    "dropout1d": (2, True),
    "dropout2d": (2, True),
    "dropout3d": (2, True),
    "alpha_dropout": (2, False),
    "feature_alpha_dropout": (2, False),
}
"""Dropout functions: position of ``training`` and its default."""

_RANDOM = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "bernoulli_",
        "normal",
        "normal_",
        "uniform_",
        "random_",
        "exponential_",
        "multinomial",
        "poisson",
        "rrelu",
        "native_dropout",
    }
)
"""Functions and tensor methods that draw random numbers."""

_HINTS: Mapping[str, str] = {
    "embedding_renorm_": (
        "nn.Embedding(max_norm=...) renormalises the rows it looks up, in place, "
        "at every forward: renormalise every row of the weight once before fit "
        "and set max_norm=None"
    ),
    "batch_norm": (
        "running statistics are updated in forward: use nn.BatchNorm in eval "
        "mode or F.batch_norm(..., training=False)"
    ),
}
"""Hints for the ATen operations whose in-place writes we know."""

_INIT_HINT = (
    "a data-dependent initialisation on first forward (Glow-style ActNorm, lazy "
    "modules) or an in-place update in forward: initialise the module once on "
    "public data before handing it to S3T (then nothing moves), and update no "
    "tensor in forward"
)


class _Watch(TorchFunctionMode):
    """Records the random and statistics-updating calls of a forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.random: list[str] = []
        self.updates: list[str] = []
        self.armed = True

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if not self.armed:
            pass
        elif name in _DROPOUTS:
            index, default = _DROPOUTS[name]
            training = args[index] if len(args) > index else kwargs.get("training")
            if default if training is None else bool(training):
                self.random.append(f"torch.nn.functional.{name}(..., training=True)")
        elif name in _RANDOM:
            self.random.append(name)
        elif func is F.batch_norm or func is F.instance_norm:
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            stats = args[1] if len(args) > 1 else kwargs.get("running_mean")
            if training and stats is not None:
                self.updates.append(f"torch.nn.functional.{name}(..., training=True)")
        return func(*args, **kwargs)


class _Writes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records in-place writes into watched storages and random operations."""

    def __init__(self, storages: Mapping[int, str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.storages = storages
        self.writes: dict[str, list[str]] = {}
        self.random: list[str] = []
        self.armed = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if self.armed and _draws(func, args, kwargs):
            self.random.append(f"aten.{name}")
        for i, argument in enumerate(func._schema.arguments):
            info = argument.alias_info
            if info is None or not info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(argument.name)
            for tensor in _tensors(value):
                path = self.storages.get(_storage(tensor))
                if path is not None:
                    ops = self.writes.setdefault(path, [])
                    if f"aten.{name}" not in ops:
                        ops.append(f"aten.{name}")
        return func(*args, **kwargs)


def _draws(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an ATen call draws random numbers (its tag, unless switched off).

    Operations that may drop out (``dropout_p`` of attention, ``train`` of
    ``native_dropout``) draw nothing at probability 0 or outside training.
    """
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    schema = func._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}
    values.update(zip([a.name for a in schema], args, strict=False))
    values.update(kwargs)
    if isinstance(values.get("dropout_p"), int | float):
        return float(values["dropout_p"]) > 0.0
    if "train" in values and not values["train"]:
        return False
    p = values.get("p")
    return not isinstance(p, int | float) or float(p) > 0.0


def _tensors(value: object) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _storage(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr()) if t.numel() else 0
    except RuntimeError:
        return 0


def _first_difference(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    gap = (a.double() - b.double()).abs()
    gap = torch.where(torch.isnan(gap), torch.inf, gap)
    return float(gap.max()) if gap.numel() else 0.0


def _hint(ops: list[str]) -> str:
    for op in ops:
        for key, hint in _HINTS.items():
            if key in op:
                return hint
    return _INIT_HINT


class Conformance:
    """Watch S3T's first contact with the module, then give the verdict.

    Use as ``with probe: ...; probe.run(...)`` around everything ``fit`` does with
    the module before training, then :meth:`verdict` (which raises).

    Parameters
    ----------
    model : AdaptedModel
        The frozen copy of the user's module (its :attr:`~AdaptedModel.pristine`
        snapshot was taken when it was copied).
    shared_state : bool
        The negative-control mode (``allow_shared_state=True``): buffers may move.
    """

    def __init__(self, model: AdaptedModel, shared_state: bool = False) -> None:
        self.model = model
        self.shared_state = shared_state
        self.before = Snapshot()
        self.watch = _Watch()
        self.writes = _Writes({})

    def __enter__(self) -> Conformance:
        self.before = capture(self.model.module)
        storages = {**self.before.storages, **self.model.pristine.storages}
        self.writes = _Writes(storages)
        self.watch.armed = False  # S3T's own draws (probe adapters) are not the model's
        self.watch.__enter__()  # type: ignore[no-untyped-call]
        self.writes.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.writes.__exit__(*exc_info)  # type: ignore[no-untyped-call]
        self.watch.__exit__(*exc_info)  # type: ignore[no-untyped-call]

    @contextlib.contextmanager
    def _armed(self) -> Iterator[None]:
        """Record random draws (only the model's passes, not S3T's own code)."""
        self.watch.armed = self.writes.armed = True
        try:
            yield
        finally:
            self.watch.armed = self.writes.armed = False

    def run(
        self, x: Tensor, y: Tensor, rank: int, lr: float, rows: Tensor | None = None
    ) -> None:
        """The probe: two passes on ``x``, one over ``rows``, one training step.

        Raises
        ------
        ValueError
            The forward is random (names the call), at once.
        """
        model = self.model
        gen = torch.Generator().manual_seed(0)
        probe = model.fresh(model.targets, rank, gen)
        with self._armed(), torch.no_grad(), model.bound(probe):
            first = model.run(x)
            second = model.run(x)
            if rows is not None:
                for start in range(0, rows.shape[0], 256):
                    model.run(rows[start : start + 256])
        gap = _first_difference(first, second)
        random = sorted(set(self.watch.random)) or sorted(set(self.writes.random))
        if gap > 0 and not random:
            self.verdict()  # a forward that reads state it writes: name the state
        if random or gap > 0:
            cause = (
                f"its forward calls {random}"
                if random
                else "its forward is not a function of its input"
            )
            raise ValueError(
                f"model: two forward passes on the same batch differ (by up to "
                f"{gap:.3g}) or draw random numbers: {cause}. S3T's exact deletion "
                "needs a deterministic forward: pass training=self.training to "
                "functional dropout (F.dropout defaults to training=True) or use "
                "nn.Dropout, and draw no noise in forward"
            )
        adapters = {
            t: (a.clone().requires_grad_(True), b.clone().requires_grad_(True))
            for t, (a, b) in probe.items()
        }
        head = {
            n: t.detach().clone().requires_grad_(True)
            for n, t in model.base_head.items()
        }
        trained = [t for lora in adapters.values() for t in lora] + list(head.values())
        optimizer = torch.optim.Adam(trained, lr=lr)
        with self._armed(), model.bound(adapters, head):
            loss = F.cross_entropy(model.run(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        random = sorted(set(self.writes.random))
        if random:
            raise ValueError(
                f"model: its backward or a training step draws random numbers "
                f"({random}); S3T's exact deletion needs a deterministic step"
            )

    def verdict(self) -> None:
        """Raise ``ValueError`` naming the first state that was written or moved."""
        after = capture(self.model.module)
        kinds = {**self.model.pristine.kinds, **self.before.kinds, **after.kinds}
        exempt = {"buffer"} if self.shared_state else set()
        writes = {
            p: ops for p, ops in self.writes.writes.items() if kinds[p] not in exempt
        }
        if writes:
            path, ops = next(iter(writes.items()))
            updates = sorted(set(self.watch.updates))
            also = f", called from {updates}" if updates else ""
            raise ValueError(
                f"model: {kinds[path]} {path!r} of the frozen backbone is written in "
                f"place by {ops}{also} during S3T's probe (forward passes and a "
                f"training step; {len(writes)} tensor(s) written: "
                f"{list(writes)[:4]}). Every stage would write into state all "
                f"stages share, a leak across deletions: {_hint(ops)}"
            )
        own = _own_changes(self.model, after, kinds, exempt)
        if own:
            path = own[0]
            updates = sorted(set(self.watch.updates))
            also = f" (its forward calls {updates})" if updates else ""
            raise ValueError(
                f"model: {kinds[path]} {path!r} of the backbone changed{also} between "
                f"the copy S3T made and the end of its probe (forward passes and a "
                f"training step; {len(own)} change(s): {own[:4]}): the module keeps "
                "state outside S3T's records (a counter, a cache, a log of inputs, "
                f"an initialisation on first use), which deletion cannot erase and "
                f"which makes every stage depend on the ones before; {_INIT_HINT}"
            )
        shared = differences(self.before.shared, after.shared)
        if shared:
            path = shared[0]
            raise ValueError(
                f"model: {kinds[path]} {path!r} changed during S3T's probe "
                f"({len(shared)} change(s): {shared[:4]}): the forward, a hook or "
                "a function it calls keeps state outside the module (a global, a "
                "class attribute, a closure, a random generator), which deletion "
                "cannot erase and a retrained model would not start from; keep "
                "forward free of side effects"
            )


def _own_changes(
    model: AdaptedModel, after: Snapshot, kinds: Mapping[str, str], exempt: set[str]
) -> list[str]:
    """Paths of the copy's own state that moved since S3T made it, by kind.

    ``exempt`` kinds (``{"buffer"}`` in the shared-state negative control) may move.
    """
    moved = differences(model.pristine.own, after.own)
    return [p for p in moved if kinds.get(p) not in exempt]


def check_unchanged(
    model: AdaptedModel, operation: str, shared_state: bool = False
) -> None:
    """Refuse ``operation`` when the copy's own state moved since it was made.

    ``fit`` proved that nothing S3T runs moves it; a change after that (a write
    through ``model.backbone``) would make a retrained stage differ from a fresh
    fit's, so it is refused naming the state (buffers may move in the
    ``shared_state`` negative control).
    """
    after = capture(model.module)
    kinds = {**model.pristine.kinds, **after.kinds}
    moved = _own_changes(model, after, kinds, {"buffer"} if shared_state else set())
    if moved:
        raise ValueError(
            f"model: {kinds[moved[0]]} {moved[0]!r} of the backbone changed since "
            f"S3T copied it ({len(moved)} change(s): {moved[:4]}); {operation} "
            "would no longer equal a fresh fit: restore the backbone or fit again "
            "on a new S3T"
        )
