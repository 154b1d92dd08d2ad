"""Statistics over seeds that researchers trust, after Agarwal et al. 2021, "Deep reinforcement
learning at the edge of the statistical precipice" (https://arxiv.org/abs/2108.13264, the rliable
library): the interquartile mean (IQM), percentile bootstrap confidence intervals and the
probability of improvement. Written with numpy; ablate.py and plot.py use them.

Agarwal et al.'s bootstrap is stratified: it resamples runs within each task. A run dir of ours
holds one task (one env), so the strata are a single one and the bootstrap resamples seeds with
replacement. Every function takes a fixed `seed`, so the same scores give the same interval.

Not a script: the tools in this folder import it.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

NUM_RESAMPLES = 2000  # bootstrap draws per interval
CONFIDENCE = 0.95
SEED = 0  # of the resampling RNG: intervals are reproducible


def finite_scores(values) -> np.ndarray:
    """The finite values as a float array: None (a seed without a finished episode), NaN and inf
    left out."""
    values = np.array([np.nan if value is None else value for value in values], dtype=float)
    return values[np.isfinite(values)]


def interquartile_mean(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """The mean of the middle 50% of the scores along `axis`, as scipy.stats.trim_mean(scores, 0.25)
    and rliable compute it: sort, cut int(0.25 * n) scores from each end, average the rest. So
    n = 1-3 cuts none (the plain mean), 4-7 cut one from each end (n = 5 averages the middle three),
    8-11 cut two, and so on."""
    scores = np.sort(np.asarray(scores, dtype=float), axis=axis)
    num_cut = int(0.25 * scores.shape[axis])
    kept = np.take(scores, np.arange(num_cut, scores.shape[axis] - num_cut), axis=axis)
    return kept.mean(axis=axis)


def probability_of_improvement(scores: np.ndarray, baseline_scores: np.ndarray) -> np.ndarray:
    """P(X > Y): the chance that a random seed of `scores` beats a random seed of the baseline, ties
    counting half. The Mann-Whitney U statistic divided by n * m: the mean over all pairs (x_i, y_j)
    of [x_i > y_j] + 0.5 [x_i == y_j]. Scores are along the last axis; leading axes broadcast
    (e.g. bootstrap draws)."""
    x = np.asarray(scores, dtype=float)[..., :, None]  # (..., n, 1)
    y = np.asarray(baseline_scores, dtype=float)[..., None, :]  # (..., 1, m)
    return ((x > y) + 0.5 * (x == y)).mean(axis=(-2, -1))


def resample_indices(num_seeds: int, num_resamples: int = NUM_RESAMPLES, rng: np.random.Generator | None = None) -> np.ndarray:
    """(num_resamples, num_seeds) seed indices, drawn with replacement: one bootstrap resample per row."""
    rng = np.random.default_rng(SEED) if rng is None else rng
    return rng.integers(0, num_seeds, size=(num_resamples, num_seeds))


def percentile_interval(draws: np.ndarray, confidence: float = CONFIDENCE, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """The percentile interval of bootstrap draws: their (1 - c) / 2 and (1 + c) / 2 quantiles along
    `axis` (numpy's linear interpolation), NaN draws left out."""
    tail = 100 * (1 - confidence) / 2
    draws = np.moveaxis(np.asarray(draws, dtype=float), axis, -1)
    flat = draws.reshape(-1, draws.shape[-1])
    bounds = np.percentile(flat, [tail, 100 - tail], axis=-1)  # (2, rows)
    with_nan = np.isnan(flat).any(axis=-1)
    if with_nan.any():  # np.nanpercentile loops over rows in Python: only where needed
        bounds[:, with_nan] = np.nanpercentile(flat[with_nan], [tail, 100 - tail], axis=-1)
    low, high = bounds.reshape(2, *draws.shape[:-1])
    return low, high


def bootstrap_draws(
    statistic: Callable[..., np.ndarray],
    *samples: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    seed: int = SEED,
) -> np.ndarray:
    """(num_resamples,) values of statistic(*resampled), each sample (1-D, over seeds) resampled
    with replacement, independently of the others. The statistic gets arrays of shape
    (num_resamples, len(sample)) and reduces the last axis, as interquartile_mean and
    probability_of_improvement do."""
    rng = np.random.default_rng(seed)
    resampled = [np.asarray(sample, dtype=float)[resample_indices(len(sample), num_resamples, rng)] for sample in samples]
    return statistic(*resampled)


def bootstrap_ci(
    statistic: Callable[..., np.ndarray],
    *samples: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[float, float]:
    """The percentile bootstrap confidence interval (low, high) of statistic(*samples), e.g.
    bootstrap_ci(interquartile_mean, scores) or
    bootstrap_ci(probability_of_improvement, scores, baseline_scores). NaN when a sample is empty."""
    if any(len(sample) == 0 for sample in samples):
        return np.nan, np.nan
    low, high = percentile_interval(bootstrap_draws(statistic, *samples, num_resamples=num_resamples, seed=seed), confidence)
    return float(low), float(high)


def bootstrap_mean_ci_per_row(
    values: np.ndarray,
    num_resamples: int = NUM_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = SEED,
) -> tuple[np.ndarray, np.ndarray]:
    """values (C, S) with NaN where a seed has no value (a cycle without a finished episode): per
    row, the percentile bootstrap CI of the mean over seeds. Each draw resamples the seed axis once
    for all rows; a row's draw averages the drawn seeds that have a value (as np.nanmean does), and
    draws that hold none are left out. Computed as (values @ counts) / (present @ counts), with
    counts (S, num_resamples) how often each seed was drawn: no (C, num_resamples, S) array."""
    values = np.asarray(values, dtype=float)
    num_seeds = values.shape[1]
    indices = resample_indices(num_seeds, num_resamples, np.random.default_rng(seed))
    counts = np.zeros((num_resamples, num_seeds))
    np.add.at(counts, (np.arange(num_resamples)[:, None], indices), 1.0)
    present = ~np.isnan(values)
    sums = np.where(present, values, 0.0) @ counts.T  # (C, num_resamples)
    num_drawn = present.astype(float) @ counts.T
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(num_drawn > 0, sums / num_drawn, np.nan)
    return percentile_interval(means, confidence, axis=1)
