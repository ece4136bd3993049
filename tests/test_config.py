import pytest

from modelcache.config import ConfigError, load, parse_fake_gpus, parse_size


def test_layers_defaults_toml_env_flags(tmp_path):
    toml = tmp_path / "mc.toml"
    toml.write_text('socket = "ipc:///from/toml"\nrequest_timeout_s = 5\nlog_level = "warning"\n')
    env = {"MODELCACHE_REQUEST_TIMEOUT_S": "7", "MODELCACHE_LOG_LEVEL": "error"}
    s = load(toml, {"log_level": "debug", "socket": None}, env=env)
    assert s.socket == "ipc:///from/toml"        # file beats default
    assert s.request_timeout_s == 7.0            # environment beats file
    assert s.log_level == "debug"                # flag beats environment
    assert s.heartbeat_interval_s == 1.0         # untouched default


def test_defaults_need_no_file(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    s = load(None, env={})
    if s.socket.startswith(f"ipc://{tmp_path}"):
        assert s.socket.endswith("/modelcache/daemon.sock")
    assert s.repository.endswith("repository")


def test_systemd_directories_are_followed(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/modelcache")
    monkeypatch.setenv("STATE_DIRECTORY", "/var/lib/modelcache")
    s = load(None, env={})
    assert s.socket == "ipc:///run/modelcache/daemon.sock"
    assert s.repository == "/var/lib/modelcache/repository"


@pytest.mark.parametrize("text, total, expect", [
    ("512M", None, 512 * 2**20), ("8G", None, 8 * 2**30), ("1.5GiB", None, int(1.5 * 2**30)),
    ("1000", None, 1000), ("25%", 4000, 1000)])
def test_sizes(text, total, expect):
    assert parse_size(text, total) == expect


@pytest.mark.parametrize("spec, expect", [
    ("2x256M", (2, 256 * 2**20)), ("1G", (1, 2**30)), (" 4X1G", (4, 2**30)), ("", (0, 0)), ("none", (0, 0))])
def test_fake_gpus(spec, expect):
    # One reading of the spec for the daemon (tiers.gpu.fake_devices) and its clients (client.device).
    assert parse_fake_gpus(spec) == expect


def test_bad_values_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="host_capacity must be a positive size"):
        load(None, {"host_capacity": "lots"}, env={})
    toml = tmp_path / "bad.toml"
    toml.write_text("sockett = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'sockett'"):
        load(toml, env={})
    toml.write_text("socket = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(toml, env={})
    with pytest.raises(ConfigError, match="MODELCACHE_LEASE_TIMEOUT_S=soon: lease_timeout_s is not a number"):
        load(None, env={"MODELCACHE_LEASE_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="unknown policy 'greedy'"):
        load(None, {"batching": "alexnet=greedy"}, env={})


GiB = 2**30


# (environment variable, value, what the error must say: the variable, the setting and its range or form)
@pytest.mark.parametrize("var, value, says", [
    ("HOST_CAPACITY", "-5G", "host_capacity must be a positive size"),
    ("HOST_CAPACITY", "150%", "host_capacity must be more than 0% and at most 100% of RAM"),
    ("HOST_CAPACITY", "0%", "host_capacity must be more than 0% and at most 100% of RAM"),
    ("HOST_CAPACITY", "1T", "host_capacity must be at most this machine's RAM"),
    ("HOST_CAPACITY", "0", "host_capacity must be at least 64K: 0 bytes"),
    ("HOST_CAPACITY", "10K", "host_capacity must be at least 64K: 10240 bytes"),
    ("GPU_CAPACITY", "-1G", "gpu_capacity must be a positive size"),
    ("GPU_CAPACITY", "101%", "gpu_capacity must be more than 0% and at most 100% of the device's memory"),
    ("GPU_CAPACITY", "10K", "gpu_capacity must be at least 64K"),
    ("LOG_LEVEL", "verbose", "log_level must be one of debug, info, warning, error, critical"),
    ("LEASE_TIMEOUT_S", "-1", "lease_timeout_s must be > 0"),
    ("HEARTBEAT_INTERVAL_S", "0", "heartbeat_interval_s must be > 0"),
    ("REQUEST_TIMEOUT_S", "nan", "request_timeout_s must be a finite number"),
    ("ADD_TIMEOUT_S", "0", "add_timeout_s must be > 0"),
    ("SERVE_IDLE_S", "-3", "serve_idle_s must be > 0"),
    ("PREPACK", "enabled", "prepack is not a boolean: write true/false"),
    ("KEEP_HOST_TIER", "maybe", "keep_host_tier is not a boolean"),
    ("VERIFY_PROMOTION", "2", "verify_promotion is not a boolean"),
    ("LOADER_THREADS", "0", "loader_threads must be >= 1"),
    ("LOADER_THREADS", "two", "loader_threads is not a whole number"),
    ("MAX_CLIENTS", "0", "max_clients must be >= 1"),
    ("MAX_BATCH", "-1", "max_batch must be >= 0"),
    ("T_OPT_MS", "-1", "t_opt_ms must be >= 0"),
    ("BATCH_WINDOW_MS", "-1", "batch_window_ms must be >= 0"),
    ("MAX_QUEUE_DELAY_MS", "-1", "max_queue_delay_ms must be >= 0"),
    ("INLINE_RUN_MS", "-0.5", "inline_run_ms must be >= 0"),
    ("METRICS_PORT", "99999", "metrics_port must be >= 0 and <= 65535"),
    ("HTTP_PORT", "-1", "http_port must be >= 0 and <= 65535"),
    ("HTTP_HOST", " ", "http_host must not be empty"),
    ("EVICTION_POLICY", "random", "eviction_policy must be one of lru, lfu, fifo, gdsf, never, eager"),
    ("SCHEDULER", "fastest", "scheduler must be one of eager, round-robin, dmda"),
    ("OPT_LEVEL", "max", "opt_level must be one of disable, basic, extended, all"),
    ("BATCHING", "turbo", "batching unknown policy 'turbo'"),
    ("WORKERS", "0", "workers must be 'auto' or threads per group, each >= 1"),
    ("GPUS", "first", "gpus must be 'auto', 'none' or device indices"),
    ("FAKE_GPUS", "lots", "fake_gpus must be a size such as 1G"),
    ("REMOTE", "ftp://x/y", "remote must be a store URL"),
    ("MAX_MESSAGE_SIZE", "1K", "max_message_size must be at least 64K"),
    ("SOCKET", "garbage", "socket is not a daemon address: write ipc://PATH (or an absolute PATH), or tcp://HOST:PORT"),
    ("SOCKET", "tcp://host", "socket is not a daemon address"),
    ("SOCKET", "ipc://", "socket is not a daemon address"),
    ("SHM_DIR", "/nonexistent/shm", "shm_dir must be an existing directory"),
])
def test_each_setting_is_checked_with_its_name_and_range(var, value, says):
    with pytest.raises(ConfigError) as e:
        load(None, env={f"MODELCACHE_{var}": value})
    assert str(e.value).startswith(f"MODELCACHE_{var}={value}: ")   # where it came from
    assert says in str(e.value)


def test_every_setting_has_a_rule():
    from dataclasses import fields

    from modelcache.config import RULES, Settings
    assert set(RULES) == {f.name for f in fields(Settings)}


def test_the_choices_are_the_implementations_names():
    from modelcache.config import EVICTION_POLICIES, SCHEDULERS
    from modelcache.eviction import POLICIES
    from modelcache.executor.scheduler import SCHEDULERS as IMPLEMENTED
    assert set(EVICTION_POLICIES) == set(POLICIES)
    assert set(SCHEDULERS) == set(IMPLEMENTED)


def test_errors_name_their_source(tmp_path):
    toml = tmp_path / "mc.toml"
    toml.write_text('host_capacity = "banana"\n')
    with pytest.raises(ConfigError, match=f"host_capacity = 'banana' in {toml}: host_capacity must be"):
        load(toml, env={})
    with pytest.raises(ConfigError, match="--metrics-port 70000: metrics_port must be >= 0 and <= 65535"):
        load(None, {"metrics_port": 70000}, env={})
    with pytest.raises(ConfigError, match="argument socket='garbage': socket is not a daemon address"):
        load(None, {"socket": "garbage"}, env={}, overrides_are="arguments")


def test_a_file_where_a_directory_belongs(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    for var in ("REPOSITORY", "STATE_DIR"):
        with pytest.raises(ConfigError, match=f"MODELCACHE_{var}={f}: {var.lower()} must be a directory: {f} is a file"):
            load(None, env={f"MODELCACHE_{var}": str(f)})


def test_lease_timeout_must_outlast_the_heartbeat():
    with pytest.raises(ConfigError, match="lease_timeout_s 1 must be longer than heartbeat_interval_s 2"):
        load(None, env={"MODELCACHE_LEASE_TIMEOUT_S": "1", "MODELCACHE_HEARTBEAT_INTERVAL_S": "2"})


@pytest.mark.parametrize("text, expect", [("true", True), ("Yes", True), ("on", True), ("1", True),
                                          ("false", False), ("NO", False), ("off", False), ("0", False)])
def test_booleans(text, expect):
    assert load(None, env={"MODELCACHE_PREPACK": text}).prepack is expect


def test_toml_types(tmp_path):
    toml = tmp_path / "mc.toml"
    toml.write_text("prepack = true\nworkers = [1, 1]\ngpus = [0]\nloader_threads = 3\nhost_capacity = \"1G\"\n")
    s = load(toml, env={})
    assert (s.prepack, s.workers, s.gpus, s.loader_threads, s.host_capacity_bytes()) == (True, "1,1", "0", 3, GiB)
    toml.write_text('prepack = "enabled"\n')
    with pytest.raises(ConfigError, match="prepack = 'enabled' in .*: prepack is not a boolean"):
        load(toml, env={})
    toml.write_text("loader_threads = 2.5\n")
    with pytest.raises(ConfigError, match="loader_threads is not a whole number"):
        load(toml, env={})
    toml.write_text("loader_threads = true\n")
    with pytest.raises(ConfigError, match="loader_threads must be a number, not a boolean"):
        load(toml, env={})
    toml.write_text('workers = ["x"]\n')
    with pytest.raises(ConfigError, match="workers must be 'auto' or threads per group"):
        load(toml, env={})


def test_a_bare_absolute_path_is_an_ipc_socket():
    assert load(None, env={"MODELCACHE_SOCKET": "/run/x/daemon.sock"}).socket == "ipc:///run/x/daemon.sock"
    assert load(None, env={"MODELCACHE_SOCKET": "tcp://127.0.0.1:5555"}).socket == "tcp://127.0.0.1:5555"


def test_a_daemon_only_setting_never_breaks_a_client(tmp_path):
    from modelcache.config import CLIENT_SETTINGS
    toml = tmp_path / "mc.toml"
    toml.write_text('host_capacity = "banana"\nloader_threads = 0\nsocket = "ipc:///x/d.sock"\n')
    s = load(toml, env={}, only=CLIENT_SETTINGS)
    assert s.socket == "ipc:///x/d.sock" and s.loader_threads == 2   # unread: its default
    with pytest.raises(ConfigError, match="host_capacity"):
        load(toml, env={})                                            # the daemon reads (and checks) it all


def test_connect_refuses_a_bad_address_with_the_accepted_forms():
    import modelcache
    from modelcache.errors import ModelCacheError
    with pytest.raises(ModelCacheError, match="socket='garbage': socket is not a daemon address: write ipc://PATH .*tcp://HOST:PORT"):
        modelcache.connect("garbage")


def test_batching_policy_per_model():
    from modelcache.config import parse_policy_spec
    assert parse_policy_spec("layer") == {"*": "layer"}
    assert parse_policy_spec("alexnet=layer, resnet50=dynamic") == {"alexnet": "layer", "resnet50": "dynamic",
                                                                      "*": "serial"}
    assert parse_policy_spec("alexnet=batch,*=dynamic") == {"alexnet": "batch", "*": "dynamic"}
