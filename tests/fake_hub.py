"""A loopback Hugging Face Hub: the part of its HTTP API huggingface_hub's downloads use.

Reached through `HF_ENDPOINT` (or HubSettings.endpoint). Served, as the real Hub serves them:
- `GET /api/models/{repo}[/revision/{rev}][?blobs=True]`: the model info (`sha`, `siblings`, with their
  sizes when asked), which resolves a revision and lists its files;
- `GET /api/models/{repo}/tree/{rev}?recursive=...`: the commit's files (`type`, `path`, `size`, `oid`);
- `HEAD` / `GET /{repo}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` and `Content-Length`,
  and `Range` requests (206) for resumed downloads.
Errors carry the Hub's `X-Error-Code` / `X-Error-Message` headers, which huggingface_hub maps to its
exceptions: an unknown repo, or a private one without a token, is 401 `RepoNotFound` to an anonymous
caller and 404 to an authenticated one; a gated repo 401 `GatedRepo` to an anonymous caller and 403 to an
account without access; an unknown revision 404 `RevisionNotFound`; a token the Hub does not know 401
"Invalid credentials in Authorization header".
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_API = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/.*)?)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]]  # revision name -> {path: content}; "main" is the default branch
    private: bool = False
    gated: tuple[str, ...] | None = None  # gated: the tokens whose accounts accepted its conditions
    commits: dict[str, str] = field(default_factory=dict)  # revision name -> commit sha

    def __post_init__(self) -> None:
        for name, files in self.revisions.items():
            digest = hashlib.sha1(name.encode())
            for path in sorted(files):
                digest.update(path.encode() + files[path])
            self.commits[name] = digest.hexdigest()

    def files_at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a revision name or a commit sha."""
        for name, commit in self.commits.items():
            if revision in (name, commit):
                return commit, self.revisions[name]
        return None


class FakeHub:
    """`with FakeHub() as hub: hub.add(...); hub.url` — a threaded HTTP server on 127.0.0.1."""

    def __init__(self, tokens: tuple[str, ...] = ()):
        self.repos: dict[str, Repo] = {}
        self.tokens = set(tokens)
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.break_once: set[str] = set()  # file paths whose next GET stops halfway and drops the connection
        self.stop_after_break = False  # and the Hub goes away with it (nothing to resume from)
        self.seconds_per_mib = 0.0  # slows file bodies down (progress lines)
        self._connections: set = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                hub._connections.add(self.connection)

            def finish(self) -> None:
                hub._connections.discard(self.connection)
                super().finish()

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                hub._handle(self, "GET")

            def do_HEAD(self) -> None:
                hub._handle(self, "HEAD")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, revisions: dict[str, dict[str, bytes]], private: bool = False,
            gated: tuple[str, ...] | None = None) -> Repo:
        self.repos[repo_id] = repo = Repo(revisions, private, gated)
        return repo

    def file_gets(self) -> list[str]:
        """The file downloads served (GETs of /resolve/), in order."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, keep=None) -> None:
        """Stop listening and drop every open connection but `keep` (a client's kept-alive ones too): gone."""
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self._connections - {keep}):
            try:
                connection.shutdown(2)
            except OSError:
                pass

    # --- answering ------------------------------------------------------------------------------

    def _handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        path = unquote(urlsplit(request.path).path)
        self.requests.append((method, path))
        auth = request.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        if token is not None and token not in self.tokens:
            return self._error(request, 401, None, "Invalid credentials in Authorization header")
        match = _API.match(path) or _RESOLVE.match(path)
        if match is None:
            return self._error(request, 404, None, "Not found")
        repo = self.repos.get(match["repo"])
        if repo is None or (repo.private and token is None):
            return self._error(request, 404 if token else 401, "RepoNotFound", "Repository not found")
        if repo.gated is not None and token not in repo.gated:  # anonymous: 401; signed in without access: 403
            return self._error(request, 403 if token else 401, "GatedRepo",
                               f"Access to model {match['repo']} is restricted"
                               + (" and you are not in the authorized list." if token else
                                  ". You must have access to it and be authenticated to access it."))
        revision = match["rev"] or "main"
        found = repo.files_at(revision)
        if found is None:
            return self._error(request, 404, "RevisionNotFound", "Invalid rev id: " + revision)
        commit, files = found
        if "kind" not in match.groupdict():
            return self._file(request, method, commit, files, match["path"])
        if match["kind"] != "tree":
            blobs = "blobs=" in urlsplit(request.path).query  # files_metadata=True: sizes and blob ids
            siblings = [{"rfilename": p, **({"size": len(c), "blobId": git_blob_id(c)} if blobs else {})}
                        for p, c in sorted(files.items())]
            body = {"id": match["repo"], "modelId": match["repo"], "sha": commit, "private": repo.private,
                    "siblings": siblings}
        else:
            body = [{"type": "file", "path": p, "size": len(c), "oid": git_blob_id(c)} for p, c in sorted(files.items())]
        self._send(request, 200, json.dumps(body).encode(), {"Content-Type": "application/json"}, method)

    def _file(self, request, method: str, commit: str, files: dict[str, bytes], path: str) -> None:
        content = files.get(path)
        if content is None:
            return self._error(request, 404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": commit})
        headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(content)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        status, body = 200, content
        ranged = re.match(r"bytes=(\d+)-$", request.headers.get("Range", ""))
        if ranged and method == "GET":
            start = int(ranged[1])
            status, body = 206, content[start:]
            headers["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"
        if method == "GET" and path in self.break_once:
            self.break_once.discard(path)
            if self.stop_after_break:
                self.stop(keep=request.connection)
            headers["Content-Length"] = str(len(body))
            self._headers(request, status, headers)
            request.wfile.write(body[: len(body) // 2])
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(2)  # the connection dies mid-body
            return
        self._send(request, status, body, headers, method)

    def _error(self, request, status: int, code: str | None, message: str, extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(request, status, json.dumps({"error": message}).encode(), headers, request.command)

    def _headers(self, request, status: int, headers: dict[str, str]) -> None:
        request.send_response(status)
        for name, value in headers.items():
            request.send_header(name, value)
        request.end_headers()

    def _send(self, request, status: int, body: bytes, headers: dict[str, str], method: str) -> None:
        self._headers(request, status, {**headers, "Content-Length": str(len(body))})
        if method == "HEAD":
            return
        step = 1 << 16
        for start in range(0, len(body), step):
            request.wfile.write(body[start:start + step])
            if self.seconds_per_mib:
                time.sleep(self.seconds_per_mib * step / 2**20)
