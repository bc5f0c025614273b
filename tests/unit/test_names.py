"""The gateway's str-Enums (specdec.gateway.names) write the strings metrics, JSON and logs
always carried, and map one to one onto their proto enums; a Placement's cache changes
only through its named transitions (specdec.gateway.fleet.placement)."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, Counter

from specdec.gateway.fleet.placement import Placement
from specdec.gateway.names import DraftMethod, Finish, KPolicy, Role, Source, Ssd
from specdec.v1 import gateway_pb2

STRINGS = {
    Role: ["drafter", "verifier"],
    DraftMethod: ["model", "ngram", "suffix", "hybrid"],
    Source: [
        "drafter",
        "prepared",
        "none",
        "no-drafter",
        "ngram",
        "suffix",
        "prediction",
        "no-match",
    ],
    Ssd: ["off", "paused", "sent", "hit", "miss", "late"],
    KPolicy: ["fixed", "adaptive"],
    Finish: ["length", "eos", "stop"],
}


@pytest.mark.parametrize("kind", list(STRINGS))
def test_members_read_as_their_old_strings(kind):
    assert [m.value for m in kind] == STRINGS[kind]
    for member in kind:
        assert member == member.value and str(member) == f"{member}" == member.value
        assert json.dumps({"x": member}) == json.dumps({"x": member.value})
        assert type(gateway_pb2.DraftSourceStats(source=member).source) is str


def test_metric_labels_keep_their_values():
    counter = Counter("names_test", "d", ["method"], registry=CollectorRegistry())
    counter.labels(method=Source.NGRAM).inc()
    counter.labels(method=DraftMethod.MODEL).inc()
    labels = {s.labels["method"] for s in next(iter(counter.collect())).samples}
    assert labels == {"ngram", "model"}


def test_proto_values_map_one_to_one():
    assert {m.proto for m in DraftMethod} == {
        v for v in gateway_pb2.SpeculationMethod.values() if v
    }
    assert {p.proto for p in KPolicy} == {v for v in gateway_pb2.KPolicy.values() if v}
    assert {f.proto for f in Finish} <= set(gateway_pb2.FinishReason.values()) - {0}
    for method in DraftMethod:
        assert DraftMethod.of(method.proto) is method
    for policy in KPolicy:
        assert KPolicy.of(policy.proto) is policy
    with pytest.raises(KeyError):
        DraftMethod.of(gateway_pb2.SPECULATION_METHOD_UNSPECIFIED)


def test_placement_transitions():
    a, b = object(), object()
    p = Placement(a, cached=10)
    p.accepted(7)  # a verdict cut the sequence: the tail is stale
    assert p.cached == 7
    p.accepted(9)  # never more than the cache holds
    assert p.cached == 7
    p.answered(12)
    assert p.cached == 12
    p.missed()
    assert p.cached == 0 and p.replica is a
    p.answered(5)
    copy = p.copy()
    assert p.moved(b) is True and (p.replica, p.cached) == (b, 0)  # the cache left behind
    assert (copy.replica, copy.cached) == (a, 5)  # a copy does not move with it
    assert p.moved(None) is False and p.replica is None
    with pytest.raises(AttributeError):
        p.cached = 3  # only the transitions write it
