"""``preheat`` commands forked from one interpreter that imported preheat's CLI once.

Every ``python -m preheat`` pays the import of jax and flax before it parses its first flag (3 s of
a ``preheat serve --help`` here, most of it); the docs' runnable blocks run twenty commands. Here
one *zygote* process imports :data:`PRELOAD` and then forks a process per command, so each command
still has a process of its own -- its own exit status, stdin/stdout/stderr, working directory,
environment and in-memory caches -- and runs ``preheat.cli.run()``, which ``python -m preheat``
runs. Only the import is shared. The zygote initialises no JAX backend and starts no thread before
it forks (numpy's BLAS pool is fork-safe, as for ``multiprocessing``'s fork).

``preheat`` on a block's PATH is :func:`shim`: a small Python client (no site, stdlib only) that
hands the zygote its argv, cwd, environment and its three standard file descriptors over a Unix
socket, and exits with the command's status. Where the socket is gone, or the command's
environment sets a variable the imports read (:data:`IMPORT_TIME_PREFIXES`) otherwise than the
zygote's, the shim runs ``python -m preheat`` itself: that costs time, never a result.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Mapping, NamedTuple

# What every command imports before it parses (preheat.cli.options pulls jax; flax.nnx is the next
# largest on `preheat sample`'s path).
PRELOAD = ("preheat.cli", "preheat.cli.options", "flax.nnx")
# Variables those imports read once, at import: jax's config flags (JAX_*), the BLAS and OpenMP
# pools' sizes. A command whose environment sets one of them differently from the zygote's is not
# forked (it would silently run with the zygote's value): the shim starts it fresh instead.
IMPORT_TIME_PREFIXES = ("JAX_", "OMP_", "OPENBLAS_", "MKL_")


def import_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` that :data:`PRELOAD` reads at import time."""
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}

_ZYGOTE = r'''
import json, os, signal, socket, sys

for name in sys.argv[2:]:
    __import__(name)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(16)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the per-request handlers are reaped by the kernel
sys.stdout.write("ready\n")
sys.stdout.flush()


def handle(conn):
    """One request: fork the command, wait for it, send its exit status back."""
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(message)
    print("forked:", *request["argv"], file=sys.stderr, flush=True)  # the zygote's log
    pid = os.fork()
    if pid == 0:  # the command's own process
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["preheat", *request["argv"]]
        from preheat.cli import run

        try:
            run()  # ends the process (os._exit) with the command's status
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    conn.send(str(code if code >= 0 else 128 - code).encode())


while True:
    conn, _ = listener.accept()
    if os.fork() == 0:
        listener.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            handle(conn)
        finally:
            os._exit(0)
    conn.close()
'''

_CLIENT = r'''
import json, os, socket, sys

try:
    if {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)} != IMPORTED_WITH:
        raise OSError("an import-time variable differs from the zygote's")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(SOCKET)
except OSError:  # no zygote, or one that imported with other settings: preheat started as usual
    os.execv(PYTHON, [PYTHON, "-m", "preheat", *sys.argv[1:]])
request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
reply = s.recv(16)
sys.exit(int(reply) if reply else 70)  # no reply: the command's handler died (EX_SOFTWARE)
'''


class Zygote(NamedTuple):
    proc: subprocess.Popen
    folder: Path  # short (a Unix socket's path is at most 107 bytes): the socket, the client, the zygote's log

    @property
    def socket(self) -> Path:
        return self.folder / "zygote.sock"


def start(env: Mapping[str, str]) -> Zygote:
    """A zygote started with ``env``, its imports done, listening on a socket of its own."""
    folder = Path(tempfile.mkdtemp(prefix="preheat-zygote-"))
    (folder / "client.py").write_text(f"SOCKET = {str(folder / 'zygote.sock')!r}\nPYTHON = {sys.executable!r}\n"
                                      f"PREFIXES = {IMPORT_TIME_PREFIXES!r}\nIMPORTED_WITH = {import_time_env(env)!r}\n"
                                      f"{_CLIENT}")
    with open(folder / "zygote.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE, str(folder / "zygote.sock"), *PRELOAD], env=dict(env),
                                stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log, text=True, cwd=folder)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        proc.wait(30)
        raise RuntimeError(f"the preheat zygote did not start: {(folder / 'zygote.log').read_text()[-3000:]}")
    return Zygote(proc, folder)


def stop(zygote: Zygote) -> None:
    """The zygote ends (each command it forked ended with its client) and its folder goes."""
    zygote.proc.kill()
    zygote.proc.wait(30)
    shutil.rmtree(zygote.folder, ignore_errors=True)


def shim(path: Path, zygote: Zygote) -> Path:
    """An executable ``preheat`` at ``path`` whose commands the zygote forks."""
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{zygote.folder / "client.py"}" "$@"\n')
    path.chmod(0o755)
    return path
