"""Where a training cycle's time goes, against the bare cost of the network.

    python scripts/profile_cycle.py --script ppo_lstm_impala.py --cycles 3
    python scripts/profile_cycle.py --script ppo_mlp.py --cycles 200 -- --num-seeds 1

Times, per cycle, after compilation and with no host callbacks:
- `cycle`: the whole cycle (rollout, GAE, every epoch and minibatch update);
- `rollout`: the same program with the update replaced by a no-op that still consumes the batch,
  so it is the rollout, the post-rollout forward pass and GAE; `update` = `cycle` - `rollout`;
- `bare network`: only the network, at the same shapes: T sequential forward steps at the rollout's
  batch, then epochs x minibatches forward+backward passes at the minibatch's shape (no env, no
  sampling, no optimizer, no GAE, no metrics).
The overhead of the train loop is `cycle / bare network - 1`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import load_script  # noqa: E402


def best_time(function, argument, repeats: int) -> float:
    """Best wall time of `function(argument)` over `repeats` runs, after one warm-up run."""
    import jax

    jax.block_until_ready(function(argument))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(argument))
        times.append(time.perf_counter() - start)
    return min(times)


def train_seconds_per_cycle(module, args, num_cycles: int, repeats: int) -> float:
    import jax

    env, env_params = module.make_env(args.env_id)
    init, train = module.make_train(args, env, env_params)
    states = module.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])
    compiled = jax.jit(lambda s: train(s)).lower(states).compile()
    return best_time(compiled, states, repeats) / num_cycles


def make_no_op_update(module):
    """Stands in for update_cycle: returns the parameters unchanged but depends on every batch
    field, so the rollout and GAE are not optimised away."""
    import jax
    import jax.numpy as jnp

    def no_op_update(params, opt_state, batch, *unused_args, **unused_kwargs):
        touched = sum(jnp.sum(jnp.asarray(leaf, jnp.float32)) for leaf in jax.tree.leaves(batch)) * 0.0
        params = jax.tree.map(lambda leaf: leaf + touched, params)
        metrics = {name: touched for name in (*module.MINIBATCH_METRIC_NAMES, "losses/epochs_run")}
        return params, opt_state, metrics, jnp.int32(0)

    return no_op_update


def bare_network_seconds(module, args, repeats: int) -> float:
    """T sequential forward steps at batch N, then E x M forward+backward at minibatch shape."""
    import jax
    import jax.numpy as jnp

    env, env_params = module.make_env(args.env_id)
    num_actions = env.action_space(env_params).n
    network = module.make_network(args, num_actions)
    num_steps, num_envs = args.num_env_steps_per_cycle, args.num_parallel_envs
    num_updates = args.num_epochs_per_cycle * args.num_minibatches_per_epoch
    recurrent = hasattr(args, "lstm_size")
    if recurrent:
        obs_shape = module.stacked_obs_shape(env, env_params, args.frame_stack)
        params = module.init_params(network, jax.random.key(0), args, obs_shape)
    else:
        obs_shape = env.observation_space(env_params).shape
        params = network.init(jax.random.key(0), jnp.zeros((1, *obs_shape)))

    def rollout_forward(params):
        def step(carry, t):
            obs = jnp.full((num_envs, *obs_shape), t, jnp.float32) * 1e-3
            if recurrent:
                carries, logits, value = network.apply(params, carry, obs[None], jnp.zeros((1, num_envs), bool))
                return carries[0], logits.sum() + value.sum()
            logits, value = network.apply(params, obs)
            return carry, logits.sum() + value.sum()

        carry = jnp.zeros((num_envs, args.carry_size if recurrent else 0), jnp.float32)
        return jax.lax.scan(step, carry, jnp.arange(num_steps, dtype=jnp.float32))[1].sum()

    if recurrent and args.lstm_training == "bptt":
        length, width = num_steps, num_envs // args.num_minibatches_per_epoch
    else:
        length, width = 1, num_steps * num_envs // args.num_minibatches_per_epoch

    def output_sum(params, obs):
        if recurrent:
            carry = jnp.zeros((width, args.carry_size), jnp.float32)
            _, logits, value = network.apply(params, carry, obs, jnp.zeros((length, width), bool))
        else:
            logits, value = network.apply(params, obs[0])
        return logits.sum() + value.sum()

    def updates(params):
        def step(params, index):
            obs = jnp.full((length, width, *obs_shape), index, jnp.float32) * 1e-3
            grads = jax.grad(output_sum)(params, obs)
            return jax.tree.map(lambda p, g: p - 1e-9 * g, params, grads), None

        return jax.lax.scan(step, params, jnp.arange(num_updates, dtype=jnp.float32))[0]

    bare = jax.jit(lambda params: (rollout_forward(params), updates(params)))
    return best_time(bare, params, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, choices=["ppo_mlp.py", "ppo_lstm_impala.py"])
    parser.add_argument("--cycles", type=int, default=3, help="cycles per timed run")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs; the best is kept")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="script flags, after --")
    options = parser.parse_args()
    if options.cycles < 1 or options.repeats < 1:
        parser.error("--cycles and --repeats must be >= 1")
    if "--num-seeds" in options.extra:
        parser.error("profile one seed: the bare-network figure is per seed")
    module = load_script(options.script)
    module.use_unrolled_threefry_on_cpu()
    script_flags = [flag for flag in options.extra if flag != "--"]
    base = module.parse_args(script_flags)
    args = module.dataclasses.replace(base, num_total_env_steps=options.cycles * base.batch_size)
    module.validate_args(args)

    cycle = train_seconds_per_cycle(module, args, options.cycles, options.repeats)
    real_update = module.update_cycle
    module.update_cycle = make_no_op_update(module)
    try:
        rollout = train_seconds_per_cycle(module, args, options.cycles, options.repeats)
    finally:
        module.update_cycle = real_update
    bare = bare_network_seconds(module, args, options.repeats)
    steps = args.batch_size * args.num_seeds
    print(f"{options.script} {' '.join(script_flags)}: {options.cycles} cycles of {steps} env steps")
    print("| part | ms per cycle | share of cycle |")
    print("|---|---|---|")
    print(f"| cycle | {cycle * 1e3:.1f} | 100% ({steps / cycle:,.0f} env steps/s) |")
    print(f"| rollout + GAE | {rollout * 1e3:.1f} | {rollout / cycle:.0%} |")
    print(f"| update (epochs x minibatches) | {(cycle - rollout) * 1e3:.1f} | {(cycle - rollout) / cycle:.0%} |")
    print(f"| bare network (fwd rollout + fwd/bwd updates) | {bare * 1e3:.1f} | overhead of the loop: {cycle / bare - 1:+.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
