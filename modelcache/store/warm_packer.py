"""A packing process kept with its imports done, which forks a fresh child for each pack.

A pack in a fresh interpreter (`python -m modelcache.store.packing`) first spends ~0.4 s importing onnx and
numpy (benchmarks/repoload/pack_profile.py: "a packing child starts"), paid again by every add: a Triton
repository of 50 models pays it 50 times. This server imports them once, then forks each pack from itself:
the child starts with the imports done, and still is a child of its own: ORT's memory goes back to the
OS when it exits, and a model that crashes ORT costs that child, not the daemon (packing.pack_in_subprocess).

How it is used (the daemon's daemon/models.py): `WarmPacker.spawn(argv, pass_fds)` is what
`subprocess.Popen([python, -m, modelcache.store.packing, *argv], pass_fds=...)` was, and returns a handle with
Popen's `pid`, `stdout`, `stderr`, `poll`, `wait` and `kill`. The server starts with the first pack (that pack
waits for its imports, as an exec'd child would) and stops `idle_s` after the last one ends (`stop_if_idle`):
a daemon that adds nothing holds no server (22 MiB of its own, USS: numpy, onnx, protobuf;
benchmarks/repoload/warm_packer.txt).

Each pack is one message on the control socket (SOCK_SEQPACKET, so a message is never split or merged): its
argv as JSON, with descriptors (SCM_RIGHTS): a status socket, the child's stdout and stderr pipes, then the
pass_fds, which the child gets under the numbers they had in the daemon, as Popen's pass_fds does. The server
answers on the status socket "pid N", then "exit RC" (Popen's returncode: -SIGNAL when killed) once it has
reaped the child. The server is single-threaded (fork keeps only the forking thread: a lock another thread
held would stay locked in the child), so it does not import onnxruntime, whose import starts a thread; nor
does numpy's OpenBLAS start its pool here (OPENBLAS_NUM_THREADS=1: packing multiplies no matrices).

The server exits when the control socket closes (the daemon stopped, or died), killing the packs it forked;
each pack also dies with the server (PR_SET_PDEATHSIG). A server that stops answering (stopped, swapped out)
costs the add waiting on it at most `answer_s`, then it is killed; the daemon's loop never waits on it.
"""

from __future__ import annotations

import array
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from ..errors import PackError

log = logging.getLogger("modelcache.packing")

# What every pack imports before it does anything (measured: 0.4 s of a fresh interpreter's 0.45 s).
PRELOAD = ("numpy", "onnx", "onnx.checker", "onnx.numpy_helper", "modelcache.store.packing",
           "modelcache.store.sources", "modelcache.session_options")
IDLE_S = 30.0     # the server stops this long after its last pack ended
ANSWER_S = 60.0   # the longest a pack waits for the server to fork it (its imports, the first time: ~0.5 s)
GRACE_S = 2.0     # after a pack's child ended, the longest the server may take to say how
UNKNOWN_EXIT = 255   # a pack whose end the server never reported (pack_in_subprocess judges by its "ok")
SCM_MAX_FD = 253  # the most descriptors one message carries (the kernel's limit): ours are 3 of them
PR_SET_PDEATHSIG = 1


class WarmPacker:
    """The daemon's side: starts the server when a pack needs it, sends it packs, stops it when idle."""

    def __init__(self, idle_s: float = IDLE_S, clock=time.monotonic, answer_s: float = ANSWER_S):
        self.idle_s, self.clock, self.answer_s = idle_s, clock, answer_s
        self._lock = threading.Lock()      # loader threads pack at once
        self._proc = None                  # the server (subprocess.Popen)
        self._control: socket.socket | None = None
        self._running = 0                  # packs forked and not yet waited for
        self._idle_since = clock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def spawn(self, argv: list[str], pass_fds=(), again: bool = True) -> "ForkedPack":
        """A pack of `argv` (packing._main's) forked by the server, `pass_fds` kept under their numbers. A model
        of more files than one message carries beside ours is packed by a fresh interpreter, as before.

        The lock is held only to start the server and send it the pack, never while waiting for it: the owner
        loop's idle check takes it too, and a server that stopped answering (SIGSTOP, swapped out) must stall
        only the add that waits on it, for at most `answer_s`, after which it is killed and started anew."""
        if len(pass_fds) + 3 > SCM_MAX_FD:
            from .packing import exec_packer
            return exec_packer(argv, pass_fds)
        with self._lock:
            self._start_locked()
            server = self._proc
            try:
                pack = ForkedPack(self, self._control, argv, list(pass_fds))
            except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError) as e:
                log.warning("the warm packer (pid %d) is gone (%s); starting it again", server.pid, e)
                self._stop_locked()
                pack = None
            else:
                self._running += 1
        try:
            if pack is not None:
                pack.started(self.answer_s)
                return pack
        except ConnectionResetError:   # (the server went before it answered)
            pass
        except TimeoutError:
            self._kill(server)
            raise PackError(f"the packing process did not start: the warm packer (pid {server.pid}) did not answer "
                            f"within {self.answer_s:g} s; it was killed, and the next add starts it again") from None
        if not again:
            raise PackError("the packing process could not start: the warm packer went as it was asked")
        return self.spawn(argv, pass_fds, again=False)

    def _kill(self, server) -> None:
        """A server that stopped answering goes (its packs with it); the next pack starts a new one."""
        with self._lock:
            if self._proc is server:
                log.warning("the warm packer (pid %d) stopped answering; killing it", server.pid)
                server.kill()
                self._stop_locked()

    def _finished(self) -> None:   # a ForkedPack waited for
        with self._lock:
            self._running -= 1
            self._idle_since = self.clock()

    def stop_if_idle(self) -> bool:
        """Stop the server if no pack ran for `idle_s` (the daemon's sweep calls this); True if it stopped.
        Never waits for the lock: a spawn holding it is a pack, not idleness."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._proc is None or self._running or self.clock() - self._idle_since < self.idle_s:
                return False
            log.debug("the warm packer (pid %d) stops after %.0f s without a pack", self._proc.pid, self.idle_s)
            self._stop_locked()
            return True
        finally:
            self._lock.release()

    def give_back(self) -> int:
        """Memory pressure: stop the server now if no pack runs; the bytes it held (its USS), or 0."""
        import psutil
        if not self._lock.acquire(blocking=False):   # (a pack is being sent: not idle)
            return 0
        try:
            if self._proc is None or self._running:
                return 0
            try:
                held = psutil.Process(self._proc.pid).memory_full_info().uss
            except psutil.Error:
                held = 0
            self._stop_locked()
            return held
        finally:
            self._lock.release()

    def stop(self) -> None:
        """Stop the server now; the packs it forked are killed with it."""
        with self._lock:
            self._stop_locked()

    def _start_locked(self) -> None:
        import subprocess
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            log.warning("the warm packer (pid %d) exited (status %s); starting it again", self._proc.pid,
                        self._proc.returncode)
            self._stop_locked()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # systemd's notify socket and watchdog are the daemon's alone; OpenBLAS's pool would be a second thread
            env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
            env["OPENBLAS_NUM_THREADS"] = "1"
            self._proc = subprocess.Popen([sys.executable, "-m", "modelcache.store.warm_packer", str(theirs.fileno())],
                                          env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          pass_fds=[theirs.fileno()])
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        log.debug("the warm packer starting (pid %d)", self._proc.pid)

    def _stop_locked(self) -> None:
        if self._control is not None:
            self._control.close()   # the server's cue: it kills what it forked, and exits
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=1)   # (it goes at once when it answers at all)
            except Exception:   # (subprocess.TimeoutExpired) a server that does not go
                self._proc.kill()
                self._proc.wait()
            self._proc = None


class ForkedPack:
    """One pack forked by the server, with what pack_in_subprocess uses of subprocess.Popen."""

    def __init__(self, owner: WarmPacker, control: socket.socket, argv: list[str], pass_fds: list[int]):
        """Send the pack to the server (`started` waits for its pid)."""
        self._owner = owner
        self._server = owner._proc        # the server that forks it (killed if it stops answering)
        self.returncode: int | None = None
        self.pid: int | None = None
        self._pidfd: int | None = None
        status_ours, status_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            fds = [status_theirs.fileno(), out_w, err_w, *pass_fds]
            message = json.dumps({"argv": argv, "targets": pass_fds}).encode()
            control.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            status_ours.close()
            raise
        finally:   # the server has its copies: the pipes end when the child's end
            status_theirs.close()
            os.close(out_w)
            os.close(err_w)
        self._status = status_ours
        self.stdout = os.fdopen(out_r, "r")
        self.stderr = os.fdopen(err_r, "r")

    def started(self, timeout_s: float) -> None:
        """Wait for the server's "pid" (the first pack's: once the server's imports are done). TimeoutError when
        it does not answer; ConnectionResetError when it went first; PackError when it could not fork."""
        try:
            self._status.settimeout(timeout_s)
            try:
                reply = self._status.recv(256).decode()
            finally:
                self._status.settimeout(None)
            kind, _, value = reply.partition(" ")
            if kind != "pid":
                if not reply:
                    raise ConnectionResetError("the warm packer closed the pack's status socket")
                raise PackError(f"the packing process could not start: {value}")
        except BaseException:
            self._done(-signal.SIGKILL)
            self.stdout.close()
            self.stderr.close()
            raise
        self.pid = int(value)
        try:   # the child as a descriptor: its end seen without the server, and a kill that cannot hit a reused pid
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:   # (it ended already: the server says how)
            pass

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._read_status(socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self) -> int:
        """The child's returncode, as the server reports it; a child that ended while the server says nothing
        for GRACE_S ends with returncode UNKNOWN_EXIT, and the server, stuck, is killed."""
        import select
        while self.returncode is None:
            ready, _, _ = select.select([self._status] + ([self._pidfd] if self._pidfd is not None else []), [], [])
            if self._status in ready:
                self._read_status(0)
            elif select.select([self._status], [], [], GRACE_S)[0]:   # the child ended: its report is on its way
                self._read_status(0)
            else:
                log.warning("the warm packer did not report pack pid %d's end within %g s", self.pid, GRACE_S)
                self._owner._kill(self._server)
                self._done(UNKNOWN_EXIT)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self.pid is not None:
            try:
                if self._pidfd is not None:
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                else:
                    os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:   # (exited)
                pass

    def _read_status(self, flags: int) -> None:
        text = self._status.recv(256, flags).decode()
        kind, _, value = text.partition(" ")
        # No word at all: the server went (killed, or its control socket closed) and took the child with it.
        self._done(int(value) if kind == "exit" else -signal.SIGKILL)

    def _done(self, returncode: int) -> None:
        self.returncode = returncode
        self._status.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        self._owner._finished()


# ---- the server's side ----------------------------------------------------------------------------------------

def serve(control_fd: int) -> None:
    """Fork a pack for each message on the control socket until it closes; report each child's exit."""
    import importlib
    import selectors

    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's ^C is the daemon's to act on, as for its packs
    for name in PRELOAD:
        importlib.import_module(name)
    control = socket.socket(fileno=control_fd)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}   # pidfd -> (pid, status socket)
    try:
        while True:
            for key, _ in sel.select():
                if key.fileobj is control:
                    try:
                        message, fds = _receive(control)
                    except ConnectionResetError:
                        return
                    if message is None:   # the daemon closed its end: stopped or died
                        return
                    child = _fork(message, fds, control, children, sel)
                    if child is not None:
                        pidfd, pid, status = child
                        children[pidfd] = (pid, status)
                        sel.register(pidfd, selectors.EVENT_READ)
                else:
                    pidfd = key.fd
                    pid, status = children.pop(pidfd)
                    sel.unregister(pidfd)
                    os.close(pidfd)
                    _, wait_status = os.waitpid(pid, 0)
                    _say(status, f"exit {os.waitstatus_to_exitcode(wait_status)}")
                    status.close()
    finally:
        for pidfd, (pid, status) in children.items():
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            _say(status, f"exit {-signal.SIGKILL}")


def _receive(control: socket.socket):
    fds = array.array("i")
    data, ancdata, _, _ = control.recvmsg(1 << 20, socket.CMSG_SPACE(SCM_MAX_FD * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


def _say(status: socket.socket, text: str) -> None:
    try:
        status.send(text.encode())
    except OSError:   # (the daemon let go of this pack)
        pass


def _fork(message: dict, fds: list[int], control, children: dict, sel):
    """Fork one pack; (pidfd, pid, status socket), or None when the fork failed (said on the status socket)."""
    status = socket.socket(fileno=fds[0])
    try:
        pid = os.fork()
    except OSError as e:
        _say(status, f"error fork: {e}")
        status.close()
        for fd in fds[1:]:
            os.close(fd)
        return None
    if pid == 0:   # the child: never returns
        code = 1
        try:
            code = _child(message, fds)
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    for fd in fds[1:]:
        os.close(fd)
    _say(status, f"pid {pid}")
    return os.pidfd_open(pid), pid, status


def _child(message: dict, fds: list[int]) -> int:
    """In the forked child: its stdout and stderr the pipes, the pass_fds under their numbers, nothing else of
    the server's open; then the pack, as `python -m modelcache.store.packing` would run it."""
    import fcntl
    server = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:   # the server went before the line above took effect
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_w, err_w, passed, targets = fds[1], fds[2], fds[3:], message["targets"]
    above = max([*fds, *targets, 2]) + 1   # out of the way of every target number
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in passed]
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    for name in os.listdir("/proc/self/fd"):   # the server's: its control socket, other packs' pipes and pidfds
        fd = int(name)
        if fd > 2 and fd not in moved:
            try:
                os.close(fd)
            except OSError:   # (the listing's own descriptor, closed by now)
                pass
    for fd, target in zip(moved, targets):
        os.dup2(fd, target)
        os.close(fd)
    from . import packing
    return packing._main(message["argv"])


if __name__ == "__main__":
    serve(int(sys.argv[1]))
