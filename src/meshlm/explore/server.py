"""`meshlm explore`: the standard library's threading HTTP server, one page, a JSON API.

Static files are a fixed table of names shipped in `static/` (read with importlib.resources), so no
URL path is ever joined onto a directory. Bound to loopback, the server also refuses requests whose
Host header is not a loopback name (a web page elsewhere cannot reach it through DNS rebinding).
"""
from __future__ import annotations

import json
import sys
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from urllib.parse import parse_qs, urlparse

from . import api, runs
from .energy import energy_schedule

TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
STATIC = {"/" + name: (name, TYPES[name.rsplit(".", 1)[1]])
          for name in ("index.html", "app.js", "charts.js", "form.js", "explorer.js", "energy.js", "mixed.js", "course.js", "runs.js",
                       "energy_trace.js", "style.css")}
STATIC["/"] = STATIC["/index.html"]
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MAX_BODY = 1 << 16


def _static(name: str) -> bytes:
    return resources.files("meshlm.explore").joinpath("static", name).read_bytes()


class Handler(BaseHTTPRequestHandler):
    server_version = "meshlm-explore"
    runs_root = "runs"
    check_host = True

    def log_message(self, fmt, *args):  # quiet: the terminal shows the URL, not every request
        pass

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the page moved on (e.g. a newer search)
            pass

    def _host_ok(self) -> bool:
        if not self.check_host:
            return True
        host = self.headers.get("Host") or ""
        if host.startswith("["):  # [::1]:8000
            host = host[:host.find("]") + 1]
        elif host.count(":") == 1:
            host = host.split(":")[0]
        return host in LOOPBACK

    def _dispatch(self, method: str) -> None:
        code, body, ctype = self._route(method)
        self._send(code, body, ctype)

    def _route(self, method: str) -> tuple[int, bytes, str]:
        """(status, body, content type) of one request; every failure is a one-line JSON error."""
        def ok(obj):
            return 200, json.dumps(obj).encode(), "application/json"

        def error(code, message, key=None):
            return code, json.dumps({"error": message, "key": key}).encode(), "application/json"

        if not self._host_ok():
            return error(403, "request: Host is not a loopback name")
        url = urlparse(self.path)
        try:
            if method == "GET" and url.path in STATIC:
                name, ctype = STATIC[url.path]
                return 200, _static(name), ctype
            if method == "GET" and url.path == "/api/options":
                return ok(api.options())
            if method == "GET" and url.path == "/api/runs":
                return ok(runs.list_runs(self.runs_root))
            if method == "GET" and url.path == "/api/run":
                return ok(runs.read_run(self.runs_root, (parse_qs(url.query).get("name") or [None])[0]))
            if method == "POST" and url.path in ("/api/estimate", "/api/plan"):
                body = self._body()
                return ok((api.run_estimate if url.path == "/api/estimate" else api.run_plan)(body, self.runs_root))
            if method == "POST" and url.path == "/api/energy_schedule":  # docs/energy.md, "Scheduling in time"
                return ok(energy_schedule(self._body(), api.BadRequest))
            return error(404, f"request: no such page or endpoint: {method} {url.path}")
        except api.BadRequest as e:
            return error(400, str(e), e.key)
        except api.NotFound as e:
            return error(404, str(e), "run")
        except Exception as e:  # noqa: BLE001 - one line to the page, the traceback to the terminal
            traceback.print_exc(file=sys.stderr)
            return error(500, f"internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    def _body(self):
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise api.BadRequest("request: bad Content-Length") from None
        if n > MAX_BODY:
            raise api.BadRequest(f"request: body over {MAX_BODY} bytes")
        try:
            return json.loads(self.rfile.read(n) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise api.BadRequest(f"request: body is not JSON ({e.msg if hasattr(e, 'msg') else e})") from None

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")


def make_server(host: str = "127.0.0.1", port: int = 8000, runs_root: str = "runs") -> ThreadingHTTPServer:
    """A server ready for serve_forever(); port 0 picks a free port (server.server_address)."""
    handler = type("ExploreHandler", (Handler,), {"runs_root": runs_root, "check_host": host in LOOPBACK})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def url_of(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/"


def add_parser(subparsers) -> None:
    e = subparsers.add_parser("explore", help="local web page: strategy explorer and runs dashboard")
    e.add_argument("--port", type=int, default=8000, help="port (default %(default)s; 0 picks a free one)")
    e.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    e.add_argument("--runs", default="runs", help="directory whose run folders the dashboard shows (default runs/)")
    e.set_defaults(func=run)


def run(args) -> int:
    import os
    if not 0 <= args.port <= 65535:
        print(f"meshlm: --port: must be 0-65535, got {args.port}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.runs):
        print(f"meshlm: --runs: {args.runs} does not exist yet; the dashboard lists runs once it does",
              file=sys.stderr)
    try:
        server = make_server(args.host, args.port, args.runs)
    except OSError as e:
        print(f"meshlm: --port: cannot listen on {args.host}:{args.port}: {e.strerror}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK:
        print(f"meshlm: note: listening on {args.host}, so other machines can read the runs under {args.runs}",
              file=sys.stderr)
    print(f"meshlm explore: {url_of(server)}  (runs from {os.path.abspath(args.runs)}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
