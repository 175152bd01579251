"""Text in: the user's tokenizer, built locally or loaded from disk, checked.

* :func:`build_tokenizer` learns a WordPiece vocabulary from the user's corpus
  (:func:`wordpiece_vocabulary`: deterministic, the same in every process; nothing
  downloads), builds the ``tokenizers`` pipeline around it and wraps it as a
  ``transformers.PreTrainedTokenizerFast`` (``save_pretrained`` /
  ``from_pretrained`` of a local folder work as for any tokenizer);
* :func:`encode` turns texts into the fixed-length token ids and attention mask of
  a converted :class:`~crypto.conversion.model.HEBert`, refusing a tokenizer whose
  vocabulary does not fit the embedding and texts longer than the converted length
  (never truncating silently).

``tokenizers`` and ``transformers`` are imported only when called.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from defenses.checks import check_int

from .model import HEBert

logger = logging.getLogger(__name__)

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_tokenizer(corpus: Iterable[str], vocab_size: int = 1000) -> Any:
    """A BERT-style WordPiece tokenizer learnt from ``corpus``, as a fast tokenizer.

    Lower-cases and splits like BERT (``BertNormalizer(lowercase=True)``,
    ``BertPreTokenizer``), adds ``[CLS] ... [SEP]``; the special tokens are ids 0-4
    (``[PAD]`` = 0, BERT's ``pad_token_id``). The vocabulary is a function of the
    corpus and ``vocab_size`` alone (:func:`wordpiece_vocabulary`): the same in every
    process, whatever ``PYTHONHASHSEED``. It is not learnt with ``tokenizers``'
    ``WordPieceTrainer``, whose continuing-subword ids follow hash-map iteration
    order and break ties between equal-count merges, so its vocabulary changes from
    one process to the next (huggingface/tokenizers issue #1794, PR #2066).

    Raises
    ------
    ValueError
        If the corpus is empty or holds a non-str, or ``vocab_size`` cannot hold the
        five special tokens and the corpus's alphabet (both forms of every
        character).
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
    )
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: dict[str, int] = {}
    for text in texts:
        for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)):
            counts[word] = counts.get(word, 0) + 1
    vocab = wordpiece_vocabulary(counts, vocab_size)
    longest = max((len(w) for w in counts), default=0)
    tok = Tokenizer(
        models.WordPiece(
            {token: i for i, token in enumerate(vocab)},
            unk_token="[UNK]",
            max_input_chars_per_word=max(100, longest),
        )
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece()
    cls, sep = SPECIAL.index("[CLS]"), SPECIAL.index("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    logger.debug("WordPiece: %d words, %d tokens", len(counts), len(vocab))
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def wordpiece_vocabulary(counts: Mapping[str, int], vocab_size: int) -> list[str]:
    """The WordPiece vocabulary of words with counts, in id order, deterministically.

    The BPE merge procedure ``tokenizers``' WordPiece trainer runs, with a total
    order on every choice:

    1. The alphabet ``A``: every character ``c`` of the words, both as a word-initial
       token ``c`` and as a continuation ``##c`` (so any word of the corpus's
       characters, at any position, has a segmentation without ``[UNK]``). The
       vocabulary starts as :data:`SPECIAL`, then ``sorted(c)``, then
       ``sorted(##c)``; ``len(SPECIAL) + len(A) > vocab_size`` is a ``ValueError``.
    2. Each word ``w`` with count ``n(w)`` is split into ``w[0], ##w[1], ...``. The
       count of an adjacent pair is ``N(a, b) = sum_w n(w) * #{(a, b) in w}``.
    3. Repeat while the vocabulary is smaller than ``vocab_size`` and a pair is
       left: merge the pair that comes first in the order (``-N(a, b)``, ``a``,
       ``b``) (highest count; ties by the pair's strings, code point order) in
       every word, left to right, into ``a + b[2:]`` (``b`` without ``##``), and
       append that token if it is new.

    No step reads a hash order (pairs are kept in a heap keyed by that order, words
    in sorted order), so the result is the same in every process. Words are
    processed once per merge that touches them (the pairs' word lists).
    """
    chars = sorted({c for word in counts for c in word})
    vocab = [*SPECIAL, *chars, *("##" + c for c in chars)]
    if len(vocab) > vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} cannot hold the {len(SPECIAL)} special tokens "
            f"and this corpus's {2 * len(chars)} alphabet tokens ({len(chars)} "
            f"characters, word-initial and ##): give vocab_size >= {len(vocab)}"
        )
    known = set(vocab)
    words = sorted(counts)
    pieces = [[w[0], *("##" + c for c in w[1:])] for w in words]
    pairs: dict[tuple[str, str], int] = {}
    where: dict[tuple[str, str], set[int]] = {}

    def count(i: int, sign: int) -> set[tuple[str, str]]:
        word = pieces[i]
        for pair in pairwise(word):
            pairs[pair] = pairs.get(pair, 0) + sign * counts[words[i]]
            where.setdefault(pair, set()).add(i)
        return set(pairwise(word))

    for i in range(len(words)):
        count(i, 1)
    heap = [(-n, a, b) for (a, b), n in pairs.items()]
    heapq.heapify(heap)
    while heap and len(vocab) < vocab_size:
        n, a, b = heapq.heappop(heap)
        now = pairs.get((a, b), 0)
        if now != -n:  # a stale entry: the count went down since it was pushed
            if now > 0:
                heapq.heappush(heap, (-now, a, b))
            continue
        token = a + b[2:]
        if token not in known:
            known.add(token)
            vocab.append(token)
        touched: set[tuple[str, str]] = set()
        for i in sorted(where.pop((a, b))):
            touched |= count(i, -1)
            pieces[i] = _merge(pieces[i], a, b, token)
            touched |= count(i, 1)
        for pair in sorted(touched):
            if pairs[pair] > 0:
                heapq.heappush(heap, (-pairs[pair], *pair))
    return vocab


def _merge(word: list[str], a: str, b: str, token: str) -> list[str]:
    """``word`` with every ``a, b`` (left to right, not overlapping) made ``token``."""
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(token)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


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
