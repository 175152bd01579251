"""The bytes between the key owner and the server (issue 41, layer 5).

Wire format (:mod:`~crypto.protocol.wire`), transports (:class:`InProcess` in
:mod:`~crypto.protocol.server`, :class:`Loopback` in
:mod:`~crypto.protocol.transport`), the client's session rules
(:mod:`~crypto.protocol.session`: admit, clip, abort), the public schedule
(:mod:`~crypto.protocol.schedule`), answer-time padding
(:mod:`~crypto.protocol.timing`), the inference clients (:class:`Client` of an
HEFormer, :class:`BertClient` of a converted transformer) and the server, the
one fine-tuning protocol for every model family (the job
:mod:`~crypto.protocol.jobs`, the server :mod:`~crypto.protocol.tuning` on the
session loop of :mod:`~crypto.protocol.serving` that inference shares, the key
owner :mod:`~crypto.protocol.tuning_client`, the HEFormer's
:mod:`~crypto.protocol.finetune`) and the
reaction-oracle red team (:mod:`~crypto.protocol.reaction`).

The public classes are importable from here; each is loaded on first use, so
``import crypto.protocol`` pulls neither TenSEAL nor torch.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "Client": ".client",
    "Exchange": ".client",
    "BertClient": ".encoder_client",
    "Server": ".server",
    "InProcess": ".server",
    "Transcript": ".server",
    "Loopback": ".transport",
    "Message": ".wire",
    "Channel": ".wire",
    "ProtocolError": ".wire",
    "Refused": ".session",
    "Schedule": ".schedule",
    "SessionServer": ".serving",
    "hosted": ".serving",
    "TuningJob": ".jobs",
    "StepProgram": ".jobs",
    "SGDProgram": ".jobs",
    "GradientProgram": ".jobs",
    "QKVJob": ".jobs",
    "TuningServer": ".tuning",
    "ProgramServer": ".tuning",
    "BertTuningServer": ".tuning",
    "tuning_schedule": ".tuning",
    "TuningClient": ".tuning_client",
    "BertTuningClient": ".tuning_client",
    "KeyOwner": ".finetune",
    "encrypted_step": ".finetune",
}
"""Public name -> the module of this package that defines it."""

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """``crypto.protocol.Client`` and the other public classes, imported lazily."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(_LAZY[name], __name__), name)
