"""A small HTTP server speaking the few Grafana HTTP API endpoints `lagscope dashboards push`
uses, recording every request. It stands in for Grafana only because no Grafana build can
be installed on the test machines (no apt package, no PyPI distribution, no Docker daemon);
the answers follow Grafana's documented API (status codes, `message` bodies, 404 for a
missing uid, 412 for a dashboard saved over without `overwrite`)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Recorded:
    method: str
    path: str
    authorization: str | None
    body: Any


@dataclass
class GrafanaState:
    datasources: dict[str, dict[str, Any]] = field(default_factory=dict)
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: (folder uid, group) -> the rule group as last put.
    rule_groups: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    #: When set, every request is answered with this status (401, 403, 500, ...).
    fail_with: int | None = None
    #: When set, only dashboard saves fail with this status.
    fail_dashboards_with: int | None = None
    token: str | None = None


def _get_datasource(state: GrafanaState, body: Any, uid: str) -> tuple[int, Any]:
    if uid not in state.datasources:
        return 404, {"message": "Data source not found"}
    return 200, state.datasources[uid]


def _put_datasource(state: GrafanaState, body: Any, uid: str) -> tuple[int, Any]:
    if uid not in state.datasources:
        return 404, {"message": "Data source not found"}
    state.datasources[uid] = {**body, "id": state.datasources[uid]["id"]}
    return 200, {"message": "Datasource updated", "datasource": body}


def _add_datasource(state: GrafanaState, body: Any) -> tuple[int, Any]:
    if any(d["name"] == body["name"] for d in state.datasources.values()):
        return 409, {"message": "data source with the same name already exists"}
    state.datasources[body["uid"]] = {**body, "id": len(state.datasources) + 1}
    return 200, {"message": "Datasource added", "datasource": body}


def _get_folder(state: GrafanaState, body: Any, uid: str) -> tuple[int, Any]:
    folder = state.folders.get(uid)
    return (200, folder) if folder else (404, {"message": "folder not found"})


def _add_folder(state: GrafanaState, body: Any) -> tuple[int, Any]:
    if body.get("uid") in state.folders:
        return 409, {"message": "a folder with the same uid already exists"}
    state.folders[body["uid"]] = body
    return 200, body


def _save_dashboard(state: GrafanaState, body: Any) -> tuple[int, Any]:
    if state.fail_dashboards_with:
        return state.fail_dashboards_with, {"message": "dashboard save failed"}
    uid = body["dashboard"]["uid"]
    if body.get("folderUid") not in state.folders:
        return 400, {"message": "folder not found"}
    if uid in state.dashboards and not body.get("overwrite"):
        return 412, {"message": "A dashboard with the same uid already exists"}
    version = state.dashboards.get(uid, {}).get("version", 0) + 1
    state.dashboards[uid] = {**body, "version": version}
    return 200, {"status": "success", "uid": uid, "url": f"/d/{uid}/{uid}", "version": version}


def _put_rule_group(state: GrafanaState, body: Any, folder: str, group: str) -> tuple[int, Any]:
    if folder not in state.folders:
        return 404, {"message": "folder not found"}
    state.rule_groups[folder, group] = body
    return 200, body


#: Path pattern -> {method: handler(state, body, *the pattern's groups)}.
_ROUTES: tuple[tuple[str, dict[str, Any]], ...] = (
    (r"/api/datasources/uid/([\w-]+)", {"GET": _get_datasource, "PUT": _put_datasource}),
    (r"/api/datasources", {"POST": _add_datasource}),
    (r"/api/folders/([\w-]+)", {"GET": _get_folder}),
    (r"/api/folders", {"POST": _add_folder}),
    (r"/api/dashboards/db", {"POST": _save_dashboard}),
    (r"/api/v1/provisioning/folder/([\w-]+)/rule-groups/([\w-]+)", {"PUT": _put_rule_group}),
)


def _route(state: GrafanaState, method: str, path: str, body: Any) -> tuple[int, Any]:
    for pattern, handlers in _ROUTES:
        if (m := re.fullmatch(pattern, path)) and method in handlers:
            return handlers[method](state, body, *m.groups())
    return 404, {"message": "Not found"}


class _Handler(BaseHTTPRequestHandler):
    server: _StubServer

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length)) if length else None

    def _answer(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        state = self.server.state
        body = self._body() if method in ("POST", "PUT") else None
        auth = self.headers.get("Authorization")
        state.requests.append(Recorded(method, self.path, auth, body))
        if state.fail_with:
            messages = {401: "Unauthorized", 403: "Permission denied", 404: "Not found"}
            message = messages.get(state.fail_with, "Internal Server Error")
            self._answer(state.fail_with, {"message": message})
            return
        if auth != f"Bearer {state.token}":
            self._answer(401, {"message": "Unauthorized"})
            return
        self._answer(*_route(state, method, self.path, body))

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")


class _StubServer(ThreadingHTTPServer):
    def __init__(self, state: GrafanaState) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


class GrafanaStub:
    def __init__(self, token: str = "glsa_test") -> None:
        self.state = GrafanaState(token=token)
        self.server = _StubServer(self.state)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> GrafanaStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
