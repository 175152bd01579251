"""Convert a ``transformers`` BERT-style sequence classifier into :class:`HEBert`.

The source is read module by module. Every module must be one the converter knows
(BERT's embeddings, self-attention, outputs, intermediate, pooler, classifier and
their ``nn`` leaves); anything else, a causal decoder, cross-attention, rotary or
relative positions, or a head other than BERT's pooler + classifier is refused,
naming the module. ``transformers`` is imported only when a model is converted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy.typing as npt
import torch
from torch import nn

from defenses.checks import check_int

from ..he.approx import depth_of
from .errors import ConversionError
from .functions import SourceFunctions
from .installed import check_installed, check_norms
from .model import HEBert, HEBertConfig
from .selfcheck import SelfCheck, check_faithful

logger = logging.getLogger(__name__)

BERT, ROBERTA = "BertForSequenceClassification", "RobertaForSequenceClassification"
ATTENTION = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", None)
"""Attention implementations that compute softmax(q k^T / sqrt(d_h) + mask) v."""
POSITIONAL = ("rope_theta", "rotary_dim", "rotary_emb_base", "relative_attention")


@dataclass(frozen=True)
class Substitution:
    """One replaced or kept function of the source model.

    Parameters
    ----------
    where : str
        The source modules, as ``named_modules`` names them (``*`` for every layer).
    source : str
        What the source computes there.
    replacement : str
        What the converted model computes instead.
    depth : int
        CKKS levels the replacement's polynomial consumes (0: no polynomial).
    """

    where: str
    source: str
    replacement: str
    depth: int = 0


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert` did: the source, the converted shape, every substitution."""

    source: str
    config: HEBertConfig
    substitutions: tuple[Substitution, ...]
    copied: tuple[str, ...]
    check: SelfCheck | None = None

    def __str__(self) -> str:
        lines = [f"converted {self.source} -> HEBert ({self.config.n_layers} layers)"]
        for s in self.substitutions:
            levels = f" [{s.depth} levels]" if s.depth else ""
            lines.append(f"  {s.where}: {s.source} -> {s.replacement}{levels}")
        lines.append(f"  copied unchanged: {len(self.copied)} tensors")
        absent = [name for name in self.copied if "(absent" in name]
        if absent:
            lines.append(f"  absent in the source, filled: {', '.join(absent)}")
        if self.check is not None:
            lines.append(f"  {self.check}")
        return "\n".join(lines)


def _parts(src: Any) -> tuple[str, Any]:
    """The base model's attribute name and its encoder layers."""
    base = "roberta" if type(src).__name__ == ROBERTA else "bert"
    return base, getattr(src, base).encoder.layer


def _head(src: Any, base: str) -> tuple[nn.Linear, nn.Linear]:
    """The tanh layer and the classifier (BERT's pooler, RoBERTa's head)."""
    if base == "bert":
        return src.bert.pooler.dense, src.classifier
    return src.classifier.dense, src.classifier.out_proj


def _check_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    kind = type(model).__name__
    if config is None or kind not in (BERT, ROBERTA):
        raise ConversionError(
            f"cannot convert a {kind}: convert() takes a transformers "
            f"{BERT} or {ROBERTA} (built from a config, loaded with "
            "from_pretrained, or in memory)"
        )
    if getattr(config, "is_decoder", False) or getattr(
        config, "add_cross_attention", False
    ):
        raise ConversionError(
            "cannot convert bert.encoder.layer.*.attention: the model is a causal "
            "decoder (is_decoder / add_cross_attention); HE conversion takes encoders"
        )
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ATTENTION:
        raise ConversionError(
            f"cannot convert the attention: implementation {attention!r} (known: "
            f"{ATTENTION[:-1]}); a custom one may not compute softmax attention"
        )
    position = getattr(config, "position_embedding_type", "absolute")
    if position != "absolute":
        raise ConversionError(
            f"cannot convert bert.embeddings.position_embeddings: position encoding "
            f"{position!r} (only absolute positions are converted)"
        )
    for attr in POSITIONAL:
        if getattr(config, attr, None) not in (None, False, 0):
            raise ConversionError(
                f"cannot convert the attention: config.{attr} (rotary or relative "
                "positions) is set; only absolute positions are converted"
            )
    if getattr(config, "num_labels", 0) < 2 or config.problem_type not in (
        None,
        "single_label_classification",
    ):
        raise ConversionError(
            f"cannot convert classifier: num_labels={config.num_labels}, problem_type="
            f"{config.problem_type!r}; single-label classification with >= 2 classes"
        )
    return config


def _copy(
    target: torch.Tensor,
    source: torch.Tensor | None,
    name: str,
    copied: list[str],
    absent: float = 0.0,
) -> None:
    """Copy ``source`` into ``target``, or fill it with ``absent``.

    A source without the tensor (a LayerNorm without affine parameters, a Linear
    without bias) gives ``absent`` everywhere (1 for a gain, 0 for a bias).
    """
    if source is not None and tuple(source.shape) != tuple(target.shape):
        raise ConversionError(
            f"cannot convert {name}: shape {tuple(source.shape)}, where the "
            f"converted model (read from the first block) has {tuple(target.shape)}"
        )
    with torch.no_grad():
        if source is None:
            target.fill_(absent)
        else:
            target.copy_(source.detach().to(torch.float64))
    copied.append(name if source is not None else f"{name} (absent: {absent})")


def _shape(src: Any, base: str, encoder: Any, config: Any) -> dict[str, int]:
    """The converted model's shape, read from the installed modules."""
    emb = getattr(src, base).embeddings
    vocab, d = emb.word_embeddings.weight.shape
    _, classifier = _head(src, base)
    return {
        "vocab_size": int(vocab),
        "d": int(d),
        "heads": int(encoder[0].attention.self.num_attention_heads),
        "ffn": int(encoder[0].intermediate.dense.weight.shape[0]),
        "n_layers": len(encoder),
        "n_classes": int(classifier.weight.shape[0]),
        "type_vocab_size": int(emb.token_type_embeddings.weight.shape[0]),
    }


def convert(
    model: nn.Module,
    n_tokens: int,
    rank: int = 2,
    activation: str = "relu",
    generator: torch.Generator | None = None,
    check_ids: npt.ArrayLike | None = None,
    check_mask: npt.ArrayLike | None = None,
    **degrees: int,
) -> tuple[HEBert, ConversionReport]:
    """The HE-friendly form of a BERT sequence classifier, and what was substituted.

    Parameters
    ----------
    model : transformers.BertForSequenceClassification
        The user's model (from a config, ``from_pretrained`` of a local folder, or
        in memory); it is read, never changed.
    n_tokens : int
        The fixed sequence length of the converted model (<= the source's
        ``max_position_embeddings``); the encrypted schedule packs this many tokens.
    rank : int
        LoRA rank on Q, K and V.
    activation : {"relu", "gelu"}
        The feed-forward function the polynomial fits: ReLU (the paper) or GELU.
    generator : torch.Generator, optional
        Draws the LoRA ``A`` factors (``B`` = 0, so the converted model starts with
        exactly the source weights).
    check_ids, check_mask : array, optional
        Sequences (n, n_tokens) for the self-check (default: 16 random ones):
        the converted structure run with the source's own functions must
        reproduce the source's outputs on them, layer by layer
        (:mod:`~crypto.conversion.selfcheck`).
    **degrees
        ``gk_degree``, ``isqrt_degree``, ``act_degree``, ``tanh_degree``,
        ``newton_steps`` of :class:`HEBertConfig`.

    Returns
    -------
    HEBert, ConversionReport
        The converted model (calibrate it, or :func:`~crypto.conversion.distill.distill`
        it, before polynomial use) and the report of every substitution.

    Raises
    ------
    ConversionError
        Naming the layer or setting that cannot be converted: what the installed
        modules compute is read from them, not from the config
        (:mod:`~crypto.conversion.installed`), and the self-check names the first
        source module whose output the conversion does not reproduce.
    """
    if not isinstance(model, nn.Module):
        raise ConversionError(
            f"cannot convert a {type(model).__name__}: convert() takes a transformers "
            "BertForSequenceClassification"
        )
    config = _check_config(model)
    src: Any = model
    base, encoder = _parts(src)
    shape = _shape(src, base, encoder, config)
    functions = check_installed(model, base, encoder, shape["d"] // shape["heads"])
    eps = check_norms(model, shape["d"])
    roberta = type(model).__name__ == ROBERTA
    top = int(config.max_position_embeddings) - (
        config.pad_token_id + 1 if roberta else 0
    )
    check_int("n_tokens", n_tokens, 2, top)
    c = HEBertConfig(
        n_tokens=n_tokens,
        rank=rank,
        activation=activation,
        layer_norm_eps=eps,
        position_padding_idx=config.pad_token_id if roberta else None,
        **shape,
        **degrees,
    )
    out = HEBert(c, generator or torch.Generator().manual_seed(0))
    copied: list[str] = []
    emb = getattr(src, base).embeddings
    rows = out.position_embeddings.shape[0]
    tensors: list[tuple[torch.Tensor, torch.Tensor | None, str]] = [
        (out.word_embeddings.weight, emb.word_embeddings.weight, "word_embeddings"),
        (out.position_embeddings, emb.position_embeddings.weight[:rows], "position"),
        (out.token_type_embeddings.weight, emb.token_type_embeddings.weight, "type"),
        (out.embedding_norm.weight, emb.LayerNorm.weight, "LayerNorm.weight"),
        (out.embedding_norm.bias, emb.LayerNorm.bias, "LayerNorm.bias"),
    ]
    for target, source, name in tensors:
        unit = 1.0 if name == "LayerNorm.weight" else 0.0
        _copy(target, source, f"{base}.embeddings.{name}", copied, unit)
    for i, (layer, theirs) in enumerate(zip(out.block_list(), encoder, strict=True)):
        pairs = {
            "query": theirs.attention.self.query,
            "key": theirs.attention.self.key,
            "value": theirs.attention.self.value,
            "attention_dense": theirs.attention.output.dense,
            "attention_norm": theirs.attention.output.LayerNorm,
            "intermediate": theirs.intermediate.dense,
            "output_dense": theirs.output.dense,
            "output_norm": theirs.output.LayerNorm,
        }
        for mine, module in pairs.items():
            for part in ("weight", "bias"):
                where = f"{base}.encoder.layer.{i}.{mine}.{part}"
                unit = 1.0 if "norm" in mine and part == "weight" else 0.0
                _copy(
                    getattr(getattr(layer, mine), part),
                    getattr(module, part),
                    where,
                    copied,
                    unit,
                )
    pooler, classifier = _head(src, base)
    for part in ("weight", "bias"):
        _copy(
            getattr(out.pooler, part), getattr(pooler, part), f"pooler.{part}", copied
        )
        _copy(
            getattr(out.classifier, part),
            getattr(classifier, part),
            f"classifier.{part}",
            copied,
        )
    report = ConversionReport(
        type(model).__name__,
        c,
        _substitutions(c, base, functions),
        tuple(copied),
        check_faithful(model, out, functions, base, check_ids, check_mask),
    )
    logger.info("%s", report)
    return out, report


def _substitutions(
    c: HEBertConfig, base: str, functions: SourceFunctions
) -> tuple[Substitution, ...]:
    layers = f"{base}.encoder.layer.*"
    return (
        Substitution(
            f"{base}.embeddings",
            "word + position + token type, LayerNorm",
            "the same, exact, on the client (type 0)",
        ),
        Substitution(
            f"{layers}.attention.self",
            "softmax(q k^T / sqrt(d_h)) with additive mask",
            "Gaussian kernel exp(-|q - k|^2 / (2 sqrt(d_h))), a Chebyshev fit on "
            "[0, D], times the mask divided by the attended length",
            depth_of(c.gk_degree),
        ),
        Substitution(
            f"{layers}.attention.self.{{query,key,value}}",
            "Linear",
            f"Linear + LoRA rank {c.rank} (B = 0)",
        ),
        Substitution(
            f"{layers}.attention.output.LayerNorm",
            "LayerNorm",
            f"polynomial LayerNorm: 1/sqrt(var/div) by a degree-{c.isqrt_degree} "
            f"fit on [a, 1] and {c.newton_steps} Newton steps",
            depth_of(c.isqrt_degree) + 3 * c.newton_steps,
        ),
        Substitution(
            f"{layers}.intermediate.intermediate_act_fn",
            functions.describe_activations(),
            f"degree-{c.act_degree} Chebyshev fit of {c.activation} on [-B, B]",
            depth_of(c.act_degree),
        ),
        Substitution(
            f"{layers}.output.LayerNorm",
            "LayerNorm",
            "polynomial LayerNorm (as above)",
            depth_of(c.isqrt_degree) + 3 * c.newton_steps,
        ),
        Substitution(
            "pooler tanh" if base == "bert" else "classifier.dense tanh",
            "tanh",
            f"degree-{c.tanh_degree} Chebyshev fit of tanh on [-B, B]",
            depth_of(c.tanh_degree),
        ),
        Substitution(
            "dropout (every layer)",
            "Dropout",
            "removed (inference form; distillation trains without it)",
        ),
    )
