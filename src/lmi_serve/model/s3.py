"""An `s3://bucket/prefix` model copied into the cache dir with boto3, then loaded like a folder.

boto3 finds credentials and the endpoint as every AWS tool does (environment, profile, container or
instance role; `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`). The prefix is listed, the files the model
needs chosen (remote_files.choose_files) and downloaded into a staging folder that is renamed into
place only once every file is complete, so an interrupted copy is never loaded.

A restart finding the complete copy serves it without contacting S3 (the copy is of a prefix you
chose; S3 has no commit to compare): to take new files, delete `<cache dir>/s3/<bucket>/...` or
point `option.model_id` at a new prefix.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path

from lmi_serve.model.download_progress import folder_bytes, progress_log
from lmi_serve.model.remote_files import S3Location, choose_files
from lmi_serve.model.source import ModelLoadError

log = logging.getLogger(__name__)

_DENIED = {"AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "403"}
_MISSING_BUCKET = {"NoSuchBucket", "404"}


def copy_folder(cache_dir: str, location: S3Location) -> Path:
    """Where the copy of `location` lives: readable, and distinct for every bucket and prefix."""
    tail = location.prefix.rsplit("/", 1)[-1] or "_bucket"
    digest = hashlib.sha256(location.url.encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / "s3" / location.bucket / f"{tail}-{digest}"


def _client():
    import boto3
    from botocore.config import Config

    # "standard" retries transient errors (throttling, 5xx, dropped connections) with backoff, 3 attempts
    # unless AWS_MAX_ATTEMPTS says otherwise
    return boto3.client("s3", config=Config(retries={"mode": "standard"}))


def _explain(exc: Exception, location: S3Location, endpoint: str) -> ModelLoadError:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return ModelLoadError(f"{location.url}: no AWS credentials found (environment, profile, or the container's "
                              "or instance's role)")
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _MISSING_BUCKET:
            return ModelLoadError(f"{location.url}: no such bucket {location.bucket!r} at {endpoint}")
        if code in _DENIED:
            return ModelLoadError(f"{location.url}: access denied ({code}) at {endpoint}: check the AWS credentials "
                                  "and that they may list and read the prefix")
        return ModelLoadError(f"{location.url}: S3 answered {code or 'an error'} at {endpoint}")
    from boto3.exceptions import RetriesExceededError

    if isinstance(exc, RetriesExceededError):
        return ModelLoadError(f"{location.url}: the connection to S3 at {endpoint} kept breaking mid-transfer "
                              "(retries exhausted); nothing partial is kept, a restart downloads it again")
    if isinstance(exc, BotoCoreError):
        return ModelLoadError(f"{location.url}: S3 at {endpoint} could not be reached or the transfer broke "
                              f"({type(exc).__name__}); nothing partial is kept")
    return ModelLoadError(f"{location.url}: the download failed ({type(exc).__name__}: {exc}); nothing partial is kept")


def _listing(client, location: S3Location) -> dict[str, int]:
    """Every object under the prefix: its path below the prefix -> its size."""
    prefix = f"{location.prefix}/" if location.prefix else ""
    sizes: dict[str, int] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
        for item in page.get("Contents", ()):
            relative = item["Key"][len(prefix):]
            if relative and not relative.endswith("/"):  # "folder" marker objects hold nothing
                sizes[relative] = item["Size"]
    return sizes


def download_from_s3(location: S3Location, *, cache_dir: str, allow_pickled: bool, gguf_file: str | None,
                     trust_remote_code: bool, progress_every: float) -> Path:
    """The local copy of `location`, downloaded now unless a complete one is in the cache."""
    target = copy_folder(cache_dir, location)
    if target.is_dir():
        log.info("%s: serving the copy in %s (downloaded earlier; delete it to download again)", location.url, target)
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # an earlier start that died mid-copy
    client = _client()
    endpoint = client.meta.endpoint_url
    try:
        sizes = _listing(client, location)
        if not sizes:
            raise ModelLoadError(f"{location.url}: no objects under this prefix at {endpoint}")
        files = choose_files(sizes, source=location.url, allow_pickled=allow_pickled, gguf_file=gguf_file,
                             trust_remote_code=trust_remote_code)
        prefix = f"{location.prefix}/" if location.prefix else ""
        with progress_log(location.url, len(files), sum(sizes[f] for f in files), lambda: folder_bytes(staging),
                          progress_every):
            for name in files:
                destination = staging / name
                destination.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(location.bucket, prefix + name, str(destination))
                if destination.stat().st_size != sizes[name]:
                    raise ModelLoadError(f"{location.url}: {name} is {destination.stat().st_size} bytes, "
                                         f"S3 listed {sizes[name]}; nothing partial is kept")
        staging.rename(target)  # atomic: the folder appears complete or not at all
    except ModelLoadError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except Exception as exc:  # botocore's and s3transfer's errors: explained, never a traceback
        shutil.rmtree(staging, ignore_errors=True)
        raise _explain(exc, location, endpoint) from None
    return target
