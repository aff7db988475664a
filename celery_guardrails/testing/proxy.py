"""A TCP forwarder on loopback, to take a real service (the store, the database) away from a worker and give it
back: the test kit's ``store_outage``, and the project's own tests."""

from __future__ import annotations

import contextlib
import socket
import threading


class TcpProxy:
    """Forwards 127.0.0.1:<port> to <host>:<target>. ``cut()`` drops every connection and refuses new ones;
    ``restore()`` accepts again."""

    def __init__(self, target: int, *, host: str = "127.0.0.1") -> None:
        self.target, self.host = target, host
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.connections: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection((self.host, self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                _hang_up(end)

    def cut(self) -> None:
        self.open.clear()
        with self.lock:
            for connection in self.connections:
                _hang_up(connection)
            self.connections.clear()

    def restore(self) -> None:
        self.open.set()

    def close(self) -> None:
        self.cut()
        _hang_up(self.listener)  # the shutdown wakes the thread blocked in accept(), which then ends


def _hang_up(end: socket.socket) -> None:
    """Shut the socket down, then close it. The shutdown is what sends the FIN: a socket closed while another
    thread is blocked reading it stays open in the kernel (a database session behind it stays open too, in
    its transaction, holding its locks)."""
    with contextlib.suppress(OSError):
        end.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        end.close()
