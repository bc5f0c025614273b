"""The verifier as `specdec serve verifier` runs it (registered in the "specdec.services"
entry point group by specdec-verifier)."""

from specdec.serve import Service

SERVICE = Service(
    "verifier",
    "the verifier service",
    config="specdec.verifier.config:VerifierConfig",
    main="specdec.verifier.server:main",
    port=50062,
)
