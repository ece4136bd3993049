"""Settings: embedded defaults < TOML file < MODELCACHE_* environment < command-line flags."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path

from .address import DEFAULT_REQUEST_TIMEOUT_S, default_config_file, default_socket, is_root
from .errors import ModelCacheError


class ConfigError(ModelCacheError):
    code = "config"


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
    host_capacity: str = "50%"        # bytes ("8G", "512M") or percent of RAM
    gpu_capacity: str = "50%"         # per GPU: bytes, or percent of the device's memory
    fake_gpus: str = ""               # simulated GPUs in shared memory, for tests and development: "2x256M"
    remote: str = ""                  # read-only model store (file:// or http(s)://), fetched on a miss
    eviction_policy: str = "lru"      # lru, lfu, fifo, gdsf, never, eager (read at start)
    log_level: str = "info"
    heartbeat_interval_s: float = 1.0  # clients ping this often ...
    lease_timeout_s: float = 4.0       # ... and lose their references after this long without a ping
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S   # every client call gives up after this long
    add_timeout_s: float = 3600.0      # packing a big model takes longer than an ordinary call
    opt_level: str = "all"             # ORT optimization applied once, at add time
    prepack: bool = False              # add: also store MLAS-prepacked MatMul weights (prepack.py): warm runs as fast as
                                       # plain ORT, but opens ~0.3 s slower and twice the host tier (README, Known limits)
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
    inline_run_ms: float = 1.0         # a stage predicted this short runs on the daemon's loop when nothing else is in flight; 0 = never
    state_dir: str = ""                # performance models persist here; default: the repository's parent
    metrics_port: int = 0              # Prometheus /metrics over HTTP; 0 = off
    metrics_host: str = "127.0.0.1"    # where /metrics listens
    http_port: int = 0                 # the daemon starts the v2 HTTP front (`modelcache http`) on this port; 0 = off
    http_host: str = "127.0.0.1"       # where the v2 HTTP front listens: loopback unless set
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

    def host_capacity_bytes(self) -> int:
        return parse_size(self.host_capacity, total=_ram_bytes())

    def max_message_bytes(self) -> int:
        return parse_size(self.max_message_size)


def _ram_bytes() -> int:
    import psutil
    return psutil.virtual_memory().total


def parse_size(text: str | int, total: int | None = None) -> int:
    """'8G', '512M', '1.5GiB', '1000000', or '40%' (of `total`) -> bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if s.endswith("%"):
            if total is None:
                raise ValueError("percent needs a total")
            return int(float(s[:-1]) / 100 * total)
        mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(s[-1:], 1)
        return int(float(s[:-1] if mult != 1 else s) * mult)
    except ValueError:
        raise ConfigError(f"cannot read {text!r} as a size: write bytes, e.g. 8G, 512M, or a percentage like 40%") from None


# The executor's batching policies (executor/batching.py), as the `batching` setting names them.
BATCHING_POLICIES = ("serial", "batch", "dynamic", "layer")


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


def _coerce(name: str, typ, value):
    try:
        if typ in (float, "float"):
            return float(value)
        if typ in (int, "int"):
            return int(value)
        if typ in (bool, "bool"):
            if isinstance(value, bool):
                return value
            return str(value).lower() in ("1", "true", "yes", "on")
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"setting {name}: {value!r} is not a valid {getattr(typ, '__name__', typ)}") from None


def load(config_file: str | Path | None = None, overrides: dict | None = None, env=None) -> Settings:
    """Settings from all four layers. `overrides` are flags; None values mean 'not given'."""
    env = os.environ if env is None else env
    known = {f.name: f.type for f in fields(Settings)}
    values: dict = {}
    path = Path(config_file) if config_file else default_config_file()
    if path is not None:
        data = read_toml(path, "config file", ConfigError)
        data = data.get("modelcache", data)  # accept a [modelcache] table or top-level keys
        for key, value in data.items():
            key = key.replace("-", "_")
            if key not in known:
                raise ConfigError(f"config file {path}: unknown setting {key!r}; known: {', '.join(known)}")
            values[key] = _coerce(key, known[key], value)
    for key, typ in known.items():
        var = f"MODELCACHE_{key.upper()}"
        if var in env and env[var] != "":
            values[key] = _coerce(var, typ, env[var])
    for key, value in (overrides or {}).items():
        if value is not None:
            if key not in known:
                raise ConfigError(f"unknown setting {key!r}")
            values[key] = _coerce(key, known[key], value)
    settings = Settings(**values)
    if settings.opt_level not in ("disable", "basic", "extended", "all"):
        raise ConfigError(f"opt_level {settings.opt_level!r}: choose disable, basic, extended or all")
    try:
        parse_policy_spec(settings.batching)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    parse_size(settings.host_capacity, total=1)  # fail early on a bad size, without asking psutil for RAM
    parse_size(settings.gpu_capacity, total=1)
    parse_fake_gpus(settings.fake_gpus)
    if settings.max_message_bytes() < 1 << 16:
        raise ConfigError(f"max_message_size {settings.max_message_size!r}: at least 64K, or no request fits")
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
