"""Structured logs for every process: one JSON event per line on stderr (a readable
console rendering when stderr is a terminal), bound with the process's role (and rank
for workers); events of a step carry `step` (bound with structlog's contextvars by
the step loops)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog


def renderers(stream=None) -> list:
    """JSON for files and pipes (what the launcher and log shippers read); colours
    for a person at a terminal. DEEPINFER_LOG_FORMAT=json|console overrides."""
    stream = stream or sys.stderr
    fmt = os.environ.get("DEEPINFER_LOG_FORMAT", "")
    if fmt == "console" or (fmt != "json" and stream.isatty()):
        return [structlog.dev.ConsoleRenderer(colors=stream.isatty())]  # formats exceptions
    return [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]


def configure_logging(role: str, rank: int | None = None, level: str | None = None):
    """Configure structlog for this process and route the standard library's records
    (uvicorn's, torch's) through the same renderer, each event carrying `role` (and
    `rank`); returns a logger bound with them."""
    level = level or os.environ.get("DEEPINFER_LOG_LEVEL", "INFO")
    identity = {"role": role} if rank is None else {"role": role, "rank": rank}

    def add_identity(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        for key, value in identity.items():
            event.setdefault(key, value)
        return event

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        add_identity,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.contextvars.clear_contextvars()
    structlog.configure(
        processors=[*shared, *renderers(sys.stderr)],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # one write per line (print() writes the newline apart): ranks sharing a log file
        # never glue two events onto one line
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    *renderers(sys.stderr)],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    return structlog.get_logger().bind(**identity)
