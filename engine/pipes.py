"""Output to a reader that went away (`shoal plan | head`): the rest is dropped, not raised,
so that a command runs to its end and keeps its exit status, without a BrokenPipeError
traceback."""

from __future__ import annotations

import io
import os
import sys


class PipeSafe:
    """sys.stdout or sys.stderr that, once the reader has gone (`shoal plan | head`), drops
    the rest of the output instead of raising: the command runs to its end and keeps its
    exit status, with no BrokenPipeError traceback."""

    def __init__(self, stream: io.TextIOWrapper) -> None:
        self._stream = stream

    def _gone(self) -> None:
        # Point the descriptor at /dev/null, so that what is still buffered goes there too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()
            self._stream.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def guard_standard_streams() -> None:
    """Put sys.stdout and sys.stderr behind PipeSafe, once per process, for the rest of its
    life: its last flush, at exit, needs the guard too."""
    sys.stdout, sys.stderr = (s if isinstance(s, PipeSafe) else PipeSafe(s)
                              for s in (sys.stdout, sys.stderr))
