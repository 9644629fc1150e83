"""A local stand-in for the Hugging Face Hub's file API, faithful enough that
`huggingface_hub` itself downloads from it (test_hub.py checks that), with faults to inject.

It serves model repositories held in memory:

- `GET /api/models/{repo}/revision/{rev}`: `{id, sha, siblings: [{rfilename}]}`;
- `GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true`: entries with the git blob
  `oid`, `size`, and `lfs: {oid (sha256), size, pointerSize}` for LFS files;
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}`: the bytes, with `X-Repo-Commit`, `ETag` (the
  git blob sha1, or the sha256 for LFS files, which also get `X-Linked-Etag` and
  `X-Linked-Size`), `Accept-Ranges` and `Range` answers (206 + `Content-Range`).

Errors look like the Hub's: a JSON `{"error": ...}` body and `X-Error-Code`
(`RepoNotFound`, `EntryNotFound`, `RevisionNotFound`, `GatedRepo`).

Faults, set per file path with `Fault`: `cut_after` (close the connection after that many
body bytes, for the first `times` requests), `corrupt` (flip one byte of every answer),
`status` (answer that status), `rate` (bytes per second). A repository with `token` set
answers 401 without `Authorization: Bearer <token>`.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

# Files the Hub stores with LFS (a subset of its .gitattributes defaults).
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".onnx", ".h5", ".msgpack")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass
class Fault:
    cut_after: int | None = None
    times: int = 1
    corrupt: bool = False
    status: int | None = None
    rate: float | None = None


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = ""
    token: str | None = None
    faults: dict[str, Fault] = field(default_factory=dict)

    def __post_init__(self):
        if not self.commit:
            h = hashlib.sha1()
            for name in sorted(self.files):
                h.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
            self.commit = h.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES) or len(self.files[path]) > 10 * 1024 * 1024

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if self.is_lfs(path) else git_blob_sha1(data)

    def tree_entry(self, path: str) -> dict:
        data = self.files[path]
        if self.is_lfs(path):
            sha = hashlib.sha256(data).hexdigest()
            pointer = lfs_pointer(sha, len(data))
            return {
                "type": "file",
                "oid": git_blob_sha1(pointer),
                "size": len(data),
                "path": path,
                "lfs": {"oid": sha, "size": len(data), "pointerSize": len(pointer)},
            }
        return {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}


def model_repo(directory: Path, names: list[str] | None = None) -> Repo:
    """A repo of the files of `directory` (all, or `names`)."""
    names = names or sorted(p.name for p in directory.iterdir() if p.is_file())
    return Repo(files={n: (directory / n).read_bytes() for n in names})


class HubStandin:
    """The stand-in, on a free port of 127.0.0.1; `log` records (method, path, range)."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        self.served: dict[tuple[str, str], int] = {}
        standin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                standin.handle(self, head=True)

            def do_GET(self):
                standin.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def ranges(self, path_suffix: str) -> list[str | None]:
        with self.lock:
            return [r for (m, p, r) in self.log if m == "GET" and p.endswith(path_suffix)]

    # --- request handling -------------------------------------------------------------

    def reply_json(self, h, status: int, body, headers: dict | None = None, head=False):
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(data)

    def error(self, h, status: int, code: str, message: str, head=False):
        self.reply_json(h, status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}, head)

    def authorized(self, h, repo: Repo) -> bool:
        return repo.token is None or h.headers.get("Authorization") == f"Bearer {repo.token}"

    def find_repo(self, parts: list[str]):
        """(repo_id, repo, rest) for a path starting with ORG/NAME."""
        if len(parts) >= 2:
            rid = f"{parts[0]}/{parts[1]}"
            if rid in self.repos:
                return rid, self.repos[rid], parts[2:]
        return None, None, parts

    def handle(self, h, head: bool):
        url = urlparse(h.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        with self.lock:
            self.log.append((h.command, url.path, h.headers.get("Range")))
        if parts[:2] == ["api", "models"]:
            return self.api(h, parts[2:], head)
        rid, repo, rest = self.find_repo(parts)
        if repo is None or len(rest) < 3 or rest[0] != "resolve":
            return self.error(h, 404, "RepoNotFound", "Repository not found", head)
        if not self.authorized(h, repo):
            return self.error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header", head)
        rev, path = rest[1], "/".join(rest[2:])
        if rev not in ("main", repo.commit):
            return self.error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if path not in repo.files:
            return self.error(h, 404, "EntryNotFound", f"{path} does not exist", head)
        self.send_file(h, rid, repo, path, head)

    def api(self, h, parts: list[str], head: bool):
        rid, repo, rest = self.find_repo(parts)
        if repo is None or not rest:
            return self.error(h, 404, "RepoNotFound", "Repository not found", head)
        if not self.authorized(h, repo):
            return self.error(h, 401, "RepoNotFound", "Invalid credentials in Authorization header", head)
        kind, rev = rest[0], (rest[1] if len(rest) > 1 else "main")
        if rev not in ("main", repo.commit):
            return self.error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
        if kind == "revision":
            return self.reply_json(h, 200, {
                "_id": rid, "id": rid, "modelId": rid, "author": rid.split("/")[0],
                "sha": repo.commit, "private": repo.token is not None, "gated": False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            }, head=head)
        if kind == "tree":
            prefix = "/".join(rest[2:])
            entries = [repo.tree_entry(p) for p in sorted(repo.files)
                       if not prefix or p.startswith(prefix.rstrip("/") + "/")]
            return self.reply_json(h, 200, entries, head=head)
        return self.error(h, 404, "EntryNotFound", "unknown API", head)

    def send_file(self, h, rid: str, repo: Repo, path: str, head: bool):
        data = repo.files[path]
        fault = repo.faults.get(path, Fault())
        if fault.status:
            return self.error(h, fault.status, "Fault", f"injected {fault.status}", head)
        etag = repo.etag(path)
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and not head:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng.strip())
            if m:
                start = int(m.group(1))
                if start >= len(data):
                    h.send_response(416)
                    h.send_header("Content-Range", f"bytes */{len(data)}")
                    h.send_header("Content-Length", "0")
                    h.end_headers()
                    return
                status = 206
        body = data[start:]
        if fault.corrupt and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        h.send_response(status)
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("X-Repo-Commit", repo.commit)
        h.send_header("ETag", f'"{etag}"')
        if repo.is_lfs(path):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if head:
            return
        key = (rid, path)
        with self.lock:
            served = self.served.get(key, 0)
            self.served[key] = served + 1
        cut = fault.cut_after if (fault.cut_after is not None and served < fault.times) else None
        chunk = 16 * 1024
        sent = 0
        try:
            while sent < len(body):
                piece = body[sent:sent + chunk]
                if cut is not None and sent + len(piece) > cut:
                    piece = piece[: max(0, cut - sent)]
                    h.wfile.write(piece)
                    h.wfile.flush()
                    h.close_connection = True
                    # Drop the connection mid-body.
                    h.connection.shutdown(2)
                    return
                h.wfile.write(piece)
                sent += len(piece)
                if fault.rate:
                    h.wfile.flush()
                    time.sleep(len(piece) / fault.rate)
        except (BrokenPipeError, ConnectionResetError, OSError):
            h.close_connection = True


if __name__ == "__main__":
    import sys

    directory = Path(sys.argv[1])
    hub = HubStandin({"org/" + directory.name: model_repo(directory)})
    print(hub.url, flush=True)
    hub.thread.join()
