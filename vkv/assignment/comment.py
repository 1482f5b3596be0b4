"""The auto-grading comment: validate a ``vkv-grade/1`` JSON document and render it as Markdown.

The comment job of the auto-grading workflow runs this file with nothing but Python's standard
library, on a document that came out of a job which ran a pull request's code, so the document
is untrusted data: every field is checked for type and range, scores are clamped to their
maximum, strings are cut and escaped, and anything else is dropped.

    python3 -m vkv.assignment.comment grade.json > comment.md
"""

import json
import re
import sys

ADVISORY = (
    "This score is advisory: it comes from a job that ran your pull request's code. Your "
    "instructor grades with the same grader on a trusted machine, possibly with hidden tests."
)
MARKER = "<!-- vkv-autograde -->"
PART_ID = re.compile(r"^\d+\.\d+$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
STATUSES = {"passed", "failed", "timeout", "error"}
MAX_PARTS = 64
MAX_FILES = 64


def validate(document: object) -> dict:
    """A clean copy of the document; ``ValueError`` naming the first field that is wrong."""
    if not isinstance(document, dict) or document.get("schema") != "vkv-grade/1":
        raise ValueError("not a vkv-grade/1 document")
    parts = document.get("parts")
    if not isinstance(parts, list) or not 0 < len(parts) <= MAX_PARTS:
        raise ValueError("parts must be a list of 1 to 64 parts")
    clean_parts = [_part(part) for part in parts]
    files = document.get("files", {})
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise ValueError("files must map at most 64 paths to sha256 digests")
    for path, digest in files.items():
        if not isinstance(path, str) or not isinstance(digest, str) or not SHA256.match(digest):
            raise ValueError(f"files: bad entry for {str(path)[:80]!r}")
    protected = document.get("protected_modified", [])
    if not isinstance(protected, list) or not all(isinstance(p, str) for p in protected):
        raise ValueError("protected_modified must be a list of paths")
    max_score = sum(part["max_score"] for part in clean_parts)
    return {
        "schema": "vkv-grade/1",
        "score": min(sum(part["score"] for part in clean_parts), max_score),
        "max_score": max_score,
        "parts": clean_parts,
        "protected_modified": [_text(p, 200) for p in protected[:MAX_FILES]],
        "files": {_text(p, 200): d for p, d in files.items()},
    }


def _part(part: object) -> dict:
    if not isinstance(part, dict):
        raise ValueError("a part must be an object")
    part_id, status = part.get("id"), part.get("status")
    if not isinstance(part_id, str) or not PART_ID.match(part_id):
        raise ValueError(f"bad part id {str(part_id)[:20]!r}")
    if status not in STATUSES:
        raise ValueError(f"part {part_id}: bad status")
    numbers = {}
    for key in ("score", "max_score", "passed", "total"):
        value = part.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e6:
            raise ValueError(f"part {part_id}: {key} must be a number in [0, 1e6)")
        numbers[key] = value
    if numbers["passed"] > numbers["total"]:
        raise ValueError(f"part {part_id}: more tests passed than ran")
    return {
        "id": part_id,
        "title": _text(part.get("title", ""), 80),
        "status": status,
        "score": min(float(numbers["score"]), float(numbers["max_score"])),
        "max_score": float(numbers["max_score"]),
        "passed": int(numbers["passed"]),
        "total": int(numbers["total"]),
    }


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
        lines += [f"- {path}" for path in document["protected_modified"]]
    if document["files"]:
        lines += ["", "<details><summary>graded files (sha256)</summary>", ""]
        lines += [f"- {path} {digest}" for path, digest in document["files"].items()]
        lines += ["", "</details>"]
    lines += ["", f"> {ADVISORY}"]
    return "\n".join(lines) + "\n"


def _text(value: object, limit: int) -> str:
    """Plain text for a table cell or list item: no Markdown, HTML or line breaks."""
    text = re.sub(r"[^\w .,:;()/+=-]", "_", str(value))
    return text[:limit]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python3 -m vkv.assignment.comment GRADE.json", file=sys.stderr)
        return 2
    try:
        with open(argv[0], encoding="utf-8") as file:
            document = validate(json.load(file))
    except (OSError, ValueError) as exc:
        print(f"invalid grade document: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(as_markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
