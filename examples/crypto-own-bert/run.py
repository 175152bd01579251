"""Your own BERT under CKKS: convert, distil, encrypt, one encrypted LoRA step.

A ``transformers`` BERT that no test of the suite builds (width 12, 3 heads, 2
layers, FFN 24), its own WordPiece tokenizer trained on its own generated corpus
(fruit vs tool sentences), trained as usual with AdamW; then
``defense_suite.crypto.convert`` and ``distill``; encrypted inference of one packed
batch over :class:`~crypto.protocol.transport.Loopback` (the server in another process),
checked against the converted model's plaintext argmax; and, with ``--step``, one
encrypted step of the last block's Q/K/V LoRA factors over Loopback, checked
against ``torch`` autograd. About 1.5 min without ``--step``, 4 min with it, on
2 cores::

    python examples/crypto-own-bert/run.py [--step]
"""

import argparse
import time

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification

from defense_suite.crypto import convert
from defense_suite.crypto.conversion.distill import DistillConfig, distill
from defense_suite.crypto.conversion.tokenizer import build_tokenizer, encode
from defense_suite.crypto.he.ckks import INTERACTIVE, INTERACTIVE_WIDE
from defense_suite.crypto.program.qkv_step import reference_qkv_step
from defense_suite.crypto.protocol import BertTuningClient, BertTuningServer, QKVJob
from defense_suite.crypto.protocol.encoder_client import BertClient
from defense_suite.crypto.protocol.transport import Loopback

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--step", action="store_true", help="also one encrypted LoRA step")
args = parser.parse_args()

rng = np.random.default_rng(7)
fruit = ["apple", "pear", "plum", "fig", "kiwi", "lime"]
tools = ["hammer", "saw", "drill", "wrench", "chisel", "file"]
filler = ["the", "a", "my", "one", "this", "red", "old", "big"]
texts, labels = [], []
for _ in range(1400):
    y = int(rng.integers(2))
    words = list(rng.choice(filler, 4)) + list(rng.choice(fruit if y else tools, 2))
    rng.shuffle(words)
    texts.append(" ".join(words))
    labels.append(y)
labels = np.array(labels)
tok = build_tokenizer(texts[:1000], vocab_size=120)
cfg = BertConfig(
    vocab_size=len(tok),
    hidden_size=12,
    num_hidden_layers=2,
    num_attention_heads=3,
    intermediate_size=24,
    max_position_embeddings=16,
    num_labels=2,
)
torch.manual_seed(7)
model = BertForSequenceClassification(cfg)
n_tokens = 8
ids_all, mask_all = encode(tok, texts, n_tokens)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
X, M, Y = map(torch.as_tensor, (ids_all[:1000], mask_all[:1000], labels[:1000]))
model.train()
for _epoch in range(20):
    for i in range(0, 1000, 50):
        out = model(
            input_ids=X[i : i + 50], attention_mask=M[i : i + 50], labels=Y[i : i + 50]
        )
        opt.zero_grad()
        out.loss.backward()
        opt.step()
model.eval()
he, report = convert(model, n_tokens=n_tokens)
ids, mask = encode(tok, texts, he)
res = distill(
    he,
    model,
    ids[:1000],
    labels[:1000],
    mask[:1000],
    DistillConfig(epochs=6),
    evaluation=(ids[1000:], labels[1000:], mask[1000:]),
)
print(
    "accuracy original / converted / distilled:",
    res.original_accuracy,
    res.before_accuracy,
    res.after_accuracy,
)
test_ids, test_mask, test_y = ids[1000:1400], mask[1000:1400], labels[1000:1400]
keep = ~he.out_of_range(test_ids, test_mask)
k = min(int(keep.sum()), INTERACTIVE.slots // n_tokens)
test_ids, test_mask, test_y = test_ids[keep][:k], test_mask[keep][:k], test_y[keep][:k]
plain = he.predict_logits(test_ids, test_mask)
client = BertClient(he, INTERACTIVE)
t = time.perf_counter()
with Loopback.for_model(he, INTERACTIVE) as server:
    enc = client.predict(server, test_ids, mask=test_mask)
agree = np.mean(enc.argmax(1) == plain.argmax(1))
print(
    f"encrypted batch of {k}: {time.perf_counter() - t:.1f} s; "
    f"argmax equal to the converted model's: {agree:.4f}; "
    f"max |logit error| {np.abs(enc - plain).max():.2e}; "
    f"encrypted accuracy {np.mean(enc.argmax(1) == test_y):.4f}"
)
assert (enc.argmax(1) == plain.argmax(1)).all()
if args.step:
    y2 = test_y[:2].astype(np.int64)
    ref = reference_qkv_step(he, test_ids[:2], y2, 0.1, test_mask[:2])
    tuner = BertTuningClient(he, INTERACTIVE_WIDE)
    t = time.perf_counter()
    with Loopback(server=BertTuningServer(QKVJob.public(he), INTERACTIVE_WIDE)) as ch:
        got = tuner.step(ch, test_ids[:2], y2, 0.1, test_mask[:2])
    err = max(float(np.abs(got.factors[n] - ref.factors[n]).max()) for n in ref.factors)
    print(
        f"encrypted Q/K/V LoRA step over Loopback (last block, 2 sequences): "
        f"{time.perf_counter() - t:.1f} s; max update error vs autograd {err:.2e}"
    )
    assert err < 1e-3
