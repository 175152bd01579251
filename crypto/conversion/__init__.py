"""Bring your own transformer: convert a BERT-style classifier into HE-friendly form.

* :func:`convert` - a ``transformers`` ``BertForSequenceClassification`` to
  :class:`~crypto.conversion.model.HEBert` with a :class:`ConversionReport`; what
  the source computes is read from its installed modules
  (:mod:`~crypto.conversion.installed`) and the converted structure must reproduce
  it before any substitution (:mod:`~crypto.conversion.selfcheck`);
* :mod:`~crypto.conversion.model` - the converted model (Gaussian-kernel attention,
  polynomial LayerNorm, activation and pooler, LoRA on Q, K, V);
* :func:`expected_logit_error` - the encrypted logit error measured per depth and
  width, and :func:`uncertain` - predictions whose top-2 margin is below it;
* :func:`~crypto.conversion.distill.distill` recovers the accuracy the substitutions
  cost;
* :mod:`~crypto.conversion.tokenizer` - the user's tokenizer, built locally or
  loaded, and the fixed-length ids and mask a converted model takes.

Issue 41's layer 3: above the backend and the HEFormer (:mod:`crypto.models`),
below the encrypted program.
"""

from .bert import ConversionReport, Substitution, convert
from .error import expected_logit_error, uncertain
from .errors import ConversionError
from .model import HEBert, HEBertConfig
from .selfcheck import SelfCheck

__all__ = [
    "ConversionError",
    "ConversionReport",
    "HEBert",
    "HEBertConfig",
    "SelfCheck",
    "Substitution",
    "convert",
    "expected_logit_error",
    "uncertain",
]
