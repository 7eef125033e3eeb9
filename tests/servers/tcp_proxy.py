"""A loopback TCP proxy on its own asyncio loop: the base of the test servers that stand
between a real client and a real server (TLS termination, a slow link).

State ownership: one asyncio loop on a daemon thread owns every socket and the listening
server; ``start()`` and ``close()`` run on the caller's thread and only hand work to that loop.
Subclasses say how the listener is made (``_ssl``) and what a chunk waits for on its way
(``_on_chunk``), both run on the loop.
"""

from __future__ import annotations

import asyncio
import ssl
import threading

HOST = "127.0.0.1"
_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0


class ProxyStartError(RuntimeError):
    """The proxy's loop did not come up."""


class TcpProxy:
    """Forwards ``HOST:port`` to ``HOST:target_port`` in chunks of ``chunk_bytes``."""

    name = "tcp-proxy"
    chunk_bytes = 1 << 16

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def host(self) -> str:
        return HOST

    def _ssl(self) -> ssl.SSLContext | None:
        return None

    async def _on_chunk(self, nbytes: int, *, to_client: bool) -> None:
        """A chunk of ``nbytes`` is about to be forwarded (towards the client or the server)."""

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=self.name,
                                        daemon=True)
        self._thread.start()
        if not ready.wait(_START_TIMEOUT_S) or self._server is None:
            raise ProxyStartError(f"{self.name} did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.set_exception_handler(lambda _loop, _context: None)  # handshake noise
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, HOST, 0, ssl=self._ssl()))
            self.port = self._server.sockets[0].getsockname()[1]
        finally:
            ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(HOST, self._target_port)
        except OSError:
            writer.close()
            self._connections.discard(writer)
            return
        self._connections.add(up_writer)
        await asyncio.gather(self._pump(reader, up_writer, to_client=False),
                             self._pump(up_reader, writer, to_client=True))
        self._connections.discard(writer)
        self._connections.discard(up_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    to_client: bool) -> None:
        try:
            while data := await reader.read(self.chunk_bytes):
                await self._on_chunk(len(data), to_client=to_client)
                writer.write(data)
                await writer.drain()
        except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        self._loop.stop()

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            self._thread.join(_STOP_TIMEOUT_S)
