"""PureJaxRL's ppo.py and our ppo_mlp.py (or, with --rnn, its ppo_rnn.py and our ppo_lstm_impala.py),
side by side on PureJaxRL's CartPole config, in one run.

    python scripts/vs_purejaxrl.py --purejaxrl-dir ~/src/purejaxrl             # 1 and 8 seeds, best of 2
    python scripts/vs_purejaxrl.py --purejaxrl-dir ~/src/purejaxrl --seeds 8 --repeats 3 --out vs.md
    python scripts/vs_purejaxrl.py --purejaxrl-dir ~/src/purejaxrl --compiled-loops --repeats 15
    python scripts/vs_purejaxrl.py --purejaxrl-dir ~/src/purejaxrl --rnn --seeds 1 --repeats 3

PureJaxRL is not a dependency and none of its code is in this repository: --purejaxrl-dir is a
checkout of https://github.com/luchris429/purejaxrl, whose purejaxrl/ppo.py is imported from there.
Every measurement is its own process, ours and theirs in turn, best of --repeats:

- ours: `python ppo_mlp.py --num-seeds N`, env steps/s over all seeds from its summary.json (after
  compilation, with its logging and metrics file, as users run it);
- PureJaxRL: `jax.jit(jax.vmap(make_train(config)))` on N keys, as its README runs several seeds,
  with its own CartPole config (ours are the same numbers) and DEBUG off, timed after compilation.

--rnn does the same with ppo_rnn.py (a dense 128 embedding, a GRU of 128, ReLU heads of 128; same
CartPole numbers) against `ppo_lstm_impala.py --torso mlp` with a dense 128 embedding, an LSTM of
128 and ReLU heads of 128, `--head-hidden-sizes 128` (OURS_ON_PPO_RNN_CONFIG).

--compiled-loops compares the compiled training programs alone, in one process: ours is the
program ppo_mlp.py's run compiles (its make_train loop, as ppo_support's segments wrap it) in one
call of every cycle, with no host work, and with the CPU settings its run() applies. PureJaxRL's
is lowered before ours, with JAX's own lowering, so the one setting the two share is XLA's
scheduler flag (read once per process). The third is ours as a run runs it: ppo_support's session
with its segments, metrics.jsonl and checkpoints in a temporary folder (console lines discarded),
which prices the host's work. The three are called in turn, in an order that turns
each round (so that none always goes first), and each ratio is taken within a round (a speed ratio
is the other's time over this one's), so a shared machine's drift over minutes falls on all; the
table gives the medians of those ratios, and the lowest and highest round of ours against theirs.

Shims let its code run beside our pins, and none touches its training loop: gymnax 1.0's
step returns (obs, state, reward, terminated, truncated, info) and PureJaxRL's code expects the
older (obs, state, reward, done, info), so it gets done = terminated | truncated (a time-out as a
termination, as it was written for); and its wrappers module imports brax at the top for a Brax
wrapper that ppo.py does not use (and navix, for another), so an empty stand-in module is installed
for each one that is missing. ppo_rnn.py calls flax's GRUCell as older flax had it (no width,
a static initialize_carry), so it gets a GRUCell that does (flax_linen_with_the_old_gru_cell).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runlib import ROOT, machine_description, run_config  # noqa: E402

# PureJaxRL ppo.py's own CartPole config (its __main__), which is also ppo_mlp.py's defaults.
PUREJAXRL_CARTPOLE = {
    "LR": 2.5e-4, "NUM_ENVS": 4, "NUM_STEPS": 128, "TOTAL_TIMESTEPS": 5e5, "UPDATE_EPOCHS": 4, "NUM_MINIBATCHES": 4,
    "GAMMA": 0.99, "GAE_LAMBDA": 0.95, "CLIP_EPS": 0.2, "ENT_COEF": 0.01, "VF_COEF": 0.5, "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh", "ENV_NAME": "CartPole-v1", "ANNEAL_LR": True, "DEBUG": False,
}
PUREJAXRL_SEED = 30  # its __main__'s PRNGKey
# --rnn: ppo_rnn.py's __main__ config has the same numbers (a dense 128 ReLU embedding, a GRU of
# 128, ReLU heads of 128). ppo_lstm_impala.py on it: the same embedding, an LSTM of 128, the same
# heads, and every PPO setting its own defaults would change set to ppo_rnn.py's.
PPO_RNN_WIDTH = 128
OURS_ON_PPO_RNN_CONFIG = [
    "--env-id", "CartPole-v1", "--torso", "mlp", "--hidden-sizes", "128", "--activation", "relu", "--lstm-size", "128",
    "--num-parallel-envs", "4", "--num-env-steps-per-cycle", "128", "--num-epochs-per-cycle", "4",
    "--num-minibatches-per-epoch", "4", "--lr", "2.5e-4", "--gamma", "0.99", "--gae-lambda", "0.95", "--clip-eps", "0.2",
    "--ent-coef", "0.01", "--vf-coef", "0.5", "--max-grad-norm", "0.5", "--head-hidden-sizes", str(PPO_RNN_WIDTH),
]


class FiveTupleEnv:
    """A gymnax 1.0 env whose step returns (obs, state, reward, done, info), done = terminated |
    truncated, and info = {"discount": ...} as older gymnax gave."""

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def step(self, key, state, action, params=None):
        obs, state, reward, terminated, truncated, info = self._env.step(key, state, action, params)
        return obs, state, reward, terminated | truncated, {"discount": info["discount"]}


def load_purejaxrl_ppo(purejaxrl_dir: Path, module: str = "ppo") -> types.ModuleType:
    """Its purejaxrl/<module>.py (ppo or ppo_rnn), with the shims of the module docstring."""
    import importlib

    import gymnax

    for name in MODULES_ITS_WRAPPERS_IMPORT:
        try:
            importlib.import_module(name)
        except ImportError:
            sys.modules[name] = StandIn(name)
    # its modules import their wrappers both as `purejaxrl.wrappers` and, run from its folder, as `wrappers`
    sys.path[:0] = [str(purejaxrl_dir), str(purejaxrl_dir / "purejaxrl")]
    ppo = importlib.import_module(f"purejaxrl.{module}")

    def make(env_id: str):  # our pinned gymnax 1.0 always returns the 6-tuple
        env, env_params = gymnax.make(env_id)
        return FiveTupleEnv(env), env_params

    ppo.gymnax = types.SimpleNamespace(make=make)
    if module == "ppo_rnn":
        ppo.nn = flax_linen_with_the_old_gru_cell()
    return ppo


def flax_linen_with_the_old_gru_cell() -> types.ModuleType:
    """flax.linen, but its GRUCell as the flax that ppo_rnn.py was written for had it: the width
    taken from the carry (ppo_rnn.py's is 128, from its initialize_carry calls) and
    `GRUCell.initialize_carry(key, batch_dims, size)` a static method giving zeros. Its module
    looks nn.GRUCell up when it runs, so nothing else changes."""
    import flax.linen as nn
    import jax.numpy as jnp

    class GRUCell(nn.GRUCell):
        features: int = PPO_RNN_WIDTH

        @staticmethod
        def initialize_carry(key, batch_dims, size):  # the old API; the carry starts at zeros
            return jnp.zeros((*batch_dims, size))

    linen = types.ModuleType("flax.linen")
    linen.__dict__.update(vars(nn))
    linen.GRUCell = GRUCell
    return linen


# Packages its wrappers module imports at the top for wrappers that ppo.py and ppo_rnn.py do not use.
MODULES_ITS_WRAPPERS_IMPORT = ["brax", "brax.envs", "brax.envs.wrappers", "brax.envs.wrappers.training", "navix"]


class StandIn(types.ModuleType):
    """An empty module in place of one that is not installed: any name it is asked for is a class
    that nothing here instantiates."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def purejaxrl_worker(purejaxrl_dir: Path, num_seeds: int, num_total_env_steps: int, module: str = "ppo") -> dict:
    """Compiles and runs PureJaxRL's train (its `module`: ppo or ppo_rnn) on num_seeds keys: env
    steps/s after compilation."""
    import jax
    import numpy as np

    ppo = load_purejaxrl_ppo(purejaxrl_dir, module)
    config = dict(PUREJAXRL_CARTPOLE, TOTAL_TIMESTEPS=num_total_env_steps)
    keys = jax.random.split(jax.random.PRNGKey(PUREJAXRL_SEED), num_seeds)
    start = time.perf_counter()
    compiled = jax.jit(jax.vmap(ppo.make_train(config))).lower(keys).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    out = jax.block_until_ready(compiled(keys))
    seconds = time.perf_counter() - start
    metrics = out["metrics"] if "metrics" in out else out["metric"]  # ppo.py's key, ppo_rnn.py's
    num_updates = int(config["NUM_UPDATES"])  # make_train set it
    env_steps = num_updates * config["NUM_STEPS"] * config["NUM_ENVS"] * num_seeds
    last = slice(num_updates - max(1, num_updates // 10), None)  # the last 10% of updates
    finished = np.asarray(metrics["returned_episode"])[:, last]
    returns = np.asarray(metrics["returned_episode_returns"])[:, last]
    return {"sps": env_steps / seconds, "compile_seconds": compile_seconds,
            "final_episodic_return": float(returns[finished].mean())}  # our summary.json's keys


def measure_purejaxrl(purejaxrl_dir: Path, num_seeds: int, num_total_env_steps: int, module: str = "ppo") -> dict:
    """purejaxrl_worker in a process of its own."""
    command = [sys.executable, __file__, "--purejaxrl-dir", str(purejaxrl_dir), "--worker-seeds", str(num_seeds),
               "--worker-module", module, "--num-total-env-steps", str(num_total_env_steps)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def compiled_loops_rows(purejaxrl_dir: Path, seeds: list[int], repeats: int, num_total_env_steps: int) -> tuple[list[str], str]:
    """The rows, and the machine they were measured on (this process trains on its device).
    PureJaxRL's programs are lowered first, with JAX's own threefry lowering as in a process of
    their own; then ours, with the CPU settings of its run(). Only XLA's scheduler flag, read once
    per process, is common to both."""
    import jax

    sys.path.insert(0, str(ROOT))
    import ppo_mlp
    from ppo_support import cpu

    cpu.avoid_cpu_qr_deadlock()  # as run() does, before the backend starts
    ppo = load_purejaxrl_ppo(purejaxrl_dir)
    config = dict(PUREJAXRL_CARTPOLE, TOTAL_TIMESTEPS=num_total_env_steps)
    theirs = {}
    for num_seeds in seeds:
        keys = jax.random.split(jax.random.PRNGKey(PUREJAXRL_SEED), num_seeds)
        theirs[num_seeds] = jax.jit(jax.vmap(ppo.make_train(dict(config)))).lower(keys).compile(), keys
    cpu.use_unrolled_threefry_on_cpu()  # from here on, for ours only
    rows = [compiled_loops_row(ppo_mlp, *theirs[num_seeds], num_seeds, repeats, num_total_env_steps) for num_seeds in seeds]
    return rows, machine_description({"devices": ppo_mlp.devices.description(), "jax_version": jax.__version__})


def compiled_loops_row(ppo_mlp: types.ModuleType, theirs, keys, num_seeds: int, repeats: int, num_total_env_steps: int) -> str:
    """Three programs in this process, called in turn each round: our train program alone (the one
    a run compiles, in one call of every cycle, no host work), PureJaxRL's, and ours as a run
    runs it (ppo_support's session: segments dispatched ahead, metrics.jsonl, the console line
    and checkpoints written by the host thread; the compilation cache makes its compile a load).
    A markdown row of the median env steps/s of each and the medians of the per-round ratios,
    after one warm-up call each."""
    import contextlib
    import dataclasses
    import io
    import statistics

    import jax
    import numpy as np

    args = ppo_mlp.Args(num_seeds=num_seeds, num_total_env_steps=num_total_env_steps)
    env, env_params = ppo_mlp.envs.make_env(args.env_id)
    init, train = ppo_mlp.make_train(args, env, env_params)
    states = ppo_mlp.devices.stack_seeds([init(args.seed + i) for i in range(num_seeds)])
    states = jax.tree.map(ppo_mlp.sessions.strongly_typed, states)  # as a run's session gives them
    segments = ppo_mlp.sessions.segments  # the script's own package's
    names = ppo_mlp.run_metric_names(env, env_params)
    program = segments.make_program(train, segments.max_segment_cycles(args.num_cycles, len(names), num_seeds), None)
    inputs = segments.program_inputs(states, None)
    ours = program.lower(*inputs).compile()
    everything = (states, np.int32(args.num_cycles), inputs[2])
    env_steps = args.num_cycles * args.batch_size * num_seeds  # the same for both: NUM_UPDATES = num_cycles
    policy = ppo_mlp.make_evaluation(ppo_mlp.make_network(args, env.action_space(env_params).n), env, env_params, args)

    def seconds(compiled, *inputs) -> float:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        return time.perf_counter() - start

    def session_seconds() -> float:
        with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()):  # console lines kept out
            run_args = dataclasses.replace(args, run_dir=str(Path(folder) / "run"), compilation_cache_dir=str(Path(folder).parent / CACHE))
            session = ppo_mlp.sessions.Session(run_args, names)
            session.compile(train, init, None, policy, env_params)  # (loaded from the cache after round 0)
            session.train(session.restore(states))
            return session.train_seconds

    timings = {"ours": [], "theirs": [], "logged": []}
    programs = [("ours", lambda: seconds(ours, *everything)), ("theirs", lambda: seconds(theirs, keys)), ("logged", session_seconds)]
    for round_ in range(repeats + 1):  # round 0 warms up
        # The order turns each round: of two identical programs called in turn, the second ran
        # 3% faster here (median of 10 rounds), so a fixed order would favour one of them.
        for name, time_it in programs[round_ % 3:] + programs[: round_ % 3]:
            elapsed = time_it()
            if round_ > 0:
                timings[name].append(elapsed)

    def per_round(slower: str, faster: str) -> list[float]:  # the faster one's speed over the slower one's
        return [s / f for s, f in zip(timings[slower], timings[faster])]

    ratios = per_round("theirs", "ours")
    speed = {name: env_steps / statistics.median(times) for name, times in timings.items()}
    return (f"| {num_seeds} | {speed['ours']:,.0f} | {speed['theirs']:,.0f} | {statistics.median(ratios):.2f}x | "
            f"{min(ratios):.2f}x-{max(ratios):.2f}x | {speed['logged']:,.0f} | "
            f"{statistics.median(per_round('theirs', 'logged')):.2f}x | {statistics.median(per_round('logged', 'ours')):.3f}x |")


CACHE = "vs-purejaxrl-compilation-cache"  # beside the rounds' temporary run dirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--purejaxrl-dir", type=Path, required=True, help="a checkout of luchris429/purejaxrl")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 8], help="vmapped seeds per measurement")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, in turn; the best is reported")
    parser.add_argument("--num-total-env-steps", type=int, default=500_000, help="per seed, for both (a smaller one for a quick check)")
    parser.add_argument("--compiled-loops", action="store_true",
                        help="time the compiled programs alone, in turn in one process (medians of per-round ratios)")
    parser.add_argument("--rnn", action="store_true",
                        help="its ppo_rnn.py (GRU) against ppo_lstm_impala.py --torso mlp, on ppo_rnn.py's CartPole config")
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    parser.add_argument("--worker-seeds", type=int, help=argparse.SUPPRESS)  # internal: one PureJaxRL measurement
    parser.add_argument("--worker-module", default="ppo", help=argparse.SUPPRESS)
    options = parser.parse_args()
    module = "ppo_rnn" if options.rnn else "ppo"
    if not (options.purejaxrl_dir / "purejaxrl" / f"{module}.py").is_file():
        parser.error(f"--purejaxrl-dir {options.purejaxrl_dir}: no purejaxrl/{module}.py there (a checkout of luchris429/purejaxrl)")
    if options.rnn and options.compiled_loops:
        parser.error("--rnn times whole processes only; --compiled-loops compares ppo_mlp.py's loop with ppo.py's")
    if min(options.seeds) < 1 or options.repeats < 1 or options.num_total_env_steps < 1:
        parser.error("--seeds, --repeats and --num-total-env-steps must be at least 1")
    if options.worker_seeds:
        print(json.dumps(purejaxrl_worker(options.purejaxrl_dir, options.worker_seeds, options.num_total_env_steps,
                                          options.worker_module)))
        return 0

    if options.compiled_loops:
        header = ["| seeds (vmapped) | ppo_mlp.py loop, median env steps/s | PureJaxRL loop, median env steps/s | "
                  "ours / theirs (median of rounds) | lowest-highest round | ppo_mlp.py loop with its logging and "
                  "checkpoints, median env steps/s | that / theirs (median of rounds) | its time / the loop's without "
                  "(median of rounds) |", "|---|---|---|---|---|---|---|---|"]
        rows, machine = compiled_loops_rows(options.purejaxrl_dir, options.seeds, options.repeats, options.num_total_env_steps)
        return print_table(options, "--compiled-loops ", f"{options.repeats} rounds, the programs in turn in one process",
                           header, rows, machine)

    script, flags = ("ppo_lstm_impala.py", OURS_ON_PPO_RNN_CONFIG) if options.rnn else ("ppo_mlp.py", [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_seeds in options.seeds:
            ours, theirs = [], []
            for repeat in range(options.repeats):
                run_flags = [*flags, "--num-seeds", str(num_seeds), "--num-total-env-steps", str(options.num_total_env_steps)]
                ours.append(run_config(script, run_flags, Path(tmp) / f"ours-{num_seeds}-{repeat}"))
                theirs.append(measure_purejaxrl(options.purejaxrl_dir, num_seeds, options.num_total_env_steps, module))
                print(f"{num_seeds} seed(s), run {repeat + 1}: ours {ours[-1]['sps']:,.0f}, "
                      f"PureJaxRL {theirs[-1]['sps']:,.0f} env steps/s", file=sys.stderr, flush=True)
            best_ours = max(ours, key=lambda summary: summary["sps"])
            best_theirs = max(theirs, key=lambda summary: summary["sps"])
            rows.append(
                f"| {num_seeds} | {best_ours['sps']:,.0f} | {best_theirs['sps']:,.0f} | "
                f"{best_ours['sps'] / best_theirs['sps']:.2f}x | "
                f"{best_ours['compile_seconds']:.1f} / {best_theirs['compile_seconds']:.1f} | "
                f"{best_ours['final_episodic_return']:.1f} / {best_theirs['final_episodic_return']:.1f} |"
            )
    header = [f"| seeds (vmapped) | {script} env steps/s | PureJaxRL {module}.py env steps/s | ours / theirs | "
              "compile s (ours / theirs) | final return (ours / theirs) |", "|---|---|---|---|---|---|"]
    return print_table(options, "--rnn " if options.rnn else "", f"best of {options.repeats}, in turn", header, rows,
                       machine_description(best_ours))


def print_table(options: argparse.Namespace, mode_flag: str, how: str, header: list[str], rows: list[str], machine: str) -> int:
    """The markdown table, headed by the date, machine and command; also to --out."""
    lines = [
        f"{datetime.date.today()} | {machine} | `python scripts/vs_purejaxrl.py {mode_flag}--seeds "
        f"{' '.join(map(str, options.seeds))} --repeats {options.repeats} --num-total-env-steps "
        f"{options.num_total_env_steps}` ({how})",
        "",
        *header,
        *rows,
    ]
    table = "\n".join(lines)
    print(table)
    if options.out:
        options.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
