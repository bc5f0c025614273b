"""The drafter as `specdec serve drafter` runs it (registered in the "specdec.services"
entry point group by specdec-drafter)."""

from specdec.serve import Service

SERVICE = Service(
    "drafter",
    "the drafter service",
    config="specdec.drafter.config:DrafterConfig",
    main="specdec.drafter.server:main",
    port=50061,
)
