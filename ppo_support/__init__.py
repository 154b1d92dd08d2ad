"""The machinery that ppo_mlp.py and ppo_lstm_impala.py share, one module per concern. The
scripts import its modules as namespaces (`from ppo_support import envs, rundir`), so that a call
such as `rundir.Checkpointer(...)` reads as "not PPO". What a module needs from a script (its
`Args` class, state type, metric names, evaluation step, file path) is passed in: nothing here
imports a script.

    cli         parsing the flags, the checks both scripts share, exit codes
    contract    what the package reads from a script: its Args fields and metric names
    cpu         CPU settings: XLA flags, the unrolled PRNG, the 3x3 convolution
    devices     seeds (vmap), devices (shard_map), reductions across them
    envs        gymnax, Craftax and XLand-MiniGrid ids, their adapters, sticky actions
    errors      the errors `cli.main` turns into exit codes
    evaluation  playing evaluation episodes inside the jit, with a script's policy step
    logs        the host's writing thread: metrics.jsonl, the console line, wandb
    nan_guard   a seed whose update is not finite keeps its last good parameters
    rundir      the run dir: args.json, checkpoints, resume, params and summary
    segments    the train program run in segments: dispatched ahead, Ctrl-C and SIGTERM
    sessions    one training session: the run dir opened, the program compiled, trained, saved
    sweeps      --sweep: a grid of hyper-parameters in the seeds' vmap, each point a run of its own
    videos      GIFs of evaluation episodes
"""

__version__ = "0.1.0"
