"""A log handler for tests that read what one logger recorded."""

from __future__ import annotations

import logging


class Caught(logging.Handler):
    """The records of the logger it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
