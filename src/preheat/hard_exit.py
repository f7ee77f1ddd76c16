"""Ending a preheat process after its atexit handlers, without the interpreter's finalisation.

Finalisation stops daemon threads where they stand, and one inside XLA (an executable loading in
the background while a command fails, a warm-up compile when a server is stopped, a loaded
executable's thread when the Runpod SDK's local test mode returns) then aborts the process:
"FATAL: exception not rethrown", exit 134 (-6), after the command's own one-line error or clean
shutdown. A leaf module, so every entry point (the CLI, the server, the Runpod worker) can use it."""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Callable


def run_and_exit(command: Callable[..., Any], **options: Any) -> None:
    """``command(**options)``, then the atexit handlers (the wait for uploads to the fleet's store,
    logging's flush), the standard streams flushed, and ``os._exit`` with the command's status
    (``SystemExit``'s, as the interpreter would report it; 0 when it returns)."""
    try:
        command(**options)
        code: int = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit("message"), as the interpreter would print it
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said
            pass
    os._exit(code)
