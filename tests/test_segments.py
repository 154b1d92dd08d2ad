"""The train loop as the host drives it (ppo_support/segments.py): one compiled program called for
a runtime number of cycles, again and again. Cut into any segments, a run trains bit for bit as in
one call; the host loop covers every cycle once, ends a segment on every cycle it must see, runs
after_segment in order, and stops every later segment once any process asks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppo_lstm_impala
import ppo_mlp
from ppo_support import devices, envs, segments, sessions

TINY = {  # 11 cycles of 2 seeds, with what the states carry besides the params: evaluation, statistics, an LSTM
    "ppo_mlp": dict(env_id="probe_envs:ActionDependentReward", num_parallel_envs=4, num_env_steps_per_cycle=16,
                    num_total_env_steps=11 * 64, num_seeds=2, norm_obs=True, norm_reward=True, eval_every_cycles=3,
                    eval_episodes=2),
    "ppo_lstm_impala": dict(env_id="probe_envs:Memory", impala_channels=(4,), torso_size=16, lstm_size=8, num_parallel_envs=4,
                            num_env_steps_per_cycle=12, num_minibatches_per_epoch=2, num_epochs_per_cycle=2,
                            num_total_env_steps=11 * 48, num_seeds=2, prev_action_reward=True, eval_every_cycles=3,
                            eval_episodes=2),
}
MODULES = {"ppo_mlp": ppo_mlp, "ppo_lstm_impala": ppo_lstm_impala}


def no_reports() -> np.ndarray:
    return segments.host_reports(segments.HostReport(0.0, 0.0), None)


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_run_cut_into_any_segments_trains_bit_for_bit_as_in_one_call(name):
    """The learning rate, the keys, the NaN guard and the evaluation come from the states alone:
    segments of 1, 4, 5 and 1 cycles through the run's program give the params, every state leaf
    and every metric of one call of all 11 cycles, byte for byte; NaN rows after a segment's last."""
    module = MODULES[name]
    args = module.Args(**TINY[name])
    env, env_params = envs.make_env(args.env_id)
    init, train = module.make_train(args, env, env_params)
    states = jax.tree.map(sessions.strongly_typed, devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)]))
    program = segments.make_program(train, args.num_cycles, None)

    whole, whole_metrics, _ = program(states, np.int32(args.num_cycles), no_reports())
    cut, rows = states, []
    for length in (1, 4, 5, 1):
        cut, metrics, agreed = program(cut, np.int32(length), no_reports())
        assert np.all(np.isnan(np.asarray(metrics["charts/learning_rate"])[length:]))
        rows.append({key: np.asarray(value)[:length] for key, value in metrics.items()})
        assert np.asarray(agreed).tolist() == [0.0, 0.0]
    assert int(cut.cycle[0]) == args.num_cycles
    for whole_leaf, cut_leaf in zip(jax.tree.leaves(whole), jax.tree.leaves(cut), strict=True):
        np.testing.assert_array_equal(jax.random.key_data(whole_leaf) if jnp.issubdtype(whole_leaf.dtype, jax.dtypes.prng_key)
                                      else whole_leaf, jax.random.key_data(cut_leaf) if jnp.issubdtype(cut_leaf.dtype, jax.dtypes.prng_key)
                                      else cut_leaf)
    for key, values in whole_metrics.items():
        np.testing.assert_array_equal(np.asarray(values), np.concatenate([row[key] for row in rows]), err_msg=key)
    assert np.isfinite(np.asarray(whole_metrics["eval/episodic_return"])[[2, 5, 8, 10]]).all()

    # A stop requested by any process: no cycle runs, and every process reads the largest request.
    reports = np.asarray([[0.0, 0.5], [15.0, 0.25]], np.float32)
    stopped, metrics, agreed = program(cut, np.int32(3), reports)
    assert int(stopped.cycle[0]) == args.num_cycles and np.asarray(agreed).tolist() == [15.0, 0.5]
    assert np.all(np.isnan(np.asarray(metrics["charts/learning_rate"])))


class FakeProgram:
    """A program of a counter: states (runs,) int32 count the cycles run, a metric per cycle holds
    its cycle number; it records each call's cycles and report."""

    def __init__(self, max_cycles: int):
        self.max_cycles, self.calls = max_cycles, []

    def __call__(self, states, num_cycles, reports):
        agreed = np.asarray(reports).max(axis=0)
        ran = 0 if agreed[0] > 0 else int(num_cycles)
        assert 0 < int(num_cycles) <= self.max_cycles
        self.calls.append((int(states.cycle[0]), ran, agreed.tolist()))
        rows = np.full((self.max_cycles, 1), np.nan, np.float32)
        rows[:ran, 0] = np.arange(int(states.cycle[0]) + 1, int(states.cycle[0]) + ran + 1)
        return Counter(states.cycle + ran), {"cycle": jnp.asarray(rows)}, jnp.asarray(agreed)


@dataclasses.dataclass
class Counter:
    cycle: jax.Array


def test_the_host_loop_covers_every_cycle_once_ends_on_every_cycle_it_must_and_stops_on_a_request(monkeypatch):
    monkeypatch.setattr(segments, "SEGMENT_SECONDS", 1e9)  # segments grow to max_cycles, and are cut where they must be
    num_cycles, max_cycles = 50, 4
    program = FakeProgram(max_cycles)
    seen = []
    must_end = lambda cycle: cycle % 7 == 0 or cycle == 20  # noqa: E731
    states, stop = segments.run(program, Counter(jnp.full(1, 3, jnp.int32)), 3, num_cycles, must_end, max_cycles, None,
                                segments.StopRequests(), seen.append)
    assert stop == 0 and int(states.cycle[0]) == num_cycles
    assert [cycle for segment in seen for cycle in segment.metrics["cycle"][:, 0].tolist()] == list(range(4, num_cycles + 1))
    ends = [segment.last_cycle for segment in seen]
    assert all(cycle in ends for cycle in (7, 14, 20, 21, 28, 35, 42, 49, 50))
    assert max(segment.last_cycle - segment.first_cycle for segment in seen) == max_cycles  # they grew
    assert all(segment.first_cycle == previous.last_cycle for previous, segment in zip(seen, seen[1:]))

    # A stop request after the third segment: what was dispatched goes on; the next dispatch and
    # every later one run no cycle, after_segment sees none of them, and run() returns the signal.
    program, seen, requests = FakeProgram(max_cycles), [], segments.StopRequests()

    def after_segment(segment):
        seen.append(segment)
        if len(seen) == 3:
            requests.signal_number = 15

    states, stop = segments.run(program, Counter(jnp.zeros(1, jnp.int32)), 0, num_cycles, must_end, max_cycles, None,
                                requests, after_segment)
    assert stop == 15 and int(states.cycle[0]) == seen[-1].last_cycle < num_cycles
    # The segments dispatched before the request still ran: the one computing and the one queued
    # behind it (the next is dispatched before the host's work on the third).
    assert len(seen) == 5
    first_stopped = next(index for index, (_, ran, _) in enumerate(program.calls) if ran == 0)
    assert all(ran == 0 for _, ran, _ in program.calls[first_stopped:])
    assert [agreed[0] for _, _, agreed in program.calls[first_stopped:]] == [15.0] * (len(program.calls) - first_stopped)


def test_one_process_paces_from_its_own_rate_and_queues_the_next_segment_before_the_host_work(monkeypatch):
    """Once the first segment is read, one process knows the rate: the second already has its full
    length (not 1 cycle, waiting a segment for the agreed rate), and the segment behind it is
    dispatched before after_segment runs, so the device never waits for the host's work."""
    monkeypatch.setattr(segments, "SEGMENT_SECONDS", 1e9)
    program, calls_before_host_work = FakeProgram(8), []
    segments.run(program, Counter(jnp.zeros(1, jnp.int32)), 0, 40, lambda cycle: False, 8, None, segments.StopRequests(),
                 lambda segment: calls_before_host_work.append(len(program.calls)))
    assert [ran for _, ran, _ in program.calls][:4] == [1, 8, 8, 8]
    assert calls_before_host_work[:3] == [3, 4, 5]


def test_the_first_rate_sets_the_next_segment_at_once_and_later_segments_grow_at_most_four_fold(monkeypatch):
    """The first rate was timed on a one-cycle segment with the host's round trip in it, so it can
    only overstate a cycle's time: the next segment takes SEGMENT_SECONDS' worth at once. A later,
    faster rate lengthens segments at most 4-fold at a time; a slower one shortens them at once."""
    monkeypatch.setattr(segments, "SEGMENT_SECONDS", 1.0)
    pace = segments.Pace(max_cycles=4096)
    assert pace.cycles == 1 and pace.segments_ahead() == 0
    pace.record(0.0)  # --distributed, before any process has a rate: nothing changes
    assert pace.cycles == 1
    pace.record(2.0**-8)  # the first rate: 256 cycles a second
    assert pace.cycles == 256 and pace.segments_ahead() == 1
    pace.record(2.0**-12)  # 4,096 a second
    assert pace.cycles == 1024
    pace.record(2.0**-12)
    assert pace.cycles == 4096
    pace.record(2.0**-6)  # 64 a second
    assert pace.cycles == 64
    pace.record(2.0)  # one cycle outlasts SEGMENT_SECONDS: one cycle, none queued ahead
    assert pace.cycles == 1 and pace.segments_ahead() == 0


def test_segments_shorten_towards_the_end_so_that_the_rows_left_to_write_after_training_are_few():
    pace = segments.Pace(max_cycles=1024)
    pace.cycles = 300  # about SEGMENT_SECONDS at the measured rate
    lengths, left = [], 976
    while left:
        lengths.append(pace.next_cycles(left))
        left -= lengths[-1]
    assert sum(lengths) == 976 and max(lengths) == 300 and len(lengths) <= 10
    assert lengths[-1] <= 300 // 64 and lengths == sorted(lengths, reverse=True)
    pace.cycles = 1  # the first segment, before any rate is known
    assert pace.next_cycles(976) == 1 and pace.next_cycles(1) == 1


def test_the_segment_that_ends_on_the_last_checkpoint_is_short_when_the_run_ends_soon_after(monkeypatch):
    """CartPole's defaults: 976 cycles, a checkpoint every 97. The host writes the rows and the
    checkpoint of cycle 970 while only cycles 971-976 are left to compute, so the segment that ends
    there must be short (its rows few), not the 97 cycles since the checkpoint before."""
    monkeypatch.setattr(segments, "SEGMENT_SECONDS", 1e9)
    program, seen = FakeProgram(976), []
    segments.run(program, Counter(jnp.zeros(1, jnp.int32)), 0, 976, lambda cycle: cycle % 97 == 0, 976, None,
                 segments.StopRequests(), seen.append)
    lengths = {segment.last_cycle: segment.last_cycle - segment.first_cycle for segment in seen}
    assert lengths[97] == 96 and lengths[194] == 97  # the full length at once, cut on every checkpoint
    assert lengths[970] <= 16 and lengths[976] == 6
    assert sum(lengths.values()) == 976 and len(seen) <= 16
