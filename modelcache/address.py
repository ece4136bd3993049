"""Where the daemon is, and whether this process may reach it: what a client needs before its first message.

Kept apart from config.py so that an attach-mode client finds the daemon without paying for the
full settings loader: importing config (its dataclass) and running load() cost ~6 ms of a fresh
process, measured after numpy and onnxruntime, against a cold start this project measures in
milliseconds (benchmarks/coldstart). The loader runs when a config file exists, since it may name
the socket; config.py builds its defaults from the functions here, so the two never disagree.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError, DaemonUnavailable, PermissionDenied

DEFAULT_REQUEST_TIMEOUT_S = 30.0
SOCKET_NAME = "daemon.sock"


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def default_runtime_dir() -> Path:
    """Where the socket lives: systemd's RuntimeDirectory, then /run as root, then the user's runtime dir."""
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0])
    if is_root():
        return Path("/run/modelcache")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "modelcache" if xdg else Path(f"/tmp/modelcache-{os.getuid()}")


def default_socket() -> str:
    return f"ipc://{default_runtime_dir() / SOCKET_NAME}"


ADDRESS_FORMS = "ipc://PATH (or an absolute PATH), or tcp://HOST:PORT"


def check_address(address: str) -> str:
    """A daemon address as ZeroMQ takes it, or ValueError saying which forms are accepted.

    A bare absolute path means ipc://PATH: it is what a user who sees the socket file types, and it
    cannot mean anything else. libzmq's own refusal ("Invalid argument") names neither the address nor
    the forms, and came only after the daemon had created its host tier."""
    text = str(address).strip()
    if text.startswith("/"):
        text = "ipc://" + text
    scheme, sep, rest = text.partition("://")
    if scheme == "ipc" and sep and rest.startswith("/") and len(rest) > 1:
        return text
    if scheme == "tcp" and sep:
        host, colon, port = rest.rpartition(":")
        if colon and host and port.isdigit() and 0 < int(port) < 65536:
            return text
    raise ValueError(f"is not a daemon address: write {ADDRESS_FORMS}")


def client_address(address: str, where: str = "") -> str:
    """check_address for an address a caller handed in: a ConfigError naming it, where it came from (as
    config.load names a setting's source), and the accepted forms."""
    try:
        return check_address(address)
    except ValueError as e:
        raise ConfigError(f"{where or f'argument socket={address!r}'}: socket {e}") from None


def default_config_file(env=None) -> Path | None:
    """The settings file: $MODELCACHE_CONFIG, else the first of the user's and (as root) the system's that exists.
    `env`: the environment to read (a daemon's, as a Ray actor starting one computes it)."""
    env = os.environ if env is None else env
    if env.get("MODELCACHE_CONFIG"):
        return Path(env["MODELCACHE_CONFIG"])
    candidates = [Path("/etc/modelcache/modelcache.toml")] if is_root() else []
    xdg = env.get("XDG_CONFIG_HOME")
    candidates.append((Path(xdg) if xdg else Path.home() / ".config") / "modelcache" / "modelcache.toml")
    return next((p for p in candidates if p.is_file()), None)


def client_settings(socket: str | None = None, timeout_s: float | None = None) -> tuple[str, float]:
    """(daemon address, request timeout) by the settings' layers: default < file < environment < argument.

    Without a config file and with no timeout in the environment, nothing but MODELCACHE_SOCKET can
    change either value, so the settings loader is skipped; otherwise it decides (and validates)."""
    if default_config_file() is None and not os.environ.get("MODELCACHE_REQUEST_TIMEOUT_S"):
        env = os.environ.get("MODELCACHE_SOCKET")
        address = client_address(socket) if socket else client_address(env, f"MODELCACHE_SOCKET={env}") if env else \
            default_socket()
        return address, DEFAULT_REQUEST_TIMEOUT_S if timeout_s is None else timeout_s
    # The one upward import of this layer, lazy on purpose: config builds its defaults from this module,
    # and a client pays for the loader only when a file or the environment may change the answer.
    from .config import CLIENT_SETTINGS, load
    settings = load(overrides={"socket": socket, "request_timeout_s": timeout_s}, only=CLIENT_SETTINGS,
                overrides_are="arguments")
    return settings.socket, settings.request_timeout_s


def check_can_connect(path: str, address: str) -> None:
    """Fail at once where the kernel would refuse the connection: libzmq retries a refused ipc:// connect
    in the background, so without this a user outside the socket's group waited for a request timeout."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaemonUnavailable(f"no modelcache daemon at {address} (no socket file): start one with "
                                "`modelcache daemon`, or point MODELCACHE_SOCKET at the running one") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied: cannot reach the modelcache socket {path}: a directory on its "
                               "path is closed to this user") from None
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise PermissionDenied(f"permission denied: cannot connect to the modelcache daemon at {address}: the socket "
                               f"is mode {st.st_mode & 0o777:04o}, group {_group_name(st.st_gid)}; ask an admin to add "
                               "this user to that group")


def check_listening(path: str, address: str) -> None:
    """Fail at once where nobody listens on the socket file: a daemon killed with SIGKILL leaves its
    socket file behind, and libzmq retries a refused ipc:// connect in the background, so a client's
    hello (and each reconnect after a crash) waited its whole timeout, 5-30 s, under the client's lock.
    A Ray replica whose node daemon was killed piled its calls up behind those waits until a request
    passed its 60 s deadline (tests/test_cluster.py's failover test, seen once in CI's conditions).
    A plain connect is refused at once; a connection that succeeds is closed before any handshake."""
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        raise DaemonUnavailable(f"no modelcache daemon is listening at {address} (its socket file is left "
                                "from one that stopped)") from None
    except BlockingIOError:
        pass            # EAGAIN: the listener's backlog is full: it is there, and busy
    except OSError as e:
        raise DaemonUnavailable(f"cannot connect to the modelcache daemon at {address}: {e.strerror}") from None
    finally:
        probe.close()


def _group_name(gid: int) -> str:
    import grp
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def listen_tcp(host: str, port: int, setting: str):
    """A listening TCP socket on host:port, or a ConfigError naming `setting` (the flag or setting that
    asked for the port) and what to do. The daemon binds its HTTP ports itself, before it creates its host
    tier, so a port it cannot have fails its start with one line and leaves nothing behind."""
    sock = _bound_tcp(host, port, setting, reuse_port=False)
    try:
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise bind_error(e, host, port, setting) from None
    return sock


def reserve_tcp(host: str, port: int, setting: str):
    """host:port bound with SO_REUSEPORT and not listening: the port is held for a child that binds it beside
    this socket with SO_REUSEPORT too (the gRPC front: daemon/children.py); no connection is queued here.
    A ConfigError naming `setting` as listen_tcp's."""
    return _bound_tcp(host, port, setting, reuse_port=True)


def _bound_tcp(host: str, port: int, setting: str, reuse_port: bool):
    import socket

    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, OverflowError) as e:
        raise ConfigError(f"{setting}: cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # (TIME_WAIT of a previous run is no reason)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
    except OSError as e:
        sock.close()
        raise bind_error(e, host, port, setting) from None
    return sock


def bind_error(e: OSError, host: str, port: int, setting: str) -> ConfigError:
    """A refused bind as one line: the setting, the address, the reason, and what to do."""
    import errno

    hint = {errno.EADDRINUSE: "another process holds it: choose another port, or stop that process",
            errno.EACCES: "ports below 1024 need root (or CAP_NET_BIND_SERVICE): choose one above 1023",
            errno.EADDRNOTAVAIL: "no interface of this machine has that address"}.get(e.errno)
    return ConfigError(f"{setting}: cannot listen on {host}:{port}: {e.strerror or e}" + (f"; {hint}" if hint else ""))
