"""Settings: embedded defaults < TOML file < MODELCACHE_* environment < command-line flags."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

from .address import DEFAULT_REQUEST_TIMEOUT_S, check_address, default_config_file, default_socket, is_root
from .errors import ConfigError
from .memlimit import ram_bytes

__all__ = ["ConfigError", "Settings", "load", "parse_size", "parse_policy_spec", "parse_fake_gpus"]


def default_state_dir() -> Path:
    """Where packed models and performance history persist."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if is_root():
        return Path("/var/lib/modelcache")
    xdg = os.environ.get("XDG_DATA_HOME")
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "modelcache"


@dataclass
class Settings:
    """Every field is also settable as MODELCACHE_<FIELD> and as `--<field>` where the CLI offers it."""

    socket: str = ""                  # ZeroMQ address of the daemon; default ipc://<runtime dir>/daemon.sock
    repository: str = ""              # packed models (the disk tier); default <state dir>/repository
    shm_dir: str = "/dev/shm"         # where the host tier's shared memory lives
    host_capacity: str = "50%"        # bytes ("8G", "512M") or percent of the memory limit (RAM, or the cgroup's)
    memory_reserve: str = "auto"      # headroom kept free under the memory limit: idle models are given back below it,
                                      # and a promotion that would leave less fails; auto = 10% of the limit, 256M-25%
    capacity_over_limit: str = "refuse"  # a host_capacity above the limit less memory_reserve: refuse to start, or warn
    open_when_full: str = "disk"      # an open the host tier cannot take now (full of models in use, or the memory limit
                                      # short): disk = map the weights from the repository at once (the page cache holds
                                      # them, as ORT's own mmap); wait = wait for room until the open's deadline
    gpu_capacity: str = "50%"         # per GPU: bytes, or percent of the device's memory
    fake_gpus: str = ""               # simulated GPUs in shared memory, for tests and development: "2x256M"
    gpu_sharing: str = "ipc"          # how clients map GPU weights: ipc (legacy CUDA IPC, read-write) or vmm-read-only
    remote: str = ""                  # read-only model store (file:// or http(s)://), fetched on a miss
    eviction_policy: str = "lru"      # lru, lfu, fifo, gdsf, never, eager, keepalive, hybrid, hybrid-sized (at start)
    keep_alive_s: float = 600.0       # keepalive: an idle model goes this long after its last call; hybrid: fallback
    log_level: str = "info"
    heartbeat_interval_s: float = 1.0  # clients ping this often ...
    lease_timeout_s: float = 4.0       # ... and lose their references after this long without a ping
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S   # every client call gives up after this long
    add_timeout_s: float = 3600.0      # packing a big model takes longer than an ordinary call
    opt_level: str = "all"             # ORT optimization applied once, at add time
    prepack: bool = False              # add: also store MLAS-prepacked MatMul weights (prepack.py): warm runs as fast as
                                       # plain ORT, but opens ~0.3 s slower and twice the host tier (docs/sessions.md, Known limits)
    loader_threads: int = 2            # promotions and packs run here, off the owner loop
    workers: str = "auto"              # serve-mode CPU worker groups: threads per group, "1,1", "2"; auto = one of all cores
    gpus: str = "auto"                 # serve-mode GPU workers: auto = one per CUDA device (with onnxruntime-gpu), none, or "0,1"
    scheduler: str = "dmda"            # serve-mode placement: eager, round-robin, dmda
    serve_idle_s: float = 300.0        # serve-mode sessions of a model unused this long are dropped
    batching: str = "serial"           # serve-mode batching: serial, batch, dynamic, layer; or per model "alexnet=layer,*=serial"
    max_batch: int = 0                 # samples per batch; 0 = the model's calibrated N_opt, else 8
    t_opt_ms: float = 0.0              # latency bound layer-to-layer protects; 0 = the model's calibrated t_opt, else none
    batch_window_ms: float = 50.0      # batch(m) waits this long for m requests
    max_queue_delay_ms: float = 0.0    # dynamic batching waits at most this long for a fuller batch
    max_queue: int = 0                 # serve requests a model's queue holds; one more is refused at once; 0 = no bound
    response_cache_size: str = "128M"  # answers kept for models that ask for a response cache (Triton's response_cache);
                                       # bytes, least recently used out first; 0 = no response cache
    inline_run_ms: float = 1.0         # a stage predicted this short runs on the daemon's loop when nothing else is in flight; 0 = never
    front_runs: str = "short"          # short: the HTTP/gRPC fronts run a model whose run is that short themselves, over
                                       # the daemon's shared weights (docs/serve.md, "Short models at the front"); never
    front_hold_s: float = 2.0          # a front lets go of a model it runs this long after its last request
    state_dir: str = ""                # performance models persist here; default: the repository's parent
    metrics_port: int = 0              # Prometheus /metrics over HTTP; 0 = off
    metrics_host: str = "127.0.0.1"    # where /metrics listens
    http_port: int = 0                 # the daemon starts the v2 HTTP front (`modelcache http`) on this port; 0 = off
    http_host: str = "127.0.0.1"       # where the v2 HTTP front listens: loopback unless set
    grpc_port: int = 0                 # the daemon starts Triton's gRPC front (`modelcache grpc`) on this port; 0 = off
    grpc_host: str = "127.0.0.1"       # where the gRPC front listens: loopback unless set
    client_shared_memory: bool = False # the fronts serve Triton's system shared-memory extension (off: Triton's default
                                       # since 2.69, after 2025's reports): see docs/http.md
    triton_repository: str = ""        # a Triton model repository the daemon imports at start (`modelcache import-triton`)
    model_control: str = "explicit"    # Triton's --model-control-mode: explicit (the fronts serve repository load and
                                       # unload), none (they refuse them), poll (triton_repository watched; they refuse them)
    repository_poll_s: float = 15.0    # with model_control = "poll": how often (Triton's --repository-poll-secs)
    max_message_size: str = "64M"      # largest request a client may send (ZeroMQ or lane); big tensors go in shm files
    max_clients: int = 1024            # hellos beyond this are refused (each client costs the daemon ~3 descriptors)
    keep_host_tier: bool = False       # a clean stop leaves the host tier for the next daemon to re-adopt (a crash always does)
    verify_promotion: bool = True      # check checksums while promoting from disk; off only to measure its cost
    admin_group: str = ""              # name or gid: may remove/pin/evict/load any model (so may root and the daemon's user)

    def __post_init__(self):
        if not self.socket:
            self.socket = default_socket()
        if not self.repository:
            self.repository = str(default_state_dir() / "repository")
        if not self.state_dir:
            self.state_dir = str(Path(self.repository).parent)

    @property
    def repository_path(self) -> Path:
        return Path(self.repository)

    def host_capacity_bytes(self, limit_bytes: int | None = None) -> int:
        """host_capacity in bytes; a percentage is of `limit_bytes` (the memory limit, memlimit.read_limit)."""
        return parse_size(self.host_capacity, total=limit_bytes if limit_bytes is not None else ram_bytes())

    def memory_reserve_bytes(self, limit_bytes: int) -> int:
        """memory_reserve in bytes under a memory limit of `limit_bytes`."""
        if self.memory_reserve == "auto":   # a tenth, but never under 256 MiB nor over a quarter of a small limit
            return int(min(max(256 << 20, limit_bytes // 10), limit_bytes // 4))
        return parse_size(self.memory_reserve, total=limit_bytes)

    def max_message_bytes(self) -> int:
        return parse_size(self.max_message_size)

    def response_cache_bytes(self) -> int:
        return parse_size(self.response_cache_size)


MIN_CAPACITY = 64 << 10    # smaller holds no model worth caching: a typo ("10K" for "10G"), not a choice
                           # (the test models of the zoo are 50-100 KiB: tests cut tiers this fine)


def parse_size(text: str | int, total: int | None = None) -> int:
    """'8G', '512M', '1.5GiB', '1000000', or '40%' (of `total`) -> bytes (never negative)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"size {text}: must not be negative")
        return text
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if s.endswith("%"):
            if total is None:
                raise ValueError("percent needs a total")
            value = float(s[:-1]) / 100 * total
        else:
            mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(s[-1:], 1)
            value = float(s[:-1] if mult != 1 else s) * mult
        if not math.isfinite(value) or value < 0:
            raise ValueError("not a size")
        return int(value)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size: write bytes, e.g. 8G, 512M, or a percentage like 40%") from None


# The executor's batching policies (executor/batching.py), as the `batching` setting names them.
BATCHING_POLICIES = ("serial", "batch", "dynamic", "layer")
# Named here, below the modules that implement them (layers: settings sit under tiers and executor);
# tests/test_config.py checks these against eviction.POLICIES and scheduler.SCHEDULERS.
EVICTION_POLICIES = ("lru", "lfu", "fifo", "gdsf", "never", "eager", "keepalive", "hybrid", "hybrid-sized")
SCHEDULERS = ("eager", "round-robin", "dmda")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
OPT_LEVELS = ("disable", "basic", "extended", "all")
GPU_SHARING = ("ipc", "vmm-read-only")   # how tiers/gpu/'s allocators lend device memory


def parse_policy_spec(spec: str) -> dict[str, str]:
    """'layer' -> {'*': 'layer'}; 'alexnet=layer,*=serial' -> per model name, '*' for the rest."""
    out = {}
    for part in str(spec).split(","):
        part = part.strip()
        if not part:
            continue
        name, _, policy = part.rpartition("=")
        name = name.strip() or "*"
        policy = policy.strip()
        if policy not in BATCHING_POLICIES:
            raise ValueError(f"batching={spec!r}: unknown policy {policy!r}; choose one of {', '.join(BATCHING_POLICIES)}, "
                             "for all models or per model as 'alexnet=layer,*=serial'")
        out[name] = policy
    out.setdefault("*", "serial")
    return out


def parse_fake_gpus(spec: str) -> tuple[int, int]:
    """The `fake_gpus` setting (MODELCACHE_FAKE_GPUS, which clients read too) -> (devices, bytes each):
    "2x256M" = two devices of 256 MiB, "1G" = one, "" or "none" = none."""
    spec = str(spec).strip().lower()
    if spec in ("", "none", "off", "0"):
        return 0, 0
    count, _, size = spec.rpartition("x")
    try:
        n = int(count) if count else 1
    except ValueError:
        raise ConfigError(f"fake_gpus={spec!r}: write a size such as 1G, or count x size such as 2x256M") from None
    total = parse_size(size)
    if n < 1 or total <= 0:
        raise ConfigError(f"fake_gpus={spec!r}: needs at least one device of a positive size")
    return n, total


# -- reading and checking each setting ----------------------------------------------------
# A rule takes the value as the file, the environment or a flag gave it (TOML: already typed; else a
# string) and returns it as Settings holds it, or raises ValueError with what it must be. load() adds
# the setting's name and where the value came from. Every field of Settings has one (a test checks).

def number(kind, low=None, high=None, above=None):
    """A rule: int or float within [low, high] (or > above); TOML booleans are not numbers. (The CLI's
    numeric flags use it too.)"""
    def rule(value):
        if isinstance(value, bool):
            raise ValueError("must be a number, not a boolean")
        try:
            x = kind(value) if kind is float or not isinstance(value, float) else _whole(value)
        except (TypeError, ValueError):
            raise ValueError(f"is not a {'whole number' if kind is int else 'number'}") from None
        if kind is float and not math.isfinite(x):
            raise ValueError("must be a finite number")
        if (low is not None and x < low) or (high is not None and x > high) or (above is not None and x <= above):
            bounds = [f"> {above}" if above is not None else f">= {low}" if low is not None else "",
                      f"<= {high}" if high is not None else ""]
            raise ValueError(f"must be {' and '.join(b for b in bounds if b)}")
        return x
    return rule


def _whole(x: float) -> int:
    if not x.is_integer():
        raise ValueError(x)
    return int(x)


def _bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("is not a boolean: write true/false, yes/no, on/off or 1/0")


def _choice(*choices):
    def rule(value):
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return rule


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError("must be a string")
    return value


def _nonempty(value) -> str:
    if not _text(value).strip():
        raise ValueError("must not be empty")
    return value.strip()


def _directory(must_exist: bool):
    def rule(value):
        path = Path(_text(value)).expanduser()
        if path.exists() and not path.is_dir():
            raise ValueError(f"must be a directory: {path} is a file")
        if must_exist and not path.is_dir():
            raise ValueError(f"must be an existing directory: {path} does not exist")
        return str(path) if value else ""
    return rule


def _capacity(of: str | None):
    """A tier's size: bytes or (with `of`) a percentage of it; at least MIN_CAPACITY, at most all of it."""
    def rule(value):
        text = str(value).strip()
        if text.endswith("%"):
            if of is None:
                raise ValueError("must be a size in bytes, e.g. 8G, at least 64K")
            try:
                number(float, above=0, high=100)(text[:-1])
            except ValueError:
                raise ValueError(f"must be more than 0% and at most 100% of {of}") from None
            return text
        try:
            n = parse_size(text)
        except ConfigError:
            raise ValueError("must be a positive size in bytes, e.g. 8G, 512M (at least 64K)" +
                             (f", or a percentage of {of} such as 50%" if of else "")) from None
        if n < MIN_CAPACITY:
            raise ValueError(f"must be at least 64K: {n} bytes holds no model")
        if of == "RAM" and n > ram_bytes():
            raise ValueError(f"must be at most this machine's RAM ({ram_bytes() / 2**30:.1f} GiB, or 100%)")
        return text
    return rule


def _reserve(value) -> str:
    """memory_reserve: auto, bytes, or a percentage of the memory limit below 90%."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    if text.endswith("%"):
        try:
            number(float, low=0, high=90)(text[:-1])
        except ValueError:
            raise ValueError("must be auto, a size such as 512M, or 0% to 90% of the memory limit") from None
        return text
    try:
        parse_size(text)
    except ConfigError:
        raise ValueError("must be auto, a size such as 512M, or a percentage of the memory limit such as 10%") from None
    return text


def _int_list(words: tuple, low: int, form: str):
    """One of `words`, or whole numbers >= low separated by commas (a TOML list too): workers, gpus."""
    def rule(value):
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        text = str(value).strip().lower()
        if text in words:
            return text
        parts = text.split(",")
        if not all(p.strip().isdigit() and int(p) >= low for p in parts):
            raise ValueError(f"must be {form}")
        return ",".join(str(int(p)) for p in parts)
    return rule


def _address(value) -> str:
    return check_address(_text(value)) if value else ""


def _fake_gpus(value) -> str:
    try:
        parse_fake_gpus(value)
    except ConfigError:
        raise ValueError("must be a size such as 1G, or count x size such as 2x256M, or none") from None
    return str(value)


def _remote(value) -> str:
    text = _text(value).strip()
    if text and text.partition("://")[0] not in ("file", "http", "https"):
        raise ValueError("must be a store URL: file:///DIR, http://HOST/DIR or https://HOST/DIR")
    return text


def _batching(value) -> str:
    try:
        parse_policy_spec(_text(value))
    except ValueError as e:
        raise ValueError(str(e).partition(": ")[2]) from None   # (names the policies, without batching=... again)
    return value


def _cache_size(value) -> str:
    text = str(value).strip()
    try:
        parse_size(text)
    except ConfigError:
        raise ValueError("must be a size in bytes, e.g. 128M, or 0 for no response cache") from None
    return text


def _message_size(value) -> str:
    text = str(value)
    try:
        n = parse_size(text)
    except ConfigError:
        raise ValueError("must be a size in bytes, e.g. 64M") from None
    if n < 1 << 16:
        raise ValueError("must be at least 64K, or no request fits")
    return text


_port = number(int, 0, 65535)
_positive = number(float, above=0)
_non_negative = number(float, low=0)

RULES = {
    "socket": _address, "repository": _directory(False), "shm_dir": _directory(True),
    "host_capacity": _capacity("RAM"), "memory_reserve": _reserve,
    "capacity_over_limit": _choice("refuse", "warn"), "open_when_full": _choice("disk", "wait"),
    "gpu_capacity": _capacity("the device's memory"),
    "fake_gpus": _fake_gpus, "gpu_sharing": _choice(*GPU_SHARING), "remote": _remote,
    "eviction_policy": _choice(*EVICTION_POLICIES),
    "keep_alive_s": _positive,
    "log_level": _choice(*LOG_LEVELS), "heartbeat_interval_s": _positive, "lease_timeout_s": _positive,
    "request_timeout_s": _positive, "add_timeout_s": _positive, "opt_level": _choice(*OPT_LEVELS),
    "prepack": _bool, "loader_threads": number(int, 1, 1024),
    "workers": _int_list(("auto",), 1, "'auto' or threads per group, each >= 1: '2', '1,1' or [1, 1]"),
    "gpus": _int_list(("auto", "none", "off", ""), 0, "'auto', 'none' or device indices: '0', '0,1' or [0, 1]"),
    "scheduler": _choice(*SCHEDULERS), "serve_idle_s": _positive, "batching": _batching,
    "max_batch": number(int, 0), "t_opt_ms": _non_negative, "batch_window_ms": _non_negative,
    "max_queue_delay_ms": _non_negative, "max_queue": number(int, 0),
    "response_cache_size": _cache_size, "inline_run_ms": _non_negative,
    "front_runs": _choice("short", "never"), "front_hold_s": _positive, "state_dir": _directory(False),
    "metrics_port": _port, "metrics_host": _nonempty, "http_port": _port, "http_host": _nonempty,
    "grpc_port": _port, "grpc_host": _nonempty, "client_shared_memory": _bool,
    "triton_repository": _directory(True), "model_control": _choice("explicit", "none", "poll"),
    "repository_poll_s": _positive,
    "max_message_size": _message_size, "max_clients": number(int, 1), "keep_host_tier": _bool,
    "verify_promotion": _bool, "admin_group": _text,
}

# What a client of the daemon reads (the library's connect, and the CLI's commands that ask the daemon): a
# daemon-only setting that is wrong in the shared config file must not break them (see load's `only`).
# (max_message_size: a client of a tcp:// daemon sends its tensors in the message, up to it: tensors.encode)
CLIENT_SETTINGS = ("socket", "request_timeout_s", "add_timeout_s", "max_message_size")


def load(config_file: str | Path | None = None, overrides: dict | None = None, env=None,
         only=None, overrides_are="flags") -> Settings:
    """Settings from all four layers, each value checked. `overrides` are flags (or, overrides_are="arguments",
    a library call's arguments: errors name them so); None values mean 'not given'.

    `only`: the settings this caller uses; the others keep their defaults, unread and unchecked, so a
    daemon-only setting the client commands never use cannot break them. None: all of them (the daemon)."""
    env = os.environ if env is None else env
    known = {f.name for f in fields(Settings)}
    wanted = known if only is None else set(only)
    given: dict = {}                       # setting -> (value, where it came from, for the error)
    path = Path(config_file) if config_file else default_config_file(env)
    if path is not None:
        data = read_toml(path, "config file", ConfigError)
        data = data.get("modelcache", data)  # accept a [modelcache] table or top-level keys
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in known:
                import difflib
                close = difflib.get_close_matches(key, known, n=1)
                raise ConfigError(f"config file {path}: unknown setting {key!r}; " +
                                  (f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"))
            given[key] = (value, f"{key} = {value!r} in {path}")
    for key in known:
        var = f"MODELCACHE_{key.upper()}"
        if env.get(var, "") != "":
            given[key] = (env[var], f"{var}={env[var]}")
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in known:
                raise ConfigError(f"unknown setting {key!r}")
            given[key] = (value, f"--{key.replace('_', '-')} {value}" if overrides_are == "flags" else
                          f"argument {key}={value!r}")
    values = {}
    for key, (value, where) in given.items():
        if key in wanted:
            try:
                values[key] = RULES[key](value)
            except ValueError as e:
                raise ConfigError(f"{where}: {key} {e}") from None
    settings = Settings(**values)
    if {"model_control", "triton_repository"} <= wanted and settings.model_control == "poll" and \
            not settings.triton_repository:
        raise ConfigError("model_control poll watches the Triton repository: set triton_repository too")
    if {"lease_timeout_s", "heartbeat_interval_s"} <= wanted and \
            settings.lease_timeout_s <= settings.heartbeat_interval_s:
        raise ConfigError(f"lease_timeout_s {settings.lease_timeout_s:g} must be longer than heartbeat_interval_s "
                          f"{settings.heartbeat_interval_s:g}, or every client loses its leases between two pings")
    return settings


def read_toml(path: str | Path, what: str, error=ConfigError) -> dict:
    """A TOML file's table; `error` saying "<what> <path> does not exist" or "is not valid TOML: ..."."""
    tomllib = _tomllib()  # imported only when there is a file: clients start faster without it
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise error(f"{what} {path} is not valid TOML: {e}") from None


def _tomllib():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def describe(settings: Settings) -> dict:
    return dataclasses.asdict(settings)
