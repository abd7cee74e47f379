"""Shared fixtures. Fixture modules live in tests/fixtures/ (one per area)."""

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.servers",
    "tests.fixtures.stack",
]
