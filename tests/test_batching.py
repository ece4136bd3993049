"""Batching decisions with a fake clock and hand-made predictions: exact outcomes expected."""

import numpy as np
import pytest

from modelcache.calibration import fit_g, g, n_opt
from modelcache.executor.batching import BatchWindow, Dynamic, LayerToLayer, Pending, Serial


def q(*specs):
    """Pending requests from (id, samples, arrival[, deadline])."""
    return [Pending(*s) for s in specs]


def test_serial_takes_one():
    assert Serial().decide(0.0, q((1, 1, 0.0), (2, 1, 0.0))).take == [1]
    assert Serial().decide(0.0, []).take == []


def test_batch_window_waits_for_m_or_the_window():
    bw = BatchWindow(m=3, window_s=0.05)
    d = bw.decide(0.01, q((1, 1, 0.0), (2, 1, 0.005)))
    assert d.take == [] and d.wait_until == pytest.approx(0.05)
    assert bw.decide(0.05, q((1, 1, 0.0), (2, 1, 0.005))).take == [1, 2]              # window over
    assert bw.decide(0.01, q((1, 1, 0.0), (2, 1, 0.0), (3, 1, 0.0), (4, 1, 0.0))).take == [1, 2, 3]


def test_dynamic_batches_up_to_max_and_keeps_multi_sample_requests_whole():
    dyn = Dynamic(max_batch=4, max_queue_delay_s=0.01)
    # 1 + 3 + 2 samples queued: the 2-sample request would overflow 4, so it waits for the next batch.
    assert dyn.decide(0.0, q((1, 1, 0.0), (2, 3, 0.0), (3, 2, 0.0))).take == [1, 2]
    d = dyn.decide(0.002, q((1, 1, 0.0)))
    assert d.take == [] and d.wait_until == pytest.approx(0.01)
    assert dyn.decide(0.01, q((1, 1, 0.0))).take == [1]
    assert Dynamic(max_batch=4).decide(0.0, q((9, 6, 0.0))).take == [9]    # bigger than a batch: alone, whole


# Two stages; stage time = 10 ms + 2 ms per sample (batching amortizes the fixed part).
def predict(stage, batch):
    return 0.010 + 0.002 * batch


def test_layer_to_layer_joins_at_stage_k_when_deadlines_hold():
    l2l = LayerToLayer(predict, stages=2, max_batch=8)
    batch = q((1, 2, 0.0, 0.100))                 # 2 samples, started, now at boundary 1, deadline 100 ms
    newcomer = q((2, 1, 0.020, 0.120))
    # catch up stage 0 alone: 12 ms; merged stage 1 with 3 samples: 16 ms -> finish 0.020 + 0.028 = 0.048
    assert l2l.finish_if_joined(0.020, 1, 2, 1) == pytest.approx(0.048)
    assert l2l.admit(0.020, 1, batch, newcomer) == [2]


def test_layer_to_layer_refuses_a_join_that_would_break_t_opt():
    l2l = LayerToLayer(predict, stages=2, max_batch=8)
    batch = q((1, 2, 0.0, 0.040))                 # tight deadline: alone it ends at 0.020 + 0.014 = 0.034
    assert l2l.admit(0.020, 1, batch, q((2, 1, 0.020, 0.200))) == []   # joined: 0.048 > 0.040
    # A later request in the queue is not considered past a refusal: FIFO order is kept.
    assert l2l.admit(0.020, 1, q((1, 2, 0.0, 0.100)), q((2, 1, 0.02, 0.03), (3, 1, 0.02, 1.0))) == []


def test_layer_to_layer_keeps_multi_sample_requests_whole_and_respects_max_batch():
    l2l = LayerToLayer(predict, stages=2, max_batch=4)
    batch = q((1, 2, 0.0, 1.0))
    assert l2l.admit(0.0, 1, batch, q((2, 3, 0.0, 1.0))) == []          # 2 + 3 > 4: not split, not joined
    assert l2l.admit(0.0, 1, batch, q((2, 2, 0.0, 1.0), (3, 1, 0.0, 1.0))) == [2]


def test_fit_g_recovers_the_curve_and_n_opt_follows_t_opt():
    truth = (0.010, 0.002, 6.0, 2.0)
    bs = np.array([1, 2, 4, 8, 16, 32])
    z = fit_g(bs, g(bs, *truth))
    np.testing.assert_allclose(g(bs, *z), g(bs, *truth), rtol=0.05)
    assert n_opt(z, t_opt=float(g(8, *truth)) * 1.001) == pytest.approx(8, abs=1)
    assert n_opt(z, t_opt=1e-9) == 1


def test_layer_to_layer_starts_a_batch_at_once_with_what_is_queued():
    l2l = LayerToLayer(predict, stages=2, max_batch=3)
    assert l2l.decide(0.0, q((1, 1, 0.0), (2, 1, 0.0), (3, 2, 0.0))).take == [1, 2]
    assert l2l.decide(0.0, []).take == []


def test_profile_predicts_measured_sizes_exactly_and_others_from_g():
    from modelcache.calibration import calibration_profile, profile_predict
    truth = (0.010, 0.002, 6.0, 2.0)
    stage_s = {b: [0.25 * float(g(b, *truth)), 0.75 * float(g(b, *truth))] for b in (1, 2, 4, 8, 16)}
    p = calibration_profile("cpu2", stage_s, t_opt_s=2 * float(g(8, *truth)) * 1.001)   # N_opt: 2 batches fit
    assert profile_predict(p, 1, 4) == pytest.approx(stage_s[4][1])
    assert profile_predict(p, 0, 6) == pytest.approx(0.25 * float(g(6, *truth)), rel=0.05)
    assert p["n_opt"] == pytest.approx(8, abs=1)
    assert profile_predict(None, 0, 1) is None and profile_predict(p, 2, 1) is None


def test_a_calibration_no_curve_fits_is_a_flat_profile_not_an_error():
    """Noise on a busy machine (batch 2 measured faster than batch 1 in all): no g(b) fits, and `calibrate`
    raised ValueError (an internal error); the profile then says batching gains nothing: N_opt 1."""
    from modelcache.calibration import calibration_profile, check_profile
    with pytest.raises(ValueError):
        fit_g([1, 2], [0.010, 0.001])
    p = calibration_profile("cpu1", {1: [0.004, 0.006], 2: [0.0005, 0.0005]}, t_opt_s=1.0)
    check_profile(p, stages=2)
    assert p["n_opt"] == 1 and p["g"][0] == p["g"][1] > 0


def test_layer_to_layer_refuses_a_join_that_saves_no_work_until_enough_have_queued():
    # Later stages cost 10 ms per sample up to 2 samples, then 4 ms more per sample: no gain until 3.
    def flat_then_cheap(stage, b):
        return 0.010 * min(b, 2) + 0.004 * max(0, b - 2)
    l2l = LayerToLayer(flat_then_cheap, stages=2, max_batch=8)
    batch = q((1, 1, 0.0, 1.0))
    assert l2l.admit(0.0, 1, batch, q((2, 1, 0.0, 1.0))) == []                    # 1 + 1: nothing saved
    assert l2l.admit(0.0, 1, batch, q((2, 1, 0.0, 1.0), (3, 1, 0.0, 1.0))) == [2, 3]   # 1 + 2 saves


def test_layer_to_layer_counts_the_overhead_outside_the_stages_against_t_opt():
    batch = q((1, 2, 0.0, 0.050))                 # joined: 0.020 + 0.028 = 0.048, just within 50 ms
    assert LayerToLayer(predict, stages=2).admit(0.020, 1, batch, q((2, 1, 0.02, 1.0))) == [2]
    assert LayerToLayer(predict, stages=2, overhead_s=0.005).admit(0.020, 1, batch, q((2, 1, 0.02, 1.0))) == []


def test_n_opt_is_one_where_batching_gains_nothing():
    flat = (0.060, 0.060, 4.0, 2.0)           # 60 ms a sample at every batch size
    assert n_opt(flat, t_opt=10.0) == 1
