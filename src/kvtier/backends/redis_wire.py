"""RESP on the socket for the Redis backend: what goes out and comes in without a copy.

- :class:`FramePacker` / :class:`FrameConnection`: a frame is sent as the header and the caller's
  payload, separate chunks of one RESP bulk string (no join, no hiredis copy).
- :class:`ReplyReader`: the replies of one ``GET`` pipeline read off the socket; a value of the
  expected size lands with ``recv_into`` in the caller's buffer (no intermediate ``bytes``).
- :func:`exchange` / :func:`exchange_gets`: one pipeline on one connection; on plain TCP the
  pipeline goes out in one ``sendmsg`` and a value comes in with one ``MSG_WAITALL`` read.

Stateless: every object here belongs to the one thread running that pipeline; a connection is
used by one thread at a time (taken from and given back to redis-py's pool by the caller).
"""

from __future__ import annotations

import socket
import struct
import sys
from typing import Any, Final

import redis

from kvtier.backends.base import MISSING_FETCH, Fetched, Outcome
from kvtier.codec import HEADER_BYTES

_SEPARATE_CHUNK_BYTES: Final = 16 * 1024


class FramedValue:
    """One RESP bulk string sent as two chunks: the frame header and the caller's payload."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + self.payload.nbytes


class FramePacker:
    """RESP command packer that never copies a large :class:`FramedValue` payload.

    redis-py's ``pack_commands`` keeps every ``memoryview`` chunk as its own ``sendall`` (no
    join), so a large payload goes from the caller's buffer to the kernel. hiredis' packer would
    copy each value twice (``bytes()`` and its output buffer); replies are still parsed by
    hiredis. Payloads up to ``_SEPARATE_CHUNK_BYTES`` are joined into the command buffer instead:
    copying a few KiB is cheaper than one more system call per block.
    """

    __slots__ = ("_encode",)

    def __init__(self, encode: Any) -> None:
        self._encode = encode

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        output: list[bytes | memoryview] = []
        pending: list[bytes] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, FramedValue) and arg.payload.nbytes > _SEPARATE_CHUNK_BYTES:
                pending += (b"$%d\r\n" % len(arg), arg.header)
                output.append(b"".join(pending))
                output.append(arg.payload)
                pending = [b"\r\n"]
            elif isinstance(arg, FramedValue):
                pending += (b"$%d\r\n" % len(arg), arg.header, arg.payload.tobytes(), b"\r\n")
            else:
                raw = self._encode(arg)
                pending += (b"$%d\r\n" % len(raw), bytes(raw), b"\r\n")
        output.append(b"".join(pending))
        return output


class FrameConnection(redis.Connection):
    """A plain TCP connection that packs commands with :class:`FramePacker`."""

    def _construct_command_packer(self, packer: Any) -> Any:
        if packer is not None:
            return packer
        return FramePacker(self.encoder.encode)


def frame_packer_works() -> bool:
    """Whether this redis-py still builds its packer through the hook we override.

    The hook is redis-py internals; should a future release drop it, frames fall back to one
    contiguous buffer instead of failing every put.
    """
    probe = FrameConnection()  # type: ignore[no-untyped-call]  # no socket opened yet
    return isinstance(getattr(probe, "_command_packer", None), FramePacker)


ZERO_COPY_SUPPORTED: Final = frame_packer_works()


# --------------------------------------------------------------------------- reading replies

_SCRATCH_BYTES: Final = 64 * 1024
_MAX_LINE_BYTES: Final = 64 * 1024  # a RESP header or error line; longer is a protocol error
_PEEK_BYTES: Final = len(b"$%d\r\n" % (1 << 63)) + HEADER_BYTES  # a bulk line and a header
# Error replies that mean "ask the cluster again" (the slot moved, a failover is under way).
_REDIRECTS: Final = (redis.exceptions.AskError, redis.exceptions.TryAgainError,
                     redis.exceptions.ClusterDownError)
_REDIRECT_WORDS: Final = frozenset({"MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN"})


def is_redirect(reply: object) -> bool:
    """Whether a Cluster reply says "ask again" (MOVED, ASK, TRYAGAIN, CLUSTERDOWN)."""
    if isinstance(reply, _REDIRECTS):
        return True
    return (isinstance(reply, redis.ResponseError)
            and str(reply).partition(" ")[0] in _REDIRECT_WORDS)


class InPlaceRead:
    """``Fetched.token`` of a frame read into the caller's buffer: the object's SHA-1 is taken
    (from the header and ``out``, while ``out`` still holds it) only if the frame is refused,
    for the compare-and-delete script."""

    __slots__ = ("digest", "header")

    def __init__(self, header: bytearray) -> None:
        self.header = header
        self.digest = ""


class ReplyReader:
    """Reads the replies of one ``GET`` pipeline off a socket (RESP2 bulk strings, nil, errors).

    A value of exactly ``HEADER_BYTES + out.nbytes`` bytes lands in a fresh header buffer and in
    ``out`` (``recv_into``: no intermediate ``bytes``; bytes already in the scratch buffer are
    copied once); any other size is read whole and left to the codec to refuse. Raises
    ``OSError`` / ``redis.ConnectionError`` / ``redis.InvalidResponse``; the caller drops the
    connection then.
    """

    __slots__ = ("_buffer", "_end", "_sock", "_start", "_view", "_whole")

    def __init__(self, sock: socket.socket, *, whole: bool) -> None:
        self._sock = sock
        self._whole = whole
        self._buffer = bytearray(_SCRATCH_BYTES)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    @property
    def leftover(self) -> int:
        return self._end - self._start

    def _fill(self, limit: int) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buffer):
            held = self._end - self._start
            self._view[:held] = self._view[self._start:self._end]
            self._start, self._end = 0, held
        got = self._sock.recv_into(self._view[self._end:self._end + limit])
        if got == 0:
            raise redis.ConnectionError("connection closed by the server")
        self._end += got

    def _line(self, limit: int) -> bytes:
        """The next CRLF-terminated line, reading at most ``limit`` bytes per system call."""
        while True:
            at = self._buffer.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._view[self._start:at])
                self._start = at + 2
                return line
            if self._end - self._start >= _MAX_LINE_BYTES:
                raise redis.InvalidResponse("reply line longer than 64 KiB")
            self._fill(limit)

    def _read_into(self, targets: list[memoryview]) -> None:
        """Fill ``targets`` in order: first from the scratch buffer, then from the socket, in
        one ``recvmsg_into(MSG_WAITALL)`` where the socket allows (one system call, so one
        wait for the interpreter lock, per value instead of one per segment)."""
        rest: list[memoryview] = []
        for target in targets:
            done = min(target.nbytes, self._end - self._start)
            if done:
                target[:done] = self._view[self._start:self._start + done]
                self._start += done
            if done < target.nbytes:
                rest.append(target[done:])
        while rest:
            if self._whole:
                got = self._sock.recvmsg_into(rest, 0, socket.MSG_WAITALL)[0]
            else:
                got = self._sock.recv_into(rest[0])
            if got == 0:
                raise redis.ConnectionError("connection closed by the server")
            while got:
                if got >= rest[0].nbytes:
                    got -= rest.pop(0).nbytes
                else:
                    rest[0] = rest[0][got:]
                    got = 0

    def read_get(self, out: memoryview) -> Fetched | redis.ResponseError:
        """The next reply, as what the medium read for ``out``'s key, or an error reply.

        Before a large value the reader takes only the reply line and the frame header into
        its scratch buffer (``_PEEK_BYTES``), so that the payload is not copied at all; before
        small ones it reads as much as has arrived (several replies per system call)."""
        line = self._line(_PEEK_BYTES if out.nbytes >= _SEPARATE_CHUNK_BYTES else _SCRATCH_BYTES)
        kind = line[:1]
        if kind == b"$":
            try:
                size = int(line[1:])
            except ValueError:
                raise redis.InvalidResponse(f"bad bulk length {line[:32]!r}") from None
            if size < 0:
                return MISSING_FETCH
            header, crlf = bytearray(HEADER_BYTES), bytearray(2)
            if size == HEADER_BYTES + out.nbytes:
                self._read_into([memoryview(header), out, memoryview(crlf)])
                fetched = Fetched(Outcome.OK, header=header, payload_bytes=out.nbytes,
                                  token=InPlaceRead(header))
            else:  # not this caller's frame: read whole, the codec refuses it
                frame = bytearray(size)
                self._read_into([memoryview(frame), memoryview(crlf)])
                fetched = Fetched(Outcome.OK, frame=memoryview(frame))
            if crlf != b"\r\n":
                raise redis.InvalidResponse("bulk string not followed by CRLF")
            return fetched
        if kind == b"-":
            return redis.ResponseError(line[1:].decode("utf-8", "replace"))
        if line == b"_":  # RESP3 null
            return MISSING_FETCH
        raise redis.InvalidResponse(f"unexpected reply {line[:32]!r} to GET")


WAIT_ALL_SUPPORTED: Final = sys.platform.startswith("linux") and hasattr(socket, "MSG_WAITALL")


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("@ll", whole, int((seconds - whole) * 1_000_000))


_IOV_MAX: Final = 1024  # buffers per sendmsg (Linux's UIO_MAXIOV)


def _kernel_timed(conn: Any) -> socket.socket | None:
    """``conn``'s socket switched to blocking mode with the same timeout kept by the kernel
    (SO_SNDTIMEO / SO_RCVTIMEO), so that a whole pipeline goes out in one ``sendmsg`` and a
    whole value comes in with one ``MSG_WAITALL`` read: one system call, so one wait for the
    interpreter lock, instead of Python's poll per segment. None where that is not available
    (TLS, not Linux, no timeout): the caller uses redis-py's own calls."""
    if conn._sock is None:
        conn.connect()
    sock = conn._sock
    timeout = sock.gettimeout()
    if not WAIT_ALL_SUPPORTED or timeout is None or type(sock) is not socket.socket:
        return None
    limit = _timeval(timeout)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
    sock.settimeout(None)
    return sock


def _send_all(sock: socket.socket, chunks: list[Any]) -> None:
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0] = views[0][sent:]
                sent = 0


def _io_failure(conn: Any, exc: BaseException, doing: str) -> redis.RedisError:
    """The redis-py error for a failed socket call of ours; the connection is dropped."""
    where = f"{conn.host}:{conn.port}"
    conn.disconnect()
    if isinstance(exc, (TimeoutError, BlockingIOError)):  # BlockingIOError: SO_*TIMEO ran out
        return redis.TimeoutError(f"Timeout {doing} {where}")
    return redis.ConnectionError(f"Error {doing} {where}: {exc}")


def exchange(conn: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """One pipeline on ``conn``: one reply per command, error replies as exception objects."""
    chunks = conn.pack_commands(commands)
    try:
        sock = _kernel_timed(conn)
        if sock is not None:
            timeout = conn.socket_timeout
            _send_all(sock, chunks)
            sock.settimeout(timeout)  # hiredis reads with Python's timeout, as redis-py does
    except OSError as exc:
        raise _io_failure(conn, exc, "writing to") from None
    except BaseException:
        conn.disconnect()
        raise
    if sock is None:
        conn.send_packed_command(chunks, check_health=False)
    replies: list[Any] = []
    for _command in commands:
        try:
            replies.append(conn.read_response())  # drops the connection on an I/O error
        except redis.ResponseError as exc:
            replies.append(exc)
    return replies


def exchange_gets(conn: Any, commands: list[tuple[Any, ...]],
                   outs: list[memoryview]) -> list[Any]:
    """One ``GET`` pipeline on ``conn``, the replies read by :class:`ReplyReader`."""
    chunks = conn.pack_commands(commands)
    doing = "writing to"
    try:
        sock = _kernel_timed(conn)
        if sock is None:
            conn.send_packed_command(chunks, check_health=False)
            sock = conn._sock
        else:
            _send_all(sock, chunks)
        doing = "reading from"
        reader = ReplyReader(sock, whole=sock.gettimeout() is None)
        replies: list[Any] = [reader.read_get(out) for out in outs]
        if reader.leftover:
            raise redis.InvalidResponse(f"{reader.leftover} bytes after the last reply")
        sock.settimeout(conn.socket_timeout)
    except OSError as exc:
        raise _io_failure(conn, exc, doing) from None
    except BaseException:
        conn.disconnect()  # a half-read reply: the connection can never be reused
        raise
    return replies
