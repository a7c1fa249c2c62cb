"""Checks schemathesis runs against shop beside its own (scripts/schemathesis).

- No 5xx, except the 502 a request asked for with `X-Simulate: bank-error`
  (and a 503 only with `Retry-After`: an outage must say when to retry).
- Every error answer is application/problem+json with its status in the body.
"""

import json

import schemathesis


def _simulated_bank_error(case):
    headers = case.headers or {}
    for name, value in headers.items():
        if name.lower() == "x-simulate" and "bank-error" in str(value):
            return True
    return False


@schemathesis.check
def no_unexpected_server_error(ctx, response, case):
    status = response.status_code
    if status < 500:
        return None
    if status == 502 and _simulated_bank_error(case):
        return None
    if status == 503 and "retry-after" in {k.lower() for k in response.headers}:
        return None
    raise AssertionError(f"unexpected {status}: {response.text[:500]}")


@schemathesis.check
def errors_are_problem_json(ctx, response, case):
    status = response.status_code
    if status < 400:
        return None
    content_type = ""
    for name, values in response.headers.items():
        if name.lower() == "content-type":
            content_type = values[0] if isinstance(values, list) else values
    if not content_type.startswith("application/problem+json"):
        raise AssertionError(f"{status} answered as {content_type!r}, not problem+json")
    try:
        body = json.loads(response.text)
    except ValueError as e:
        raise AssertionError(f"{status} problem is not JSON: {e}") from e
    if body.get("status") != status or not body.get("type") or not body.get("title"):
        raise AssertionError(f"{status} problem lacks type/title/status: {body}")
    return None
