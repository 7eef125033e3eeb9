"""A bandwidth-limiting TCP proxy: a real server reached over a slow link.

:class:`ThrottledProxy` accepts connections on a loopback port and forwards them to a target
port; the bytes flowing back to the client (server -> client: what a load reads) pass through
one shared token bucket of ``bytes_per_s``, the way a congested network link or a slow remote
store delivers them. Requests (client -> server) pass at full speed, so stores stay fast. It
stands in for a remote Valkey/Redis a long way off: the server, the protocol and the client are
all real, only the link is slowed.

State ownership: one asyncio loop on a daemon thread owns every socket, the server and the
bucket (``_next_free``: when the link is free for the next chunk); ``start()`` and ``close()``
run on the caller's thread and only hand work to that loop.
"""

from __future__ import annotations

import asyncio
import threading

HOST = "127.0.0.1"
_CHUNK = 16 * 1024  # the link's unit: a chunk is delivered once its transmission time passed
_START_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0


class ThrottleStartError(RuntimeError):
    """The proxy's loop did not come up."""


class ThrottledProxy:
    """Forwards ``HOST:port`` to ``HOST:target_port``; replies limited to ``bytes_per_s``."""

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"ThrottledProxy bytes_per_s: expected a number > 0, got "
                             f"{bytes_per_s!r}")
        self._target_port = target_port
        self._bytes_per_s = float(bytes_per_s)
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._next_free = 0.0
        self.port = 0

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    def url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="throttle-proxy",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(_START_TIMEOUT_S) or self._server is None:
            raise ThrottleStartError("throttling proxy did not start")

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, HOST, 0))
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
        await asyncio.gather(self._pump(reader, up_writer, throttled=False),
                             self._pump(up_reader, writer, throttled=True))
        self._connections.discard(writer)
        self._connections.discard(up_writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                    throttled: bool) -> None:
        try:
            while data := await reader.read(_CHUNK):
                if throttled:
                    await self._transmit(len(data))
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _transmit(self, nbytes: int) -> None:
        """Wait until ``nbytes`` have crossed the link (one link shared by all connections)."""
        now = self._loop.time()
        start = max(now, self._next_free)
        self._next_free = start + nbytes / self._bytes_per_s
        await asyncio.sleep(self._next_free - now)

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

    def __enter__(self) -> ThrottledProxy:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
