"""Stopping a run by SIGINT (Ctrl-C) or SIGTERM: the first signal saves and stops, a second stops now.

While ``StopSignals`` is open, the first signal is noted in ``received`` (the loop saves a checkpoint at
the end of its step, or between two batches of an evaluation, and stops) and said at once on stderr:

    lra-run: stopping: saving at the end of this step; Ctrl-C again to stop now

A second signal ends the process at once (exit status 130), saying which checkpoint the same command
will continue from. Every file of a run is written to a temporary name and renamed into place, so the
last checkpoint is whole whatever the moment (run/folder.py; a resume cuts metrics.jsonl back to it).

The signals are read by a thread woken through ``signal.set_wakeup_fd``: Python runs a signal handler
only between two bytecodes of the main thread, which can sit for seconds inside one long operation
(an attention call, a matrix product), while the C-level handler writes the signal's number to the
wakeup socket at once. The Python-level handler notes the stop too (for the main thread's next check;
the thread may come second), and keeps the default handlers (KeyboardInterrupt, termination) away.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Dict, Optional

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# what the first signal says will happen, by what the run is doing when it arrives
PLANS = {
    "step": "saving at the end of this step",
    "evaluation": "saving before the next batch of this evaluation",
    "test": "saving before the next batch of the test",
    "record": "the run has finished and is writing its record",
}
# the process's exit status when a second signal stops it (128 + SIGINT, as a shell reports Ctrl-C)
EXIT_NOW = 130


class StopSignals:
    """While open, SIGINT and SIGTERM are noted (``received``) and said instead of killing the process;
    a second one ends it at once. ``phase`` (a key of PLANS) is what the run is doing; ``kept()`` says
    which checkpoint a stop now leaves. The previous handlers come back on close."""

    def __init__(self, kept: Callable[[], str] = lambda: "the last checkpoint is kept", prog: str = "lra-run") -> None:
        self.received: Optional[int] = None
        self.phase = "step"
        self.kept = kept
        self.prog = prog
        # signals the watching thread has seen
        self.seen = 0

    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> "StopSignals":
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous: Dict[int, Any] = {s: signal.signal(s, self.note) for s in STOP_SIGNALS}
        self.previous_fd = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self.watch, name="stop-signals", daemon=True)
        self.thread.start()
        return self

    def watch(self) -> None:
        """Each signal as it arrives: the first is noted and said, a second ends the process."""
        while True:
            try:
                data = self.reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS:
                    self.arrived(signum)

    def note(self, signum: int, _frame: Any) -> None:
        """The Python-level handler (the main thread, at its next bytecode): the stop is noted."""
        if self.received is None:
            self.received = signum

    def arrived(self, signum: int) -> None:
        """The watching thread's: said at once, and a second signal ends the process."""
        self.seen += 1
        if self.seen == 1:
            if self.received is None:
                self.received = signum
            again = "Ctrl-C again" if signum == signal.SIGINT else "a second signal"
            say(f"{self.prog}: stopping: {PLANS.get(self.phase, PLANS['step'])}; {again} to stop now")
            return
        say(f"{self.prog}: stopped now; {self.kept()}")
        os._exit(EXIT_NOW)

    def __exit__(self, *exc: Any) -> None:
        signal.set_wakeup_fd(self.previous_fd)
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        # the reader sees the end of the stream and the thread returns
        self.writer.close()
        self.thread.join(timeout=5)
        self.reader.close()


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
