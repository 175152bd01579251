"""The encrypted programs of every HE model family (issue 41, layer 4).

:mod:`~crypto.program.spec` describes a model family as a value (a
:class:`~crypto.program.spec.Program` of blocks and a head, built from the HEFormer's
or the converted BERT's public weights); :mod:`~crypto.program.forward` evaluates
any program on packed values, with an optional trace of activations;
:mod:`~crypto.program.blocks` and :mod:`~crypto.program.attention` hold its layers.
"""

from __future__ import annotations

from .attention import SoftmaxPolys, gk_attention, softmax_attention
from .blocks import affine, layer_norm, mapped, project
from .forward import Run, Trace, encode, forward
from .spec import (
    Affine,
    Block,
    Head,
    Norm,
    Program,
    depth,
    from_bert,
    from_heformer,
)

__all__ = [
    "Affine",
    "Block",
    "Head",
    "Norm",
    "Program",
    "Run",
    "SoftmaxPolys",
    "Trace",
    "affine",
    "depth",
    "encode",
    "forward",
    "from_bert",
    "from_heformer",
    "gk_attention",
    "layer_norm",
    "mapped",
    "project",
    "softmax_attention",
]
