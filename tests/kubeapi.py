"""A stand-in Kubernetes API server for discovery tests (see FakeKubeAPI)."""

from __future__ import annotations

import json
import re
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeKubeAPI:
    """A stand-in for kube-apiserver: there is no kube-apiserver binary (nor a cluster) on
    this machine, so this small HTTP server on loopback serves what the gateway's real
    `kubernetes` client asks for: list and watch of discovery.k8s.io/v1 EndpointSlices in
    one namespace, with labelSelector `kubernetes.io/service-name=NAME`, resourceVersions,
    chunked watch streams of ADDED/MODIFIED/DELETED events, and `410 Gone` (an ERROR event
    with a v1 Status) for a watch from a resourceVersion older than the last expire().
    """

    PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")

    def __init__(self, namespace: str):
        self.namespace = namespace
        self.version = 1
        self.oldest = 0  # watches from an older resourceVersion get 410
        self.slices: dict[str, dict] = {}
        self.events: list[tuple[int, str, dict]] = []
        self.lists: dict[str, int] = {}  # service -> list requests
        self.cond = threading.Condition()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                api.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        with self.cond:
            self.oldest = 1 << 60
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- state changes ---------------------------------------------------------------

    def put(self, service: str, name: str, port: int, endpoints, emit: bool = True) -> None:
        """Create or replace a slice; endpoints: [(ip, ready)]. emit=False changes the
        state without a watch event (only a new list shows it)."""
        with self.cond:
            self.version += 1
            kind = "MODIFIED" if name in self.slices else "ADDED"
            obj = {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "labels": {"kubernetes.io/service-name": service},
                    "resourceVersion": str(self.version),
                },
                "addressType": "IPv4",
                "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
                "endpoints": [
                    {"addresses": [ip], "conditions": {"ready": ready}} for ip, ready in endpoints
                ],
            }
            self.slices[name] = obj
            if emit:
                self.events.append((self.version, kind, obj))
            self.cond.notify_all()

    def delete(self, name: str, emit: bool = True) -> None:
        with self.cond:
            self.version += 1
            obj = self.slices.pop(name)
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
            if emit:
                self.events.append((self.version, "DELETED", obj))
            self.cond.notify_all()

    def expire(self) -> None:
        """Every resourceVersion so far is too old: open watches end with 410 Gone."""
        with self.cond:
            self.oldest = self.version + 1
            self.cond.notify_all()

    # -- HTTP ------------------------------------------------------------------------

    def handle(self, req: BaseHTTPRequestHandler) -> None:
        url = urllib.parse.urlsplit(req.path)
        m = self.PATH.match(url.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        selector = query.get("labelSelector", "")
        key, _, service = selector.partition("=")
        if not m or m.group(1) != self.namespace or key != "kubernetes.io/service-name":
            body = json.dumps({"kind": "Status", "code": 404, "message": req.path}).encode()
            req.send_response(404)
            req.send_header("Content-Type", "application/json")
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            req.wfile.write(body)
            return
        if query.get("watch") in ("true", "1"):
            self._watch(req, service, int(query.get("resourceVersion") or 0))
            return
        with self.cond:
            self.lists[service] = self.lists.get(service, 0) + 1
            items = [s for s in self.slices.values() if self._of(s, service)]
            body = json.dumps(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            ).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    @staticmethod
    def _of(obj: dict, service: str) -> bool:
        return obj["metadata"]["labels"].get("kubernetes.io/service-name") == service

    def _watch(self, req, service: str, since: int) -> None:
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Transfer-Encoding", "chunked")
        req.end_headers()

        def send(event: dict) -> None:
            data = (json.dumps(event) + "\n").encode()
            req.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            req.wfile.flush()

        try:
            while True:
                with self.cond:
                    if since < self.oldest:
                        gone = {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "status": "Failure",
                            "reason": "Expired",
                            "message": f"too old resource version: {since}",
                            "code": 410,
                        }
                        pending, expired = [], gone
                    else:
                        pending = [
                            (v, t, o)
                            for v, t, o in self.events
                            if v > since and self._of(o, service)
                        ]
                        expired = None
                        if not pending:
                            self.cond.wait(1.0)
                            continue
                if expired:
                    send({"type": "ERROR", "object": expired})
                    break
                for v, kind, obj in pending:
                    send({"type": kind, "object": obj})
                    since = v
            req.wfile.write(b"0\r\n\r\n")
            req.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def write_kubeconfig(self, path: Path) -> str:
        """A kubeconfig that points the `kubernetes` client at this server; returns its path."""
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
                    "users": [{"name": "gateway", "user": {"token": "stand-in-token"}}],
                    "contexts": [
                        {"name": "stand-in", "context": {"cluster": "stand-in", "user": "gateway"}}
                    ],
                    "current-context": "stand-in",
                }
            )
        )
        return str(path)
