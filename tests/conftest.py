"""Shared pytest configuration: real servers are provided by the plugins in tests/servers/."""

pytest_plugins = ["servers.valkey", "servers.seaweed"]
