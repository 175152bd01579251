"""Former home of the converted BERT's Q/K/V step as messages (thin aliases).

The step runs on the one fine-tuning protocol: the job is
:meth:`crypto.protocol.jobs.TuningJob.qkv` (a
:class:`~crypto.protocol.jobs.GradientProgram`), the server
:class:`~crypto.protocol.tuning.TuningServer`, the key owner
:class:`~crypto.protocol.tuning_client.TuningClient` (bound to the model by
:class:`~crypto.protocol.tuning_client.BertTuningClient`). The names below keep
the imports the docs taught working.
"""

from __future__ import annotations

from .jobs import QKVJob, step_slots
from .tuning import BertTuningServer
from .tuning_client import BertTuningClient

__all__ = ["BertTuningClient", "BertTuningServer", "QKVJob", "step_slots"]
