"""Encrypted inference of a converted BERT: the key owner's side of the protocol.

:class:`BertClient` is the :class:`~crypto.protocol.client.Client` of a converted
:class:`~crypto.conversion.model.HEBert`: it takes token ids (from the user's tokenizer,
:func:`crypto.conversion.tokenizer.encode`) and their 0/1 attention mask, embeds them on
its side (exact LayerNorm, :meth:`HEBert.embed_tokens`), encrypts the packed features
and the key weights of the mask (:mod:`crypto.program.inputs`) with its secret LoRA
factors (the range guard advisory, :mod:`crypto.program.shadow`), and answers the
server's refresh and roll requests. The session runs through the same bytes-only
messages and transports (``InProcess``, ``Loopback``) and the same checks: the public
schedule is derived by running the program on zeros
(:func:`inference_schedule`), every request is admitted before
decryption and its decrypted slots are clipped to the encoding-safe bound
(:mod:`crypto.protocol.session`). The converted model's blocks need refreshes and rolls,
so only the interactive configuration exists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from defenses.arrays import FloatArray

from ..conversion.error import CHAIN, expected_logit_error, uncertain
from ..he.ckks import INTERACTIVE
from ..he.evaluator import Evaluator, NumpyBackend, Value
from ..he.packing import unit
from ..program.encoder import BertWeights, forward, lora_factors
from ..program.inputs import pack_inputs
from ..program.shadow import flag_ids, pack_ids, report
from .client import Client
from .schedule import Recorder, Schedule, finished, safe_bound
from .server import Server
from .timing import Floor
from .wire import Channel, Message

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..he.ckks import CKKSParams


def _interactive(interactive: bool) -> None:
    if interactive is not True:
        raise ValueError(
            "the converted BERT runs interactively only (its blocks need refreshes "
            "and rolls of K and V by the key owner)"
        )


def inference_schedule(model: HEBert, params: CKKSParams, slots: int) -> Schedule:
    """The public schedule of one interactive encrypted inference of ``model``.

    Derived on zeros (one sequence, zero LoRA factors of the model's shapes) with a
    :class:`~crypto.protocol.schedule.Recorder`; ``slots`` is every ciphertext's length.
    """
    w = BertWeights.from_model(model)
    n, d = w.n_tokens, w.d
    rec = Recorder(n, safe_bound(params), lambda h: int(np.asarray(h).size))
    ev = Evaluator(NumpyBackend(), params.levels, rec.refresh)
    rec.ev = ev
    shapes = {k: unit(lambda x: 0.0 * x, M) for k, M in lora_factors(model).items()}
    zeros = [Value(np.zeros(n)) for _ in range(d)]
    masks = [Value(np.full(n, 1.0 / n)) for _ in range(n)]
    logits = forward(ev, w, zeros, masks, shapes, rec.roll)
    return finished(rec, "logits", "logits", logits, params, slots)


class BertClient(Client):
    """The data owner of a converted BERT: secret key, token ids, LoRA factors.

    Parameters
    ----------
    model : HEBert
        The calibrated converted model (its base weights are public, its LoRA
        factors are the client's secret).
    params : CKKSParams
        The modulus chain (at least 5 levels: the attention stage needs 5).
    answer_floor : float or "auto"
        As for :class:`~crypto.protocol.client.Client` (default ``"auto"``).
    """

    def __init__(self, model: HEBert, params: CKKSParams, answer_floor: Floor = "auto"):
        from ..conversion.model import HEBert

        if not isinstance(model, HEBert):
            raise TypeError(f"model must be an HEBert, got {type(model).__name__}")
        if not model.calibration.calibrated:
            raise ValueError("calibrate the converted model before encrypting with it")
        super().__init__(model, params, None, answer_floor)  # type: ignore[arg-type]
        self.bert = model

    def schedule(self, interactive: bool = True) -> Schedule:
        """The public schedule of one inference (derived once on zeros, cached)."""
        _interactive(interactive)
        if True not in self._schedules:
            self._schedules[True] = inference_schedule(
                self.bert, self.params, self._slots
            )
        return self._schedules[True]

    def encrypt_inputs(
        self,
        X: npt.ArrayLike,
        rolled: bool = False,
        mask: npt.ArrayLike | None = None,
        *,
        guard: bool = True,
    ) -> Message:
        """An ``infer`` message: packed features, then the ``n`` key weights.

        ``X`` holds token ids (batch, n_tokens); ``mask`` their 0/1 attention mask
        (None: every position attended). ``guard=False`` leaves the range verdict
        to :meth:`predict`'s advisory check (the session path).
        """
        _interactive(not rolled)
        packing = pack_inputs if guard else pack_ids
        z, masks, batch = packing(self.bert, X, mask, self._slots)
        meta = {"interactive": True, "sequences": batch}
        return self._encrypt("infer", z + masks, meta)

    def secret_factors(self) -> dict[str, FloatArray]:
        """The secret LoRA factors of every block, by name."""
        return lora_factors(self.bert)

    def _warn_uncertain(self, logits: FloatArray) -> None:
        """Log (locally, never to the server) predictions within the measured error.

        A row whose top-2 logit margin is at most twice the encrypted logit error
        measured for this depth and width (:func:`crypto.conversion.error.
        expected_logit_error`, on the ``INTERACTIVE`` chain) may have another
        argmax than the plaintext model. Only a log line: the decrypted values are
        shaped by the server, so nothing the client sends depends on them.
        """
        c = self.bert.config
        if self.params != INTERACTIVE or len(logits) == 0:
            return
        flagged = uncertain(logits, c.n_layers, c.d)
        if flagged.any():
            logger.warning(
                "%d of %d predictions have a top-2 logit margin at most twice the "
                "measured encrypted error %.2g (%d layers, width %d, %s): their "
                "argmax may differ from the plaintext model's",
                int(flagged.sum()),
                flagged.size,
                expected_logit_error(c.n_layers, c.d),
                c.n_layers,
                c.d,
                CHAIN,
            )

    def infer(
        self,
        connection: Channel,
        X: FloatArray,
        interactive: bool = True,
        mask: npt.ArrayLike | None = None,
    ) -> FloatArray:
        """One packed batch of token ids over an open session."""
        schedule = self.schedule(interactive)
        message = self.encrypt_inputs(X, mask=mask, guard=False)
        batch = int(message.meta["sequences"])
        logits = self._exchange(connection, schedule, message.encode(), batch, True)
        self._warn_uncertain(logits)
        return logits

    def predict_texts(
        self, server: Server | Channel, tokenizer: Any, texts: Sequence[str]
    ) -> FloatArray:
        """Tokenize ``texts`` with the user's tokenizer on the client, then predict.

        :func:`crypto.conversion.tokenizer.encode` refuses a tokenizer whose vocabulary
        does not fit the embedding and texts longer than the converted length.
        """
        from ..conversion.tokenizer import encode

        ids, mask = encode(tokenizer, texts, self.bert)
        return self.predict(server, ids, mask=mask)

    def predict(
        self,
        server: Server | Channel,
        X: npt.ArrayLike,
        interactive: bool = True,
        mask: npt.ArrayLike | None = None,
    ) -> FloatArray:
        """Encrypted logits for token ids ``X`` (batched to fill the slots).

        ``server`` is a :class:`~crypto.protocol.server.Server` (served in-process for
        this call) or an open connection to one (``InProcess``, ``Loopback``). Bad ids
        or a mask of the wrong shape are refused before anything is uploaded; the range
        guard is advisory (``flagged``, logged), as for
        :meth:`crypto.protocol.client.Client.predict`.
        """
        _interactive(interactive)
        ids_t, mask_t = self.bert.check_ids(X, mask)
        ids = np.asarray(ids_t.numpy())
        m = np.asarray(mask_t.numpy())
        flags = flag_ids(self.bert, ids, m)  # advisory: changes no message
        per_batch = self._slots // self.bert.config.n_tokens
        with self.connected(server) as connection:
            out = [
                self.infer(
                    connection,
                    ids[start : start + per_batch],
                    mask=m[start : start + per_batch],
                )
                for start in range(0, ids.shape[0], per_batch)
            ]
        self.flagged = report(flags, "sequences")
        return np.concatenate(out)
