"""--drafter-canary: parsing, the split of new sessions, and the pool's choice."""

from __future__ import annotations

import math

import pytest

from specdec.common.settings import ConfigError
from specdec.common.version import read_model_version
from specdec.gateway.fleet.canary import (
    Canary,
    VersionRule,
    parse_canary,
    session_share,
    version_rule,
)
from specdec.gateway.sessions import replica_session_id
from specdec.v1 import common_pb2


def test_parse():
    assert parse_canary("") is None
    assert parse_canary("distill-abc123:12.5") == Canary("distill-abc123", 12.5)
    assert parse_canary("v1:0") == Canary("v1", 0.0)
    for bad in ("v1", "v1:101", "v1:-1", "v1:ten", ":10", "bad version:10"):
        with pytest.raises(ValueError):
            parse_canary(bad)


@pytest.mark.parametrize("percent", [1.0, 10.0, 50.0, 90.0])
def test_split_follows_the_percentage_within_binomial_error(percent):
    n = 20_000
    canary = Canary("v2", percent)
    hits = sum(version_rule(canary, replica_session_id(f"user-{i}")).canary for i in range(n))
    p = percent / 100
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(hits - n * p) < 4 * sigma, (hits, n * p, sigma)


def test_a_session_keeps_its_side_and_a_larger_share_keeps_the_canary():
    keys = [replica_session_id(f"s{i}") for i in range(500)]
    small, large = Canary("v2", 10.0), Canary("v2", 30.0)
    for key in keys:
        assert version_rule(small, key) == version_rule(small, key)  # a pure function
        if version_rule(small, key).canary:
            assert version_rule(large, key).canary
    assert all(0 <= session_share(k) < 100 for k in keys)
    assert version_rule(None, keys[0]) is None
    assert not any(version_rule(Canary("v2", 0.0), k).canary for k in keys)
    assert all(version_rule(Canary("v2", 100.0), k).canary for k in keys)


def test_rule_matches_versions():
    new, old = common_pb2.ModelInfo(model_version="v2"), common_pb2.ModelInfo(model_version="")
    assert VersionRule("v2", canary=True).matches(new)
    assert not VersionRule("v2", canary=True).matches(old)
    assert VersionRule("v2", canary=False).matches(old)
    assert not VersionRule("v2", canary=False).matches(new)
    assert not VersionRule("v2", canary=True).matches(None)


def test_pool_picks_by_rule_and_falls_back(monkeypatch):
    from prometheus_client import REGISTRY

    from specdec.gateway.fleet.replicas import Replica, ReplicaPool

    pool = ReplicaPool.__new__(ReplicaPool)  # no channels: pick reads the replica list only
    pool.role, pool.source = "drafter", "test"
    a = Replica("drafter", "a:1", None, None, up=True, info=common_pb2.ModelInfo())
    b = Replica(
        "drafter", "b:1", None, None, up=True, info=common_pb2.ModelInfo(model_version="v2")
    )
    a.transport = b.transport = None
    pool.replicas = [a, b]
    canary, rest = VersionRule("v2", True), VersionRule("v2", False)
    assert pool.pick(rule=canary) is b
    assert pool.pick(rule=rest) is a
    assert pool.pick(preferred="a:1", rule=canary) is a  # a session keeps its drafter
    fallbacks = REGISTRY.get_sample_value("specdec_gateway_drafter_canary_fallbacks_total")
    b.up = False
    assert pool.pick(rule=canary) is a  # no canary drafter up: any drafter (same tokens)
    after = REGISTRY.get_sample_value("specdec_gateway_drafter_canary_fallbacks_total")
    assert after == fallbacks + 1


def test_model_version_file(tmp_path):
    assert read_model_version(str(tmp_path)) == ""
    assert read_model_version("some/hub-id") == ""
    (tmp_path / "specdec_version.json").write_text('{"version": "distill-1a2b"}')
    assert read_model_version(str(tmp_path)) == "distill-1a2b"
    for bad in ('{"version": ""}', '{"version": "a b"}', "{}", "not json", '{"version": 3}'):
        (tmp_path / "specdec_version.json").write_text(bad)
        with pytest.raises(ConfigError, match=r"specdec_version\.json"):
            read_model_version(str(tmp_path))


def test_gateway_flags():
    from specdec.cli import build_parser
    from specdec.gateway.config import GatewayConfig

    def gateway(*argv):
        base = ["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"]
        return GatewayConfig.from_args(build_parser().parse_args([*base, *argv]))

    cfg = gateway()
    assert cfg.record_dir is None and cfg.drafter_canary is None
    cfg = gateway("--record", "/r", "--record-max-bytes", "1000", "--drafter-canary", "v2:5")
    assert (cfg.record_dir, cfg.record_max_bytes, cfg.record_max_files) == ("/r", 1000, 16)
    assert cfg.drafter_canary == Canary("v2", 5.0)
    for flag, value in (
        ("--drafter-canary", "v2"),
        ("--drafter-canary", "v2:150"),
        ("--record-max-bytes", "0"),
        ("--record-max-files", "-1"),
    ):
        with pytest.raises(ConfigError, match=flag):
            gateway(flag, value)
