"""Environments behind one interface, gymnax's: reset(key, params) -> (obs, state), and
step(key, state, action, params) -> (obs, state, reward, terminated, truncated, info), which resets
a finished episode itself and puts the observation from before that reset in
info["final_observation"]. gymnax ids are gymnax's own; Craftax and XLand-MiniGrid are adapted here
(SuiteEnv), and their packages (requirements-envs.txt) are imported only when one of their ids is
used. Also: sticky actions, optimistic resets, the env's own episode metrics (env/<name>) and the
Craftax score."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from .errors import ConfigError

if TYPE_CHECKING:
    from gymnax.environments import spaces


class DeferredModule(types.ModuleType):
    """Stands in for a module that gymnax imports at its start for its renderers alone, until one
    of its attributes is read, and then imports it: seaborn (with scipy, for Pong's palette, about
    1.5 s) and matplotlib.pyplot (bsuite's Catch and four more, about 0.5 s), at every start of a
    script."""

    def __getattr__(self, name: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), name)


for _name in ("seaborn", "matplotlib.pyplot"):  # before anything imports gymnax
    if _name not in sys.modules:
        sys.modules[_name] = DeferredModule(_name)

CRAFTAX_IDS = ("Craftax-Classic-Symbolic-v1", "Craftax-Classic-Pixels-v1", "Craftax-Symbolic-v1", "Craftax-Pixels-v1")
XMINIGRID_PREFIXES = ("MiniGrid-", "XLand-MiniGrid-")  # every id in xminigrid.registered_environments()


def make_env(
    env_id: str, sticky_action_prob: float = 0.0, optimistic_reset_ratio: int = 1, param_values: tuple[str, ...] = ()
) -> tuple[Any, Any]:
    """`env_id` is a gymnax id, a Craftax id (CRAFTAX_IDS), an XLand-MiniGrid id, or
    `module.path:Name` (an Environment subclass, or a zero-argument factory returning
    (env, env_params)). Wrapped in StickyActions only when sticky_action_prob > 0; a suite's env
    resets optimistically (SuiteEnv.step_batch) when optimistic_reset_ratio > 1. param_values
    (--env-params, KEY=VALUE each) replace fields of the env's params (set_params)."""
    # gymnax is imported where it is used: importing it builds arrays, which starts JAX's backend,
    # and --distributed must join the other processes before that (devices.start_distributed).
    import gymnax
    from gymnax.environments import spaces

    if ":" in env_id:
        module_name, _, attr_name = env_id.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ConfigError(f"--env-id {env_id}: cannot import module {module_name!r} ({error})")
        if not hasattr(module, attr_name):
            raise ConfigError(f"--env-id {env_id}: module {module_name!r} has no attribute {attr_name!r}")
        target = getattr(module, attr_name)
        if isinstance(target, type) and issubclass(target, gymnax.environments.environment.Environment):
            env = target()
            env_params = env.default_params
        elif callable(target):
            made = target()
            if not (isinstance(made, tuple) and len(made) == 2):
                raise ConfigError(f"--env-id {env_id}: the factory must return (env, env_params)")
            env, env_params = made
        else:
            raise ConfigError(f"--env-id {env_id}: {attr_name!r} is neither an Environment class nor a factory")
    elif env_id in CRAFTAX_IDS:
        env, env_params = craftax_env(env_id, param_values)
    elif env_id.startswith(XMINIGRID_PREFIXES):
        env, env_params = xminigrid_env(env_id, param_values)
    else:
        if env_id not in gymnax.registered_envs:
            raise ConfigError(f"--env-id {env_id} is not a gymnax, Craftax or XLand-MiniGrid environment{did_you_mean(env_id)}")
        env, env_params = gymnax.make(env_id)
    if not isinstance(env, SuiteEnv):  # a suite's env sets them itself, before it reads its observation shape
        env_params = set_params(env_params, param_values, env_id)
    action_space = env.action_space(env_params)
    if not isinstance(action_space, spaces.Discrete):
        raise ConfigError(
            f"--env-id {env_id} has a {type(action_space).__name__} action space; these PPO scripts support "
            "discrete actions only"
        )
    if optimistic_reset_ratio > 1:
        if not isinstance(env, SuiteEnv):
            raise ConfigError(
                f"--optimistic-reset-ratio applies to Craftax and XLand-MiniGrid ids only; --env-id {env_id} resets its "
                "episodes inside its own step"
            )
        if sticky_action_prob > 0:
            raise ConfigError("--optimistic-reset-ratio above 1 cannot be combined with --sticky-action-prob (the "
                              "sticky-action wrapper steps one env at a time)")
        env = dataclasses.replace(env, reset_ratio=optimistic_reset_ratio)
    if sticky_action_prob > 0:
        env = StickyActions(env, sticky_action_prob)
    return env, env_params


class StickyState(NamedTuple):
    env_state: Any  # the wrapped env's state
    previous_action: jax.Array  # int32: the action executed at the previous step; 0 after a reset


@dataclasses.dataclass(frozen=True)
class StickyActions:
    """--sticky-action-prob p (Machado et al. 2018; MinAtar's own default is 0.1, gymnax has none):
    at every step, with probability p, the env executes its previous executed action instead of
    the agent's. The coin's key is split from the step's key. The transition still stores the
    agent's action: the policy's log-prob is of what the agent chose. With an env that has an
    action_mask, an action is only repeated while the mask still allows it."""

    env: Any
    prob: float

    def reset(self, key: jax.Array, params: Any) -> tuple[jax.Array, StickyState]:
        obs, env_state = self.env.reset(key, params)
        return obs, StickyState(env_state, jnp.int32(0))

    def step(self, key: jax.Array, state: StickyState, action: jax.Array, params: Any):
        step_key, coin_key = jax.random.split(key)
        repeat = jax.random.uniform(coin_key) < self.prob
        if self.action_mask is not None:
            repeat = repeat & self.action_mask(state, params)[state.previous_action]
        executed = jnp.where(repeat, state.previous_action, action).astype(jnp.int32)
        obs, env_state, reward, terminated, truncated, info = self.env.step(step_key, state.env_state, executed, params)
        previous_action = jnp.where(jnp.logical_or(terminated, truncated), 0, executed)  # the episode was reset
        return obs, StickyState(env_state, previous_action), reward, terminated, truncated, info

    @property
    def action_mask(self) -> Callable | None:
        """The env's own action_mask on the wrapped state; None when the env has none."""
        env_mask = getattr(self.env, "action_mask", None)
        return None if not callable(env_mask) else lambda state, params: env_mask(state.env_state, params)

    def action_space(self, params: Any = None) -> spaces.Discrete:
        return self.env.action_space(params)

    def observation_space(self, params: Any = None) -> Any:
        return self.env.observation_space(params)


def set_params(env_params: Any, param_values: tuple[str, ...], env_id: str) -> Any:
    """env_params with the fields that param_values (--env-params, KEY=VALUE each) name replaced.
    Each VALUE is parsed as its field's current value's type: bool (true/false), int, float, or
    a scalar array of that dtype. A ConfigError names an unknown field (listing the valid ones), a
    value of the wrong type, a field given twice, or a field that is not a scalar."""
    if not param_values:
        return env_params
    if not dataclasses.is_dataclass(env_params):
        raise ConfigError(f"--env-params: the params of --env-id {env_id} ({type(env_params).__name__}) are not a dataclass")
    fields = [field.name for field in dataclasses.fields(env_params)]
    values = {}
    for text in param_values:
        key, equals, value = text.partition("=")
        if not equals or not key:
            raise ConfigError(f"--env-params takes KEY=VALUE, got {text!r}")
        if key not in fields:
            raise ConfigError(f"--env-params {text}: {type(env_params).__name__} of --env-id {env_id} has no field "
                              f"{key!r}; its fields: {', '.join(fields)}")
        if key in values:
            raise ConfigError(f"--env-params sets {key} twice")
        values[key] = parse_like(getattr(env_params, key), value, text)
    return dataclasses.replace(env_params, **values)


def parse_like(current: Any, value: str, text: str) -> Any:
    """`value` as the type of `current` (a field's value); a ConfigError when it is not one."""
    kinds = [(bool, "bool"), (int, "int"), (float, "float")]  # bool first: a bool is an int too
    kind = next((name for python_type, name in kinds if isinstance(current, python_type)), None)
    dtype = None
    if kind is None and getattr(current, "shape", None) == ():
        dtype = jnp.asarray(current).dtype
        kind = {"b": "bool", "i": "int", "u": "int", "f": "float"}.get(dtype.kind)
    if kind is None:
        raise ConfigError(f"--env-params {text}: only scalar fields can be set (bool, int, float), and this one is "
                          f"{type(current).__name__} {getattr(current, 'shape', '')}".rstrip())
    try:
        if kind == "bool":
            if value.lower() not in ("true", "false"):
                raise ValueError
            parsed: Any = value.lower() == "true"
        elif kind == "int":
            parsed = int(value)
        else:
            parsed = float(value)
    except ValueError:
        raise ConfigError(f"--env-params {text}: {text.partition('=')[0]} is a {kind}, got {value!r}") from None
    return parsed if dtype is None else jnp.asarray(parsed, dtype)


def did_you_mean(env_id: str) -> str:
    """Close names among every suite's ids (XLand-MiniGrid's only when it is installed)."""
    try:
        import xminigrid

        xminigrid_ids = xminigrid.registered_environments()
    except ImportError:
        xminigrid_ids = ()
    import gymnax

    close = difflib.get_close_matches(env_id, [*gymnax.registered_envs, *CRAFTAX_IDS, *xminigrid_ids], n=3, cutoff=0.5)
    if close:
        return f"; did you mean {', '.join(close)}?"
    return "; see gymnax.registered_envs, CRAFTAX_IDS and xminigrid.registered_environments()"


def import_suite(module_name: str, env_id: str) -> Any:
    """The suite's package, imported only now; one line saying how to install it if it is missing."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        package = module_name.partition(".")[0]
        raise ConfigError(
            f"--env-id {env_id} needs the {package} package ({error}); install it with: pip install -r requirements-envs.txt"
        )


@dataclasses.dataclass(frozen=True)
class SuiteEnv:
    """An env of another suite behind the gymnax interface above: reset(key, params) -> (obs,
    state) and step(key, state, action, params), which resets a finished episode itself. The
    adapter supplies `step_without_reset`: (final obs, final state, reward, terminated,
    truncated, info)."""

    reset: Callable
    step_without_reset: Callable
    num_actions: int
    obs_shape: tuple[int, ...]
    reset_ratio: int = 1  # --optimistic-reset-ratio: used by step_batch

    def step(self, key: jax.Array, state: Any, action: jax.Array, params: Any):
        """One env; a finished episode restarts from reset(its own reset key): exact, but under
        vmap XLA runs the reset for every env at every step."""
        step_key, reset_key = jax.random.split(key)
        final_obs, final_state, reward, terminated, truncated, info = self.step_without_reset(step_key, state, action, params)
        obs, state = where_done(terminated | truncated, self.reset(reset_key, params), (final_obs, final_state))
        return obs, state, reward, terminated, truncated, {**info, "final_observation": final_obs}

    def step_batch(self, keys: jax.Array, states: Any, actions: jax.Array, params: Any):
        """N envs. With --optimistic-reset-ratio R > 1 (as Craftax's own PPO, which uses 16) only
        M = ceil(N / R) new episodes are generated per step, from the first M envs' reset keys,
        and the k-th env to finish at this step (in env order) takes new episode k mod M: exact
        while at most M episodes end at once, beyond that some envs restart from the same state."""
        if self.reset_ratio == 1:
            return jax.vmap(self.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)
        step_keys, reset_keys = jnp.moveaxis(jax.vmap(jax.random.split)(keys), 1, 0)
        stepped = jax.vmap(self.step_without_reset, in_axes=(0, 0, 0, None))(step_keys, states, actions, params)
        final_obs, final_states, reward, terminated, truncated, info = stepped
        done = terminated | truncated
        num_resets = -(-done.shape[0] // self.reset_ratio)
        new_episodes = jax.vmap(self.reset, in_axes=(0, None))(reset_keys[:num_resets], params)
        which = (jnp.cumsum(done) - 1) % num_resets
        obs, states = jax.vmap(where_done)(done, jax.tree.map(lambda x: x[which], new_episodes), (final_obs, final_states))
        return obs, states, reward, terminated, truncated, {**info, "final_observation": final_obs}

    def action_space(self, params: Any = None) -> spaces.Discrete:
        from gymnax.environments import spaces

        return spaces.Discrete(self.num_actions)

    def observation_space(self, params: Any = None) -> spaces.Box:
        from gymnax.environments import spaces

        return spaces.Box(0.0, 1.0, self.obs_shape, jnp.float32)


def step_envs(env: Any, keys: jax.Array, states: Any, actions: jax.Array, params: Any):
    """Steps a batch of envs: env.step under vmap, or a suite's step_batch (optimistic resets)."""
    if isinstance(env, SuiteEnv):
        return env.step_batch(keys, states, actions, params)
    return jax.vmap(env.step, in_axes=(0, 0, 0, None))(keys, states, actions, params)


def where_done(done: jax.Array, reset: Any, stepped: Any) -> Any:
    """The reset (obs, state) where the episode is done, else the stepped one (one env)."""
    return jax.tree.map(lambda new, old: jax.lax.select(done, new, old), reset, stepped)


ACHIEVEMENT_PREFIX = "achievement_"  # Craftax's achievements in info: achievement_<name>, 1 or 0


def craftax_env(env_id: str, param_values: tuple[str, ...] = ()) -> tuple[SuiteEnv, Any]:
    """Craftax (Matthews et al. 2024), made without its auto-reset and reset here. Its `done`
    includes the time limit (params.max_timesteps: 10,000 steps in Classic, 100,000 in Craftax):
    here game over (death, lava, the final boss beaten) terminates and the limit truncates.
    Generating a world costs about 40 steps: see --optimistic-reset-ratio in docs/env-suites.md."""
    craftax = import_suite("craftax.craftax_env", env_id).make_craftax_env_from_name(env_id, auto_reset=False)
    env_params = set_params(craftax.default_params, param_values, env_id)

    def step_without_reset(key, state, action, params):
        final_obs, final_state, reward, done, craftax_info = craftax.step_env(key, state, action, params)
        terminated = craftax.is_terminal(final_state, params.replace(max_timesteps=jnp.iinfo(jnp.int32).max))  # no limit
        truncated = done & ~terminated
        info = {  # Craftax reports 100 x achieved at episode ends (0 elsewhere): here 1 or 0
            ACHIEVEMENT_PREFIX + name.partition("/")[2]: value / 100.0
            for name, value in craftax_info.items() if name.startswith("Achievements/")
        }
        info.update(discount=1.0 - terminated.astype(jnp.float32), terminated=terminated, truncated=truncated)
        return final_obs, final_state, reward, terminated, truncated, info

    obs_shape = tuple(craftax.observation_space(env_params).shape)
    return SuiteEnv(craftax.reset_env, step_without_reset, craftax.num_actions, obs_shape), env_params


XMINIGRID_DIRECTIONS = 4  # the agent faces one of 4 directions


def xminigrid_env(env_id: str, param_values: tuple[str, ...] = ()) -> tuple[SuiteEnv, Any]:
    """XLand-MiniGrid (Nikulin et al. 2024), whose TimeStep API does not reset, reset here. An
    episode terminates when it is won or lost (LAST with discount 0) and is truncated at
    params.max_steps (LAST with discount 1). Observation: the (V, V, 2) tile and colour ids of the
    agent's view as one-hots, and its direction as a one-hot broadcast over the view: float32
    (V, V, 13 + 12 + 4). info["success"]: 1 for a won episode (terminated with reward > 0)."""
    xminigrid = import_suite("xminigrid", env_id)
    if env_id not in xminigrid.registered_environments():
        raise ConfigError(f"--env-id {env_id} is not an XLand-MiniGrid environment{did_you_mean(env_id)}")
    if env_id.startswith("XLand-MiniGrid-"):
        raise ConfigError(
            f"--env-id {env_id} needs a ruleset (its task: without one it has no goal), which xminigrid only gets by "
            "downloading a benchmark (xminigrid.load_benchmark); this script downloads nothing. Use a MiniGrid-* id"
        )
    from xminigrid.core.constants import NUM_COLORS, NUM_TILES

    minigrid, env_params = xminigrid.make(env_id)
    env_params = set_params(env_params, param_values, env_id)

    def encode(timestep) -> jax.Array:
        ids = timestep.observation  # (V, V, 2) uint8: tile id, colour id
        direction = jax.nn.one_hot(timestep.state.agent.direction, XMINIGRID_DIRECTIONS)
        return jnp.concatenate(
            [jax.nn.one_hot(ids[..., 0], NUM_TILES), jax.nn.one_hot(ids[..., 1], NUM_COLORS),
             jnp.broadcast_to(direction, (*ids.shape[:2], XMINIGRID_DIRECTIONS))],
            axis=-1,
        )

    def reset(key, params):
        timestep = minigrid.reset(params, key)
        return encode(timestep), timestep

    def step_without_reset(key, timestep, action, params):  # xminigrid's step is deterministic: no key
        final = minigrid.step(params, timestep, action)
        terminated = final.last() & (final.discount == 0.0)
        truncated = final.last() & ~terminated
        info = {
            "success": (terminated & (final.reward > 0.0)).astype(jnp.float32),
            "discount": final.discount, "terminated": terminated, "truncated": truncated,
        }
        return encode(final), final, final.reward, terminated, truncated, info

    view = minigrid.observation_shape(env_params)[0]
    obs_shape = (view, view, NUM_TILES + NUM_COLORS + XMINIGRID_DIRECTIONS)
    return SuiteEnv(reset, step_without_reset, minigrid.num_actions(env_params), obs_shape), env_params


# --- the env's own episode metrics ------------------------------------------------------------
# An env's own episode metrics (Craftax's achievements, XLand-MiniGrid's success) are the
# numeric scalar entries of its step's `info`. Each is logged as env/<name>: the mean of its
# values at the steps where episodes ended in the cycle (NaN when none did).

STEP_INFO_KEYS = ("final_observation", "discount", "terminated", "truncated")  # per step, not episode metrics
CRAFTAX_SCORE = "env/score"


def env_info_names(env: Any, env_params: Any) -> tuple[str, ...]:
    """The names of the numeric scalar entries of one step's info, besides STEP_INFO_KEYS; from
    jax.eval_shape of a step (traced, nothing computed). They shape the metrics rows, so they
    must be known before the training loop is traced."""
    key = jax.random.key(0)
    _, state = jax.eval_shape(env.reset, key, env_params)
    info = jax.eval_shape(env.step, key, state, jax.ShapeDtypeStruct((), jnp.int32), env_params)[5]
    return tuple(sorted(
        name for name, value in info.items()
        if name not in STEP_INFO_KEYS and isinstance(value, jax.ShapeDtypeStruct) and value.shape == ()
        and (jnp.issubdtype(value.dtype, jnp.number) or value.dtype == jnp.bool_)
    ))


def env_metric_names(info_names: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(f"env/{name}" for name in info_names)
    has_achievements = any(name.startswith(ACHIEVEMENT_PREFIX) for name in info_names)
    return names + ((CRAFTAX_SCORE,) if has_achievements else ())


def craftax_score(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The Craftax score (Crafter's, Hafner 2021; Matthews et al. 2024): the geometric mean of
    the achievements' success rates in percent, offset by 1, exp(mean(log(1 + 100 rate))) - 1,
    from 0 to 100; here over the episodes that ended in the cycle. Empty without achievements."""
    rates = [value for name, value in metrics.items() if name.startswith(f"env/{ACHIEVEMENT_PREFIX}")]
    if not rates:
        return {}
    return {CRAFTAX_SCORE: jnp.exp(jnp.mean(jnp.log1p(100.0 * jnp.stack(rates)))) - 1.0}


def console_env_metrics(metric_names: tuple[str, ...]) -> list[str]:
    """The env metrics on the console line: the score when there is one, else every env/<name>."""
    if CRAFTAX_SCORE in metric_names:
        return [CRAFTAX_SCORE]
    return [name for name in metric_names if name.startswith("env/")]


def without_sticky_actions(env_state: Any) -> Any:
    """The wrapped env's own state, which the renderers draw (--sticky-action-prob adds a layer)."""
    return env_state.env_state if isinstance(env_state, StickyState) else env_state
