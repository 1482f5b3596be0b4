"""The comment job's calls to GitHub's REST API, with nothing but Python's standard library.

Step 2 of auto-grading (``autograde-comment.yml``) runs this file from the default branch, with
a token that may write pull-request comments. It never runs the pull request's code; what it
downloads is the artifact of the grading run, handed to ``vkv.assignment.comment`` as untrusted
data. Two commands:

    python3 -m vkv.assignment.github download --run-id ID --out grade.zip
    python3 -m vkv.assignment.github post comment.md --pr-number-file pr_number --head-sha SHA

``download`` saves the run's artifact named ``grade`` as a zip. ``post`` refuses when the pull
request's head is no longer the commit that was graded (a push after the grading run must not
get the older grade), then updates this workflow's earlier comment (a bot's comment that starts
with ``comment.MARKER``) or creates one, so that a pull request carries one grade comment.

The endpoints (GitHub REST API version 2022-11-28) are the ones ``actions/github-script`` would
call: list a workflow run's artifacts, download an artifact (a redirect to a pre-signed URL,
fetched without the token), get a pull request, list an issue's comments (100 a page, following
the ``Link`` header's ``rel="next"``), create a comment, update a comment. The API's address is
``$GITHUB_API_URL`` and the repository ``$GITHUB_REPOSITORY``, both set by the runner; the token
is ``$GITHUB_TOKEN``.
"""

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request

from vkv.assignment.comment import MARKER

ARTIFACT = "grade"
MAX_ARTIFACT_BYTES = 16 << 20
NEXT_PAGE = re.compile(r'<([^>]+)>;\s*rel="next"')


class GitHub:
    """A repository's REST endpoints, called with one token."""

    def __init__(self, api_url: str, repository: str, token: str) -> None:
        self.base = f"{api_url.rstrip('/')}/repos/{repository}"
        self.token = token

    def call(self, method: str, url: str, body: dict | None = None) -> tuple[object, dict]:
        """The decoded JSON answer to one request, and its headers."""
        request = urllib.request.Request(
            url if url.startswith("http") else self.base + url,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={
                "Accept": "application/vnd.github+json",
                "Authorization": f"Bearer {self.token}",
                "X-GitHub-Api-Version": "2022-11-28",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read() or b"null"), dict(answer.headers)

    def pages(self, url: str) -> list:
        """Every item of a paginated list, page after page."""
        items, next_url = [], f"{url}?per_page=100"
        while next_url:
            page, headers = self.call("GET", next_url)
            items += page
            found = NEXT_PAGE.search(headers.get("Link", ""))
            next_url = found.group(1) if found else None
        return items

    def download_artifact(self, run_id: int, name: str) -> bytes:
        """The zip of the run's artifact called ``name``."""
        listing, _ = self.call("GET", f"/actions/runs/{run_id}/artifacts?name={name}")
        found = [a for a in listing["artifacts"] if a["name"] == name and not a.get("expired")]
        if not found:
            raise LookupError(f"run {run_id} left no artifact named {name!r}")
        request = urllib.request.Request(
            f"{self.base}/actions/artifacts/{found[0]['id']}/zip",
            headers={"Authorization": f"Bearer {self.token}"},
        )
        try:  # GitHub answers 302 with a pre-signed URL, which must not receive the token
            with _NO_REDIRECTS.open(request, timeout=60) as answer:
                return answer.read(MAX_ARTIFACT_BYTES)
        except urllib.error.HTTPError as redirect:
            if redirect.code not in (301, 302, 303, 307, 308):
                raise
            with urllib.request.urlopen(redirect.headers["Location"], timeout=60) as answer:
                return answer.read(MAX_ARTIFACT_BYTES)

    def post_or_update(self, number: int, head_sha: str, body: str) -> str:
        """Put ``body`` on pull request ``number`` if its head is ``head_sha``; what was done."""
        pull, _ = self.call("GET", f"/pulls/{number}")
        if pull["head"]["sha"] != head_sha:
            raise LookupError(f"pull request {number} is not the one this grade was made for")
        comments = self.pages(f"{self.base}/issues/{number}/comments")
        earlier = [
            c for c in comments if c["user"]["type"] == "Bot" and c["body"].startswith(MARKER)
        ]
        if earlier:
            self.call("PATCH", f"/issues/comments/{earlier[0]['id']}", {"body": body})
            return f"updated comment {earlier[0]['id']}"
        created, _ = self.call("POST", f"/issues/{number}/comments", {"body": body})
        return f"created comment {created['id']}"


class _KeepRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # the caller follows it, without the Authorization header


_NO_REDIRECTS = urllib.request.build_opener(_KeepRedirects)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the auto-grading comment job's GitHub calls")
    commands = parser.add_subparsers(dest="command", required=True)
    download = commands.add_parser("download", help="save a run's grade artifact as a zip")
    download.add_argument("--run-id", type=int, required=True)
    download.add_argument("--out", required=True)
    post = commands.add_parser("post", help="create or update the pull request's grade comment")
    post.add_argument("body", help="the comment, as rendered by vkv.assignment.comment")
    post.add_argument("--pr-number-file", required=True, help="the validated number")
    post.add_argument("--head-sha", required=True, help="the commit the grading run graded")
    args = parser.parse_args(argv)
    github = GitHub(
        os.environ.get("GITHUB_API_URL", "https://api.github.com"),
        os.environ["GITHUB_REPOSITORY"],
        os.environ["GITHUB_TOKEN"],
    )
    try:
        if args.command == "download":
            with open(args.out, "wb") as file:
                file.write(github.download_artifact(args.run_id, ARTIFACT))
            print(f"saved the {ARTIFACT!r} artifact of run {args.run_id} as {args.out}")
        else:
            with open(args.pr_number_file, encoding="ascii") as file:
                number = int(file.read())
            with open(args.body, encoding="utf-8") as file:
                print(github.post_or_update(number, args.head_sha, file.read()))
    except (LookupError, urllib.error.URLError, OSError, ValueError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
