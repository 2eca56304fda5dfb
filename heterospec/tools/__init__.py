"""Command-line tools (``heterospec demo | generate | calibrate | bench | train-draft``): they import the
rest of the package and nothing imports them.  Their progress bars: :class:`ProgressBar` (tqdm)."""
from __future__ import annotations

import math
import sys


# the help of every command's --gguf-file
GGUF_HELP = ("a GGUF file inside --target's directory: transformers dequantizes it to float32, and on a CPU with "
             "AVX2 or AVX-512 our decoder reads its codes back (the K-quants, the IQ grids and the older formats)")
# the help of every command's --cpu-decoder (demo, generate, calibrate, bench)
CPU_DECODER_HELP = ("our engines' forwards on heterospec's own CPU code (float32 arithmetic, bfloat16/float16 weights "
                    "read as stored), the target's decoder and the EAGLE-3 draft's layer (auto: where supported; on: "
                    "insist on the target's; off: torch's modules)")


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


class ProgressBar:
    """``bar(i, n)``: step i of n done, drawn by tqdm (rate and ETA) on ``file``, default ``sys.stderr`` as it
    is when the bar starts (so pytest's capture and redirections are honoured).  ``desc=`` replaces the text
    before the bar, ``postfix=`` adds one after the rate.  The bar starts at the first call, starts again
    when n changes or i goes back, and ends (its last state on a line of its own) at i >= n or
    :meth:`close`.  tqdm is imported when a bar starts: the tools' argument parsing does not need it.

    The bar is drawn only by these calls (``maxinterval=inf``: tqdm's monitor thread never redraws it between
    them, e.g. over an answer streaming to the terminal, nor drops ``miniters`` to 1 after 10 s without a
    redraw).  On a terminal tqdm redraws one line in place (``\\r``), at most every 0.1 s (``mininterval``;
    ``miniters=1``: no step count learnt on fast steps holds the bar back when they turn slow).  Anywhere
    else (CI logs, ``2> file``, Jupyter's captured stderr) every redraw stays in the log, so the bar is
    redrawn every ``n / redraws`` steps whatever the time (``miniters``, ``mininterval=0``): ``redraws`` + 2
    times at most.  It is not switched off there (tqdm's ``disable=None``): a log keeps how far a run got
    and at what rate."""

    FORMAT = "{desc} [{bar:24}] {n_fmt}/{total_fmt} {elapsed}<{remaining}, {rate_fmt}{postfix}"

    def __init__(self, desc="", *, redraws=10, file=None):
        self.desc, self.redraws, self.file, self.bar, self._tty = desc, redraws, file, None, False

    def __call__(self, i, n, *, desc=None, postfix=None):
        if self.bar is None or n != self.bar.total or i < self.bar.n:
            self.close()
            self.bar = self._start(i, n, self.desc if desc is None else desc, postfix)
        else:
            if desc is not None:
                self.bar.set_description_str(desc, refresh=False)
            if postfix is not None:
                self.bar.set_postfix_str(postfix, refresh=False)
            if i < n:
                self.bar.update(i - self.bar.n)
            else:
                self.bar.n = i   # drawn once, by close
        if i >= n:
            self.close()

    def _start(self, i, n, desc, postfix):
        from tqdm import tqdm

        file = sys.stderr if self.file is None else self.file
        self._tty = _isatty(file)
        every = {"mininterval": 0.1, "miniters": 1} if self._tty else \
            {"mininterval": 0, "miniters": max(1, math.ceil(n / self.redraws))}
        return tqdm(total=n, initial=i, desc=desc, postfix=postfix, file=file, bar_format=self.FORMAT, ascii=" #",
                    maxinterval=math.inf, **every)

    def clear(self):
        """Erase the bar from a terminal, e.g. before other output on its line (the next call redraws it)."""
        if self.bar is not None and self._tty:
            self.bar.clear()

    def close(self):
        """End the bar (nothing when none is running)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
