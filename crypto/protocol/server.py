"""The honest-but-curious HE inference server.

:class:`Server` holds the frozen plaintext weights and the public context the
client sends it; it answers ``lora`` and ``infer`` messages on the session loop
of :class:`~crypto.protocol.serving.SessionServer` (the forward program of an
HEFormer or of a converted BERT under CKKS, asking the client for refreshes and
rolls by message).
It never holds a reference to a :class:`~crypto.protocol.client.Client`, a private
context or a secret key. :class:`InProcess` runs it in a thread of this process
behind two queues of bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..he.ckks import CKKSParams, TenSEALBackend
from ..he.evaluator import Evaluator, Value
from ..program.encoder import BertWeights
from ..program.encoder import forward as bert_forward
from ..program.heformer import HEWeights, forward
from .serving import (
    InProcess,
    Serving,
    SessionServer,
    Transcript,
    hosted,
)
from .wire import Channel, Message, ProtocolError

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..models.heformer import HEFormer

__all__ = ["InProcess", "Server", "Serving", "Transcript", "hosted", "public_weights"]


def public_weights(model: HEFormer | HEBert) -> HEWeights | BertWeights:
    """The public folded weights of an HEFormer or of a converted BERT."""
    from ..conversion.model import HEBert

    if isinstance(model, HEBert):
        return BertWeights.from_model(model)
    return HEWeights.from_model(model)


class Server(SessionServer):
    """The honest-but-curious server: public context and frozen plaintext weights.

    Parameters
    ----------
    context : bytes or None
        The client's public context (or None: it arrives in a ``context`` message).
    weights : HEWeights or BertWeights
        The public folded weights (of an HEFormer or of a converted BERT).
    params : CKKSParams
        The modulus chain the context was made with.

    Raises
    ------
    ValueError
        If the context holds a secret key or is not a TenSEAL context.
    """

    def __init__(
        self,
        context: bytes | None,
        weights: HEWeights | BertWeights,
        params: CKKSParams,
    ):
        if not isinstance(weights, HEWeights | BertWeights):
            raise TypeError(
                "weights must be HEWeights or BertWeights, got "
                f"{type(weights).__name__}"
            )
        if not isinstance(params, CKKSParams):
            raise TypeError(f"params must be CKKSParams, got {type(params).__name__}")
        super().__init__(params, params.slots - params.slots % weights.n_tokens)
        self.weights = weights
        self.counts: dict[str, int] = {}
        self._lora: dict[str, list[list[Value]]] | None = None
        if context is not None:
            self._set_context(context)

    @classmethod
    def for_model(
        cls, context: bytes | None, model: HEFormer | HEBert, params: CKKSParams
    ) -> Server:
        """A server for the public part of ``model`` (HEFormer or converted BERT)."""
        return cls(context, public_weights(model), params)

    def _set_context(self, blob: bytes) -> None:
        super()._set_context(blob)
        self._lora = None

    def handlers(self) -> dict[str, Any]:
        """``lora`` (the encrypted factors) and ``infer`` (a batch)."""
        return {"lora": self._on_lora, "infer": self._on_infer}

    def _on_lora(self, channel: Channel, pending: list[Message]) -> None:
        self._lora = self._factors(pending.pop())

    def _on_infer(self, channel: Channel, pending: list[Message]) -> None:
        channel.send(self._infer(channel, pending.pop()).encode())

    def _factors(self, message: Message) -> dict[str, list[list[Value]]]:
        names, shapes = message.meta.get("names"), message.meta.get("shapes")
        flat = self._load(message)
        if (
            not isinstance(names, list)
            or not isinstance(shapes, list)
            or len(names) != len(shapes)
            or not all(isinstance(s, list) and len(s) == 2 for s in shapes)
            or sum(int(r) * int(c) for r, c in shapes) != len(flat)
        ):
            raise ProtocolError("lora message: names and shapes do not match the blobs")
        out, at = {}, 0
        for name, (rows, cols) in zip(names, shapes, strict=True):
            out[str(name)] = [
                flat[at + r * cols : at + (r + 1) * cols] for r in range(rows)
            ]
            at += rows * cols
        return out

    def _infer(self, channel: Channel, message: Message) -> Message:
        """Evaluate the layer on an ``infer`` message; refresh by asking the client."""
        start = time.perf_counter()
        w = self.weights
        d, n = w.d, w.n_tokens
        interactive = message.meta.get("interactive")
        if not isinstance(interactive, bool):
            raise ProtocolError("infer message: meta 'interactive' must be a bool")
        if self._lora is None:
            raise ProtocolError("send the LoRA factors (a lora message) before infer")
        values = self._load(message)
        refresh, roll, _ = self.services(channel)
        ev = Evaluator(
            TenSEALBackend(), self.params.levels, refresh if interactive else None
        )
        if isinstance(w, BertWeights):
            if not interactive:
                raise ProtocolError(
                    "the converted BERT runs interactively only (its blocks need "
                    "refreshes and rolls)"
                )
            if len(values) != d + n:
                raise ProtocolError(
                    f"expected {d} input and {n} key-weight ciphertexts, got "
                    f"{len(values)}"
                )
            logits = bert_forward(ev, w, values[:d], values[d:], self._lora, roll)
        elif interactive:
            if len(values) != d:
                raise ProtocolError(
                    f"expected {d} input ciphertexts, got {len(values)}"
                )
            logits = forward(ev, w, values, self._lora, roll=roll)
        else:
            if len(values) != d * (n + 1):
                raise ProtocolError(
                    f"non-interactive inference expects {d * (n + 1)} ciphertexts "
                    f"(inputs and {n} rolled copies), got {len(values)}"
                )
            rolled = [values[d + s * d : d + (s + 1) * d] for s in range(n)]
            logits = forward(ev, w, values[:d], self._lora, rolled_z=rolled)
        for k, v in ev.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        seconds = time.perf_counter() - start
        self.transcript.seconds.append(seconds)
        return self._dump("logits", logits, counts=dict(ev.counts), seconds=seconds)
