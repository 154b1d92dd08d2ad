"""Slow, obviously-correct reference code that both scripts' tests compare against.

Written independently of the scripts: plain Python loops and NumPy, one element at a time.
"""

from __future__ import annotations

import math

import numpy as np


def gae_reference(reward, value, next_value, terminated, truncated, gamma, gae_lambda, bootstrap_truncated=True):
    """GAE for (T, N) arrays, one env and one step at a time, walking backwards.

    next_value[t, n] is V of the observation step t produced, before any automatic reset.
    """
    reward, value, next_value = (np.asarray(x, np.float64) for x in (reward, value, next_value))
    terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
    num_steps, num_envs = reward.shape
    advantage = np.zeros((num_steps, num_envs))
    for n in range(num_envs):
        running = 0.0
        for t in reversed(range(num_steps)):
            episode_ended = terminated[t, n] or truncated[t, n]
            if terminated[t, n] or (truncated[t, n] and not bootstrap_truncated):
                bootstrap = 0.0
            else:
                bootstrap = next_value[t, n]
            delta = reward[t, n] + gamma * bootstrap - value[t, n]
            if episode_ended:
                running = 0.0
            running = delta + gamma * gae_lambda * running
            advantage[t, n] = running
    return advantage, advantage + value


def ppo_loss_reference(new_logp, entropy, new_value, old_logp, old_value, advantage, target, clip_eps, clip_vloss, norm_adv):
    """The PPO losses and debug metrics, element by element."""
    n = len(new_logp)
    adv = [float(a) for a in advantage]
    if norm_adv:
        mean = sum(adv) / n
        std = math.sqrt(sum((a - mean) ** 2 for a in adv) / n)
        adv = [(a - mean) / (std + 1e-8) for a in adv]
    policy_terms, value_terms = [], []
    actor_clipped = critic_clipped = 0
    kl1 = kl3 = 0.0
    for i in range(n):
        logratio = float(new_logp[i]) - float(old_logp[i])
        ratio = math.exp(logratio)
        clipped_ratio = min(max(ratio, 1 - clip_eps), 1 + clip_eps)
        policy_terms.append(-min(ratio * adv[i], clipped_ratio * adv[i]))
        actor_clipped += abs(ratio - 1) > clip_eps
        kl1 += -logratio
        kl3 += (ratio - 1) - logratio
        change = float(new_value[i]) - float(old_value[i])
        critic_clipped += abs(change) > clip_eps
        unclipped = (float(new_value[i]) - float(target[i])) ** 2
        if clip_vloss:
            clipped_value = float(old_value[i]) + min(max(change, -clip_eps), clip_eps)
            value_terms.append(max(unclipped, (clipped_value - float(target[i])) ** 2))
        else:
            value_terms.append(unclipped)
    return {
        "losses/policy_loss": sum(policy_terms) / n,
        "losses/value_loss": 0.5 * sum(value_terms) / n,
        "losses/entropy": sum(float(e) for e in entropy) / n,
        "losses/actor_clipfrac": actor_clipped / n,
        "losses/critic_clipfrac": critic_clipped / n,
        "losses/actor_approxkl1": kl1 / n,
        "losses/actor_approxkl3": kl3 / n,
    }


def prev_action_reward_reference(action, reward, terminated, truncated, num_actions):
    """--prev-action-reward's input with obs[t] for (T, N) arrays of steps that start from fresh
    episodes at t = 0, one env and one step at a time: zeros where obs[t] starts an episode (t = 0,
    or step t - 1 terminated or was truncated), else step t - 1's action one-hot and its reward."""
    action, reward = np.asarray(action), np.asarray(reward, np.float64)
    terminated, truncated = np.asarray(terminated, bool), np.asarray(truncated, bool)
    num_steps, num_envs = action.shape
    inputs = np.zeros((num_steps, num_envs, num_actions + 1))
    for n in range(num_envs):
        for t in range(1, num_steps):
            if not (terminated[t - 1, n] or truncated[t - 1, n]):
                inputs[t, n, int(action[t - 1, n])] = 1.0
                inputs[t, n, num_actions] = reward[t - 1, n]
    return inputs
