"""What classroom-resources/autograding-grading-reporter v1 does with its runners' results.

For each id of ``$RUNNERS`` (split on commas and white space) it decodes the base64 JSON of
``$<ID>_RESULTS``, prints a line per test (✅ pass, ❌ fail, ``Error: message`` for an error)
with the test's ``test_code``, and the runner's points: the sum of its tests' ``score`` over its
``max_score``. Then two notice annotations, which are what Classroom reads: ``Points X/Y`` and
``{"totalPoints": X, "maxPoints": Y}``. The step fails when a runner's status is ``fail`` or
``error``. Left out: colours and the summary table.
"""

import base64
import json
import os
import re
import sys


def number(value: float) -> str:
    """A number as JavaScript prints it: 30, not 30.0."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def main() -> int:
    runners = [r for r in re.split(r"[\s,]", os.environ["RUNNERS"]) if r]
    results = [
        (runner, json.loads(base64.b64decode(os.environ[f"{runner.upper()}_RESULTS"])))
        for runner in runners
    ]
    total = maximum = 0.0
    for runner, result in results:
        print(f"Processing: {runner}")
        for test in result["tests"]:
            if test["status"] == "error":
                print(f"Error: {test.get('message') or test['name']}")
            else:
                print(f"{'✅' if test['status'] == 'pass' else '❌'} {test['name']}")
            if test.get("test_code"):
                print(f"Test code:\n{test['test_code']}\n")
        score = sum(test["score"] for test in result["tests"])
        if result.get("max_score"):
            print(f"Total points for {runner}: {score:.2f}/{number(result['max_score'])}")
            total += score
            maximum += result["max_score"]
    if maximum:
        print(f"::notice title=Autograding complete::Points {number(total)}/{number(maximum)}")
        report = json.dumps({"totalPoints": total, "maxPoints": maximum}, separators=(",", ":"))
        print(f"::notice title=Autograding report::{report}")
    statuses = {result["status"] for _, result in results}
    for status, message in (("fail", "Some tests failed."), ("error", "Some tests errored.")):
        if status in statuses:
            print(f"::error::{message}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
