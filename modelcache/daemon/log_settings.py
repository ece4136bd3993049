"""Triton's logging extension (GET/POST /v2/logging, gRPC LogSettings), as the daemon keeps it: Triton's settings
over Python's logging, for the daemon's log and the log of the front that asked (oip/operations.py applies the
answer there too).

Triton's settings switch each level on and off apart (log_info, log_warning, log_error; log_verbose_level for
the verbose lines, which are modelcache's DEBUG ones); Python's logging has one threshold. Both are honoured: the
"modelcache" logger's level lets through the lowest level switched on, and a filter on the process's log
handlers drops the levels switched off above it. Updates are checked in Triton's words (its http_server.cc
HandleLogging) and taken from admins only (root, the daemon's user, admin_group: a protocol front is the
daemon's user): a log turned off, or flooded with verbose lines, is the whole machine's business.
"""

from __future__ import annotations

import logging
import time

from ..errors import InputError

DEFAULT_FORMAT, ISO8601 = "default", "ISO8601"
ISO8601_DATES = "%Y-%m-%dT%H:%M:%SZ"   # Triton's ISO8601 lines: UTC, to the second


class TritonLogLevels(logging.Filter):
    """Drops the records of the levels Triton's settings switch off (above the logger's threshold)."""

    def __init__(self):
        super().__init__()
        self.switch_on()

    def switch_on(self) -> None:
        """Every level on: the logger's level is the whole say (the daemon's log_level, at a start or reload)."""
        self.info = self.warning = self.error = True

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return self.error
        if record.levelno >= logging.WARNING:
            return self.warning
        if record.levelno >= logging.INFO:
            return self.info
        return True   # (DEBUG: the logger's level says, by log_verbose_level)


class LogSettings:
    """The process's log settings in Triton's terms; `apply` changes them, `settings` reads them."""

    def __init__(self, logger: str = "modelcache"):
        self.logger = logging.getLogger(logger)
        self.levels = TritonLogLevels()
        self.format = DEFAULT_FORMAT
        self._installed = False

    def settings(self) -> dict:
        """Triton's six settings, as its GET answers them (log_file "": the process's standard error, or the
        journal under systemd)."""
        level = self.logger.getEffectiveLevel()
        return {"log_file": "", "log_info": level <= logging.INFO and self.levels.info,
                "log_warning": level <= logging.WARNING and self.levels.warning,
                "log_error": level <= logging.ERROR and self.levels.error,
                "log_verbose_level": 1 if level <= logging.DEBUG else 0, "log_format": self.format}

    def apply(self, update: dict) -> dict:
        """Check every setting of `update` first (nothing changes on a refusal), then apply them; the settings
        after. InputError in Triton's words."""
        wanted = {k: v for k, v in update.items() if v is not None}   # (Triton skips a null setting)
        now = self.settings()
        if "log_file" in wanted:
            raise InputError("log file location can not be updated through network protocol")
        unknown = sorted(set(wanted) - set(now))
        if unknown:
            raise InputError(f"unknown log setting {unknown[0]!r}; Triton's are {', '.join(now)}")
        for name in ("log_info", "log_warning", "log_error"):
            if name in wanted and type(wanted[name]) is not bool:
                raise InputError(f"{name}: attempt to access JSON non-boolean as boolean")
        verbose = wanted.get("log_verbose_level", now["log_verbose_level"])
        if type(verbose) is not int or verbose < 0:
            raise InputError("log_verbose_level: attempt to access JSON non-unsigned-integer as unsigned-integer")
        fmt = wanted.get("log_format", self.format)
        if fmt not in (DEFAULT_FORMAT, ISO8601):
            raise InputError(f"invalid argument for --log_format, got: {fmt}")
        merged = {**now, **wanted}
        self.levels.info, self.levels.warning, self.levels.error = \
            merged["log_info"], merged["log_warning"], merged["log_error"]
        # The threshold: the lowest level on (the filter drops those off above it).
        self.logger.setLevel(logging.DEBUG if verbose > 0 else logging.INFO if merged["log_info"] else
                             logging.WARNING if merged["log_warning"] else logging.ERROR)
        self._install()
        self._set_format(fmt)
        return self.settings()

    def _install(self) -> None:
        """The filter, on every handler the root logger writes through (the process's one, as cli.py sets it)."""
        if not self._installed:
            for handler in logging.getLogger().handlers:
                handler.addFilter(self.levels)
            self._installed = True

    def _set_format(self, fmt: str) -> None:
        if fmt == self.format:
            return
        self.format = fmt
        for handler in logging.getLogger().handlers:
            formatter = handler.formatter
            if formatter is None:
                continue
            if fmt == ISO8601:   # (a journal line has no time of ours to change: the journal stamps it)
                formatter.datefmt, formatter.converter = ISO8601_DATES, time.gmtime
            else:
                formatter.datefmt, formatter.converter = None, time.localtime
