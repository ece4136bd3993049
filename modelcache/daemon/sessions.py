"""Clients and their sessions: hello, heartbeats, open and close (leases), goodbye, and client liveness.

`Sessions` runs on the owner loop. It is handed the registry (clients, model records), the tiers' residency
managers that bring a model in for an open and own its leases (the host tier's, and the GPUs'; one lease
table), and `reply` to answer an open once its load lands. A client that stops beating, whose process is
gone or whose lane connection closed is dropped here, and the managers end its leases.
"""

from __future__ import annotations

import logging
import traceback

import psutil

from .. import __version__
from ..errors import CapacityError, LeaseError, ModelCacheError, ProtocolError
from ..wire import protocol as P, tensors
from . import lease_files
from .disk_opens import DiskOpens
from .identity import check_client_owner
from .lane_server import LaneConnection
from .registry import ModelRecord, Registry
from .residency.room import deadline_of
from .wording import plural

log = logging.getLogger("modelcache.daemon")
PID_MAX = 1 << 22          # Linux's PID_MAX_LIMIT: no pid_max setting goes higher
MAX_CLIENT_NAME = 256      # a program's name, shown in stats


class Sessions:
    def __init__(self, *, registry: Registry, host, gpus, fetcher, disk: DiskOpens, settings, counters: dict, clock,
                 wall, reply, open_latency):
        self.registry = registry
        self.host = host                  # the host tier's Residency
        self.gpus = gpus                  # daemon/gpus.py: the GPU tiers' Residency, by UUID
        self.fetcher = fetcher            # daemon/fetch.py: a model only the remote store has
        self.disk = disk                  # daemon/disk_opens.py: opens the host tier cannot take now
        self.settings = settings
        self.departed: dict[int, float] = {}   # pid -> when: closed lane connections' processes, maybe exiting
        self.counters = counters
        self.clock = clock                # monotonic: liveness
        self.wall = wall                  # wall time: a model's last use, as `ls` shows it
        self.reply = reply                # (ident, message): answer a request later
        self.open_latency = open_latency  # metrics.Histogram of request-to-answer seconds

    def handlers(self) -> dict:
        return {P.Hello: self.on_Hello, P.Heartbeat: self.on_Heartbeat, P.Goodbye: self.on_Goodbye,
                P.Open: self.on_Open, P.Close: self.on_Close}

    # -- who is asking ---------------------------------------------------------------------
    def touch(self, client_id: str, ident, name: str = ""):
        """The caller's own client record, kept alive; PermissionDenied if the id is another process's.
        Client id "" on a lane connection is the connection's own client, made by its first open: an
        attach-mode client needs no hello and no heartbeat (client/leases.py)."""
        if not client_id and type(ident) is LaneConnection:
            if ident.sock is None:   # a request re-run (after a fetch) for a connection that has gone
                raise LeaseError("the connection that asked has closed")
            client = self.registry.clients.get(ident.client_id) if ident.client_id else None
            if client is None:
                client = self._new_client(ident, name, connection=ident)
                ident.client_id = client.client_id
            return client
        client = self.registry.client(client_id)
        check_client_owner(ident, client)
        client.last_seen = self.clock()
        return client

    def _new_client(self, ident, name: str, connection=None):
        if len(name) > MAX_CLIENT_NAME:
            raise ProtocolError(f"client_name is {len(name)} characters; at most {MAX_CLIENT_NAME}")
        if len(self.registry.clients) >= self.settings.max_clients:
            raise CapacityError(f"the modelcache daemon serves {plural(len(self.registry.clients), 'client')}, its "
                                f"max_clients; try again later, or raise max_clients")
        # The kernel's pid, not the message's: the sweep drops a client whose process is gone. A tcp:// client
        # has none (0: the heartbeat alone decides).
        client = self.registry.new_client(ident.pid, name, self.clock(), ident.uid, ident.gid, connection)
        log.debug("client %s (pid %d, uid %s) connected%s", client.client_id, ident.pid, ident.uid,
                  " on the lane" if connection is not None else "")
        return client

    def _drop(self, client_id: str) -> list:
        """Forget a client; every lease it held ends (in whichever tier: the managers share one lease table)."""
        self.registry.forget_client(client_id)
        return self.host.drop_client(client_id)

    def connection_closed(self, conn: LaneConnection) -> None:
        """A lane connection went away. One that was a client and said no goodbye (a process that exits says one:
        client/leases.py) died, or fell off: its leases go, and it counts as lost. Whichever it was, the serve-mode
        input files its process may have left (a SIGKILL between writing one and unlinking it, even before its
        first request reached us and made it a client) go once that process has."""
        client = self.registry.clients.get(conn.client_id) if conn.client_id else None
        if client is not None and client.connection is conn:
            released = self._drop(client.client_id)
            self.counters["clients_lost"] += 1
            log.info("client lost: %s (pid %d), its connection closed without goodbye; released %s",
                     client.client_id, client.pid, plural(len(released), "lease"))
        if conn.pid > 0:
            if process_gone(conn.pid):
                self._remove_files_of(conn.pid)
            else:   # (it may still be exiting: the sweep looks again)
                self.departed[conn.pid] = self.clock()

    def _remove_files_of_departed(self, now: float) -> None:
        """The I/O files of lane connections' processes that are gone now; a process still alive after
        lease_timeout_s lives on: its files are its own."""
        for pid, since in list(self.departed.items()):
            if process_gone(pid):
                self._remove_files_of(pid)
            elif now - since < self.settings.lease_timeout_s:
                continue
            del self.departed[pid]

    @staticmethod
    def _remove_files_of(pid: int) -> None:
        files = tensors.remove_io_files_of(pid)
        if files:
            log.info("removed %s that the gone process %d left", plural(files, "I/O file"), pid)

    # -- handlers: each returns a reply, or None when it will reply later ---------------
    def on_Hello(self, ident, msg: P.Hello):
        if msg.protocol_version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol {msg.protocol_version}, this daemon "
                                f"{P.PROTOCOL_VERSION}: upgrade the older of the two")
        # The sweep asks the kernel about this pid: one past what a pid can be (2**31) killed the daemon there.
        if not 0 <= msg.pid <= PID_MAX:
            raise ProtocolError(f"hello: pid {msg.pid} is not a process id (1 to {PID_MAX}, or 0 for none)")
        client = self._new_client(ident, msg.client_name)
        return P.HelloReply(req_id=msg.req_id, protocol_version=P.PROTOCOL_VERSION, daemon_version=__version__,
                            client_id=client.client_id, heartbeat_interval_s=self.settings.heartbeat_interval_s,
                            lease_timeout_s=self.settings.lease_timeout_s)

    def on_Heartbeat(self, ident, msg: P.Heartbeat):
        client = self.registry.clients.get(msg.client_id)
        if client is not None and (client.uid is None or (ident.uid, ident.pid) == (client.uid, client.pid)):
            client.last_seen = self.clock()   # (another process's heartbeat for it keeps nothing alive)
        return None

    def on_Goodbye(self, ident, msg: P.Goodbye):
        client_id = msg.client_id
        if not client_id and type(ident) is LaneConnection:   # a lane connection's own client, if it made one
            client_id = ident.client_id
        client = self.registry.clients.get(client_id) if client_id else None
        if client is not None:
            check_client_owner(ident, client)
            self._drop(client_id)
        return P.Ack(req_id=msg.req_id)

    def on_Open(self, ident, msg: P.Open):
        client = self.touch(msg.client_id, ident, msg.client_name)
        deadline = deadline_of(self.clock(), msg.deadline_ms)   # (a fetch re-runs this: its time counts too)
        residency = self.host if msg.device == "cpu" else self.gpus.named(msg.device)
        if residency is not self.host:
            self.gpus.check_transport(ident, residency)   # (before any load: a reply it could not take)
        model = self.fetcher.resolve_or_fetch(ident, msg)
        if model is None:
            return None  # fetching from the remote store; the request runs again when it lands
        self.counters["opens"] += 1
        t_request = self.clock()

        def answer(error: ModelCacheError | None, hit: bool):
            self.open_latency.observe(self.clock() - t_request)
            if error is not None:
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            if self.registry.clients.get(client.client_id) is not client:   # left while we were loading
                residency.unclaimed(model)     # (its policy hears the call, and that the copy is idle)
                return
            tier = residency.tier
            mapped = tier.export(model.key, model.manifest)
            try:
                if residency is self.host:
                    fds = self._lease_files(ident, msg, model, mapped)
                else:
                    self.gpus.check_may_map(ident, model, residency)
                    fds = tier.lease_fds(model.key)
            except ModelCacheError as e:   # no lease, no descriptor
                residency.unclaimed(model)
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=e.code, message=str(e)))
                return
            lease = residency.grant(client, model, self.wall())
            self.reply(ident, self._open_reply(msg.req_id, lease.lease_id, model, hit, mapped, fds))

        def from_disk(error: ModelCacheError | None):
            self.open_latency.observe(self.clock() - t_request)
            if error is None:
                if self.registry.clients.get(client.client_id) is not client:
                    return   # it left meanwhile: no lease
                mapped = self.disk.export(model)
                try:
                    fds = self._lease_files(ident, msg, model, mapped)
                except ModelCacheError as e:   # no lease, no descriptor
                    error = e
            if error is not None:
                self.reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            self.counters["opens_from_disk"] += 1
            lease = residency.grant_unheld(client, model, self.wall())
            self.reply(ident, self._open_reply(msg.req_id, lease.lease_id, model, False, mapped, fds))

        def overflow():
            self.disk.when_checked(model, from_disk)

        disk = residency is self.host and self.settings.open_when_full == "disk"
        hit = residency.when_resident(model, answer, deadline, overflow=overflow if disk else None)
        model.opened(hit)
        self.counters["hits" if hit else "misses"] += 1
        return None

    def _open_reply(self, req_id: int, lease_id: str, model: ModelRecord, hit: bool, mapped: dict,
                    fds: list[int]) -> P.OpenReply:
        reply = self._reply_fields(req_id, lease_id, model, hit, mapped)
        if fds and not reply.device_uuid:
            reply.ipc_fds = len(fds)     # (a GPU tier's export declares its own)
        reply.passed_fds = fds   # (not a field: the lane sends them and server._reply closes them)
        return reply

    def _lease_files(self, ident, msg: P.Open, model: ModelRecord, mapped: dict) -> list[int]:
        """A host lease's files as descriptors, for a client that asked over the lane (daemon/lease_files.py);
        [] where it did not, or the version has no portable skeleton (its paths serve, as before)."""
        if not lease_files.wanted(ident, msg):
            return []
        try:
            return lease_files.open_lease_files(ident, model, mapped["segments"], self.host.tier.root)
        except ModelCacheError:   # (PermissionDenied is an OSError too: refused, not a fall back to the paths)
            raise
        except OSError as e:   # a repository file gone under us: the paths say the rest
            log.warning("%s: its files could not be passed as descriptors (%s); the client gets their paths",
                        model.key, e)
            return []

    @staticmethod
    def _reply_fields(req_id: int, lease_id: str, model: ModelRecord, hit: bool, mapped: dict) -> P.OpenReply:
        """An open's reply: the model's inputs and outputs, and what its lease maps (`mapped`: a tier's export)."""
        m = model.manifest
        io = m.io_summary()
        return P.OpenReply(req_id=req_id, lease_id=lease_id, name=model.name, version=model.version,
                           inputs=io["inputs"], outputs=io["outputs"], weights_bytes=m.weights_bytes, hit=hit, **mapped)

    def on_Close(self, ident, msg: P.Close):
        client = self.touch(msg.client_id, ident)
        self.host.close(msg.lease_id, client.client_id)   # (whichever tier's: one table)
        self.counters["closes"] += 1
        return P.Ack(req_id=msg.req_id)

    # -- client liveness ---------------------------------------------------------------
    def sweep(self, now: float, listening_since: float) -> None:
        """Release the leases of clients that stopped sending heartbeats or whose process died.
        `listening_since`: when the owner loop last came back from not listening; silence before it
        does not count (heartbeats sent meanwhile may still be on their way in)."""
        self._remove_files_of_departed(now)
        for client in list(self.registry.clients.values()):
            try:
                # A lane connection's client sends no heartbeats: the connection's end is its end.
                silent = client.connection is None and \
                    now - max(client.last_seen, listening_since) > self.settings.lease_timeout_s
                dead = process_gone(client.pid)
                if silent or dead:
                    released = self._drop(client.client_id)
                    self.counters["clients_lost"] += 1
                    files = tensors.remove_io_files_of(client.pid) if dead else 0
                    log.info("client lost: %s (pid %d, %s), released %s, removed %s", client.client_id, client.pid,
                             "process gone without goodbye" if dead else "no heartbeat",
                             plural(len(released), "lease"), plural(files, "I/O file"))
            except Exception:  # one client's record must not stop the sweep, or the owner loop with it
                log.error("sweep failed on client %s: %s", client.client_id, traceback.format_exc())


def process_gone(pid: int) -> bool:
    """Whether the client's process has surely exited (a zombie has: only its parent's wait is left); False
    when the kernel cannot say (then the heartbeat decides), e.g. with no file descriptor left to read /proc."""
    if pid <= 0:
        return False
    try:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:   # (gone between the two questions)
        return True
    except (psutil.Error, OSError, OverflowError, ValueError) as e:
        log.warning("cannot tell whether pid %d is alive: %s", pid, e)
        return False
