"""Issue 38 item 13: a request the endpoint refused as invalid can be corrected under the
same key when the route says that status is not stored (``unstored_statuses``); by default
a 4xx is stored, as before, and the corrected request is refused as a reused key.

Every server of the shared suite (conftest.SERVERS: uvicorn and waitress, the SQL store on
PostgreSQL and SQLite, the Redis store), with tests/http/asgi_apps.py's routes:
/validated (``unstored_statuses={422}``) and /validated-stored (the default), each answering
422 unless the JSON body has an "amount".
"""

from __future__ import annotations

import httpx

from tests.http.conftest import Server, new_key


def post(server: Server, path: str, key: str, body: bytes) -> httpx.Response:
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=body, headers=headers, timeout=30)


def test_a_422_not_stored_lets_the_corrected_request_reuse_the_key(server: Server) -> None:
    key, tag = new_key(), new_key()
    wrong = f'{{"amont": 5, "tag": "{tag}"}}'.encode()
    right = f'{{"amount": 5, "tag": "{tag}"}}'.encode()
    refused = post(server, "/validated", key, wrong)
    assert refused.status_code == 422 and "idempotent-replayed" not in refused.headers
    corrected = post(server, "/validated", key, right)
    assert corrected.status_code == 201, corrected.text
    assert "idempotent-replayed" not in corrected.headers
    again = post(server, "/validated", key, right)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == corrected.content
    # Two runs: the refused one (nothing kept of it) and the corrected one, replayed after.
    assert server.runs("validated", wrong.decode()) == 1
    assert server.runs("validated", right.decode()) == 1
    # The trade-off: a retry of the refused request itself runs the endpoint again.
    other = new_key()
    assert post(server, "/validated", other, wrong).status_code == 422
    assert post(server, "/validated", other, wrong).status_code == 422
    assert server.runs("validated", wrong.decode()) == 3


def test_by_default_a_422_is_stored_and_the_corrected_request_is_refused(server: Server) -> None:
    key, tag = new_key(), new_key()
    wrong = f'{{"amont": 5, "tag": "{tag}"}}'.encode()
    right = f'{{"amount": 5, "tag": "{tag}"}}'.encode()
    refused = post(server, "/validated-stored", key, wrong)
    assert refused.status_code == 422 and "idempotent-replayed" not in refused.headers
    corrected = post(server, "/validated-stored", key, right)
    assert corrected.status_code == 422, corrected.text
    assert corrected.json()["type"].endswith(":key-reused")
    retried = post(server, "/validated-stored", key, wrong)
    assert retried.status_code == 422 and retried.headers["idempotent-replayed"] == "true"
    assert retried.content == refused.content
    assert server.runs("validated-stored", wrong.decode()) == 1
    assert server.runs("validated-stored", right.decode()) == 0
