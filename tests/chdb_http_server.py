"""A ClickHouse HTTP interface over one chDB session, for tests of several processes
sharing one store.

chDB is the ClickHouse engine in-process: one process owns a data directory, so worker
processes cannot share a chDB store, and no ClickHouse server binary can be installed
here. This server owns the directory and answers ClickHouse's HTTP protocol, enough for
clickhouse-connect (the client the sink uses): every statement, setting, dedup token and
table engine is the real engine's; only the HTTP framing is ours.

What it speaks:

- `GET /ping` -> `Ok.`; `GET|POST /?query=...` with the statement in `query`, in the
  body, or both (the body follows the parameter, as ClickHouse reads them).
- `INSERT INTO t (cols) FORMAT F` (in `query`, or as the body's first line) with the data
  in the body: the data goes to a temp file and is inserted with `FROM INFILE`.
- `database`, `param_<name>` (bound parameters) and settings as URL parameters, or as the
  fields of a `multipart/form-data` body (clickhouse-connect sends `query` and its bound
  parameters so once they would make the URL longer than 4 KB); transport parameters
  (session, compression, progress, query id) are taken, not passed on.
  Settings are applied with `SET` for the one statement (the session is the server's
  one); settings of the previous request that this one lacks are reset to DEFAULT.
- A URL parameter or form field longer than a server takes by default
  (`http_max_field_value_size`, 128 KiB) fails the request, as it does on a server.
- Request bodies in chunked transfer encoding, and `Content-Encoding` lz4, zstd, gzip,
  deflate, br; responses are not compressed (no `Content-Encoding`), which the client
  reads as such.
- The output format: the statement's own `FORMAT`, else `default_format`, else
  TabSeparated. Headers `X-ClickHouse-Query-Id`, `X-ClickHouse-Format`,
  `X-ClickHouse-Timezone`, `X-ClickHouse-Summary`.
- Errors: HTTP 500 with `X-ClickHouse-Exception-Code` and ClickHouse's own text
  (`Code: NN. DB::Exception: ...`), so the client raises as it does against a server.

One lock serialises the engine (chDB is not thread-safe); requests arrive on threads.

    python -m tests.chdb_http_server --port 0 --data-dir DIR

prints `chdb-http-server listening on http://127.0.0.1:PORT` once it serves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

#: URL parameters that steer the transport, never engine settings.
TRANSPORT_PARAMS = frozenset(
    {
        "query",
        "database",
        "default_format",
        "user",
        "password",
        "buffer_size",
        "session_id",
        "session_timeout",
        "session_check",
        "query_id",
        "quota_key",
        "compress",
        "decompress",
        "wait_end_of_query",
        "client_protocol_version",
        "role",
        "send_progress_in_http_headers",
        "http_headers_progress_interval_ms",
        "enable_http_compression",
        "cancel_http_readonly_queries_on_client_close",
    }
)

_SETTING_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TRAILING_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.IGNORECASE)
#: An insert whose data follows: `INSERT INTO ... FORMAT F` then a newline and the data.
_INSERT_HEAD = re.compile(rb"^\s*(INSERT\s+INTO\s[^\n]*?)\bFORMAT\s+(\w+)[ \t]*(?:\r?\n|$)", re.I)
_CODE = re.compile(r"Code:\s*(\d+)")


def _quote(value: str) -> str:
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


class ChdbEngine:
    """The one chDB connection and the session state the HTTP requests share."""

    def __init__(self, data_dir: Path):
        import chdb

        data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir = data_dir
        self.tmp_dir = data_dir / "http-inserts"
        self.tmp_dir.mkdir(exist_ok=True)
        self.conn = chdb.connect(str(data_dir))
        self.lock = threading.Lock()
        self.database = "default"
        self.applied: dict[str, str] = {}
        self.timezone = self.conn.query("SELECT timezone()", "TabSeparated").bytes().decode()
        self.timezone = self.timezone.strip()

    def _set_session(self, database: str | None, settings: dict[str, str]) -> None:
        wanted = database or "default"
        if wanted != self.database:
            self.conn.query(f"USE `{wanted.replace('`', '')}`", "TabSeparated")
            self.database = wanted
        for name in [n for n in self.applied if n not in settings]:
            del self.applied[name]
            self.conn.query(f"SET {name} = DEFAULT", "TabSeparated")
        for name, value in settings.items():
            if self.applied.get(name) != value:
                self.conn.query(f"SET {name} = {_quote(value)}", "TabSeparated")
                self.applied[name] = value  # (a SET that failed, e.g. unknown, is not)

    def run(
        self,
        sql: str,
        fmt: str,
        *,
        database: str | None,
        settings: dict[str, str],
        params: dict[str, str],
        data: bytes | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        """(output, summary) of one statement; `data`: the insert's data, `sql` then
        being the statement without its FORMAT clause."""
        path = None
        try:
            if data is not None:
                fd, path = tempfile.mkstemp(dir=self.tmp_dir, suffix="." + fmt.lower())
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                sql = f"{sql} FROM INFILE {_quote(path)} FORMAT {fmt}"
                fmt = "TabSeparated"
            with self.lock:
                self._set_session(database, settings)
                result = self.conn.query(sql, fmt, params=params)
            out = result.bytes() or b""
            rows, size = result.rows_read(), result.bytes_read()
            if data is not None:
                summary = {"written_rows": str(rows), "written_bytes": str(size)}
            else:
                summary = {"read_rows": str(rows), "read_bytes": str(size)}
            summary["elapsed_ns"] = str(int(result.elapsed() * 1e9))
            return out, summary
        finally:
            if path is not None:
                os.unlink(path)


def _form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The fields of a multipart/form-data body, by name (files are not taken: external
    data is not spoken here)."""
    from email.parser import BytesParser
    from email.policy import HTTP

    message = BytesParser(policy=HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body
    )
    if not message.is_multipart():
        raise ValueError("not a multipart body")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name is None or part.get_filename() is not None:
            raise ValueError("a part without a field name, or a file")
        fields[str(name)] = _field_value(part.get_payload(decode=True).decode())
    return fields


#: A ClickHouse server takes a URL parameter or form field up to this long
#: (`http_max_field_value_size`, its default): a longer one fails the request.
HTTP_MAX_FIELD_VALUE_SIZE = 131_072


def _field_value(value: str) -> str:
    if len(value.encode()) > HTTP_MAX_FIELD_VALUE_SIZE:
        raise ValueError(
            f"field value too long: {len(value.encode())} bytes, http_max_field_value_size "
            f"is {HTTP_MAX_FIELD_VALUE_SIZE}"
        )
    return value


def _decompress(data: bytes, encoding: str) -> bytes:
    if encoding in ("", "identity"):
        return data
    if encoding == "lz4":
        import lz4.frame

        # clickhouse-connect compresses each block as a frame of its own: read them all.
        parts = []
        while data:
            frame = lz4.frame.LZ4FrameDecompressor()
            parts.append(frame.decompress(data))
            if not frame.eof:
                raise ValueError("truncated lz4 frame")
            data = frame.unused_data
        return b"".join(parts)
    if encoding == "zstd":
        from clickhouse_connect.driver.compression import _zstd_decompress

        return _zstd_decompress(data)
    if encoding == "gzip":
        import gzip

        return gzip.decompress(data)
    if encoding == "deflate":
        import zlib

        return zlib.decompress(data)
    if encoding == "br":
        import brotli

        return brotli.decompress(data)
    raise ValueError(f"unsupported Content-Encoding {encoding!r}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "chdb-http-server"
    engine: ChdbEngine  # set on the subclass by `make_server`
    quiet = True

    def log_message(self, format: str, *args: object) -> None:
        if not self.quiet:
            super().log_message(format, *args)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            body = b"".join(parts)
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        return _decompress(body, self.headers.get("Content-Encoding", "").strip().lower())

    def _reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        url = urlsplit(self.path)
        args = dict(parse_qsl(url.query, keep_blank_values=True))
        try:
            args = {name: _field_value(value) for name, value in args.items()}
        except ValueError as exc:
            self._error(f"Code: 1001. DB::Exception: {exc}", "")
            return
        try:
            body = self._body() if self.command == "POST" else b""
        except Exception as exc:  # a body we cannot read: the client's mistake
            self._error(f"Code: 1001. DB::Exception: cannot read the request body: {exc}", "")
            return
        if self.headers.get_content_type() == "multipart/form-data":
            try:
                args.update(_form_fields(self.headers["Content-Type"], body))
            except ValueError as exc:
                self._error(f"Code: 1001. DB::Exception: cannot read the form: {exc}", "")
                return
            body = b""
        if url.path in ("/ping", "/ping/"):
            self._reply(200, b"Ok.\n", {"Content-Type": "text/plain; charset=UTF-8"})
            return
        query_id = args.get("query_id") or str(uuid.uuid4())
        params = {k[6:]: v for k, v in args.items() if k.startswith("param_")}
        settings = {
            k: v
            for k, v in args.items()
            if k not in TRANSPORT_PARAMS and not k.startswith("param_") and _SETTING_NAME.match(k)
        }
        query = args.get("query", "")
        data = None
        head = _INSERT_HEAD.match(query.encode()) if query else None
        if head is not None and body:
            sql, fmt, data = head.group(1).decode(), head.group(2).decode(), body
        elif not query and (head := _INSERT_HEAD.match(body)) is not None:
            sql, fmt, data = head.group(1).decode(), head.group(2).decode(), body[head.end() :]
        else:
            sql = f"{query}\n{body.decode()}" if query and body else query or body.decode()
            found = _TRAILING_FORMAT.search(sql)
            fmt = found.group(1) if found else args.get("default_format", "TabSeparated")
        try:
            out, summary = self.engine.run(
                sql,
                fmt,
                database=args.get("database"),
                settings=settings,
                params=params,
                data=data,
            )
        except Exception as exc:
            self._error(str(exc), query_id)
            return
        self._reply(
            200,
            out,
            {
                "Content-Type": "application/octet-stream",
                "X-ClickHouse-Query-Id": query_id,
                "X-ClickHouse-Format": fmt,
                "X-ClickHouse-Timezone": self.engine.timezone,
                "X-ClickHouse-Summary": json.dumps(summary),
            },
        )

    def _error(self, message: str, query_id: str) -> None:
        start = message.find("Code: ")
        text = (message[start:] if start > 0 else message).strip()
        code = _CODE.search(text)
        self._reply(
            500,
            (text + "\n").encode(errors="replace"),
            {
                "Content-Type": "text/plain; charset=UTF-8",
                "X-ClickHouse-Exception-Code": code.group(1) if code else "1001",
                "X-ClickHouse-Query-Id": query_id,
            },
        )


def make_server(data_dir: Path, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    handler = type("BoundHandler", (Handler,), {"engine": ChdbEngine(data_dir)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123, help="0: a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--log-requests", action="store_true")
    args = parser.parse_args(argv)
    server = make_server(args.data_dir, args.port, args.host)
    Handler.quiet = not args.log_requests
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    host, port = server.server_address[:2]
    print(f"chdb-http-server listening on http://{host}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
