"""The statistics of scripts/runlib.py against hand computations on tiny arrays: the interquartile mean, the
probability of improvement and percentile bootstrap confidence intervals."""

from __future__ import annotations

import itertools
import sys
import warnings
from collections import Counter

import numpy as np
import pytest
from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from runlib import (  # noqa: E402
    bootstrap_ci,
    bootstrap_draws,
    bootstrap_mean_ci_per_row,
    finite_scores,
    interquartile_mean,
    percentile_interval,
    probability_of_improvement,
)


@pytest.mark.parametrize(
    "scores, expected",
    [
        ([7.0], 7.0),  # n = 1-3: int(0.25 n) = 0, nothing cut, the plain mean
        ([1, 2, 6], 3.0),
        ([1, 2, 3, 4], 2.5),  # n = 4: one cut from each end, mean of 2 and 3
        ([4, 1, 3, 2], 2.5),  # order does not matter
        ([1, 2, 3, 4, 5], 3.0),  # n = 5: one cut from each end, mean of 2, 3, 4
        ([100, 1, 2, 3, 4, 5, -50], 3.0),  # n = 7: still one from each end, mean of 1..5
        ([1, 2, 3, 4, 5, 6, 7, 100], 4.5),  # n = 8: two from each end, mean of 3..6
    ],
)
def test_interquartile_mean_by_hand(scores, expected):
    assert interquartile_mean(np.array(scores, dtype=float)) == pytest.approx(expected)


def test_interquartile_mean_is_scipys_trim_mean_along_an_axis():
    from scipy.stats import trim_mean

    rng = np.random.default_rng(0)
    for n in range(1, 13):
        scores = rng.normal(size=(3, n))
        np.testing.assert_allclose(interquartile_mean(scores), trim_mean(scores, 0.25, axis=1))
        np.testing.assert_allclose(interquartile_mean(scores.T, axis=0), trim_mean(scores, 0.25, axis=1))


def test_probability_of_improvement_by_hand():
    # Pairs (x, y) of [3, 5] x [1, 3, 4]: 3>1: 1, 3=3: 0.5, 3<4: 0, 5 beats all three: 3; 4.5 / 6.
    assert probability_of_improvement([3, 5], [1, 3, 4]) == pytest.approx(0.75)
    assert probability_of_improvement([1, 3, 4], [3, 5]) == pytest.approx(0.25)  # P(X > Y) + P(Y > X) = 1
    assert probability_of_improvement([2, 2], [2, 2, 2]) == 0.5
    assert probability_of_improvement([9], [1, 2]) == 1.0
    # Leading axes broadcast: one value per bootstrap draw.
    np.testing.assert_allclose(probability_of_improvement([[3, 5], [0, 0]], [[1, 3, 4], [1, 3, 4]]), [0.75, 0.0])


def test_percentile_interval_by_hand():
    """All 4 resamples of [0, 3] (n^n = 4, equally likely) have means 0, 1.5, 1.5, 3. numpy's
    linear interpolation: the 2.5th percentile sits at index 0.025 * 3 = 0.075, between 0 and 1.5,
    so 0.075 * 1.5 = 0.1125; the 97.5th at index 2.925: 1.5 + 0.925 * 1.5 = 2.8875."""
    means = [np.mean(resample) for resample in itertools.product([0.0, 3.0], repeat=2)]
    assert sorted(means) == [0.0, 1.5, 1.5, 3.0]
    low, high = percentile_interval(np.array(means))
    assert (low, high) == (pytest.approx(0.1125), pytest.approx(2.8875))
    low, high = percentile_interval(np.array([np.nan, *means]))  # NaN draws are left out
    assert (low, high) == (pytest.approx(0.1125), pytest.approx(2.8875))
    lows, highs = percentile_interval(np.array([means, [1.0, 1.0, 1.0, 1.0]]), axis=1)
    np.testing.assert_allclose(lows, [0.1125, 1.0])
    np.testing.assert_allclose(highs, [2.8875, 1.0])


def test_bootstrap_of_the_iqm_matches_the_exact_enumeration_of_all_resamples():
    """Scores [1, 2, 6], n = 3: the IQM is the mean; all 27 resamples are equally likely. By hand,
    their sums and counts: 3 (1), 4 (3), 5 (3), 6 (1), 8 (3), 9 (6), 10 (3), 13 (3), 14 (3),
    18 (1). Cumulative: 1, 4, 7, 8, 11, 17, 20, 23, 26, 27 of 27. So the 2.5% quantile is the
    lowest mean, 3/3 (1/27 = 3.7% > 2.5%), the 97.5% quantile the highest, 18/3 (26/27 = 96.3%
    < 97.5%); the 80% interval is [4/3, 14/3] (10%: 1/27 < 0.1 <= 4/27; 90%: 23/27 < 0.9 <= 26/27)."""
    scores = np.array([1.0, 2.0, 6.0])
    exact = Counter(round(3 * float(np.mean(resample))) for resample in itertools.product(scores, repeat=3))
    assert exact == {3: 1, 4: 3, 5: 3, 6: 1, 8: 3, 9: 6, 10: 3, 13: 3, 14: 3, 18: 1}

    draws = bootstrap_draws(interquartile_mean, scores, num_resamples=20_000)
    frequencies = Counter(np.round(3 * draws).astype(int).tolist())
    for total, count in exact.items():
        assert frequencies[total] / draws.size == pytest.approx(count / 27, abs=0.01)

    assert bootstrap_ci(interquartile_mean, scores, num_resamples=20_000) == (pytest.approx(1.0), pytest.approx(6.0))
    assert bootstrap_ci(interquartile_mean, scores, num_resamples=20_000, confidence=0.8) == (
        pytest.approx(4 / 3), pytest.approx(14 / 3))


def test_bootstrap_of_an_iqm_that_cuts_matches_the_exact_enumeration():
    """n = 4 cuts one score from each end: the 256 equally likely resamples of [0, 1, 2, 10]
    (the outlier 10 enters the IQM only when drawn at least twice)."""
    scores = np.array([0.0, 1.0, 2.0, 10.0])
    exact = Counter(float(interquartile_mean(np.array(resample))) for resample in itertools.product(scores, repeat=4))
    draws = bootstrap_draws(interquartile_mean, scores, num_resamples=20_000)
    frequencies = Counter(draws.tolist())
    assert set(frequencies) <= set(exact)
    for value, count in exact.items():
        assert frequencies[value] / draws.size == pytest.approx(count / 256, abs=0.01)


def test_bootstrap_is_reproducible_and_resamples_two_samples_independently():
    scores, baseline = np.array([1.0, 5.0, 2.0, 8.0, 3.0]), np.array([2.0, 4.0, 4.0, 1.0, 3.0])
    draws = bootstrap_draws(interquartile_mean, scores)
    np.testing.assert_array_equal(draws, bootstrap_draws(interquartile_mean, scores))  # a fixed seed
    assert not np.array_equal(draws, bootstrap_draws(interquartile_mean, scores, seed=1))
    # Two samples get independent draws: resampling [a, b] against itself is not always a tie.
    draws = bootstrap_draws(probability_of_improvement, scores, scores)
    assert draws.shape == (2000,) and 0.0 < np.mean(draws == 0.5) < 1.0
    low, high = bootstrap_ci(probability_of_improvement, scores, baseline)
    assert 0.0 <= low <= probability_of_improvement(scores, baseline) <= high <= 1.0
    assert bootstrap_ci(interquartile_mean, np.array([])) == (pytest.approx(np.nan, nan_ok=True),) * 2


def test_bootstrap_mean_ci_per_row_by_hand_and_as_a_loop_over_rows():
    """Row [0, 3]: the resample means are 0 (1/4), 1.5 (1/2), 3 (1/4), so the 95% interval is
    [0, 3]. Row [5, NaN] (seed 2 without a finished episode): every draw holding seed 1 averages 5;
    draws of seed 2 alone have no value and are left out: [5, 5]."""
    values = np.array([[0.0, 3.0], [5.0, np.nan]])
    low, high = bootstrap_mean_ci_per_row(values)
    np.testing.assert_allclose(low, [0.0, 5.0])
    np.testing.assert_allclose(high, [3.0, 5.0])

    # The (values @ counts) form equals resampling each row's seeds with the same draws.
    rng = np.random.default_rng(0)
    values = rng.normal(size=(6, 5))
    values[rng.random(values.shape) < 0.3] = np.nan
    values[0] = np.nan
    values[0, 2] = 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # np.nanmean of draws holding no value
        expected = [bootstrap_ci(lambda resampled: np.nanmean(resampled, axis=-1), row) for row in values]
    low, high = bootstrap_mean_ci_per_row(values)
    np.testing.assert_allclose(np.stack([low, high], axis=1), expected)


def test_finite_scores_drop_missing_seeds():
    np.testing.assert_array_equal(finite_scores([1.0, None, np.nan, np.inf, 2.0]), [1.0, 2.0])
