"""The user's tokenizer: a WordPiece vocabulary that is the same in every process.

``tokenizers``' own trainer gives a different vocabulary in each process
(huggingface/tokenizers #1794); :func:`~crypto.conversion.tokenizer.build_tokenizer`
learns its vocabulary itself (:func:`~crypto.conversion.tokenizer.
wordpiece_vocabulary`). The tests: two processes with different hash seeds agree,
the heap-driven merges equal a brute-force recount, the size is respected, every
corpus text (and any text of the corpus's characters) segments without ``[UNK]``,
and save / load keeps the ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import itertools

from defense_suite.crypto.conversion.tokenizer import (
    SPECIAL,
    build_tokenizer,
    wordpiece_vocabulary,
)
from defense_suite.crypto.tasks import negation_texts

ROOT = Path(__file__).resolve().parents[2]
MIXED = [
    "Héllo, WORLD! it's 12.5% off -- naïve café",
    "中文 text, 日本語; ÜBER straße",
    "#hash ##tags and [brackets] (parens)",
    "aaaa aaa aa a abab baba",
]
"""Accents, CJK, punctuation, ``#`` and repeated letters (overlapping pairs)."""

WORDS = st.text(alphabet="abcde#é中", min_size=1, max_size=7)
CORPORA = st.lists(
    st.lists(WORDS, min_size=1, max_size=5).map(" ".join), min_size=1, max_size=12
)

_PRINT = """
import json, sys
from defense_suite.crypto.conversion.tokenizer import build_tokenizer
corpus = json.loads(sys.stdin.read())
print(json.dumps(build_tokenizer(corpus, vocab_size=150).get_vocab(), sort_keys=True))
"""


def _corpus() -> list[str]:
    generated, _ = negation_texts(np.random.default_rng(3), 80, length=5)
    return [*generated, *MIXED]


def _words(tokenizer: Any, text: str) -> list[str]:
    """The normalized, pre-tokenized words of ``text``, as the tokenizer splits."""
    backend = tokenizer.backend_tokenizer
    normal = backend.normalizer.normalize_str(text)
    return [w for w, _ in backend.pre_tokenizer.pre_tokenize_str(normal)]


def _joined(tokens: list[str]) -> list[str]:
    """Words from WordPiece tokens: a ``##`` token continues the word before it."""
    words: list[str] = []
    for token in tokens:
        if token.startswith("##") and words:
            words[-1] += token[2:]
        else:
            words.append(token)
    return words


def _reference(counts: dict[str, int], vocab_size: int) -> list[str]:
    """The merge rule recounted from scratch at every step (no heap, no index)."""
    chars = sorted({c for w in counts for c in w})
    vocab = [*SPECIAL, *chars, *("##" + c for c in chars)]
    words = {w: [w[0], *("##" + c for c in w[1:])] for w in counts}
    while len(vocab) < vocab_size:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, pieces in words.items():
            for pair in itertools.pairwise(pieces):
                pairs[pair] += counts[w]
        if not pairs:
            return vocab
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        token = a + b[2:]
        vocab += [token] if token not in vocab else []
        for w, pieces in words.items():
            out, i = [], 0
            while i < len(pieces):
                if pieces[i : i + 2] == [a, b]:
                    out.append(token)
                    i += 2
                else:
                    out.append(pieces[i])
                    i += 1
            words[w] = out
    return vocab


def test_two_processes_with_different_hash_seeds_agree() -> None:
    corpus = _corpus()
    here = build_tokenizer(corpus, vocab_size=150).get_vocab()
    seen = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "TOKENIZERS_PARALLELISM": "true"}
        run = subprocess.run(
            [sys.executable, "-c", _PRINT],
            input=json.dumps(corpus),
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
            timeout=120,
            check=True,
        )
        seen.append(json.loads(run.stdout))
    assert seen[0] == seen[1] == here
    assert len(here) == 150  # merges left at 150: the tie-breaks were exercised


@settings(max_examples=40)
@given(corpus=CORPORA, extra=st.integers(0, 40))
def test_merges_equal_a_brute_force_recount(corpus: list[str], extra: int) -> None:
    counts = Counter(w for text in corpus for w in text.split())
    alphabet = 2 * len({c for w in counts for c in w})
    size = len(SPECIAL) + alphabet + extra
    assert wordpiece_vocabulary(dict(counts), size) == _reference(dict(counts), size)
    # the vocabulary depends on the word counts, not on the corpus's order
    shuffled = dict(sorted(counts.items(), reverse=True))
    assert wordpiece_vocabulary(shuffled, size) == _reference(dict(counts), size)


@pytest.mark.parametrize("vocab_size", [93, 120, 150, 400])
def test_vocabulary_size_is_respected(vocab_size: int) -> None:
    tokenizer = build_tokenizer(_corpus(), vocab_size=vocab_size)
    vocab = tokenizer.get_vocab()
    assert len(tokenizer) == len(vocab) <= vocab_size
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert [vocab[s] for s in SPECIAL] == [0, 1, 2, 3, 4]
    assert tokenizer.pad_token_id == 0
    if vocab_size <= 150:  # merges are left at 150 (the subprocess test's corpus)
        assert len(vocab) == vocab_size


def test_too_small_a_vocabulary_is_refused_naming_the_minimum() -> None:
    # "ab ba": a, b, ##a, ##b and the five special tokens
    assert len(build_tokenizer(["ab ba"], vocab_size=9)) == 9
    with pytest.raises(ValueError, match=r"vocab_size=8 .* vocab_size >= 9"):
        build_tokenizer(["ab ba"], vocab_size=8)
    with pytest.raises(ValueError, match="corpus"):
        build_tokenizer(["fine", 3])  # type: ignore[list-item]


@settings(max_examples=25)
@given(corpus=CORPORA, extra=st.integers(0, 30), probe=st.lists(WORDS, max_size=6))
def test_corpus_and_its_alphabet_never_map_to_unk(
    corpus: list[str], extra: int, probe: list[str]
) -> None:
    alphabet = 2 * len(set("".join(corpus).replace(" ", "").lower()))
    tokenizer = build_tokenizer(corpus, vocab_size=len(SPECIAL) + alphabet + extra)
    chars = set("".join(corpus).replace(" ", "").lower())
    # any text over the corpus's characters (any order), the corpus itself first
    probes = [*corpus, " ".join("".join(c for c in w if c in chars) for w in probe)]
    for text in probes:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.unk_token_id not in ids, text
        tokens = tokenizer.convert_ids_to_tokens(ids)
        assert tokens[0] == "[CLS]"
        assert tokens[-1] == "[SEP]"
        assert _joined(tokens[1:-1]) == _words(tokenizer, text)


def test_mixed_corpus_round_trips_without_unk() -> None:
    corpus = _corpus()
    tokenizer = build_tokenizer(corpus, vocab_size=150)
    for text in corpus:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])
        assert "[UNK]" not in tokens, text
        assert _joined(tokens[1:-1]) == _words(tokenizer, text)
    # a character the corpus never had is the one thing that maps to [UNK]
    assert tokenizer.unk_token_id in tokenizer("zebra ☃")["input_ids"]
    assert tokenizer.unk_token_id not in tokenizer("tea")["input_ids"]


def test_save_and_load_keep_the_vocabulary_and_ids(tmp_path: Path) -> None:
    import transformers

    corpus = _corpus()
    tokenizer = build_tokenizer(corpus, vocab_size=150)
    tokenizer.save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    again = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert loaded.get_vocab() == again.get_vocab() == tokenizer.get_vocab()
    for other in (loaded, again):
        assert other(corpus)["input_ids"] == tokenizer(corpus)["input_ids"]
        assert (other.pad_token_id, other.cls_token_id) == (0, 2)
        pair = other("good film", "not bad", return_token_type_ids=True)
        assert pair["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]
    assert tokenizer.decode(tokenizer("Not BAD, naïve!")["input_ids"][1:-1]) == (
        "not bad, naive!"
    )
