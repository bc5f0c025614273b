"""Where the replicas of a role are: a static list, DNS records, or Kubernetes EndpointSlices.

A role's --drafter / --verifier value is one of

* ``HOST:PORT[,HOST:PORT...]``: a static list (as before);
* ``dns:[//DNS_SERVER:PORT/]NAME:PORT``: the A and AAAA records of NAME (a headless
  Service), re-resolved every --dns-interval seconds, each address one replica on PORT.
  Without a server, the system's resolver configuration (/etc/resolv.conf) is used;
* ``k8s:[NAMESPACE/]SERVICE:PORT``: the EndpointSlices of SERVICE, listed and then watched
  through the Kubernetes API (in-cluster credentials, else $KUBECONFIG). Only ready
  endpoints count; PORT is the endpoint port number or name. An expired watch (410 Gone)
  relists. Without NAMESPACE, the pod's own namespace.

A discovery source reports the full set of addresses each time it changes; the pool adds
new replicas (they serve once their health check and Info pass, see replicas.Fleet) and
drops the ones that left. A session whose replica left moves to another one with a
full-context resend (loop.Speculator), so its output stays exact.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: kubernetes is needed by k8s: discovery only
    from kubernetes.watch import Watch

log = logging.getLogger(__name__)

Publish = Callable[[frozenset[str]], None]

IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def _port(text: str, what: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{what}: {text!r} is not a port number")
    return int(text)


def join(host: str, port: int | str) -> str:
    """HOST:PORT, with brackets around an IPv6 address."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


@dataclass(frozen=True)
class DnsTarget:
    name: str
    port: int
    server: tuple[str, int] | None = None  # None: the system resolver

    def __str__(self) -> str:
        server = f"//{join(*self.server)}/" if self.server else ""
        return f"dns:{server}{self.name}:{self.port}"


@dataclass(frozen=True)
class K8sTarget:
    namespace: str | None  # None: the pod's own namespace
    service: str
    port: int | str  # endpoint port number, or its name

    def __str__(self) -> str:
        ns = f"{self.namespace}/" if self.namespace else ""
        return f"k8s:{ns}{self.service}:{self.port}"


_DNS_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")
_K8S_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def parse_target(raw: str) -> DnsTarget | K8sTarget | None:
    """A ``dns:`` or ``k8s:`` target, or None for a static HOST:PORT list.
    Raises ValueError with the reason for a malformed one."""
    raw = raw.strip()
    if raw.startswith("dns:"):
        rest, server = raw[4:], None
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            host, colon, port = authority.rpartition(":")
            host = host.strip("[]")
            if not slash or not colon:
                raise ValueError(f"{raw!r}: expected dns://DNS_SERVER:PORT/NAME:PORT")
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ValueError(f"{raw!r}: the DNS server must be an IP address") from None
            server = (host, _port(port, raw))
        name, _, port = rest.rpartition(":")
        if not name or not _DNS_NAME.match(name):
            raise ValueError(f"{raw!r}: expected dns:NAME:PORT")
        return DnsTarget(name, _port(port, raw), server)
    if raw.startswith("k8s:"):
        rest = raw[4:]
        where, _, port = rest.rpartition(":")
        namespace, _, service = where.rpartition("/")
        if not service or not _K8S_NAME.match(service):
            raise ValueError(f"{raw!r}: expected k8s:[NAMESPACE/]SERVICE:PORT")
        if namespace and not _K8S_NAME.match(namespace):
            raise ValueError(f"{raw!r}: {namespace!r} is not a namespace name")
        if not port:
            raise ValueError(f"{raw!r}: expected k8s:[NAMESPACE/]SERVICE:PORT")
        return K8sTarget(namespace or None, service, int(port) if port.isdigit() else port)
    if raw.split(":", 1)[0] in ("static", "http", "https", "grpc", "unix", "xds", "consul"):
        raise ValueError(f"{raw!r}: unknown discovery scheme")
    return None


class DnsDiscovery:
    """Resolves A and AAAA records every `interval` seconds (dnspython, asyncio)."""

    def __init__(self, target: DnsTarget, interval: float, timeout: float = 2.0):
        import dns.asyncresolver

        self.target = target
        self.interval = interval
        self.resolver = dns.asyncresolver.Resolver(configure=target.server is None)
        if target.server:
            self.resolver.nameservers = [target.server[0]]
            self.resolver.port = target.server[1]
        self.resolver.lifetime = timeout

    async def resolve(self) -> frozenset[str]:
        """The current addresses; raises dns.exception.DNSException when no answer came
        (a name without records is an empty set, not an error)."""
        import dns.resolver

        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(self.target.name, rdtype, search=True)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            found.update(join(r.address, self.target.port) for r in answer)
        return frozenset(found)

    async def run(self, publish: Publish) -> None:
        import dns.exception

        while True:
            try:
                publish(await self.resolve())
            except dns.exception.DNSException as e:  # keep the last set until DNS answers
                log.warning(
                    "DNS discovery failed; keeping the replicas known",
                    extra={"target": str(self.target), "why": str(e) or type(e).__name__},
                )
            await asyncio.sleep(self.interval)


class K8sDiscovery:
    """Lists, then watches, the EndpointSlices of a Service (kubernetes client, in a thread).

    Only ready endpoints count (a missing `ready` condition means ready, as the API
    documents). On 410 Gone (the watch's resourceVersion expired) it lists again.
    """

    def __init__(self, target: K8sTarget, retry_seconds: float = 2.0):
        self.target = target
        self.retry_seconds = retry_seconds
        self.namespace = target.namespace or self._own_namespace()
        self._slices: dict[str, frozenset[str]] = {}
        self._watch: Watch | None = None
        self._stopped = threading.Event()

    @staticmethod
    def _own_namespace() -> str:
        try:
            with open(IN_CLUSTER_NAMESPACE) as f:
                return f.read().strip()
        except OSError:
            raise ValueError(
                "k8s: discovery without a NAMESPACE needs the pod's namespace file "
                f"{IN_CLUSTER_NAMESPACE}; write k8s:NAMESPACE/SERVICE:PORT"
            ) from None

    @staticmethod
    def api_client() -> Any:
        """In-cluster credentials when running in a pod, else $KUBECONFIG / ~/.kube/config."""
        from kubernetes import client, config

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return client.ApiClient()
        return config.new_client_from_config()

    def addresses(self, raw_slice: dict[str, Any]) -> frozenset[str]:
        """The ready endpoints of one EndpointSlice (a dict as the API sends it)."""
        if raw_slice.get("addressType") not in ("IPv4", "IPv6"):
            return frozenset()
        port = None
        for p in raw_slice.get("ports") or []:
            if self.target.port in (p.get("port"), p.get("name")):
                port = p.get("port")
                break
        if port is None:
            return frozenset()
        found: set[str] = set()
        for ep in raw_slice.get("endpoints") or []:
            ready = (ep.get("conditions") or {}).get("ready")
            if ready is False:
                continue
            found.update(join(a, port) for a in ep.get("addresses") or [])
        return frozenset(found)

    def _union(self) -> frozenset[str]:
        return frozenset().union(*self._slices.values())

    def _list(self, api: Any) -> str:
        selector = f"{SERVICE_NAME_LABEL}={self.target.service}"
        resp = api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=selector, _preload_content=False
        )
        import json

        body = json.loads(resp.data)
        self._slices = {s["metadata"]["name"]: self.addresses(s) for s in body.get("items") or []}
        return str(body["metadata"]["resourceVersion"])

    def _follow(self, publish: Publish) -> None:
        """Runs in a thread until stop(): list, publish, watch; relist after 410."""
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        selector = f"{SERVICE_NAME_LABEL}={self.target.service}"
        api = None
        while not self._stopped.is_set():
            try:
                if api is None:  # no credentials yet is an error like any other: retried
                    api = client.DiscoveryV1Api(self.api_client())
                version = self._list(api)
                publish(self._union())
                self._watch = watch.Watch()
                for event in self._watch.stream(
                    api.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                ):
                    kind, obj = event["type"], event["raw_object"]
                    if kind == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    if kind == "DELETED":
                        self._slices.pop(name, None)
                    else:  # ADDED, MODIFIED
                        self._slices[name] = self.addresses(obj)
                    publish(self._union())
            except ApiException as e:
                if e.status == 410:
                    log.info("EndpointSlice watch expired; listing again", extra=self._extra())
                    continue
                self._failed(e)
            except Exception as e:  # the API server unreachable, a broken stream
                if self._stopped.is_set():
                    break
                self._failed(e)

    def _extra(self) -> dict[str, str]:
        return {"target": str(self.target), "namespace": self.namespace}

    def _failed(self, e: Exception) -> None:
        log.warning(
            "EndpointSlice discovery failed; keeping the replicas known, retrying",
            extra={**self._extra(), "why": str(e).splitlines()[0] if str(e) else repr(e)},
        )
        self._stopped.wait(self.retry_seconds)

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()

        def publish_threadsafe(addresses: frozenset[str]) -> None:
            loop.call_soon_threadsafe(publish, addresses)

        thread = threading.Thread(
            target=self._follow, args=(publish_threadsafe,), daemon=True, name="k8s-discovery"
        )
        thread.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            self._stopped.set()
            if self._watch is not None:
                self._watch.stop()


def make_discovery(raw: str, dns_interval: float) -> DnsDiscovery | K8sDiscovery | None:
    """The discovery source a --drafter / --verifier value asks for (None: static)."""
    target = parse_target(raw)
    if isinstance(target, DnsTarget):
        return DnsDiscovery(target, dns_interval)
    if isinstance(target, K8sTarget):
        return K8sDiscovery(target)
    return None
