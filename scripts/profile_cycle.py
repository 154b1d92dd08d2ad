"""How a training cycle's time compares with the sum of its parts, each timed standalone.

    python scripts/profile_cycle.py --script ppo_lstm_impala.py            # the LSTM defaults' shapes
    python scripts/profile_cycle.py --script ppo_lstm_impala.py --quarter  # 64 envs instead of 256
    python scripts/profile_cycle.py --script ppo_mlp.py -- --num-parallel-envs 4 --num-epochs-per-cycle 4

The shapes are the LSTM defaults' (256 envs x 128 steps, 5 epochs x 8 minibatches) for both
scripts, `--quarter` for 64 envs, and any script flag after `--` overrides them; one seed.
Each part is its own `jax.jit`, called on its own (never inside a `lax.scan`), on inputs of the
cycle's shapes (random observations and rollout data: the costs do not depend on the values):

- (a) rollout forwards: one policy forward of the network on the N envs' observations, the
  rollout's per-step call (the LSTM script: with its carry and episode starts), x T;
- (a) env steps: one `env.step` vmapped over the N envs, x T (the rollout's other sequential
  work; action sampling, frame stacking and bookkeeping are not timed);
- (b) post-rollout forward: the batched forward over the whole rollout as `train_cycle` does it
  (ppo_mlp.py: the forward on the T x N observations and on their final observations, then the
  log-probs; ppo_lstm_impala.py: `batch_from_rollout`), x 1;
- (c) minibatch forward+backward: `jax.value_and_grad` of the script's `loss_fn` on one minibatch,
  x epochs x minibatches (no optimizer step).

Each part's time is the median of --part-calls calls after one warm-up call, times its count.
The full cycle is the script's own train program as a run compiles it (`make_train` in
ppo_support's segment program), --cycles cycles in one call with no host work, the median of --repeats timed runs after one warm-up run, divided by --cycles;
compilation is never timed. The last line is the ratio cycle / sum of parts: 1.0 means the cycle
costs exactly its parts; above 1 is what the train loop adds (the scan, shuffles, GAE, Adam,
metrics, and anything XLA compiles worse inside a loop than standalone).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import load_script  # noqa: E402

# The LSTM defaults' shapes (ppo_lstm_impala.py's Args), which both scripts are profiled at.
LSTM_DEFAULT_SHAPES = ["--num-parallel-envs", "256", "--num-env-steps-per-cycle", "128",
                       "--num-epochs-per-cycle", "5", "--num-minibatches-per-epoch", "8"]
QUARTER_ENVS = 64


def median_seconds(function, arguments: tuple, calls: int) -> float:
    """Median wall time of one `function(*arguments)` call over `calls` calls, after a warm-up."""
    import jax

    jax.block_until_ready(function(*arguments))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(function(*arguments))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cycle_seconds(module, args, num_cycles: int, repeats: int) -> float:
    """The script's train program as a run compiles it (one seed), num_cycles cycles in one call
    with no host work, per cycle."""
    import numpy as np

    env, env_params = module.envs.make_env(args.env_id, args.sticky_action_prob, args.optimistic_reset_ratio, args.env_params)
    init, train = module.make_train(args, env, env_params)
    states = module.devices.stack_seeds([init(args.seed)])
    segments = module.sessions.segments  # the script's own package's
    program, inputs = segments.make_program(train, num_cycles, None), segments.program_inputs(states, None)
    compiled = program.lower(*inputs).compile()
    return median_seconds(compiled, (states, np.int32(num_cycles), inputs[2]), repeats) / num_cycles


def random_rollout_data(args, obs_shape: tuple[int, ...], num_actions: int) -> dict:
    """Random (T, N, ...) rollout arrays; observations are 0 or 1, as MinAtar's channels."""
    import jax
    import jax.numpy as jnp

    num_steps, num_envs = args.num_env_steps_per_cycle, args.num_parallel_envs
    keys = jax.random.split(jax.random.key(0), 6)
    shape = (num_steps, num_envs)
    return {
        "obs": jax.random.bernoulli(keys[0], 0.1, (*shape, *obs_shape)).astype(jnp.float32),
        "final_obs": jax.random.bernoulli(keys[1], 0.1, (*shape, *obs_shape)).astype(jnp.float32),
        "action": jax.random.randint(keys[2], shape, 0, num_actions),
        "episode_start": jax.random.bernoulli(keys[3], 0.01, shape),
        "normal": jax.random.normal(keys[4], (4, *shape)),  # logp, value, advantage, target
    }


def mlp_parts(module, args, network, params, data):
    """The policy forward, the post-rollout forward and a minibatch, for ppo_mlp.py."""
    import jax

    num_steps, num_envs = args.num_env_steps_per_cycle, args.num_parallel_envs
    flat = lambda x: x.reshape(num_steps * num_envs, *x.shape[2:])  # noqa: E731

    def policy_forward(params, obs):
        return network.apply(params, obs, method=module.ActorCritic.policy)

    def post_rollout_forward(params, obs, final_obs, action):  # as in train_cycle
        logits, value = network.apply(params, flat(obs))
        _, next_value = network.apply(params, flat(final_obs))
        logp, _ = module.log_prob_and_entropy(logits, flat(action))
        return logp, value, next_value

    size = args.batch_size // args.num_minibatches_per_epoch
    logp, value, advantage, target = (flat(x)[:size] for x in data["normal"])
    minibatch = module.Batch(flat(data["obs"])[:size], flat(data["action"])[:size], logp, value, advantage, target, None)
    return (
        (jax.jit(policy_forward), (params, data["obs"][0])),
        (jax.jit(post_rollout_forward), (params, data["obs"], data["final_obs"], data["action"])),
        minibatch,
    )


def lstm_parts(module, args, network, params, data):
    """The policy forward, the post-rollout forward and a minibatch, for ppo_lstm_impala.py."""
    import jax
    import jax.numpy as jnp

    num_steps, num_envs = args.num_env_steps_per_cycle, args.num_parallel_envs
    carry = jnp.zeros((num_envs, args.carry_size), jnp.float32)

    def policy_forward(params, carry, obs, episode_start):  # as in collect_rollout
        return network.apply(params, carry, obs[None], episode_start[None])

    stored = args.lstm_training == "stored"
    transitions = module.Transition(
        obs=data["obs"], episode_start=data["episode_start"],
        carry=jnp.zeros((num_steps, num_envs, args.carry_size if stored else 0), jnp.float32),
        action=data["action"], reward=data["normal"][0], terminated=jnp.zeros((num_steps, num_envs), bool),
        truncated=jnp.zeros((num_steps, num_envs), bool), final_obs=data["final_obs"], action_mask=None,
    )

    def post_rollout_forward(params, first_carry, transitions):
        return module.batch_from_rollout(params, first_carry, transitions, network, args)

    # One minibatch: (L, S / M, ...) of the (L, S) sequences, `carry` (S / M, C).
    length, width = args.sequence_length, args.num_sequences // args.num_minibatches_per_epoch
    cut = lambda x: x.reshape(length, args.num_sequences, *x.shape[2:])[:, :width]  # noqa: E731
    logp, value, advantage, target = (cut(x) for x in data["normal"])
    minibatch = module.Batch(
        obs=cut(data["obs"]), episode_start=cut(data["episode_start"]), carry=jnp.zeros((width, args.carry_size), jnp.float32),
        action=cut(data["action"]), logp=logp, value=value, advantage=advantage, target=target, action_mask=None,
    )
    return (
        (jax.jit(policy_forward), (params, carry, data["obs"][0], data["episode_start"][0])),
        (jax.jit(post_rollout_forward), (params, carry, transitions)),
        minibatch,
    )


def part_seconds(module, args, calls: int) -> list[tuple[str, str, float]]:
    """(part, how it is timed, seconds per cycle) for the four standalone parts."""
    import jax
    import jax.numpy as jnp

    env, env_params = module.envs.make_env(args.env_id, args.sticky_action_prob, args.optimistic_reset_ratio, args.env_params)
    num_actions = env.action_space(env_params).n
    network = module.make_network(args, num_actions)
    recurrent = hasattr(module, "batch_from_rollout")
    if recurrent:
        obs_shape = module.stacked_obs_shape(env, env_params, args.frame_stack)
    else:
        obs_shape = env.observation_space(env_params).shape
    params = module.init_params(network, jax.random.key(0), args, obs_shape)
    data = random_rollout_data(args, obs_shape, num_actions)
    policy, post_rollout, minibatch = (lstm_parts if recurrent else mlp_parts)(module, args, network, params, data)

    num_envs, num_steps = args.num_parallel_envs, args.num_env_steps_per_cycle
    reset_keys, step_keys = jax.random.split(jax.random.key(1), (2, num_envs))
    _, env_states = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)
    env_step = jax.jit(lambda keys, states, action: jax.vmap(env.step, in_axes=(0, 0, 0, None))(keys, states, action, env_params))

    clip_eps = jnp.float32(args.clip_eps)
    grad_fn = jax.value_and_grad(module.loss_fn, has_aux=True)
    minibatch_grad = jax.jit(lambda params, minibatch: grad_fn(params, minibatch, clip_eps, network, args, None))
    num_updates = args.num_epochs_per_cycle * args.num_minibatches_per_epoch
    minibatch_size = args.batch_size // args.num_minibatches_per_epoch
    return [
        ("(a) rollout forwards", f"one policy forward on {num_envs} observations x {num_steps}",
         median_seconds(*policy, calls) * num_steps),
        ("(a) env steps", f"one env.step vmapped over {num_envs} envs x {num_steps}",
         median_seconds(env_step, (step_keys, env_states, data["action"][0]), calls) * num_steps),
        ("(b) post-rollout forward", f"the batched forward over the {args.batch_size} transitions x 1",
         median_seconds(*post_rollout, calls)),
        ("(c) minibatch fwd+bwd", f"value_and_grad of loss_fn on {minibatch_size} transitions x {num_updates}",
         median_seconds(minibatch_grad, (params, minibatch), calls) * num_updates),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, choices=["ppo_mlp.py", "ppo_lstm_impala.py"])
    parser.add_argument("--quarter", action="store_true", help=f"{QUARTER_ENVS} parallel envs instead of 256")
    parser.add_argument("--cycles", type=int, default=1, help="cycles per timed run of the full cycle")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of the full cycle; the median is kept")
    parser.add_argument("--part-calls", type=int, default=5, help="timed calls of each part; the median is kept")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="script flags, after --; they override the shapes")
    options = parser.parse_args()
    if min(options.cycles, options.repeats, options.part_calls) < 1:
        parser.error("--cycles, --repeats and --part-calls must be >= 1")
    script_flags = [flag for flag in options.extra if flag != "--"]
    if "--num-seeds" in script_flags:
        parser.error("profile one seed: the parts are timed per seed")
    module = load_script(options.script)
    module.cpu.avoid_cpu_qr_deadlock()  # before JAX starts its backend, as run() does
    module.cpu.use_unrolled_threefry_on_cpu()
    shape_flags = LSTM_DEFAULT_SHAPES + (["--num-parallel-envs", str(QUARTER_ENVS)] if options.quarter else [])
    base = module.cli.parse_args(module.Args, shape_flags + script_flags)  # the last occurrence of a flag wins
    args = dataclasses.replace(base, num_total_env_steps=options.cycles * base.batch_size)
    try:
        module.validate_args(args)
    except module.cli.ConfigError as error:
        parser.error(str(error))

    parts = part_seconds(module, args, options.part_calls)
    cycle = cycle_seconds(module, args, options.cycles, options.repeats)
    total = sum(seconds for _, _, seconds in parts)
    print(
        f"{options.script} {args.env_id}: {args.num_parallel_envs} envs x {args.num_env_steps_per_cycle} steps, "
        f"{args.num_epochs_per_cycle} epochs x {args.num_minibatches_per_epoch} minibatches, 1 seed"
    )
    print("| part | timed standalone as | ms per cycle |")
    print("|---|---|---|")
    for name, how, seconds in parts:
        print(f"| {name} | {how} | {seconds * 1e3:.1f} |")
    print(f"| sum of parts | | {total * 1e3:.1f} |")
    print(f"| full cycle | the compiled train loop, {options.cycles} cycle(s), median of {options.repeats} run(s) | {cycle * 1e3:.1f} |")
    print(f"| ratio cycle / sum of parts | | {cycle / total:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
