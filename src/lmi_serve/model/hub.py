"""A Hub model into the Hugging Face cache with huggingface_hub, only the files it needs.

The revision is resolved to a commit (`HfApi.resolve_revision`), the commit's files listed
(`model_info` with their sizes), the wanted ones chosen (remote_files.choose_files), and those missing from the
cached snapshot fetched with `snapshot_download` (resumed and size-checked by huggingface_hub; a file
appears in the snapshot only once complete). The token is huggingface_hub's: `HF_TOKEN`, else a
saved login. When the Hub cannot be reached, or `HF_HUB_OFFLINE=1`, the cached snapshot of that
revision is served if it holds every chosen file, and refused otherwise: never a partial model.
"""

from __future__ import annotations

import glob
import logging
from dataclasses import dataclass
from pathlib import Path

from lmi_serve.model.download_progress import folder_bytes, progress_log
from lmi_serve.model.remote_files import choose_files
from lmi_serve.model.source import ModelLoadError

log = logging.getLogger(__name__)

# huggingface_hub's HTTP client logs every request at INFO: the progress lines say enough.
logging.getLogger("httpx2").setLevel(logging.WARNING)


@dataclass(frozen=True)
class HubSettings:
    """Where the Hub is, where its cache is, and the token: huggingface_hub's own settings
    (HF_ENDPOINT, HF_HOME / HF_HUB_CACHE, HF_TOKEN or a saved login) unless given."""

    endpoint: str
    cache: Path
    token: str | None

    @classmethod
    def from_environment(cls) -> HubSettings:
        from huggingface_hub import constants, get_token

        return cls(constants.ENDPOINT, Path(constants.HF_HUB_CACHE), get_token())


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    import httpx2
    from huggingface_hub.errors import OfflineModeIsEnabled

    return httpx2.TransportError, OfflineModeIsEnabled


def _cached_listing(repo_id: str, commit: str, snapshot: Path, cache: Path) -> dict[str, int]:
    """The commit's files from the cache: huggingface_hub's tree listing, else the snapshot folder
    itself (a cache filled by an older client, which kept no listing)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path: f.size for f in get_cached_repo_tree(repo_id, revision=commit, cache_dir=cache)}
    except CachedRepoTreeNotFoundError:
        if not snapshot.is_dir():
            return {}
        return {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}


def _explain(exc: Exception, repo_id: str, revision: str | None, hub: HubSettings) -> ModelLoadError:
    """huggingface_hub's error as one line naming the model and what to change (never the token)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError, RevisionResolutionError)

    name = f"Hub model {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    token_set = bool(hub.token)
    if isinstance(exc, GatedRepoError):
        return ModelLoadError(f"{name} is gated (HTTP {status}): accept its conditions on the Hub, then set "
                              "HF_TOKEN to a token of that account")
    if isinstance(exc, RepositoryNotFoundError):
        who = "HF_TOKEN has no access to it" if token_set else "HF_TOKEN is not set"
        return ModelLoadError(f"{name}: no such repository at {hub.endpoint} (HTTP {status}), or it is private "
                              f"or gated and {who}")
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(f"{name}: no such revision (HTTP {status}; option.revision / HF_REVISION)")
    if isinstance(exc, HfHubHTTPError) and status == 401:
        return ModelLoadError(f"{name}: the Hub refused the token in HF_TOKEN (HTTP 401, invalid credentials); "
                              "set a valid token, or unset HF_TOKEN for a public model")
    if isinstance(exc, HfHubHTTPError) and status == 403:
        return ModelLoadError(f"{name}: the Hub forbids it to this token (HTTP 403); give the token read access")
    if isinstance(exc, HfHubHTTPError):
        return ModelLoadError(f"{name}: the Hub answered HTTP {status}")
    if isinstance(exc, (RevisionResolutionError, *_unreachable_errors())):
        if _offline():
            return ModelLoadError(f"{name} is not in the local Hugging Face cache ({hub.cache}) and "
                                  "downloads are off (HF_HUB_OFFLINE=1): download it once with the Hub reachable, "
                                  "or point option.model_id at a folder")
        cause = exc.__cause__ if isinstance(exc, RevisionResolutionError) and exc.__cause__ else exc
        return ModelLoadError(f"{name}: the Hub at {hub.endpoint} could not be reached ({type(cause).__name__}) "
                              f"and the local cache ({hub.cache}) does not hold it")
    return ModelLoadError(f"{name}: the download failed ({type(exc).__name__}: {exc}); nothing partial is "
                          "loaded, and a restart resumes it")


def _scrubbed(error: ModelLoadError, token: str | None) -> ModelLoadError:
    """The error with the token masked, should any library have put it in a message."""
    text = str(error)
    return ModelLoadError(text.replace(token, "****")) if token and token in text else error


def download_from_hub(repo_id: str, *, revision: str | None, allow_pickled: bool, gguf_file: str | None,
                      trust_remote_code: bool, progress_every: float, hub: HubSettings | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` holding the files the model needs."""
    hub = hub or HubSettings.from_environment()
    try:
        return _download(repo_id, revision, allow_pickled, gguf_file, trust_remote_code, progress_every, hub)
    except ModelLoadError as exc:
        raise _scrubbed(exc, hub.token) from None
    except Exception as exc:  # huggingface_hub's and its HTTP client's errors: explained, never a traceback
        raise _scrubbed(_explain(exc, repo_id, revision, hub), hub.token) from None


def _route_library_logs() -> None:
    """huggingface_hub writes its warnings (a retry, a resumed file) through a stderr handler of its
    own as well: they go through the server's handler alone, in its format (text or JSON lines)."""
    from huggingface_hub.utils import logging as hub_logging

    library = hub_logging.get_logger("huggingface_hub")  # configures it first, if not yet
    for handler in list(library.handlers):
        library.removeHandler(handler)
    library.propagate = True


def _unavailable(exc: Exception) -> bool:
    """Whether `exc` means the Hub could not answer (unreachable, offline mode, a 5xx), not a refusal."""
    from huggingface_hub.errors import HfHubHTTPError

    status = getattr(getattr(exc, "response", None), "status_code", 0)
    return isinstance(exc, _unreachable_errors()) or (isinstance(exc, HfHubHTTPError) and status >= 500)


def _listing(api, repo_id: str, commit: str, snapshot: Path, cache: Path) -> tuple[dict[str, int], Exception | None]:
    """The commit's files and sizes from the Hub, else (the Hub unavailable) from the cache, with why."""
    try:  # the model info, not the tree listing: huggingface_hub retries that for half a minute when the Hub is down
        info = api.model_info(repo_id, revision=commit, files_metadata=True)
        return {s.rfilename: s.size or 0 for s in info.siblings or ()}, None
    except Exception as exc:
        if not _unavailable(exc):
            raise
        sizes = _cached_listing(repo_id, commit, snapshot, cache)
        if not sizes:
            raise
        return sizes, exc


def _download(repo_id: str, revision: str | None, allow_pickled: bool, gguf_file: str | None,
              trust_remote_code: bool, progress_every: float, hub: HubSettings) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.file_download import repo_folder_name

    _route_library_logs()
    api = HfApi(endpoint=hub.endpoint, token=hub.token or False)
    storage = hub.cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    # the cached ref when the Hub is unreachable
    resolved = api.resolve_revision(repo_id, revision=revision, cache_dir=hub.cache)
    snapshot = storage / "snapshots" / resolved.resolved
    sizes, unavailable = _listing(api, repo_id, resolved.resolved, snapshot, hub.cache)
    name = repo_id + (f"@{revision}" if revision else "")
    files = choose_files(sizes, source=f"Hub model {name!r}", allow_pickled=allow_pickled, gguf_file=gguf_file,
                         trust_remote_code=trust_remote_code)
    missing = [f for f in files if not (snapshot / f).is_file()]
    if not missing:
        log.info("Hub model %s (commit %s): all %d files are in the cache %s%s", name, resolved.resolved[:12],
                 len(files), snapshot, f" (the Hub is unavailable: {type(unavailable).__name__})" if unavailable else "")
        return snapshot
    if unavailable:
        raise ModelLoadError(
            f"Hub model {name!r}: the Hub could not be reached ({type(unavailable).__name__}) and the cached copy "
            f"in {snapshot} lacks {len(missing)} of its files ({', '.join(missing[:3])}): it is not loaded")
    blobs = storage / "blobs"
    before = folder_bytes(blobs)
    with progress_log(f"Hub model {name} (commit {resolved.resolved[:12]})", len(missing),
                      sum(sizes[f] for f in missing), lambda: folder_bytes(blobs) - before, progress_every):
        folder = Path(snapshot_download(repo_id, revision=resolved, allow_patterns=[glob.escape(f) for f in files],
                                        cache_dir=hub.cache, endpoint=hub.endpoint, token=hub.token or False))
    still_missing = [f for f in files if not (folder / f).is_file()]
    if still_missing:  # huggingface_hub raises first; this keeps "never a partial model" true regardless
        raise ModelLoadError(f"Hub model {name!r}: {len(still_missing)} files missing after the download "
                             f"({', '.join(still_missing[:3])})")
    return folder
