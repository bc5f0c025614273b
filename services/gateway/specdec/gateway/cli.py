"""The gateway as `specdec serve gateway` runs it (registered in the "specdec.services"
entry point group by specdec-gateway)."""

from specdec.serve import Service

SERVICE = Service(
    "gateway",
    "the gateway (public API, speculation loop)",
    config="specdec.gateway.config:GatewayConfig",
    main="specdec.gateway.front.server:main",
)
