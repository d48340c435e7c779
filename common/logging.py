"""structlog set-up: JSON lines when not on a terminal, readable key=value on one."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(service: str, level: str = "info") -> None:
    """Every line carries `service`; lines about a request also `rid` and `trace_id`
    (use `request_logger`, or bind them with structlog's contextvars in a request's task)."""
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )

    def add_service(logger, method: str, event: dict) -> dict:
        # a processor, not a contextvar: the model worker thread logs too and has no context
        event.setdefault("service", service)
        return event

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        add_service,
    ]
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        # one write per line, newline included: the services share the launcher's stderr, and
        # with PYTHONUNBUFFERED a print's separate "\n" let two lines run into one
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # Libraries log through the standard library (the OTLP exporter, aiohttp): the same lines,
    # so a collector never meets a plain-text line among the JSON ones.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name,
                           structlog.processors.format_exc_info],
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.WARNING))


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)


def request_logger(rid: str, trace_id: str | None, name: str | None = None):
    """A logger whose every line says which request (and which trace) it is about."""
    return structlog.get_logger(name).bind(rid=rid, trace_id=trace_id)
