"""Where the weight sockets may listen and connect: loopback TCP, or a Unix socket in a private directory.

An endpoint is exactly one of

    ipc://<absolute path>            (its directory owned by this user, writable by nobody else)
    tcp://127.0.0.1:<port>   tcp://[::1]:<port>   tcp://localhost:<port>     (port 1-65535)

Anything else is refused before ZeroMQ sees it: ZeroMQ reads more than it shows (`a;b` is a source
address then the one to use, `*` is every interface, a name may be a network interface), and after
bind or connect the address the socket really took is checked again.
"""
from __future__ import annotations

import atexit
import os
import re
import socket as pysocket
import stat
import tempfile
import weakref

import zmq

ALLOWED = ("allowed: ipc://<absolute path> (in a directory only you can write to; private_ipc_endpoint() makes "
           "one), tcp://127.0.0.1:<port>, tcp://[::1]:<port> or tcp://localhost:<port> with port 1-65535")
_TCP = re.compile(r"tcp://(127\.0\.0\.1|\[::1\]|localhost):([0-9]{1,5})")
_BOUND_TCP = re.compile(r"tcp://(127\.0\.0\.1|\[::1\]|\[::ffff:127\.0\.0\.1\]):([0-9]{1,5})")
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
_PRIVATE_DIRS: set[str] = set()  # made by private_ipc_endpoint: removed with the socket in them
_PRIVATE_PREFIX = "rollout-engine-"  # a private directory's name: this and mkdtemp's 8 random characters


def check_endpoint(endpoint, *, bind: bool = False) -> str:
    """`endpoint` if it is allowed, else ValueError naming it and what is allowed. With bind=True port 0
    (a free port, chosen by the system: read it back from the receiver's `endpoint`) is allowed too."""
    if not isinstance(endpoint, str):
        raise ValueError(f"endpoint={endpoint!r} is not allowed: it must be a str; {ALLOWED}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            raise ValueError(f"endpoint={endpoint!r} is not allowed: an ipc path must be absolute; {ALLOWED}")
        if any(c in path for c in ";*") or any(ord(c) < 32 or ord(c) == 127 for c in path):
            raise ValueError(f"endpoint={endpoint!r} is not allowed: ';', '*' and control characters have "
                             f"meanings of their own to ZeroMQ; {ALLOWED}")
        if len(path.encode()) > _UNIX_PATH_MAX:
            raise ValueError(f"endpoint={endpoint!r} is not allowed: a Unix socket path has at most "
                             f"{_UNIX_PATH_MAX} bytes; {ALLOWED}")
        return endpoint
    match = _TCP.fullmatch(endpoint)
    port = int(match[2]) if match else -1
    if not match or port > 65535 or (port == 0 and not bind) or match[2] != str(port):
        raise ValueError(f"endpoint={endpoint!r} is not allowed; {ALLOWED}")
    return endpoint


def zmq_address(endpoint: str) -> str:
    """What ZeroMQ is given: localhost pinned to 127.0.0.1 (bind takes no host names, and connect would
    resolve it however the system's resolver says)."""
    return endpoint.replace("tcp://localhost:", "tcp://127.0.0.1:", 1)


def use_ipv6(sock: zmq.Socket, endpoint: str) -> None:
    """IPv6 only for [::1]: with it on, an IPv4 socket reports its address as [::ffff:127.0.0.1]."""
    sock.setsockopt(zmq.IPV6, int(endpoint.startswith("tcp://[::1]:")))


def check_bound(sock: zmq.Socket, endpoint: str) -> str:
    """The address `sock` really took after bind/connect to `endpoint`; ValueError unless it is loopback
    (or the ipc path given)."""
    actual = sock.getsockopt(zmq.LAST_ENDPOINT).decode(errors="replace")
    wanted = zmq_address(endpoint)
    if wanted.startswith("ipc://"):
        ok = actual == wanted
    else:
        match, port = _BOUND_TCP.fullmatch(actual), wanted.rsplit(":", 1)[1]
        host = match and match[1].replace("[::ffff:127.0.0.1]", "127.0.0.1")
        ok = match is not None and host == wanted[len("tcp://"):].rsplit(":", 1)[0] and port in ("0", match[2])
    if not ok:
        raise ValueError(f"endpoint={endpoint!r} made the socket take {actual!r}, which is not the loopback "
                         f"address (or ipc path) asked for; {ALLOWED}")
    return actual


def private_ipc_endpoint(name: str = "weights") -> str:
    """ipc://<a fresh directory of mode 0700>/<name>. The receiver bound there removes the socket and the
    directory when it closes (or at exit)."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name) or name in (".", ".."):
        raise ValueError(f"name={name!r} is not allowed; 1 to 64 of A-Z a-z 0-9 . _ -")
    directory = tempfile.mkdtemp(prefix=_PRIVATE_PREFIX, dir=_socket_parent(name))  # mode 0700
    _PRIVATE_DIRS.add(directory)
    atexit.register(_remove_private_dir, directory)  # when nothing was ever bound in it
    return check_endpoint(f"ipc://{directory}/{name}")


def _socket_parent(name: str) -> str:
    """The temporary directory, or /tmp where a socket's path under it would pass _UNIX_PATH_MAX (a cluster job's
    TMPDIR is often that long)."""
    parent = tempfile.gettempdir()
    socket_path = f"{parent}/{_PRIVATE_PREFIX}{'x' * 8}/{name}"
    return parent if len(os.fsencode(socket_path)) <= _UNIX_PATH_MAX else "/tmp"


def _remove_private_dir(directory: str) -> None:
    if directory in _PRIVATE_DIRS:
        try:
            os.rmdir(directory)
            _PRIVATE_DIRS.discard(directory)
        except OSError:
            pass  # not empty: something else lives there now


def check_ipc_directory(path: str) -> None:
    """ipc://`path`'s directory must be this user's and writable by nobody else (so no one else can put, move
    or replace a socket there: a sender connecting to one would hand its weights to whoever bound it), and so
    must each directory above it be, or root's, or sticky (/tmp) above one of this user's: whoever may write a
    directory may rename what it holds and put their own in its place. A symbolic link on the way is held to the
    same rule, and must be this user's or root's: whoever owns a link may point it elsewhere."""
    directory = os.path.dirname(path) or "/"
    try:
        st = os.stat(directory)
    except OSError as err:
        raise ValueError(f"endpoint='ipc://{path}': its directory {directory!r} cannot be used "
                         f"({err.strerror})") from None
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ValueError(f"endpoint='ipc://{path}' is not allowed: its directory {directory!r} (mode "
                         f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}) must be owned by this user (uid "
                         f"{os.geteuid()}) and writable by nobody else; {ALLOWED}")
    _check_above(os.path.realpath(directory), st.st_uid, path)
    _check_links(directory, path)


def _check_above(child: str, owner: int, path: str) -> None:
    """Each directory above `child` (a resolved path, owned by `owner`) lets nobody else replace what it holds."""
    while child != "/":
        parent = os.path.dirname(child)
        up = os.stat(parent)
        guarded = not up.st_mode & 0o022 or up.st_mode & stat.S_ISVTX and owner == os.geteuid()
        if up.st_uid not in (0, os.geteuid()) or not guarded:
            raise ValueError(f"endpoint='ipc://{path}' is not allowed: {parent!r} above it (mode "
                             f"{stat.S_IMODE(up.st_mode):o}, uid {up.st_uid}) lets others replace {child!r}; "
                             f"each directory above must be this user's or root's and writable by nobody else "
                             f"(or sticky, as /tmp is); {ALLOWED}")
        child, owner = parent, up.st_uid


MAX_LINKS = 40  # the links one path may go through, as the kernel allows (ELOOP past that)


def _check_links(directory: str, path: str) -> None:
    """Each symbolic link met on the way to `directory`, as the kernel walks it (a link's target component by
    component, ".." after the link is followed), is this user's or root's and in a directory that lets nobody
    else replace it."""
    pending = [part for part in directory.split("/") if part not in ("", ".")]
    reached, links = ("/" if directory.startswith("/") else os.getcwd()), 0
    while pending:
        part = pending.pop(0)
        if part == "..":  # whoever could replace the directory left would choose where ".." lands
            owner = os.lstat(reached).st_uid
            if owner not in (0, os.geteuid()):
                raise ValueError(f"endpoint='ipc://{path}' is not allowed: it leaves {reached!r} (uid {owner}'s) by "
                                 f"'..', so that user decides where it lands; {ALLOWED}")
            _check_above(reached, owner, path)
            reached = os.path.dirname(reached)  # `reached` holds no link: its parent is the kernel's ".."
            continue
        step = os.path.join(reached, part)
        try:
            st = os.lstat(step)
        except OSError as err:
            raise ValueError(f"endpoint='ipc://{path}': {step!r} on its way cannot be used ({err.strerror})") from None
        if not stat.S_ISLNK(st.st_mode):
            reached = step
            continue
        links += 1
        if links > MAX_LINKS or st.st_uid not in (0, os.geteuid()):
            why = (f"it goes through more than {MAX_LINKS} symbolic links" if links > MAX_LINKS else
                   f"the symbolic link {step!r} on its way is uid {st.st_uid}'s, who may point it elsewhere; links "
                   f"on the way must be this user's (uid {os.geteuid()}) or root's")
            raise ValueError(f"endpoint='ipc://{path}' is not allowed: {why}; {ALLOWED}")
        _check_above(step, st.st_uid, path)
        target = os.readlink(step)
        pending = [p for p in target.split("/") if p not in ("", ".")] + pending
        if target.startswith("/"):
            reached = "/"


def check_ipc_path(path: str) -> None:
    """Before binding ipc://`path`: check_ipc_directory, and no live socket may be bound at `path` already
    (ZeroMQ's bind would silently take the path over from it). A stale socket file is replaced."""
    check_ipc_directory(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ValueError(f"endpoint='ipc://{path}' is not allowed: {path!r} exists and is not a socket "
                         "(binding would delete it)")
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # nobody listens: a socket file left by a process that died
    except OSError as err:
        raise ValueError(f"endpoint='ipc://{path}': cannot tell whether a socket is live there ({err})") from None
    finally:
        probe.close()
    raise ValueError(f"endpoint='ipc://{path}' is in use: another socket (a second receiver?) is bound and "
                     "listening there; close it first or use another path (private_ipc_endpoint())")


class IpcFile:
    """The socket file a receiver bound: removed on close, or at exit (weakref.finalize), but only while
    it is still the file this receiver made (a later receiver may have replaced a stale one)."""

    def __init__(self, owner, path: str):
        st = os.stat(path)
        self.finalizer = weakref.finalize(owner, _remove_socket_file, path, (st.st_dev, st.st_ino))

    def remove(self) -> None:
        self.finalizer()


def _remove_socket_file(path: str, identity: tuple[int, int]) -> None:
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)
    except OSError:
        pass  # already gone
    _remove_private_dir(os.path.dirname(path))
