"""Upload a folder as a v4 artifact, as actions/upload-artifact does, to act's artifact server.

The Actions results service is a Twirp API: ``CreateArtifact`` answers with a signed blob URL,
the zip is PUT there as a block and committed with a block list, and ``FinalizeArtifact``
records its size and sha256. The run and job ids come from the ``scp`` claim of
``$ACTIONS_RUNTIME_TOKEN`` (``Actions.Results:RUN:JOB``), as in @actions/artifact.
"""

import base64
import hashlib
import io
import json
import os
import sys
import urllib.request
import zipfile
from pathlib import Path

SERVICE = "twirp/github.actions.results.api.v1.ArtifactService"


def backend_ids(token: str) -> tuple[str, str]:
    payload = token.split(".")[1]
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    scope = next(s for s in claims["scp"].split() if s.startswith("Actions.Results:"))
    _, run, job = scope.split(":")
    return run, job


def twirp(method: str, body: dict, token: str) -> dict:
    request = urllib.request.Request(
        os.environ["ACTIONS_RESULTS_URL"].rstrip("/") + f"/{SERVICE}/{method}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def put(url: str, data: bytes) -> None:
    request = urllib.request.Request(url, data=data, method="PUT")
    urllib.request.urlopen(request, timeout=60).close()


def zipped(source: Path) -> bytes:
    """The folder's files, named relative to it (or the one file), as the real action zips."""
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    root = source.parent if source.is_file() else source
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            archive.write(path, path.relative_to(root).as_posix())
    return buffer.getvalue()


def main(name: str, source: str) -> None:
    token = os.environ["ACTIONS_RUNTIME_TOKEN"]
    run, job = backend_ids(token)
    ids = {"workflowRunBackendId": run, "workflowJobRunBackendId": job, "name": name}
    created = twirp("CreateArtifact", {**ids, "version": 4}, token)
    data = zipped(Path(os.environ["GITHUB_WORKSPACE"], source))
    put(created["signedUploadUrl"] + "&comp=block&blockid=MDAwMDAx", data)
    put(created["signedUploadUrl"] + "&comp=blocklist", b"<BlockList/>")
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    finalized = twirp("FinalizeArtifact", {**ids, "size": str(len(data)), "hash": digest}, token)
    print(f"uploaded artifact {name!r} ({len(data)} bytes), id {finalized['artifactId']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
