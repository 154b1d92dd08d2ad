"""Where a run's start-up goes, before its first cycle trains: imports, the env, the seeds' init,
then tracing, lowering and XLA's compile of the train program, and of its parts compiled alone.

    python scripts/startup.py --script ppo_lstm_impala.py                 # the main job's defaults
    python scripts/startup.py --script ppo_mlp.py -- --num-seeds 8        # flags after -- go to the script
    python scripts/startup.py --script ppo_lstm_impala.py --parts         # also its rollout and update alone

One process, phase after phase, each timed with time.perf_counter (compilation cache off, so every
compile is a real one; the seeds' init on the host CPU, as a run puts it there on an accelerator):

- import jax; import the script (flax, optax, tyro and the package);
- envs.make_env (gymnax, or another suite, imported there);
- init: the seeds' jitted init (trace, compile and run);
- the train program: trace (Python to jaxpr), lower (to StableHLO) and compile (XLA), as a run
  compiles it;
- with --parts: the script's collect_rollout and update_cycle, each jitted and compiled alone at
  the shapes a cycle gives them, and one train_cycle alone: what of the program's compile each
  part is (the rest: the loop, GAE, the post-rollout forward, the metrics).

Timings are not asserted anywhere: this is for docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("ppo_mlp.py", "ppo_lstm_impala.py")


def timed(phases: dict[str, float], name: str, function, *arguments):
    start = time.perf_counter()
    result = function(*arguments)
    phases[name] = time.perf_counter() - start
    return result


def measure(script: str, flags: list[str], parts: bool) -> dict:
    phases: dict[str, float] = {}
    jax = timed(phases, "import jax", __import__, "jax")
    jax.config.update("jax_enable_compilation_cache", False)  # every compile a real one
    sys.path.insert(0, str(ROOT))
    module = timed(phases, "import the script", __import__, Path(script).stem)
    args = module.cli.parse_args(module.Args, flags)
    module.cpu.avoid_cpu_qr_deadlock()  # as run() does, before the backend starts
    env, env_params = timed(phases, "make_env", module.envs.make_env, args.env_id, args.sticky_action_prob,
                            args.optimistic_reset_ratio, args.env_params)
    mesh = module.devices.make_mesh(args, getattr(args, "sequence_length", 1))
    init, train = module.make_train(args, env, env_params, mesh)

    def init_seeds():
        return jax.block_until_ready(module.devices.on_host_cpu(
            lambda: module.devices.stack_seeds([init(args.seed + i) for i in range(args.num_seeds)])))

    states = module.devices.place_on_mesh(timed(phases, "init (trace, compile, run)", init_seeds), mesh)
    module.cpu.use_unrolled_threefry_on_cpu()
    segments = module.sessions.segments  # the script's own package's
    names = module.run_metric_names(env, env_params) + module.evaluation.eval_metric_names(args)
    max_cycles = segments.max_segment_cycles(args.num_cycles, len(names), states.cycle.shape[0])
    program, inputs = segments.make_program(train, max_cycles, mesh), segments.program_inputs(states, mesh)
    traced = timed(phases, "train program: trace", program.trace, *inputs)
    lowered = timed(phases, "train program: lower", traced.lower)
    timed(phases, "train program: XLA compile", lowered.compile)
    if parts:
        phases.update(compile_parts(module, args, env, env_params, jax.tree.map(lambda x: x[0], states)))
    return {"script": script, "flags": flags, "backend": jax.default_backend(),
            "device": jax.devices()[0].device_kind, "phases": phases}


def compile_parts(module, args, env, env_params, state) -> dict[str, float]:
    """train_cycle, collect_rollout and update_cycle of one seed, each jitted alone and compiled
    (trace, lower and XLA) at the shapes the cycle gives them."""
    import jax

    network = module.make_network(args, env.action_space(env_params).n)
    optimizer = module.make_optimizer(args)
    captured = {}

    def capturing(name):
        original = getattr(module, name)

        def capture(*arguments, **keywords):
            captured[name] = (original, arguments, keywords)
            return original(*arguments, **keywords)

        return capture

    originals = {name: getattr(module, name) for name in ("collect_rollout", "update_cycle")}
    for name in originals:
        setattr(module, name, capturing(name))
    try:
        jax.eval_shape(lambda state: module.train_cycle(state, network, optimizer, env, env_params, args), state)
    finally:
        for name, original in originals.items():
            setattr(module, name, original)

    seconds = {}
    start = time.perf_counter()
    jax.jit(lambda state: module.train_cycle(state, network, optimizer, env, env_params, args)).lower(state).compile()
    seconds["one train_cycle alone: compile"] = time.perf_counter() - start
    for name, (original, arguments, keywords) in captured.items():
        arrays = [index for index, value in enumerate(arguments) if is_array_tree(value)]

        def part(*array_arguments, original=original, arguments=arguments, keywords=keywords, arrays=arrays):
            filled = list(arguments)
            for index, value in zip(arrays, array_arguments):
                filled[index] = value
            return original(*filled, **keywords)

        shapes = [jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), arguments[index]) for index in arrays]
        start = time.perf_counter()
        jax.jit(part).lower(*shapes).compile()
        seconds[f"{name} alone: compile"] = time.perf_counter() - start
    return seconds


def is_array_tree(value) -> bool:
    import jax

    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(leaf, jax.Array) or hasattr(leaf, "aval") for leaf in leaves)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", required=True, choices=SCRIPTS)
    parser.add_argument("--parts", action="store_true", help="also compile train_cycle, collect_rollout and update_cycle alone")
    parser.add_argument("--json", type=Path, help="also write the phases here")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="the script's flags, after --")
    options = parser.parse_args()
    flags = [flag for flag in options.flags if flag != "--"]
    result = measure(options.script, flags, options.parts)
    result["date"] = datetime.date.today().isoformat()
    print(f"`python scripts/startup.py {' '.join(sys.argv[1:])}` on {result['backend']} ({result['device']}), {result['date']}")
    print("\n| phase | seconds |\n|---|---|")
    for name, seconds in result["phases"].items():
        print(f"| {name} | {seconds:.1f} |")
    if options.json:
        options.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
