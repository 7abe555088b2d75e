"""The multi-host harness says in one line why it cannot run, instead of failing."""

from __future__ import annotations

import subprocess

import pytest

from bench.harness import netns


def test_not_root_and_no_ip_are_named(monkeypatch):
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert netns.unavailable() == "network namespaces need root (run the multi-host tests as root)"
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    assert "the `ip` command (iproute2) is missing" in netns.unavailable()
    monkeypatch.setattr(netns.shutil, "which", lambda name: "/usr/sbin/ip")
    assert netns.unavailable() is None


def test_operation_not_permitted_is_unavailable_in_one_line(monkeypatch):
    def refused(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 2, "", "RTNETLINK answers: Operation not "
                                                       "permitted\n\n")

    monkeypatch.setattr(netns.subprocess, "run", refused)
    with pytest.raises(netns.Unavailable) as e:
        netns._ip("link", "add", "bt000000br", "type", "bridge")
    assert str(e.value) == ("`ip link add bt000000br type bridge`: RTNETLINK answers: Operation "
                            "not permitted (no CAP_NET_ADMIN here)")


def test_other_ip_failures_are_errors_not_skips(monkeypatch):
    monkeypatch.setattr(netns.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 2, "", "Error: argument \"x\" is wrong\n"))
    with pytest.raises(RuntimeError, match=r'`ip addr add x` failed: Error: argument "x"'):
        netns._ip("addr", "add", "x")
