"""The end of SIGTERM's drain: the listening port closed without resetting a connection the kernel had already
accepted (Linux; elsewhere the port closes as before). :func:`close_the_door` is called by
:func:`batcher.app._drain_on_sigterm` between the drain and the exit."""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import logging
import os
import socket
import struct
import termios

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the end of the drain: the port
#: ``SO_ATTACH_FILTER`` (``asm-generic/socket.h``): a classic BPF program that filters what reaches a socket
SO_ATTACH_FILTER = 26
#: A socket filter that drops TCP segments with SYN set and ACK clear - new connection attempts - and keeps every
#: other (a TCP socket's filter sees the segment from its TCP header on): ``ldb [13]`` (the flags), ``and #0x12``,
#: ``jeq #0x02`` drop, else keep. Handshakes already under way complete (their ACK passes).
DROP_NEW_CONNECTIONS = ((0x30, 0, 0, 13), (0x54, 0, 0, 0x12), (0x15, 0, 1, 0x02), (0x06, 0, 0, 0),
                        (0x06, 0, 0, 0xFFFFFFFF))
#: the longest :func:`close_the_door` waits for what the kernel accepted to be taken and read, seconds
DOOR_WAIT_S = 2.0
_TCP_ESTABLISHED, _TCP_SYN_RECV = 1, "03"  # tcp_info's state; /proc/net/tcp's st column
_TCP_INFO_BYTES = 232


def _tcp_sockets() -> list[socket.socket]:
    """This process's TCP sockets, each through a duplicate of one of its descriptors (close them after use):
    Linux's ``/proc/self/fd``; none where it is missing."""
    out: list[socket.socket] = []
    seen: set[str] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if not target.startswith("socket:") or target in seen:
                continue
            fd = os.dup(int(name))
        except (OSError, ValueError):  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            continue
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            seen.add(target)
            out.append(sock)
        else:
            sock.close()
    return out


def _half_open_handshakes(ports: set[int]) -> int:
    """Handshakes to ``ports`` the kernel is in the middle of (``SYN_RECV`` in ``/proc/net/tcp``, ``tcp6``)."""
    n = 0
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == _TCP_SYN_RECV and int(fields[1].rsplit(":", 1)[1], 16) in ports:
                n += 1
    return n


def _waiting(ports: set[int]) -> int:
    """Connections to ``ports`` the server still owes a look: in an accept queue, in the middle of their handshake,
    or accepted with bytes not read yet or nothing sent yet."""
    n = _half_open_handshakes(ports)
    for sock in _tcp_sockets():
        try:
            if sock.getsockname()[1] not in ports:
                continue
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                n += struct.unpack_from("I", info, 24)[0]  # tcpi_unacked: a listener's accept queue
            elif info[0] == _TCP_ESTABLISHED:
                unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
                received = struct.unpack_from("Q", info, 128)[0] if len(info) >= 136 else 1  # tcpi_bytes_received
                n += unread > 0 or received == 0
        except OSError:
            pass
        finally:
            sock.close()
    return n


async def close_the_door(wait_s: float = DOOR_WAIT_S, poll_s: float = 0.005) -> None:
    """The end of SIGTERM's drain, before aiohttp closes the listening sockets (Linux; elsewhere nothing is done).

    Closing a listening socket resets every connection still in its accept queue (the kernel completed their
    handshake; the server had not taken them yet), and closing a connection whose bytes were never read resets it
    too: clients that connected in the last moments of the drain got a reset instead of an answer. So new
    connection attempts are dropped first (:data:`DROP_NEW_CONNECTIONS` on every listening socket of the process:
    the client sends its SYN again a second later and then finds the port closed, refused, which is safe to
    retry), and the event loop goes on taking and answering (503 + ``Retry-After``, ``Connection: close``) what the
    kernel accepted, until no connection is in an accept queue or half-way through its handshake, and every
    accepted one has sent something and had it read - at most ``wait_s`` (a client that connects and sends nothing
    is closed then, as an idle keep-alive connection is)."""
    sockets = _tcp_sockets()
    ports: set[int] = set()
    try:
        program = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *op) for op in DROP_NEW_CONNECTIONS))
        fprog = struct.pack("@HP", len(DROP_NEW_CONNECTIONS), ctypes.addressof(program))
        for sock in sockets:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
                ports.add(sock.getsockname()[1])
    except OSError as exc:  # no socket filters here: close as before
        log.debug("cannot hold back new connections (%s); closing the port", exc)
        return
    finally:
        for sock in sockets:
            sock.close()
    if not ports:
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + wait_s
    while (waiting := _waiting(ports)) and loop.time() < end:
        await asyncio.sleep(poll_s)
    if waiting:
        log.info("closing the port with %d connection(s) still unanswered after %.1f s", waiting, wait_s)
