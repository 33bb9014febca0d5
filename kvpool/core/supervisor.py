"""One supervisor for a daemon's background work. A task that raises stops the whole
daemon loudly (logged, non-zero exit) instead of silently switching a feature off."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger("kvpool.supervisor")


class Supervisor:
    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.failure: BaseException | None = None
        self._threads: list[threading.Thread] = []

    def every(self, name: str, interval_ms: int, task: Callable[[], object]) -> None:
        """Run ``task`` every ``interval_ms`` until stop."""

        def loop() -> None:
            while not self.stopping.wait(interval_ms / 1000.0):
                task()

        self.spawn(name, loop)

    def spawn(self, name: str, target: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # crash loudly: the daemon must not limp on
                log.critical("background task %r crashed: %s", name, exc, exc_info=True)
                self.fail(exc)

        thread = threading.Thread(target=guarded, name=f"kvpool-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def fail(self, exc: BaseException) -> None:
        """A task owned elsewhere (an etcd role on its session's loop) crashed: stop the
        daemon as if one of ours had."""
        self.failure = exc
        self.stopping.set()

    def stop(self, join_timeout_s: float = 5.0) -> None:
        self.stopping.set()
        for thread in self._threads:
            thread.join(join_timeout_s)

    def install_stop_signals(self) -> None:
        """SIGTERM/SIGINT set ``stopping``. Call before serving starts, so a signal that
        arrives during start-up still shuts down cleanly; a no-op off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("signal %d: shutting down", signum)
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def wait_for_stop(self) -> bool:
        """Block until SIGTERM/SIGINT or a crashed task; True if a task crashed."""
        self.install_stop_signals()
        while not self.stopping.wait(0.5):
            pass
        return self.failure is not None
