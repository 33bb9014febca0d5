"""A put's write window switched a piece at a time while the copy runs (``PipelinedWindow``).

Why: without memory protection keys, a put opens its pages with ``mprotect`` before the copy
and shuts them after (``ProtectedWindow``): two walks over every page-table entry of the
put, ~10-16 ms per 256 MiB on 4 KiB pages here, as much as half of the copy. Cut into pieces,
the next piece is opened and the last one shut by the write mapping's helper thread while
this thread copies, so the switching hides behind the copy (a two-thread check: 256 MiB
opened, copied and shut in 16-18 ms instead of 26-27; docs/benchmarks.md).

The promise of a window is kept: a page is writable only from its piece's open to its shut,
both inside the put, and ``close`` returns only after every piece is shut (or was never
opened). The copy touches a piece only inside ``writing(start, stop)``, which waits until
the pieces under ``[start, stop)`` are open; a piece is shut as soon as writes covered all
of it. Used for puts whose bytes one thread copies itself (``write_rows``), where the
window knows what is written when; an engine's fill writes where it likes and keeps the
plain window. A put of one piece never uses the helper: it is a ``ProtectedWindow``.
"""

from __future__ import annotations

import bisect
import logging
import mmap
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.core.arena_map import ProtectedWindow, WriteMapping
from kvpool.core.errors import Unavailable

log = logging.getLogger(__name__)


@dataclass
class _Piece:
    start: int
    stop: int
    opened: Future[Any] | None  # None: opened by the constructor's thread
    written: int = 0  # bytes of it the copy has filled
    shut: Future[Any] | None = None  # submitted once written covers it


class PipelinedWindow(ProtectedWindow):
    """A ``ProtectedWindow`` whose pages are opened ahead of the copy and shut behind it, a
    piece of ``piece_bytes`` (``arena_map.PUT_PIECE_BYTES``, a multiple of ``page_bytes``) at
    a time, on the write mapping's helper thread (module docstring). Write only inside
    ``writing(start, stop)``."""

    def __init__(
        self,
        writer: WriteMapping,
        capacity_bytes: int,
        offsets: Sequence[int],
        length: int,
        page_bytes: int,
        piece_bytes: int,
    ) -> None:
        if piece_bytes <= 0 or piece_bytes % page_bytes:
            raise ValueError(f"piece_bytes {piece_bytes} is not a positive multiple of the page, {page_bytes}")
        self._piece_bytes = piece_bytes
        # taken once: ``WriteMapping.helper`` takes the mapping's lock, which the helper holds
        # through each switch (~0.3 ms a 16 MiB piece here); asked for at every submit, it made
        # the copy wait out the switch it was meant to run beside
        self._helper = writer.helper()
        self._pieces: list[_Piece] = []
        self._piece_starts: list[int] = []
        super().__init__(writer, capacity_bytes, offsets, length, page_bytes)

    def _open_run(self, start: int, stop: int) -> tuple[mmap.mmap | None, np.ndarray]:
        """The run's first piece opened now (the copy starts there), the rest queued in order.
        A failure part-way (the mapping closed meanwhile) shuts what this run opened before
        it propagates: the constructor's ``close`` covers only runs that were opened whole."""
        try:
            for piece_start in range(start, stop, self._piece_bytes):
                piece_stop = min(piece_start + self._piece_bytes, stop)
                if not self._pieces:
                    self._writer.open(piece_start, piece_stop)
                    opened = None
                else:
                    try:
                        opened = self._helper.submit(self._writer.open, piece_start, piece_stop)
                    except RuntimeError:  # the helper was shut down: the mapping closed
                        raise Unavailable("the arena mapping was closed during this put") from None
                self._pieces.append(_Piece(piece_start, piece_stop, opened))
                self._piece_starts.append(piece_start)
        except BaseException:
            try:
                self._close_run(start, stop, None)
            except BaseException as exc:  # the first error is the one to report
                log.warning("shutting a put window that failed to open: %s", exc)
            raise
        return None, self._writer.view[start:stop]

    def _under(self, start: int, stop: int) -> list[_Piece]:
        first = bisect.bisect_right(self._piece_starts, start) - 1
        pieces = []
        for piece in self._pieces[max(first, 0) :]:
            if piece.start >= stop:
                break
            if piece.stop > start:
                pieces.append(piece)
        return pieces

    def writing(self, start: int = -1, stop: int = -1) -> AbstractContextManager[None]:
        """Around a write of arena bytes ``[start, stop)``: waits until their pieces are open
        (raising what opening them raised), and after the write shuts the pieces it filled."""
        if start < 0:
            raise ValueError("a pipelined window needs the bytes each write covers")
        return self._writing(start, stop)

    @contextmanager
    def _writing(self, start: int, stop: int) -> Iterator[None]:
        pieces = self._under(start, stop)
        for piece in pieces:
            if piece.opened is not None:
                piece.opened.result()
        yield
        for piece in pieces:
            piece.written += min(stop, piece.stop) - max(start, piece.start)
            if piece.written >= piece.stop - piece.start and piece.shut is None:
                try:
                    piece.shut = self._helper.submit(self._writer.shut, piece.start, piece.stop)
                except RuntimeError:  # the helper was shut down (the mapping closed): close shuts it
                    raise Unavailable("the arena mapping was closed during this put") from None

    def _close_run(self, start: int, stop: int, mapping: mmap.mmap | None) -> None:
        """Every piece of the run shut before this returns: queued opens are cancelled, the
        rest waited for; the first error is raised after all of them were dealt with."""
        error: BaseException | None = None
        for piece in self._under(start, stop):
            try:
                if piece.opened is not None and (piece.opened.cancel() or piece.opened.exception() is not None):
                    continue  # never opened: nothing to shut
                if piece.shut is None:  # not filled (a failed copy): shut here, beside the helper's
                    self._writer.shut(piece.start, piece.stop)
            except BaseException as exc:  # the other pieces must still be shut
                error = error or exc
        for piece in self._under(start, stop):
            try:
                if piece.shut is not None:
                    piece.shut.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
