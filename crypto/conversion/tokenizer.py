"""Text in: the user's tokenizer, built locally or loaded from disk, checked.

* :func:`build_tokenizer` trains a WordPiece tokenizer with the ``tokenizers``
  library on the user's corpus (nothing downloads) and wraps it as a
  ``transformers.PreTrainedTokenizerFast`` (``save_pretrained`` /
  ``from_pretrained`` of a local folder work as for any tokenizer);
* :func:`encode` turns texts into the fixed-length token ids and attention mask of
  a converted :class:`~crypto.conversion.model.HEBert`, refusing a tokenizer whose
  vocabulary does not fit the embedding and texts longer than the converted length
  (never truncating silently).

``tokenizers`` and ``transformers`` are imported only when called.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int

from .model import HEBert

logger = logging.getLogger(__name__)

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1000) -> Any:
    """A BERT-style WordPiece tokenizer trained on ``corpus``, as a fast tokenizer.

    Lower-cases and splits like BERT, adds ``[CLS] ... [SEP]``; the special tokens
    are ids 0-4 (``[PAD]`` = 0, BERT's ``pad_token_id``).
    """
    check_int("vocab_size", vocab_size, len(SPECIAL) + 1)
    texts = list(corpus)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("corpus: give at least one text, every item a str")
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def encode(
    tokenizer: Any, texts: Sequence[str], model: HEBert | int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Token ids and attention mask, shape (len(texts), n_tokens), padded.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Any tokenizer with ``__call__`` and ``pad_token_id`` (the user's).
    texts : sequence of str
        The texts to encode.
    model : HEBert or int
        The converted model (its ``n_tokens`` and vocabulary are checked), or a
        sequence length alone (to encode for the original model).

    Raises
    ------
    ValueError
        If the tokenizer's vocabulary is larger than the model's embedding, it has
        no padding token, or a text needs more than ``n_tokens`` tokens.
    """
    if isinstance(model, HEBert):
        n_tokens, rows = model.config.n_tokens, model.config.vocab_size
        size = len(tokenizer)
        if size > rows:
            raise ValueError(
                f"tokenizer: {size} tokens, but the model's embedding has {rows} rows:"
                " this tokenizer does not match the model (use the tokenizer it was "
                "trained with)"
            )
    else:
        n_tokens = check_int("n_tokens", model, 2)
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise TypeError("texts must be a sequence of str")
    if not texts:
        raise ValueError("texts is empty: give at least one text")
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("tokenizer: no padding token (set tokenizer.pad_token)")
    encoded = tokenizer(list(texts), truncation=False, padding=False)["input_ids"]
    ids = np.full((len(texts), n_tokens), int(pad), dtype=np.int64)
    mask = np.zeros((len(texts), n_tokens), dtype=np.int64)
    for row, tokens in enumerate(encoded):
        if len(tokens) > n_tokens:
            raise ValueError(
                f"texts[{row}]: {len(tokens)} tokens, longer than the converted "
                f"length n_tokens={n_tokens} (shorten it or convert with a longer "
                "n_tokens)"
            )
        ids[row, : len(tokens)] = tokens
        mask[row, : len(tokens)] = 1
    return ids, mask
