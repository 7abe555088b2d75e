"""Snapshot points of a prompt length (DOMAIN.md section 2 vectors and edge cases)."""

from __future__ import annotations

import pytest

from baton.cache.policy import snapshot_points
from baton.config.cache import MambaStateConfig


def pol(interval=0, start=(), end=(0,), **kw) -> MambaStateConfig:
    return MambaStateConfig(
        periodic_snapshot_interval=interval,
        additional_snapshot_offsets_from_start=start,
        additional_snapshot_offsets_from_end=end,
        **kw,
    )


DOMAIN = pol(64, (128, 999), (0, 22, 999))


@pytest.mark.parametrize(
    "length, want", [(150, [64, 128, 150]), (128, [64, 106, 128]), (32, [10, 32])]
)
def test_domain_vectors(length, want):
    assert snapshot_points(DOMAIN, length) == want


def test_domain_vector_without_periodic():
    assert snapshot_points(pol(0, (128,), (0, 13)), 150) == [128, 137, 150]


@pytest.mark.parametrize(
    "policy, length, want",
    [
        (pol(0, (128,), (200,)), 50, []),  # L below every offset
        (pol(0, (128,), (0, 200)), 50, [50]),
        (pol(0, (50,), (0,)), 50, [50]),  # L equal to a from_start offset: one point
        (pol(0, (8, 8, 20), (0, 0, 12)), 20, [8, 20]),  # duplicates collapse
        (pol(0, (), (22,)), 22, []),  # L - o == 0 is not a point
        (pol(0, (), (21,)), 22, [1]),
        (pol(16, (), ()), 48, [16, 32, 48]),  # periodic includes L when aligned
        (pol(16, (), ()), 47, [16, 32]),
        (pol(16, (), ()), 15, []),
        (pol(0, (), (0,)), 1, [1]),
        (pol(16, (3,), (0, 1)), 0, []),
        (pol(0, (5,), (0, 7), per_conversation=True), 30, [30]),  # turn boundary only
    ],
)
def test_edge_cases(policy, length, want):
    assert snapshot_points(policy, length) == want


def test_points_are_sorted_unique_and_in_range():
    p = pol(4, (3, 9, 40), (0, 1, 5, 9))
    for length in range(0, 45):
        pts = snapshot_points(p, length)
        assert pts == sorted(set(pts))
        assert all(0 < x <= length for x in pts)
