"""Progress lines on stderr that suit both a terminal and a log file.

On a terminal one line is redrawn in place (``\\r``); anywhere else (CI logs, ``2> file``, Jupyter's captured
stderr) a ``\\r`` would leave hundreds of overwritten lines in the log, so a full line is written only when the
completed tenth changes and at the end."""
from __future__ import annotations

import sys


class Progress:
    """``p(text, i, n)`` reports step i of n; ``p.done()`` ends the line.  ``stream`` defaults to stderr at
    the time of each call (so pytest's capture and redirections are honoured)."""

    def __init__(self, stream=None):
        self._stream = stream
        self._last = None
        self._open = False

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    def _tty(self):
        isatty = getattr(self.stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed stream
            return False

    def __call__(self, text, i, n):
        if self._tty():
            print("\r" + text, end="", file=self.stream, flush=True)
            self._open = True
            return
        tenth = (10 * i) // max(n, 1)
        if tenth != self._last or i >= n:
            if i < n or self._last != "end":
                print(text, file=self.stream, flush=True)
            self._last = "end" if i >= n else tenth

    def clear(self):
        """Erase the redrawn line (a terminal only)."""
        if self._tty() and self._open:
            print("\r" + " " * 79 + "\r", end="", file=self.stream, flush=True)
            self._open = False

    def done(self):
        """End the redrawn line (a terminal only; log lines already end)."""
        if self._tty() and self._open:
            print(file=self.stream, flush=True)
            self._open = False
