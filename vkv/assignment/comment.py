"""The auto-grading comment: validate a ``vkv-grade/1`` document and render it as Markdown.

The comment job of the auto-grading workflow runs this file with nothing but Python's standard
library, on an artifact that came out of a job which ran a pull request's code (and which the
pull request could rewrite): the artifact is untrusted data. Part ids, titles and points come
from the default branch's ``assignment/parts.toml``; from the artifact only each part's status
and test counts are taken, checked for type and range, and the score is recomputed from them.
Paths are reduced to a few safe characters and shown as code, so nothing renders as a link.

    python3 -m vkv.assignment.comment ARTIFACT.zip --parts assignment/parts.toml \\
        [--only 1.1,1.2] [--pr-number-out FILE] > comment.md

``--only`` names the parts a course grades so far (the repository variable ``VKV_PARTS``, which
a pull request cannot change); the others are left out of the table and of the maximum.
"""

import argparse
import json
import re
import sys
import tomllib
import zipfile

ADVISORY = (
    "This score is advisory: it comes from a job that ran your pull request's code. Your "
    "instructor grades with the same grader on a trusted machine, possibly with hidden tests."
)
MARKER = "<!-- vkv-autograde -->"
PART_ID = re.compile(r"^\d+\.\d+$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
STATUSES = {"passed", "failed", "not started", "not graded", "timeout", "error"}
MAX_ITEMS = 64
MAX_MEMBER_BYTES = 1 << 20

Parts = dict[str, tuple[str, float]]  # part id -> (title, points), from a trusted manifest


def load_parts(path: str, only: str = "") -> Parts:
    """The manifest's parts; with ``only`` ("1.1,1.2"), those parts, which must all exist."""
    with open(path, "rb") as file:
        manifest = tomllib.load(file)
    parts = {p["id"]: (p["title"], float(p["points"])) for p in manifest.get("part", [])}
    if not only:
        return parts
    wanted = [part_id.strip() for part_id in only.split(",")]
    if unknown := [part_id for part_id in wanted if part_id not in parts]:
        raise ValueError(f"no part {', '.join(unknown)} in {path}")
    return {part_id: parts[part_id] for part_id in wanted}


def validate(document: object, parts: Parts) -> dict:
    """A clean document: the trusted parts with the artifact's counts; ``ValueError`` if bad."""
    if not isinstance(document, dict) or document.get("schema") != "vkv-grade/1":
        raise ValueError("not a vkv-grade/1 document")
    reported = document.get("parts")
    if not isinstance(reported, list) or not 0 < len(reported) <= MAX_ITEMS:
        raise ValueError("parts must be a list of 1 to 64 parts")
    counts = {part["id"]: part for part in map(_counts, reported)}
    clean_parts = []
    for part_id, (title, points) in parts.items():
        got = counts.get(part_id, {"status": "error", "passed": 0, "total": 0})
        score = round(points * got["passed"] / got["total"], 2) if got["total"] else 0.0
        clean_parts.append(
            {"id": part_id, "title": title, "max_score": points, "score": score}
            | {k: got[k] for k in ("status", "passed", "total")}
        )
    files = document.get("files", {})
    if not isinstance(files, dict) or len(files) > MAX_ITEMS:
        raise ValueError("files must map at most 64 paths to sha256 digests")
    if not all(isinstance(d, str) and SHA256.match(d) for d in files.values()):
        raise ValueError("files: a digest is not a sha256")
    protected = document.get("protected_modified", [])
    if not isinstance(protected, list) or not all(isinstance(p, str) for p in protected):
        raise ValueError("protected_modified must be a list of paths")
    not_graded = document.get("not_graded", {})
    if not isinstance(not_graded, dict) or len(not_graded) > MAX_ITEMS:
        raise ValueError("not_graded must map at most 64 paths to reasons")
    if not all(isinstance(reason, str) for reason in not_graded.values()):
        raise ValueError("not_graded: a reason is not text")
    return {
        "schema": "vkv-grade/1",
        "score": round(sum(part["score"] for part in clean_parts), 2),
        "max_score": sum(part["max_score"] for part in clean_parts),
        "parts": clean_parts,
        "protected_modified": [_path(p) for p in protected[:MAX_ITEMS]],
        "files": {_path(p): d for p, d in files.items()},
        "not_graded": {_path(p): _path(reason) for p, reason in not_graded.items()},
    }


def _counts(part: object) -> dict:
    if not isinstance(part, dict):
        raise ValueError("a part must be an object")
    part_id, status = part.get("id"), part.get("status")
    if not isinstance(part_id, str) or not PART_ID.match(part_id):
        raise ValueError(f"bad part id {str(part_id)[:20]!r}")
    if status not in STATUSES:
        raise ValueError(f"part {part_id}: bad status")
    for key in ("passed", "total"):
        value = part.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 100_000:
            raise ValueError(f"part {part_id}: {key} must be a count")
    if part["passed"] > part["total"]:
        raise ValueError(f"part {part_id}: more tests passed than ran")
    return {"id": part_id, "status": status, "passed": part["passed"], "total": part["total"]}


def as_markdown(document: dict) -> str:
    """The comment for a validated document."""
    lines = [
        MARKER,
        f"### vkv-engine autograde: {document['score']:g} / {document['max_score']:g} (advisory)",
        "",
        "| part | title | tests | status | score |",
        "|---|---|---|---|---|",
    ]
    for part in document["parts"]:
        lines.append(
            f"| {part['id']} | {part['title']} | {part['passed']}/{part['total']} "
            f"| {part['status']} | {part['score']:g} / {part['max_score']:g} |"
        )
    if document["protected_modified"]:
        lines += ["", "**Not graded: protected files modified**", ""]
        lines += [f"- `{path}`" for path in document["protected_modified"]]
    if document["not_graded"]:
        lines += ["", "**Not graded: files that break the submission policy**", ""]
        lines += [f"- `{path}`: {reason}" for path, reason in document["not_graded"].items()]
    if document["files"]:
        lines += ["", "<details><summary>graded files (sha256)</summary>", ""]
        lines += [f"- `{path}` `{digest}`" for path, digest in document["files"].items()]
        lines += ["", "</details>"]
    lines += ["", f"> {ADVISORY}"]
    return "\n".join(lines) + "\n"


def _path(value: str) -> str:
    """A path reduced to safe characters, for a code span."""
    return re.sub(r"[^\w./ ()-]", "_", value)[:200]


def read_artifact(path: str) -> tuple[object, str]:
    """The grade document and the pull-request number text, from a zip or a JSON file."""
    if not path.endswith(".zip"):
        with open(path, encoding="utf-8") as file:
            return json.loads(file.read(MAX_MEMBER_BYTES)), ""
    with zipfile.ZipFile(path) as archive:

        def member(name: str) -> bytes:
            with archive.open(name) as file:
                return file.read(MAX_MEMBER_BYTES)

        return json.loads(member("grade.json")), member("pr_number").decode("ascii", "replace")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="render the auto-grading comment")
    parser.add_argument("artifact", help="the grade job's artifact: a .zip, or grade.json")
    parser.add_argument("--parts", required=True, help="the trusted assignment/parts.toml")
    parser.add_argument(
        "--only", default="", help="the graded parts (e.g. 1.1,1.2), from a trusted setting"
    )
    parser.add_argument("--pr-number-out", help="write the validated pull-request number here")
    args = parser.parse_args(argv)
    try:
        document, pr_number = read_artifact(args.artifact)
        clean = validate(document, load_parts(args.parts, args.only))
        if args.pr_number_out:
            if not re.fullmatch(r"[1-9][0-9]{0,8}", pr_number.strip()):
                raise ValueError("the artifact names no pull request")
            with open(args.pr_number_out, "w", encoding="ascii") as file:
                file.write(pr_number.strip())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        print(f"invalid grade artifact: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(as_markdown(clean))
    return 0


if __name__ == "__main__":
    sys.exit(main())
