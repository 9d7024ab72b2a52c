"""For benchmarks that run the control plane's code in their own process: Django on a test
database, as the test suite sets it up."""

from __future__ import annotations

import os


def setup_test_database() -> None:
    """Django set up in this process on a fresh test database (in memory on the embedded
    defaults), as the test suite runs it."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    connection.creation.create_test_db(verbosity=0)
