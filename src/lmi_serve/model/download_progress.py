"""Download progress as log lines: bytes done of total every few seconds (model/hub.py, model/s3.py).

Lines, not bars, so that they read the same in the server's text and JSON log formats.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("lmi_serve.model.download")  # one logger for every download line

PROGRESS_EVERY_S = 10.0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@contextmanager
def progress_log(what: str, files: int, total: int, measure: Callable[[], int],
                 every: float = PROGRESS_EVERY_S) -> Iterator[None]:
    """Log the start, then `measure()` (bytes done) against `total` every `every` seconds from a
    thread, then the end, while the block downloads `files` files of `what`."""
    log.info("Downloading %s: %d files, %s", what, files, _mib(total))
    started = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(every):
            current = min(measure(), total)
            percent = 100 * current / total if total else 100.0
            log.info("Downloading %s: %s of %s (%.0f%%)", what, _mib(current), _mib(total), percent)

    reporter = threading.Thread(target=report, name="download-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()
    seconds = time.monotonic() - started
    log.info("Downloaded %s: %s in %.1f s", what, _mib(total), seconds)


def folder_bytes(folder: Path) -> int:
    """The bytes of every file under `folder` (partial downloads included); 0 when it is absent."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # renamed or removed while we looked
                pass
    return total
