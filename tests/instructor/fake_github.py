"""A fake of the GitHub REST endpoints the auto-grading comment job calls, on 127.0.0.1.

One repository, one token. The shapes follow GitHub's published REST description (API version
2022-11-28), trimmed to the fields a client reads:

- ``GET /repos/O/R/actions/runs/ID/artifacts``: ``{total_count, artifacts: [{id, name,
  size_in_bytes, expired, archive_download_url, workflow_run: {id}}]}``, read from act's
  artifact server folder (``RUN/NAME/NAME.zip``);
- ``GET /repos/O/R/actions/artifacts/ID/zip``: ``302`` to a pre-signed address on this server,
  which refuses a request that carries the token (GitHub's blob storage does not want it);
- ``GET /repos/O/R/pulls/N``: ``{number, state, head: {sha, ref}, base: {sha, ref}}``;
- ``GET /repos/O/R/issues/N/comments``: ``[{id, body, user: {login, type}}]``, ``per_page``
  and ``page``, with a ``Link`` header naming the next page;
- ``POST /repos/O/R/issues/N/comments`` (201) and ``PATCH /repos/O/R/issues/comments/ID``: the
  comment, written as ``github-actions[bot]`` (a ``Bot``).

Everything else is a 404, and a request without the token a 401. Every request is logged.
"""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

BOT = {"login": "github-actions[bot]", "type": "Bot"}


class FakeGitHub:
    def __init__(self, repository: str, token: str, artifacts: Path) -> None:
        self.repository = repository
        self.token = token
        self.artifacts = artifacts
        self.pulls: dict[int, str] = {}  # number -> head sha
        self.comments: dict[int, list[dict]] = {}  # issue number -> comments, oldest first
        self.log: list[tuple[str, str]] = []
        self.blob_requests_with_token = 0
        self._next_id = 1000
        self._artifact_ids: dict[int, Path] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeGitHub":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add_comment(self, number: int, body: str, user: dict) -> dict:
        self._next_id += 1
        comment = {"id": self._next_id, "body": body, "user": user}
        self.comments.setdefault(number, []).append(comment)
        return comment

    def calls(self, method: str) -> list[str]:
        return [path for m, path in self.log if m == method]

    def answer(self, method: str, url: str, authorized: bool, body: bytes):
        """(status, headers, JSON or bytes) for one request."""
        path, query = urlparse(url).path, parse_qs(urlparse(url).query)
        if path.startswith("/_blobs/"):
            self.blob_requests_with_token += authorized
            artifact = self._artifact_ids.get(int(path.rsplit("/", 1)[1]))
            if authorized or artifact is None or query.get("sig") != ["signed"]:
                return 403, {}, {"message": "AuthenticationFailed"}
            return 200, {"Content-Type": "application/zip"}, artifact.read_bytes()
        if not authorized:
            return 401, {}, {"message": "Bad credentials"}
        prefix = f"/repos/{self.repository}"
        if not path.startswith(prefix + "/"):
            return 404, {}, {"message": "Not Found"}
        route = (method, path[len(prefix) :])
        if found := _match(route, "GET", r"/actions/runs/(\d+)/artifacts"):
            return 200, {}, self._list_artifacts(int(found[0]), query.get("name", [None])[0])
        if found := _match(route, "GET", r"/actions/artifacts/(\d+)/zip"):
            if int(found[0]) not in self._artifact_ids:
                return 404, {}, {"message": "Not Found"}
            return 302, {"Location": f"{self.url}/_blobs/{found[0]}?sig=signed"}, b""
        if found := _match(route, "GET", r"/pulls/(\d+)"):
            number = int(found[0])
            if number not in self.pulls:
                return 404, {}, {"message": "Not Found"}
            head = {"sha": self.pulls[number], "ref": f"part-{number}"}
            return 200, {}, {"number": number, "state": "open", "head": head, "base": {}}
        if found := _match(route, "GET", r"/issues/(\d+)/comments"):
            return self._page(int(found[0]), query, url)
        if found := _match(route, "POST", r"/issues/(\d+)/comments"):
            return 201, {}, self.add_comment(int(found[0]), json.loads(body)["body"], BOT)
        if found := _match(route, "PATCH", r"/issues/comments/(\d+)"):
            for comment in (c for cs in self.comments.values() for c in cs):
                if comment["id"] == int(found[0]) and comment["user"] == BOT:
                    comment["body"] = json.loads(body)["body"]
                    return 200, {}, comment
            return 404, {}, {"message": "Not Found"}
        return 404, {}, {"message": "Not Found"}

    def _list_artifacts(self, run_id: int, name: str | None) -> dict:
        listed = []
        for archive in sorted((self.artifacts / str(run_id)).glob("*/*.zip")):
            if name is not None and archive.stem != name:
                continue
            artifact_id = 5000 + len(self._artifact_ids)
            self._artifact_ids[artifact_id] = archive
            download = f"{self.url}/repos/{self.repository}/actions/artifacts/{artifact_id}/zip"
            listed.append(
                {
                    "id": artifact_id,
                    "name": archive.stem,
                    "size_in_bytes": archive.stat().st_size,
                    "expired": False,
                    "archive_download_url": download,
                    "workflow_run": {"id": run_id},
                }
            )
        return {"total_count": len(listed), "artifacts": listed}

    def _page(self, number: int, query: dict, url: str):
        per_page = min(int(query.get("per_page", ["30"])[0]), 100)
        page = int(query.get("page", ["1"])[0])
        comments = self.comments.get(number, [])
        headers = {}
        if page * per_page < len(comments):
            base = self.url + url.split("?")[0]
            headers["Link"] = f'<{base}?per_page={per_page}&page={page + 1}>; rel="next"'
        return 200, headers, comments[(page - 1) * per_page : page * per_page]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                fake.log.append((self.command, self.path))
                authorization = self.headers.get("Authorization", "")
                authorized = authorization in (f"Bearer {fake.token}", f"token {fake.token}")
                status, headers, payload = fake.answer(self.command, self.path, authorized, body)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                headers.setdefault("Content-Type", "application/json; charset=utf-8")
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PATCH = _serve

            def log_message(self, *args) -> None:
                pass

        return Handler


def _match(route: tuple[str, str], method: str, pattern: str) -> tuple[str, ...] | None:
    if route[0] != method:
        return None
    found = re.fullmatch(pattern, route[1])
    return found.groups() if found else None
