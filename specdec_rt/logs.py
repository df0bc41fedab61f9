"""structlog key-value events routed through the standard ``logging`` module.

A library must not print by itself: events go to the stdlib logger ``specdec_rt`` (silent until
the application configures logging; the CLI sends them to stderr). Per-round events are at debug
level and are filtered before any formatting work.
"""

from __future__ import annotations

import logging

import structlog

__all__ = ["get_logger", "configure_cli_logging"]


def get_logger(name: str = "specdec_rt") -> structlog.stdlib.BoundLogger:
    """A structlog logger writing ``event key=value ...`` lines to stdlib logger ``name``."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=False),
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return logger


def configure_cli_logging(level: int = logging.WARNING) -> None:
    """Send specdec_rt events to stderr (stdout stays free for JSON output)."""
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logger = logging.getLogger("specdec_rt")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
