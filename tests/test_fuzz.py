"""Protocol fuzzing of both of the daemon's sockets, property-based (hypothesis, derandomized in CI).

The messages come from modelcache.bench.fuzz_messages, driven by the Random hypothesis hands in
(so a failing batch shrinks); `modelcache bench fuzz --messages 40000` is the long run of the same.
Property, after every batch: the daemon lives; every reply decodes, and is an error (never an
"internal" one) or the reply its request kind is answered with; a real client's serve-mode
request still gets plain ORT's answer quickly; the daemon's RSS stays bounded.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from modelcache.bench.fuzz import (Fuzzer, make_probe, named_cases, peak_rss_bytes, reset_peak_rss, rss_bytes,
                                   warm_up)
from conftest import DaemonProcess, stop_cleanly

MiB = 1 << 20
BATCHES = settings(derandomize=True, max_examples=25, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, zoo_file):
    """One daemon for the module (hypothesis runs many batches against it), with "cnn" for the probe and
    "fuzz" for the fuzz to name; yields a Fuzzer in strict mode (the first broken property raises)."""
    root = tmp_path_factory.mktemp("fuzz")
    d = DaemonProcess(root, {"MODELCACHE_WORKERS": "1", "MODELCACHE_LOG_LEVEL": "warning",
                             "PYTHONFAULTHANDLER": "1"}).start()
    src = zoo_file("tiny-cnn")
    client = d.client(timeout_s=10)
    try:
        client.add(src, "cnn")
        client.add(src, "fuzz")
        warm_up(client, "fuzz", src)
        fz = Fuzzer(d.socket, d.pid, make_probe(client, "cnn", src), hang_s=10)
        fz.probe()
        fz.baseline = rss_bytes(d.pid)
        yield fz
        fz.close()
    finally:
        client.close()
        stop_cleanly(d)


@pytest.mark.parametrize("batch", ["zmq_batch", "lane_batch"])   # the ZeroMQ socket, the serve lane
@BATCHES
@given(rng=st.randoms(use_true_random=False))
def test_fuzz_never_crashes_hangs_or_answers_wrongly(fuzzed, rng, batch):
    getattr(fuzzed, batch)(rng, 40)
    fuzzed.probe()
    assert rss_bytes(fuzzed.pid) - fuzzed.baseline < 64 * MiB


def test_the_named_cases_cost_at_most_twice_the_largest_message(fuzzed):
    """hello with pid 2**31, infer of a FIFO, a 50 MB array of zeros (both sockets), 10**7 stages."""
    before = rss_bytes(fuzzed.pid)
    reset_peak_rss(fuzzed.pid)
    named_cases(fuzzed, "fuzz")
    fuzzed.probe()
    peak = peak_rss_bytes(fuzzed.pid) - before
    c = fuzzed.counts
    assert c["error:input"] >= 2 and c["error:pack"] >= 1, c     # the FIFO (twice), the stages
    assert fuzzed.largest_bytes >= 50_000_000
    assert peak <= 2 * fuzzed.largest_bytes + MiB, f"peak +{peak / MiB:.0f} MiB"
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"modelcache-io.fuzz-{os.getpid()}")]


def test_nothing_went_wrong_and_memory_came_back(fuzzed):
    """Last in the module: the totals of every batch above, and RSS back near where it started."""
    assert fuzzed.counts["sent_zmq"] >= 25 * 40 and fuzzed.counts["sent_lane"] >= 25 * 40
    assert fuzzed.failures == [] and fuzzed.counts["hangs"] == 0 and fuzzed.counts["crashes"] == 0
    assert fuzzed.counts["replies"] > 1000
    print(f"fuzz totals: {dict(fuzzed.counts)}; RSS {(rss_bytes(fuzzed.pid) - fuzzed.baseline) / MiB:+.1f} MiB")
    assert rss_bytes(fuzzed.pid) - fuzzed.baseline < 32 * MiB
