"""A bandwidth-limiting TCP proxy: a real server reached over a slow link.

:class:`ThrottledProxy` accepts connections on a loopback port and forwards them to a target
port; the bytes flowing back to the client (server -> client: what a load reads) pass through
one shared token bucket of ``bytes_per_s``, the way a congested network link or a slow remote
store delivers them. Requests (client -> server) pass at full speed, so stores stay fast. It
stands in for a remote Valkey/Redis a long way off: the server, the protocol and the client are
all real, only the link is slowed.

State ownership: as :class:`~servers.tcp_proxy.TcpProxy` (one asyncio loop on a daemon thread
owns every socket); the loop also owns the bucket (``_next_free``: when the link is free for the
next chunk).
"""

from __future__ import annotations

import asyncio

from servers.tcp_proxy import HOST, ProxyStartError, TcpProxy

ThrottleStartError = ProxyStartError


class ThrottledProxy(TcpProxy):
    """Forwards ``HOST:port`` to ``HOST:target_port``; replies limited to ``bytes_per_s``."""

    name = "throttle-proxy"
    chunk_bytes = 16 * 1024  # the link's unit: a chunk is delivered once its time has passed

    def __init__(self, target_port: int, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"ThrottledProxy bytes_per_s: expected a number > 0, got "
                             f"{bytes_per_s!r}")
        super().__init__(target_port)
        self._bytes_per_s = float(bytes_per_s)
        self._next_free = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self._bytes_per_s

    def url(self, db: int = 0) -> str:
        return f"redis://{HOST}:{self.port}/{db}"

    async def _on_chunk(self, nbytes: int, *, to_client: bool) -> None:
        """Replies wait until ``nbytes`` have crossed the link (one link shared by all
        connections); requests pass at full speed."""
        if not to_client:
            return
        now = self._loop.time()
        start = max(now, self._next_free)
        self._next_free = start + nbytes / self._bytes_per_s
        await asyncio.sleep(self._next_free - now)

    def __enter__(self) -> ThrottledProxy:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
