"""The lookup drafts' settings: what the gateway's flags (--prompt-lookup-min/max,
--suffix-*, --confident-*) default to, declared here once (specdec.gateway.config reads
these defaults). Import-light on purpose: `specdec serve drafter|verifier` builds the
gateway's flags too, and must not load the gateway's lookup code or register its metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SuffixParams:
    depth: int = 24  # Arctic Inference's smallest max_tree_depth
    max_match: int = 12  # longest suffix matched: leaves depth - max_match tokens of path
    spec_factor: float = 1.0  # draft at most ceil(match length x spec_factor) tokens
    min_prob: float = 0.1  # stop where the path's probability falls below this


@dataclass(frozen=True)
class LookupSettings:
    """The gateway's lookup settings (flags --prompt-lookup-min/max, --suffix-*): the
    flags' defaults are these (specdec.gateway.config declares them from here)."""

    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    suffix: SuffixParams = field(default_factory=SuffixParams)
    confident_match: int = 3  # hybrid: tokens matched before a lookup draft is used alone
    confident_score: float = 2.0  # hybrid: and, from the cache, tokens expected accepted
