"""Models named by a Hub id or an `s3://` URL, downloaded at start-up into a local folder.

`fetch_model_files` runs in each worker before its model loads (ModelService.load, while /ping says
Loading). A file lock in the cache dir makes it once per container: the first worker downloads, the
others wait, then find the files in place and download nothing. Whatever loads the model afterwards
(transformers, the task decision, tensor-parallel followers) is given the local folder, never the id.
Progress is logged every few seconds as lines (bytes done of total), in the server's log format.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from lmi_serve.model.download_progress import PROGRESS_EVERY_S
from lmi_serve.model.remote_files import looks_like_hub_id, parse_s3_url
from lmi_serve.model.source import PACKAGE_PREFIX

if TYPE_CHECKING:
    from lmi_serve.config.sources import ModelConfig

log = logging.getLogger(__name__)


@contextmanager
def _exclusive(cache_dir: str, key: str, what: str) -> Iterator[None]:
    """One process at a time per `key` (every gunicorn worker of this container shares cache_dir)."""
    locks = Path(cache_dir).expanduser() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(key.encode()).hexdigest()[:24]
    with open(locks / f"download-{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("Waiting for another worker downloading %s", what)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def is_hub_id(model_id: str) -> bool:
    """A Hub repo id: not `package:`, not `s3://`, not an existing local path, not spelled as a path."""
    if model_id.startswith((PACKAGE_PREFIX, "s3://", "/", "./", "../", "~")):
        return False
    if Path(model_id).expanduser().exists():
        return False  # a local folder wins, as before
    return looks_like_hub_id(model_id)


def fetch_model_files(config: ModelConfig, cache_dir: str, *, progress_every: float = PROGRESS_EVERY_S) -> str | None:
    """The local folder holding `config.model_id` when it names a Hub repo or an S3 prefix (downloaded
    now unless the cache already holds it); None when model_id is local (nothing to fetch).

    Raises ModelLoadError naming the model when it cannot be fetched."""
    model_id = config.model_id
    if not model_id:
        return None
    s3 = parse_s3_url(model_id)
    if s3 is not None:
        from lmi_serve.model.s3 import download_from_s3

        with _exclusive(cache_dir, s3.url, s3.url):
            return str(download_from_s3(s3, cache_dir=cache_dir, allow_pickled=config.allow_pickled_weights,
                                        gguf_file=config.gguf_file, trust_remote_code=config.trust_remote_code,
                                        progress_every=progress_every))
    if not is_hub_id(model_id):
        return None
    from lmi_serve.model.hub import download_from_hub

    key = f"hub:{model_id}@{config.revision or 'main'}"
    with _exclusive(cache_dir, key, model_id):
        return str(download_from_hub(model_id, revision=config.revision, allow_pickled=config.allow_pickled_weights,
                                     gguf_file=config.gguf_file, trust_remote_code=config.trust_remote_code,
                                     progress_every=progress_every))
