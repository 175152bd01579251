r"""The CKKS reaction-oracle attack of an actively malicious server, for red-teaming.

SEAL refuses to encode coefficients above about :math:`2^{\log Q_{data}-2}`. A client
that decrypts a server ciphertext and re-encodes the plaintext therefore either
answers or fails, and the server chooses the plaintext: from a secret ciphertext
:math:`c` it forms, with additions only (no level used),

.. math::

    p = O + 2^k (c - a),

:math:`O` its own encryption of a constant just below the encoding limit
:math:`T` and :math:`2^k w \le T/4` for the half-width :math:`w` of its current
interval, so re-encoding :math:`p` fails exactly when :math:`c > a` (to
:math:`w/512`). One bit per session, and a bisection over sessions recovers
:math:`c` (the audit of issue 26 recovered a LoRA entry, a head weight and input
slots to 3e-5 in about six sessions each).

:class:`OracleServer` replays it through the real wire protocol: it walks the
client's public schedule with forged ciphertexts (its inputs multiplied by 1.0
until they sit at each step's level) and puts the probe at every level-0 position
of the first step that has one; the reaction is whether the client answered.
:func:`bisect` runs the sessions. Against the clipping client every probe is
answered, so the reactions, and the estimate, are the same whatever the secret.
:func:`answer_times` measures the client's answer time on small and huge
plaintexts, interleaved (the timing side channel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..he.evaluator import Value
from .schedule import Schedule, Step, safe_bound
from .server import Server
from .wire import Channel, Message, ProtocolError

if TYPE_CHECKING:
    from .client import Client

Target = Callable[[Server, list[Value]], Any]
"""Picks the secret ciphertext from the server's state and the uploaded inputs."""


def lora_entry(name: str, i: int = 0, j: int = 0) -> Target:
    """The encrypted entry ``(i, j)`` of the client's secret matrix ``name``."""

    def pick(server: Server, inputs: list[Value]) -> Any:
        assert server._lora is not None
        return server._lora[name][i][j].handle

    return pick


def input_feature(f: int = 0) -> Target:
    """The ciphertext of input feature ``f`` (slot ``b n + i``: token i of seq. b)."""

    def pick(server: Server, inputs: list[Value]) -> Any:
        return inputs[f].handle

    return pick


def encoding_limit(context: Any, slots: int) -> float:
    """The largest replicated constant that encodes under ``context`` (bisected).

    Found with the public context only: encoding needs no secret.
    """
    import tenseal as ts

    lo, hi = 1.0, 2.0**400
    for _ in range(60):
        mid = float(np.sqrt(lo * hi))
        try:
            ts.ckks_vector(context, [mid] * slots)
            lo = mid
        except ValueError:
            hi = mid
    return lo


def _lift(handle: Any, level: int) -> Any:
    """``handle`` moved down to ``level`` by multiplications with 1.0."""
    for _ in range(level):
        handle = handle * 1.0
    return handle


class OracleServer(Server):
    """A malicious server replaying the reaction-oracle probe (one per session).

    Set ``schedule`` (public), ``target``, ``threshold`` ``a`` and ``width`` ``w``
    before each session; ``reactions`` records, per session, whether the client
    answered the probe, ``probes`` the probe's bytes (for an omniscient check).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.schedule: Schedule | None = None
        self.target: Target | None = None
        self.threshold, self.width = 0.0, 1.0
        self.reactions: list[bool] = []
        self.asked: list[float] = []
        self.probes: list[bytes] = []

    def probe(self, secret: Any, slots: int) -> Any:
        """:math:`O + 2^k (c - a)` with additions only (no level used)."""
        import tenseal as ts

        limit = encoding_limit(self.context, slots)
        offset = ts.ckks_vector(self.context, [limit * (1 - 2.0**-10)] * slots)
        k = max(int(np.floor(np.log2(limit / 4 / self.width))), 0)
        p = secret + (-self.threshold)
        for _ in range(k):
            p = p + p
        return offset + p

    def _forged(self, step: Step, inputs: list[Value], probe: Any) -> list[Value]:
        out = []
        for i, level in enumerate(step.levels):
            if level == 0 and probe is not None:
                out.append(Value(probe))
            else:
                out.append(Value(_lift(inputs[i % len(inputs)].handle, level), level))
        return out

    def _infer(self, channel: Channel, message: Message) -> Message:
        assert self.schedule is not None
        assert self.target is not None
        inputs = self._load(message)
        slots = self.schedule.reply.sizes[0]
        probe = self.probe(self.target(self, inputs), slots)
        self.probes.append(probe.serialize())
        self.asked.append(self.threshold)
        for step in self.schedule.steps:
            armed = 0 in step.levels
            meta = {"copies": step.copies} if step.kind != "refresh" else {}
            request = self._dump(
                step.kind, self._forged(step, inputs, probe if armed else None), **meta
            )
            channel.send(request.encode())
            reply = Message.decode(channel.recv())
            self.transcript.record(reply)
            if armed:
                self.reactions.append(reply.kind != "abort")
                break
            if reply.kind == "abort":
                raise ProtocolError("the client refused a forged step")
        # garbage logits end the session (the client refuses them)
        return self._dump("logits", inputs[: self.weights.n_classes])


@dataclass(frozen=True)
class Bisection:
    """The estimate of a bisection and the reactions it saw."""

    estimate: float
    reactions: tuple[bool, ...]


def bisect(
    client: Client,
    server: OracleServer,
    X: Any,
    lo: float,
    hi: float,
    sessions: int,
) -> Bisection:
    """Bisect the target on ``[lo, hi]``, one probe per session (``client.predict``).

    A failed answer means ``c > a``: the interval moves up.
    """
    from .client import InProcess

    server.schedule = client.schedule(True)
    seen: list[bool] = []
    for _ in range(sessions):
        server.threshold, server.width = (lo + hi) / 2, (hi - lo) / 2
        connection = InProcess(server)
        try:
            client.predict(connection, X)
        except (ProtocolError, RuntimeError):
            pass  # the session ends either way; the reaction is what counts
        finally:
            connection.close()
        answered = server.reactions[-1]
        seen.append(answered)
        if answered:
            hi = server.threshold
        else:
            lo = server.threshold
    return Bisection((lo + hi) / 2, tuple(seen))


def answer_times(
    client: Client, repeats: int, ciphertexts: int = 4, huge_bits: int = 150
) -> dict[str, float]:
    """Median seconds of the client's answer on small vs huge plaintexts.

    The two kinds of request (all ``ciphertexts`` encrypt 0.5, or 0.5 doubled
    ``huge_bits`` times by additions) alternate ``repeats`` times, so drift in the
    machine's load hits both alike. Returns the two medians and their difference.
    """
    import tenseal as ts

    slots = client.schedule(True).reply.sizes[0]
    public = ts.context_from(client.public_context())
    step = Step(
        "refresh",
        "timing probe",
        (0,) * ciphertexts,
        (slots,) * ciphertexts,
        (safe_bound(client.params),) * ciphertexts,
    )
    small = ts.ckks_vector(public, [0.5] * slots)
    huge = small
    for _ in range(huge_bits):
        huge = huge + huge
    requests = {
        name: Message("refresh", client.key, (c.serialize(),) * ciphertexts)
        for name, c in (("small", small), ("huge", huge))
    }
    times: dict[str, list[float]] = {"small": [], "huge": []}
    for _ in range(repeats):
        for name, request in requests.items():
            start = time.perf_counter()
            client.answer(request, step)
            times[name].append(time.perf_counter() - start)
    out = {name: statistics.median(t) for name, t in times.items()}
    out["difference"] = out["huge"] - out["small"]
    return out
