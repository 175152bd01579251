"""A Flower Grid that delivers each message to a real ClientApp in this process.

The ServerApp and ClientApp are Flower's own objects; only the transport is
replaced, so a test can run a real (honest or malicious) ServerApp against real
clients in milliseconds and inspect every message that crossed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from defense_suite.federated.flower import (
    PrivateRound,
    TimeAdaptiveClient,
    TimeAdaptiveMod,
    node_privacy,
)


def user_app(
    train: Callable[[Message, Context, PrivateRound], Message | None],
    mod: TimeAdaptiveMod | None = None,
) -> ClientApp:
    """A user's ClientApp: ``mod`` (default: the mod on :func:`node_privacy`) and a
    train that takes its granted round first, then runs ``train(msg, context, rnd)``."""
    mod = TimeAdaptiveMod(node_privacy) if mod is None else mod
    app = mod.register(ClientApp(mods=[mod]))

    @app.train()
    def granted(msg: Message, context: Context) -> Message | None:
        rnd = TimeAdaptiveClient(node_privacy(context), context).round(msg)
        return train(msg, context, rnd)

    return app


def node_contexts(n: int, run_config: dict | None = None, **node: dict) -> dict:
    """One context per node (ids 100, 101, ...), as Flower's simulation builds."""
    return {
        100 + i: Context(
            run_id=1,
            node_id=100 + i,
            node_config={
                "partition-id": i,
                "num-partitions": n,
                **node.get(str(i), {}),
            },
            state=RecordDict(),
            run_config=dict(run_config or {}),
        )
        for i in range(n)
    }


class LoopbackGrid(Grid):
    """Deliver messages to ``app`` with each node's own persistent context."""

    def __init__(self, app: ClientApp, contexts: dict[int, Context]) -> None:
        self.app = app
        self.contexts = contexts
        self.sent: list[Message] = []
        self.replies: list[Message] = []
        self._run = Run.create_empty(1)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content,
            message_type=message_type,
            dst_node_id=dst_node_id,
            group_id=group_id,
            ttl=ttl,
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _deliver(self, msg: Message) -> Message:
        self.sent.append(msg)
        try:
            reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
        except Exception as error:  # the runtime turns a raise into an error reply
            reply = Message(Error(code=0, reason=repr(error)), reply_to=msg)
        self.replies.append(reply)
        return reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._pending = [self._deliver(m) for m in messages]
        return [str(i) for i in range(len(self._pending))]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._pending[int(i)] for i in message_ids]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return [self._deliver(m) for m in messages]
