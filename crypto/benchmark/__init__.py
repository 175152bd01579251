"""Measurement benchmarks of the HE package (timings and sweeps, not games).

* :mod:`~crypto.benchmark.attention` - ``crypto-attention``: one encrypted attention
  head, Gaussian kernel versus polynomial softmax;
* :mod:`~crypto.benchmark.lora` - ``crypto-lora``: one encrypted linear layer, LoRA
  versus full encrypted weights;
* :mod:`~crypto.benchmark.layer` - ``crypto-layer``: the whole encrypted layer
  between a client and a server, interactive or not;
* :mod:`~crypto.benchmark.finetune` - ``crypto-finetune``: one encrypted
  fine-tuning step, arm against arm;
* :mod:`~crypto.benchmark.personalised` - the per-seed model they share.
"""
