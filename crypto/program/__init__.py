"""The encrypted programs of every HE model family (issue 41, layer 4).

:mod:`~crypto.program.spec` describes a model family as a value (a
:class:`~crypto.program.spec.Program` of blocks and a head, built from the HEFormer's
or the converted BERT's public weights); :mod:`~crypto.program.forward` evaluates
any program on packed values, for inference or as a fine-tuning step's forward
pass, under the refresh policy of its :class:`~crypto.program.run.Run`
(:mod:`~crypto.program.run`), with an optional trace of activations;
:mod:`~crypto.program.blocks` and :mod:`~crypto.program.attention` hold its layers.

The rest of the layer: each family's public weights and secret factors
(:mod:`~crypto.program.heformer`, :mod:`~crypto.program.encoder`), the client's
packing of a converted model's inputs (:mod:`~crypto.program.inputs`), the one
backward pass of either family (:mod:`~crypto.program.backward`, the layers' backward
passes in :mod:`~crypto.program.layer_grad`) and the SGD steps
(:mod:`~crypto.program.sgd`, the function-call steps of :mod:`~crypto.program.steps`,
:mod:`~crypto.program.qkv_step`, :mod:`~crypto.program.head_step`), the public
update bounds every returned update passes (:mod:`~crypto.program.bounds`) and the
client's advisory range guard (:mod:`~crypto.program.shadow`). The program does not
know the protocol (:mod:`crypto.protocol`): the round trips it needs are parameters.
"""

from __future__ import annotations

from .attention import SoftmaxPolys, gk_attention, softmax_attention
from .backward import Trained, adapter_gradients, loss_gradient, train_forward
from .blocks import affine, layer_norm, mapped, project
from .forward import encode, forward
from .run import INFERENCE, TRAINING, Policy, Run, Trace
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
    "INFERENCE",
    "TRAINING",
    "Affine",
    "Block",
    "Head",
    "Norm",
    "Policy",
    "Program",
    "Run",
    "SoftmaxPolys",
    "Trace",
    "Trained",
    "adapter_gradients",
    "affine",
    "depth",
    "encode",
    "forward",
    "from_bert",
    "from_heformer",
    "gk_attention",
    "layer_norm",
    "loss_gradient",
    "mapped",
    "project",
    "softmax_attention",
    "train_forward",
]
