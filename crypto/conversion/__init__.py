"""Bring your own transformer: convert a BERT-style classifier into HE-friendly form.

* :func:`convert` - a ``transformers`` ``BertForSequenceClassification`` to
  :class:`~crypto.conversion.model.HEBert` with a :class:`ConversionReport`;
* :mod:`~crypto.conversion.model` - the converted model (Gaussian-kernel attention,
  polynomial LayerNorm, activation and pooler, LoRA on Q, K, V);
* :func:`~crypto.distill.distill` recovers the accuracy the substitutions cost.
"""

from .bert import ConversionReport, Substitution, convert
from .errors import ConversionError
from .model import HEBert, HEBertConfig

__all__ = [
    "ConversionError",
    "ConversionReport",
    "HEBert",
    "HEBertConfig",
    "Substitution",
    "convert",
]
