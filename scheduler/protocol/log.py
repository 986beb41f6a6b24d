"""Structured logs for every process: one JSON event per line on stderr, bound with the
process's role (and rank for workers); events of a step carry `step`."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(role: str, rank: int | None = None, level: str | None = None):
    level = level or os.environ.get("DEEPINFER_LOG_LEVEL", "INFO")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    log = structlog.get_logger().bind(role=role)
    return log if rank is None else log.bind(rank=rank)
