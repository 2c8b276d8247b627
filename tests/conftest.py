"""Temporary development fixture (to be replaced by the project's conftest)."""

import os

import pytest


@pytest.fixture(scope="session")
def pg_admin_dsn():
    """libpq DSN of a superuser connection, from CDC_TEST_PG_ADMIN_DSN; skip when unset."""
    dsn = os.environ.get("CDC_TEST_PG_ADMIN_DSN")
    if not dsn:
        pytest.skip("CDC_TEST_PG_ADMIN_DSN is not set")
    return dsn
