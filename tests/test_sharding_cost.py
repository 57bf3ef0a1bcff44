"""The ZeRO-1 sharding cost formula (cost_models/sharding.py): even shards reduce to data parallelism."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, strategies as st

from hetpipe.cost_models.sharding import shard_fractions, shard_sync_s, sharded_memory_bytes
from hetpipe.errors import ConfigError


@given(st.lists(st.floats(min_value=0.0, max_value=1e12), min_size=1, max_size=8).filter(lambda v: sum(v) > 1.0))
def test_shares_sum_to_one_and_follow_free_memory(free):
    f = shard_fractions(free)
    assert math.isclose(sum(f), 1.0, rel_tol=1e-9)
    assert all(math.isclose(share * sum(free), b, rel_tol=1e-9, abs_tol=1e-6) for share, b in zip(f, free))


@pytest.mark.parametrize("replicas", [2, 3, 4, 8])
def test_even_shards_cost_the_ring_all_reduce_plus_an_all_gather(replicas):
    f = shard_fractions([1.0] * replicas)
    got = shard_sync_s(f, grad_bytes=5e9, weight_bytes=5e9, bandwidth_bytes_s=1e9, latency_s=0.0)
    # what runs on gloo: the all-reduce (cost_formulas.md s.3.4), then each holder's 1/R all-gathered
    assert math.isclose(got, 2 * (replicas - 1) / replicas * 5e9 / 1e9 + (replicas - 1) / replicas * 5e9 / 1e9)


@given(st.lists(st.floats(min_value=0.01, max_value=1.0), min_size=2, max_size=4), st.integers(1000, 10**6))
def test_the_all_gather_term_is_the_padded_slice_the_runtime_sends(free, numel):
    from hetpipe.runtime.replicas.shard import shard_bounds

    f = shard_fractions(free)
    bounds = shard_bounds(numel, f)
    longest = max(b - a for a, b in bounds)  # every holder sends its slice padded to the largest
    elem, bw, lat, r = 4, 1e9, 1e-4, len(f)
    got = shard_sync_s(f, grad_bytes=numel * elem, weight_bytes=numel * elem, bandwidth_bytes_s=bw, latency_s=lat)
    all_reduce = 2 * (r - 1) * lat + 2 * (r - 1) / r * numel * elem / bw
    wire = all_reduce + (r - 1) * (longest * elem / bw + lat)
    assert math.isclose(got, wire, rel_tol=0, abs_tol=(r - 1) * 2 * elem / bw)  # slices round to whole elements


def test_memory_adds_each_share_and_no_free_memory_is_refused():
    assert sharded_memory_bytes([1.0, 2.0], (0.25, 0.75), optimizer_bytes=8.0) == (3.0, 8.0)
    assert shard_sync_s((1.0,), grad_bytes=1.0, weight_bytes=1.0, bandwidth_bytes_s=1.0, latency_s=1.0) == 0.0
    with pytest.raises(ConfigError, match="no replica has free memory"):
        shard_fractions([0.0, -5.0])
