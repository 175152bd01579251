"""What the shield accepts, recognised without importing torch or SciPy.

``import defenses.ssd`` must stay light (torch alone takes about 1.5 s to import,
scikit-learn 1.2 s), yet the shield accepts tensors, torch modules and sparse
matrices. A caller who holds a tensor has imported torch, and one who holds a sparse
matrix has imported :mod:`scipy.sparse`, so the tests read :data:`sys.modules`: when
the module is not loaded, the value cannot be one of its types. :data:`OUTPUTS`
names what a wrapped model may return (checked before any wrapper is imported).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard

from defenses.checks import check_choice

if TYPE_CHECKING:
    import torch

OUTPUTS = ("auto", "probs", "logits", "log-probs")
"""What a wrapped model returns (``"auto"``: read it from the model)."""


def check_outputs(outputs: str) -> str:
    """Return ``outputs`` if it is one of :data:`OUTPUTS`, else raise ValueError."""
    return check_choice("outputs", outputs, OUTPUTS)


def loaded_torch() -> ModuleType | None:
    """The :mod:`torch` module if some code has imported it, else None."""
    return sys.modules.get("torch")


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a :class:`torch.Tensor` (False when torch is not loaded)."""
    torch_module = loaded_torch()
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def is_torch_dtype(value: object) -> TypeGuard[torch.dtype]:
    """Whether ``value`` is a :class:`torch.dtype` (False when torch is not loaded)."""
    torch_module = loaded_torch()
    return torch_module is not None and isinstance(value, torch_module.dtype)


def is_module(value: object) -> TypeGuard[torch.nn.Module]:
    """Whether ``value`` is a :class:`torch.nn.Module` (False without torch)."""
    torch_module = loaded_torch()
    return torch_module is not None and isinstance(value, torch_module.nn.Module)


def is_sparse(value: Any) -> bool:
    """Whether ``value`` is a SciPy sparse matrix or array (False without SciPy)."""
    sparse = sys.modules.get("scipy.sparse")
    return sparse is not None and bool(sparse.issparse(value))
