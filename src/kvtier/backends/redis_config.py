"""Redis / Valkey tier settings: the URL grammar, the options table and the typed config.

Stateless: :func:`parse_redis_url` turns a URL and keyword options into a frozen
:class:`RedisConfig` (secrets held as :class:`~kvtier.settings.Secret`, never shown).
"""

from __future__ import annotations

import enum
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Final

from kvtier.backends import redact_url, split_url_options
from kvtier.backends.base import (
    COMMON_SETTINGS,
    AuthKey,
    load_auth_key,
)
from kvtier.settings import MAX_TIMEOUT_S, MAX_TTL_S, Kind, Secret, Setting, SettingsTable

_TLS_OPTIONS: Final = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
_SCHEMES: Final = ("redis", "rediss", "redis+cluster", "rediss+cluster")
_DEFAULT_PORT: Final = 6379
_DEFAULT_SOCKET_TIMEOUT_S: Final = 5.0
_DEFAULT_CONNECT_TIMEOUT_S: Final = 2.0
_DEFAULT_BATCH_BYTES: Final = 4 << 20
_DEFAULT_CONNECTIONS: Final = 4


class RedisTopology(enum.Enum):
    STANDALONE = "standalone"
    CLUSTER = "cluster"


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Everything parsed from the URL and options; validated by :func:`parse_redis_url`."""

    topology: RedisTopology
    tls: bool
    host: str
    port: int
    db: int
    username: str | None
    password: Secret | None
    ssl_ca_certs: str | None
    ssl_certfile: str | None
    ssl_keyfile: str | None
    ssl_check_hostname: bool
    ttl_ms: int | None
    socket_timeout_s: float
    connect_timeout_s: float
    max_connections: int | None
    batch_bytes: int = _DEFAULT_BATCH_BYTES
    connections: int = _DEFAULT_CONNECTIONS
    auth_key: AuthKey | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """The URL with credentials redacted (the password never appears)."""
        scheme = ("rediss" if self.tls else "redis") + (
            "+cluster" if self.topology is RedisTopology.CLUSTER else ""
        )
        user = ""
        if self.username is not None or self.password is not None:
            user = urllib.parse.quote(self.username or "", safe="")
            user += ":***@" if self.password is not None else "@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        db = f"/{self.db}" if self.topology is RedisTopology.STANDALONE else ""
        return f"{scheme}://{user}{host}:{self.port}{db}"


# --------------------------------------------------------------------------- URL parsing


SETTINGS = SettingsTable("redis backend", (
    Setting("username", Kind.STR, None, nullable=True,
            help="ACL user (or user@ in the URL)"),
    Setting("password", Kind.SECRET, None, nullable=True,
            help="password (or :password@ in the URL); never shown"),
    Setting("ssl_ca_certs", Kind.STR, None, nullable=True,
            help="CA bundle that signs the server certificate (rediss only)"),
    Setting("ssl_certfile", Kind.STR, None, nullable=True,
            help="client certificate, with ssl_keyfile (rediss only)"),
    Setting("ssl_keyfile", Kind.STR, None, nullable=True,
            help="client certificate key, with ssl_certfile (rediss only)"),
    Setting("ssl_check_hostname", Kind.BOOL, True,
            help="check the server certificate's host name (rediss only)"),
    Setting("ttl_s", Kind.FLOAT, None, nullable=True, minimum=0.001, maximum=MAX_TTL_S, unit="s",
            help="expiry of every block; a read pushes it forward (unset = no expiry)"),
    Setting("socket_timeout_s", Kind.FLOAT, _DEFAULT_SOCKET_TIMEOUT_S, minimum=0,
            maximum=MAX_TIMEOUT_S, strict_min=True, unit="s", help="per-command socket timeout"),
    Setting("connect_timeout_s", Kind.FLOAT, _DEFAULT_CONNECT_TIMEOUT_S, minimum=0,
            maximum=MAX_TIMEOUT_S, strict_min=True, unit="s", help="connect timeout"),
    Setting("max_connections", Kind.INT, None, nullable=True, minimum=1,
            help="bound on pooled connections; callers wait for a free one (standalone only)"),
    Setting("batch_bytes", Kind.SIZE, _DEFAULT_BATCH_BYTES, minimum=4096, maximum=1 << 30,
            help="value bytes per pipeline: a larger batch call goes as several pipelines "
                 "(a block larger than this goes alone)"),
    Setting("connections", Kind.INT, _DEFAULT_CONNECTIONS, minimum=1, maximum=64,
            help="connections (per Cluster node) that one call's pipelines use at once; "
                 "1 with max_connections set"),
    *COMMON_SETTINGS,
))


def parse_redis_url(url: str, options: dict[str, Any]) -> RedisConfig:
    """Parse and validate a redis URL plus options; ``ValueError`` names the bad part."""
    shown = redact_url(url)
    try:
        parts, merged = split_url_options(url, options)
    except ValueError as exc:
        raise ValueError(f"redis backend URL {shown!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"redis backend URL {shown!r}: scheme {scheme + '://'!r} is not one of "
            f"{[s + '://' for s in _SCHEMES]}"
        )
    if parts.fragment:
        raise ValueError(f"redis backend URL {shown!r}: unexpected fragment '#...'")
    parsed = SETTINGS.parse(merged, "redis")
    topology = RedisTopology.CLUSTER if scheme.endswith("+cluster") else RedisTopology.STANDALONE
    tls = scheme.startswith("rediss")
    host, port = _host_and_port(parts, scheme, shown)
    username = _url_or_option("username", parts.username, parsed["username"], shown)
    password_text = _url_or_option("password", parts.password, parsed["password"], shown)
    _check_tls_options(merged, parsed, tls, topology, shown)
    if parsed["max_connections"] is not None and topology is RedisTopology.CLUSTER:
        # A cluster pipeline holds one connection per node at once; bounded per-node pools let
        # two threads deadlock on each other's nodes until the pool timeout.
        raise ValueError(
            f"redis backend URL {shown!r}: option max_connections is only supported for "
            "standalone servers, not redis+cluster://"
        )
    ttl_s = parsed["ttl_s"]
    return RedisConfig(
        topology=topology,
        tls=tls,
        host=host,
        port=port,
        db=_parse_db(parts.path, topology, shown),
        username=username,
        password=None if password_text is None else Secret(password_text),
        ssl_ca_certs=parsed["ssl_ca_certs"],
        ssl_certfile=parsed["ssl_certfile"],
        ssl_keyfile=parsed["ssl_keyfile"],
        ssl_check_hostname=parsed["ssl_check_hostname"],
        ttl_ms=None if ttl_s is None else round(ttl_s * 1000),
        socket_timeout_s=parsed["socket_timeout_s"],
        connect_timeout_s=parsed["connect_timeout_s"],
        max_connections=parsed["max_connections"],
        batch_bytes=parsed["batch_bytes"],
        connections=parsed["connections"],
        auth_key=load_auth_key(parsed, "redis"),
    )


def _host_and_port(parts: urllib.parse.SplitResult, scheme: str, shown: str) -> tuple[str, int]:
    host = parts.hostname
    if not host:
        raise ValueError(
            f"redis backend URL {shown!r}: missing host; expected {scheme}://HOST:PORT"
        )
    try:
        port = parts.port
    except ValueError:
        raw_port = parts.netloc.rpartition(":")[2]
        raise ValueError(
            f"redis backend URL {shown!r}: bad port {raw_port!r}; expected an integer 1..65535"
        ) from None
    if port is None:
        port = _DEFAULT_PORT
    if not 1 <= port <= 65535:
        raise ValueError(f"redis backend URL {shown!r}: bad port {port}; expected 1..65535")
    return host, port


def _check_tls_options(merged: dict[str, Any], parsed: dict[str, Any], tls: bool,
                       topology: RedisTopology, shown: str) -> None:
    tls_given = [name for name in _TLS_OPTIONS if name in merged]
    if tls_given and not tls:
        raise ValueError(
            f"redis backend URL {shown!r}: option(s) {tls_given} need TLS; use "
            f"{'rediss+cluster' if topology is RedisTopology.CLUSTER else 'rediss'}://"
        )
    for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = parsed[name]
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"option {name}={path!r}: no such file")
    if (parsed["ssl_certfile"] is None) != (parsed["ssl_keyfile"] is None):
        raise ValueError(
            "options ssl_certfile and ssl_keyfile go together (client certificate and its key)"
        )


MAX_DB = 2**31 - 1
"""The largest db index any Redis server accepts (SELECT takes a 32-bit integer). Which dbs
exist is the server's ``databases`` setting (16 by default): checked when a backend opens."""


def _parse_db(path: str, topology: RedisTopology, shown: str) -> int:
    text = path.strip("/")
    if topology is RedisTopology.CLUSTER:
        if text not in ("", "0"):
            raise ValueError(
                f"redis backend URL {shown!r}: bad db {text!r}; Redis Cluster has only db 0 "
                "(omit the path)"
            )
        return 0
    if text == "":
        return 0
    if not text.isdigit() or not text.isascii():
        raise ValueError(
            f"redis backend URL {shown!r}: bad db {text!r}; expected a non-negative integer "
            "path such as /0"
        )
    if len(text) > len(str(MAX_DB)) or int(text) > MAX_DB:
        raise ValueError(
            f"redis backend URL {shown!r}: bad db {text!r}; expected 0 to {MAX_DB} (and below "
            "the server's `databases` setting, 16 by default)"
        )
    return int(text)


def _url_or_option(name: str, from_url: str | None, option: str | Secret | None,
                   shown: str) -> str | None:
    if from_url is not None and from_url != "":
        if option is not None:
            raise ValueError(
                f"redis backend URL {shown!r}: {name} is given both in the URL and as an option"
            )
        return urllib.parse.unquote(from_url)
    return option.reveal() if isinstance(option, Secret) else option


# --------------------------------------------------------------------------- zero-copy sending
