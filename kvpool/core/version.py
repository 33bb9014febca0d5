"""kvpool's version, in the lowest layer so that every layer (the CLI's ``--version`` too) can
name it without importing the package root; ``tests/unit/test_packaging.py`` keeps it equal to
pyproject.toml's."""

VERSION = "0.1.0"
