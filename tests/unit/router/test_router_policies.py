"""round_robin, least_loaded and session policies: exact choices."""

from __future__ import annotations

import typing

import pytest

from baton.config.router import RouterConfig
from baton.contract import Role, WorkerLoad, WorkerView
from baton.errors import ConfigError
from router.policies import POLICIES, RouteRequest, make_policy


def view(wid, role=Role.PREFILL, running=0, waiting=0, free=0, inflight=0, tpb=16):
    load = WorkerLoad(running=running, waiting=waiting, free_blocks=free)
    return WorkerView(wid, role, f"{wid}:1", tpb, load, inflight)


def ids(choice):
    return choice.prefill.worker_id, choice.decode.worker_id


REQ = RouteRequest("r", (1, 2, 3))


def test_every_configurable_policy_is_in_the_dict():
    names = typing.get_args(typing.get_type_hints(RouterConfig)["policy"])
    assert set(names) == set(POLICIES)
    for name in names:
        assert type(make_policy(RouterConfig(policy=name))) is POLICIES[name]


def test_unknown_policy_names_the_choices():
    with pytest.raises(ConfigError, match="'random' is unknown.*least_loaded"):
        make_policy(RouterConfig(policy="random"))


def test_round_robin_cycles_each_role_in_id_order():
    policy = make_policy(RouterConfig(policy="round_robin"))
    pre = [view("p0"), view("p1"), view("p2")]
    dec = [view("d0", Role.DECODE), view("d1", Role.DECODE)]
    got = [ids(policy.choose(REQ, pre, dec)) for _ in range(4)]
    assert got == [("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1")]


def test_least_loaded_counts_reported_and_routed_requests():
    policy = make_policy(RouterConfig(policy="least_loaded"))
    pre = [view("p0", running=2), view("p1", running=1, waiting=2), view("p2", inflight=1)]
    dec = [view("d0", Role.DECODE, inflight=3), view("d1", Role.DECODE, running=2)]
    assert ids(policy.choose(REQ, pre, dec)) == ("p2", "d1")


def test_least_loaded_ties_go_to_more_free_blocks_then_lowest_id():
    policy = make_policy(RouterConfig(policy="least_loaded"))
    pre = [view("p0", free=10), view("p1", free=30), view("p2", free=30)]
    dec = [view("d1", Role.DECODE), view("d0", Role.DECODE)]
    assert ids(policy.choose(REQ, pre, dec)) == ("p1", "d0")


def test_session_sticks_while_its_workers_live():
    policy = make_policy(RouterConfig(policy="session"))
    pre = [view("p0"), view("p1", running=5)]
    dec = [view("d0", Role.DECODE, running=5), view("d1", Role.DECODE)]
    s1 = RouteRequest("r1", (1,), session_id="chat")
    assert ids(policy.choose(s1, pre, dec)) == ("p0", "d1")
    busier = [view("p0", running=9), view("p1")]
    assert ids(policy.choose(s1, busier, dec)) == ("p0", "d1")
    assert ids(policy.choose(RouteRequest("r2", (1,)), busier, dec)) == ("p1", "d1")


def test_session_moves_when_its_worker_is_gone_and_stays_moved():
    policy = make_policy(RouterConfig(policy="session"))
    dec = [view("d0", Role.DECODE)]
    s = RouteRequest("r", (1,), session_id="s")
    assert ids(policy.choose(s, [view("p0"), view("p1", running=1)], dec)) == ("p0", "d0")
    assert ids(policy.choose(s, [view("p1", running=1), view("p2", running=3)], dec)) == (
        "p1",
        "d0",
    )
    assert ids(policy.choose(s, [view("p0"), view("p1", running=1)], dec)) == ("p1", "d0")


def test_session_table_is_lru_bounded():
    policy = make_policy(RouterConfig(policy="session", session_max_entries=2))
    pre, dec = [view("p0"), view("p1")], [view("d0", Role.DECODE)]
    policy.choose(RouteRequest("a", (1,), session_id="A"), pre, dec)
    policy.choose(RouteRequest("b", (1,), session_id="B"), pre, dec)
    policy.choose(RouteRequest("a", (1,), session_id="A"), pre, dec)
    policy.choose(RouteRequest("c", (1,), session_id="C"), pre, dec)
    assert len(policy) == 2
    assert policy.sessions() == ["A", "C"]
