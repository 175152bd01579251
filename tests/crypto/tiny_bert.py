"""The corpus and length of the tiny converted BERT the encrypted-BERT tests share.

The fixtures ``tokenizer`` and ``converted`` (in ``tests/crypto/conftest.py``) are
a WordPiece tokenizer trained on :func:`texts` and a 2-layer ``transformers`` BERT
of width 8 with 2 heads, converted to :data:`N_TOKENS` tokens, its LoRA factors
made nonzero and its ranges calibrated on the same corpus.
"""

from __future__ import annotations

import numpy as np

from defense_suite.crypto.tasks import negation_texts

N_TOKENS = 6


def texts() -> list[str]:
    """The corpus: 60 generated three-word sentences and three short ones."""
    generated, _ = negation_texts(np.random.default_rng(0), 60, length=3)
    return [*generated, "good film", "not bad", "awful"]
