"""Checks of the files a command will write, made before its work (a replay, sampling), so a
typo in a path costs one clear line at once, not a traceback after minutes."""

from __future__ import annotations

import pathlib


def unwritable_file(flag: str, path: str) -> str:
    """Why ``flag PATH`` cannot be written as a file, or "" (it may still fail later: a
    full disk, permissions, which the writer reports)."""
    target = pathlib.Path(path)
    if target.is_dir():
        return f"{flag} {path} is a directory; name a file"
    parent = target.resolve().parent
    if not parent.is_dir():
        return f"{flag} {path}: no directory {parent}"
    return ""
