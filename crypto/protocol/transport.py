"""The HE server in another process, over a real connection on loopback.

:class:`Loopback` starts a fresh Python interpreter (nothing of the client's memory is
inherited; the public weights arrive pickled on its standard input) that builds a
:class:`~crypto.protocol.server.Server` from the public weights only, listens on an
ephemeral port of 127.0.0.1 and serves one session. The client connects with a TCP
socket; each message travels as an 8-byte big-endian length and the bytes of
:meth:`~crypto.protocol.wire.Message.encode`. The server's side of the boundary is then
a process that never had the secret key in its address space.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
from typing import TYPE_CHECKING

from .server import Server, Serving
from .wire import Message

if TYPE_CHECKING:
    from ..conversion.model import HEBert
    from ..he.ckks import CKKSParams
    from ..models.heformer import HEFormer
    from ..program.encoder import BertWeights
    from ..program.heformer import HEWeights

_FRAME = struct.Struct(">Q")
MAX_MESSAGE = 1 << 36
"""Largest message accepted (64 GiB): a length beyond it is a broken stream."""


class SocketChannel:
    """Length-prefixed byte strings over a connected stream socket."""

    def __init__(self, sock: socket.socket):
        self._sock = sock

    def send(self, data: bytes) -> None:
        """Send one message."""
        self._sock.sendall(_FRAME.pack(len(data)))
        self._sock.sendall(data)

    def _exactly(self, size: int) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = self._sock.recv_into(view[got:], size - got)
            if n == 0:
                raise EOFError("the connection closed in the middle of a message")
            got += n
        return bytes(buf)

    def recv(self) -> bytes:
        """Receive one message (EOFError when the peer has gone)."""
        (size,) = _FRAME.unpack(self._exactly(_FRAME.size))
        if size > MAX_MESSAGE:
            raise ValueError(f"message of {size} bytes exceeds {MAX_MESSAGE}")
        return self._exactly(size)


def serve_stdin() -> None:
    """Child process: read (server, timeout), serve one session, exit.

    The server object (public weights and parameters only, no context yet)
    arrives pickled on standard input from the process that started this one;
    the listening port goes to standard output.
    """
    server, timeout = pickle.load(sys.stdin.buffer)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout)
        sys.stdout.write(f"{listener.getsockname()[1]}\n")
        sys.stdout.flush()
        conn, _ = listener.accept()
    with conn:
        conn.settimeout(None)
        server.serve(SocketChannel(conn))


class Loopback:
    """A connection to a server running in its own process (127.0.0.1).

    Parameters
    ----------
    weights : HEWeights, BertWeights or None
        The public weights an inference server is built from (sent to the child).
    params : CKKSParams or None
        The modulus chain.
    start_timeout : float
        Seconds to wait for the child to listen and for the client to connect.
    server : object with ``serve(channel)`` or None
        Instead of ``weights``: a server not yet serving (e.g. a
        :class:`~crypto.protocol.tuning.TuningServer`), pickled to the child.

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        weights: HEWeights | BertWeights | None = None,
        params: CKKSParams | None = None,
        start_timeout: float = 120.0,
        server: Serving | None = None,
    ):
        if server is None:
            if weights is None or params is None:
                raise ValueError("Loopback needs weights and params, or a server")
            server = Server(None, weights, params)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if os.path.isdir(p))
        code = f"from {__package__}.transport import serve_stdin; serve_stdin()"
        self._process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self._process.stdin is not None
        assert self._process.stdout is not None
        self._process.stdin.write(pickle.dumps((server, start_timeout)))
        self._process.stdin.close()
        ready, _, _ = select.select([self._process.stdout], [], [], start_timeout)
        line = self._process.stdout.readline() if ready else b""
        if not line.strip().isdigit():
            self._process.kill()
            self._process.wait()
            raise RuntimeError("the server process did not start listening")
        port = int(line)
        self.address = ("127.0.0.1", int(port))
        self._sock = socket.create_connection(self.address, timeout=start_timeout)
        self._sock.settimeout(None)
        self._channel = SocketChannel(self._sock)

    @classmethod
    def for_model(cls, model: HEFormer | HEBert, params: CKKSParams) -> Loopback:
        """A server process for the public part of ``model`` (HEFormer or HEBert)."""
        from .server import public_weights

        return cls(public_weights(model), params)

    @property
    def pid(self) -> int | None:
        """The server process's id."""
        return self._process.pid

    def send(self, data: bytes) -> None:
        """Deliver bytes to the server process."""
        self._channel.send(data)

    def recv(self) -> bytes:
        """The server's next message."""
        try:
            return self._channel.recv()
        except EOFError:
            raise RuntimeError("the server process closed the connection") from None

    def close(self) -> None:
        """End the session and wait for the server process to exit."""
        with contextlib.suppress(OSError):
            self._channel.send(Message("close").encode())
        self._sock.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
