"""The port Serve's proxy will listen on: never one another process already listens on.

Ray Serve's proxy binds its port with SO_REUSEPORT (ray/serve/_private/proxy.py, `set_socket_reuse_port` in
http_util.py), so a second Serve on a port that one already holds does not fail: both listen and the kernel
splits new connections between them. Before art-ray starts Serve it probes the port with a plain bind
(SO_REUSEADDR, never SO_REUSEPORT), which any listener makes fail. A port the user asked for that is held
is an error (`PortInUseError`); the default one, held, gives way to a free port, and the user is told.

Two art-ray processes on one machine could probe at the same moment and both find the port free; a file
lock serializes probe and start (`machine_lock`) until the first proxy listens.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Callable, Iterator

from art_ray.errors import PortInUseError

DEFAULT_PORT = 8000
LOCK_FILE = "art-ray-serve-start.lock"

Probe = Callable[[str, int], str | None]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_holder(host: str, port: int) -> str | None:
    """None when nothing listens on host:port; else who does (`describe_listener`)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR: a connection left in TIME_WAIT by an earlier server is no listener. Never
        # SO_REUSEPORT: with it this bind would succeed beside a proxy that set it too, the case to catch.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            return describe_listener(port)
    return None


def describe_listener(port: int) -> str:
    """Who listens on `port` on this machine: "pid N (command)" for each process that can be seen, else
    "another process" (another user's sockets, or a system that hides them)."""
    try:
        import psutil

        pids = {
            connection.pid
            for connection in psutil.net_connections(kind="inet")
            if connection.status == psutil.CONN_LISTEN
            and connection.laddr
            and connection.laddr.port == port
            and connection.pid is not None
        }
        holders = []
        for pid in sorted(pids):
            try:
                process = psutil.Process(pid)
                # Ray's workers pad their process titles (setproctitle) with spaces
                command = " ".join(" ".join(process.cmdline()).split()) or process.name()
            except psutil.Error:
                command = "?"
            holders.append(f"pid {pid} ({command[:120]})")
    except Exception:  # noqa: BLE001 - psutil missing or not permitted: the port is held all the same
        holders = []
    return ", ".join(holders) if holders else "another process"


def free_port(host: str) -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def choose_port(
    host: str,
    port: int | None,
    how_to_choose: str,
    *,
    default: int = DEFAULT_PORT,
    probe: Probe = port_holder,
    free: Callable[[str], int] = free_port,
    say: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
    """The port Serve may start on: `port` if free (PortInUseError naming its holder if not); with no
    port asked for, `default` if free, else a free one, which `say` announces."""
    if port is not None:
        holder = probe(host, port)
        if holder is not None:
            raise PortInUseError(host, port, holder, how_to_choose)
        return port
    holder = probe(host, default)
    if holder is None:
        return default
    chosen = free(host)
    say(
        f"art-ray: port {default} on {host} is in use by {holder}; Serve listens on port {chosen} instead "
        f"(choose one with {how_to_choose})"
    )
    return chosen


@contextlib.contextmanager
def machine_lock(
    say: Callable[[str], None] = lambda line: print(line, flush=True), lock_file: str | None = None
) -> Iterator[None]:
    """Held by one art-ray process on this machine at a time while it probes a port and starts Serve, so a
    second one probes only once the first one's proxy listens. Without a lock file to open (another
    user's, no fcntl) it goes on unlocked: another user's proxy cannot share this user's port anyway.
    `lock_file`: the machine's (in the temp folder) unless given."""
    try:
        import fcntl

        path = lock_file or os.path.join(tempfile.gettempdir(), LOCK_FILE)
        descriptor = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("art-ray: waiting for another art-ray process on this machine to finish starting Serve")
            fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock
