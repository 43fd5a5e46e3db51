"""A TCP proxy a test can cut and restore: a broker that goes away and comes back,
without restarting the shared server other tests use."""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    """Forwards a local port to the broker; ``cut()`` resets every connection and refuses
    new ones until ``restore()``, as a broker that went down and came back would."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.sockets: list[socket.socket] = []
        self.accepted: list[float] = []
        """When each client connection came (time.monotonic())."""
        self.lock = threading.Lock()
        self.held: socket.socket | None = None
        """The port's socket while cut: bound, not listening."""
        self.restore()

    def restore(self) -> None:
        self.listener = self.held if self.held is not None else self._bound(self.port)
        self.held = None
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    @staticmethod
    def _bound(port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        return sock

    def cut(self) -> None:
        # The port stays ours through the outage: a socket bound to it, not listening, is
        # refused connections as a stopped broker's port is, and no other process (another
        # test's bind(0) or outgoing connection) can take it meanwhile. Closed, it once was
        # taken, and restore() failed with EADDRINUSE. Bound before the listener closes
        # (SO_REUSEPORT on both), so there is no moment the port is free.
        if self.held is None:
            self.held = self._bound(self.port)
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                # Both ends see the stream end with no AMQP goodbye. shutdown() first: a bare
                # close() would not wake the pump blocked in recv(), and the socket would linger.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self.sockets.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self.accepted.append(time.monotonic())
            upstream = socket.create_connection(self.target)
            with self.lock:
                self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
