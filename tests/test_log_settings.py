"""Triton's logging extension (daemon/log_settings.py): its settings over Python's logging in process, with a real
handler; then a real daemon's, through tritonclient over both fronts, its log showing what the settings let through.
"""

from __future__ import annotations

import logging

import pytest

from modelcache import zoo
from modelcache.daemon.log_settings import LogSettings
from modelcache.errors import InputError

from conftest import stop_cleanly, wait_until
from test_repository_load import CONFIG
from test_triton_repo import put_model, start_importing


class Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []
        self.setFormatter(logging.Formatter("%(asctime)s %(message)s"))

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def log():
    """LogSettings over the "modelcache.t" logger, with a handler on the root logger as cli.py sets one up
    (`log.kept`); the logger's level, the root's handlers and their filters and formats as they were after."""
    root, logger = logging.getLogger(), logging.getLogger("modelcache.t")
    kept, level = Keep(), logger.level
    root.addHandler(kept)
    settings = LogSettings("modelcache.t")
    settings.kept = kept
    try:
        yield settings
    finally:
        settings.apply({"log_format": "default"})
        for h in root.handlers:
            h.removeFilter(settings.levels)
        root.removeHandler(kept)
        logger.setLevel(level)


def test_each_level_is_switched_on_and_off_apart_as_tritons(log):
    handler = log.kept.records
    out = logging.getLogger("modelcache.t")
    out.setLevel(logging.INFO)
    assert log.settings() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                              "log_verbose_level": 0, "log_format": "default"}
    after = log.apply({"log_verbose_level": 1, "log_warning": False})
    assert (after["log_verbose_level"], after["log_info"], after["log_warning"], after["log_error"]) == (1, True,
                                                                                                         False, True)
    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
        out.log(level, "at %s", logging.getLevelName(level))
    assert [r.levelname for r in handler] == ["DEBUG", "INFO", "ERROR"]   # (warnings switched off on their own)
    handler.clear()
    log.apply({"log_verbose_level": 0, "log_info": False, "log_warning": True, "log_format": "ISO8601"})
    out.info("not this")
    out.warning("this")
    [record] = handler
    stamped = log.kept.format(record)
    assert record.getMessage() == "this" and stamped[10] == "T" and stamped[19] == "Z", stamped


@pytest.mark.parametrize("update, words", [
    ({"log_file": "/tmp/x"}, "log file location can not be updated through network protocol"),
    ({"log_info": "yes"}, "attempt to access JSON non-boolean as boolean"),
    ({"log_verbose_level": -1}, "non-unsigned-integer"),
    ({"log_verbose_level": True}, "non-unsigned-integer"),
    ({"log_format": "json"}, "invalid argument for --log_format, got: json"),
    ({"log_colour": True}, "unknown log setting 'log_colour'"),
])
def test_a_bad_setting_is_refused_in_tritons_words_and_changes_nothing(update, words, log):
    before = log.settings()
    with pytest.raises(InputError, match=words):
        log.apply({"log_warning": False, **update})
    assert log.settings() == before
    assert log.apply({"log_info": None}) == before   # (a null setting is skipped, as Triton skips it)


def test_a_daemons_log_settings_over_both_fronts(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    repo = tmp_path / "models"
    put_model(repo, "m", zoo.build("tiny-cnn", seed=1), CONFIG)
    d, grpc_at, http_at = start_importing(tmp_path, repo, {"MODELCACHE_LOG_LEVEL": "info"})
    g, h = grpcclient.InferenceServerClient(grpc_at), httpclient.InferenceServerClient(http_at)
    try:
        assert "logging" in h.get_server_metadata()["extensions"]
        assert h.get_log_settings() == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                                        "log_verbose_level": 0, "log_format": "default"}
        assert "client c" not in d.log_path.read_text()   # (a client's connection is a DEBUG line)
        after = h.update_log_settings({"log_verbose_level": 1})
        assert after["log_verbose_level"] == 1 and after["log_info"]
        # the daemon's log, for every front: the other front reads the same, and the daemon's DEBUG lines come
        got = g.get_log_settings(as_json=True)["settings"]
        assert got["log_verbose_level"]["uint32_param"] == 1 and got["log_info"]["bool_param"] is True
        import modelcache
        with d.client() as c:   # (a new client: a DEBUG line of the daemon's)
            modelcache.InferenceSession("m", client=c).close()
        wait_until(lambda: "DEBUG modelcache.daemon: client c" in d.log_path.read_text(), 10, "a DEBUG line")
        assert "log settings changed over a protocol front" in d.log_path.read_text()
        g.update_log_settings({"log_verbose_level": 0, "log_info": False})
        assert h.get_log_settings()["log_info"] is False
        from tritonclient.utils import InferenceServerException
        with pytest.raises(InferenceServerException, match="log file location can not be updated"):
            h.update_log_settings({"log_file": "/tmp/elsewhere"})
        with pytest.raises(InferenceServerException, match="invalid argument for --log_format"):
            g.update_log_settings({"log_format": "xml"})
    finally:
        g.close()
        h.close()
        stop_cleanly(d)
