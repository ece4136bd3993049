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
    with pytest.raises(ConfigError, match="as a size"):
        load(None, {"host_capacity": "lots"}, env={})
    toml = tmp_path / "bad.toml"
    toml.write_text("sockett = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'sockett'"):
        load(toml, env={})
    toml.write_text("socket = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(toml, env={})
    with pytest.raises(ConfigError, match="not a valid float"):
        load(None, env={"MODELCACHE_LEASE_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="unknown policy 'greedy'"):
        load(None, {"batching": "alexnet=greedy"}, env={})


def test_batching_policy_per_model():
    from modelcache.config import parse_policy_spec
    assert parse_policy_spec("layer") == {"*": "layer"}
    assert parse_policy_spec("alexnet=layer, resnet50=dynamic") == {"alexnet": "layer", "resnet50": "dynamic",
                                                                      "*": "serial"}
    assert parse_policy_spec("alexnet=batch,*=dynamic") == {"alexnet": "batch", "*": "dynamic"}
