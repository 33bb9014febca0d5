"""Moved to ``kvpool.core.supervisor`` (the directory uses it too, and sits below the
daemon); this name stays so existing imports keep working."""

from kvpool.core.supervisor import Supervisor

__all__ = ["Supervisor"]
