"""The one exception family of Shoal, its messages written for the user: the CLIs print them
without a traceback and exit non-zero; the servicers map them to gRPC status codes."""


class ShoalError(Exception):
    """An expected failure with a message a user can act on."""


class InvalidInput(ShoalError):
    """A request, file or argument is malformed (gRPC: INVALID_ARGUMENT)."""


class NotFound(ShoalError):
    """A file, expert or worker that was asked for does not exist (gRPC: NOT_FOUND)."""


class Unauthenticated(ShoalError):
    """A peer did not prove it holds the cluster secret (gRPC: UNAUTHENTICATED)."""


class Unavailable(ShoalError):
    """A worker cannot be reached or an expert has no live owner (gRPC: UNAVAILABLE)."""


class Moved(ShoalError):
    """A worker was asked for an expert it has since given up; ask where it is now (gRPC:
    ABORTED, which callers answer by fetching the inventory again and retrying)."""


class CorruptData(ShoalError):
    """A file's bytes do not match its recorded checksum or format (gRPC: DATA_LOSS)."""


MAX_ECHO = 200  # characters of a client's own string quoted back in a message
MAX_MESSAGE = 2000  # characters of any message a worker sends back (gRPC metadata is limited)


def worded(error: ShoalError | OSError) -> str:
    """What a command prints for `error`: a ShoalError's message, or for an I/O error nobody
    expected (a folder that is a file, a full disk) the path and the problem, as in
    "/tmp/map.png: No such file or directory"."""
    if isinstance(error, ShoalError):
        return str(error)
    problem = error.strerror or str(error) or type(error).__name__
    paths = [str(path) for path in (error.filename, error.filename2) if path is not None]
    return f"{' -> '.join(paths)}: {problem}" if paths else problem


def clip(text: object, limit: int = MAX_ECHO) -> str:
    """`text` as a string of at most about `limit` characters, saying how much was cut: how
    a message quotes what a client sent, and how every message sent back is bounded."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s) - limit} more characters)"
