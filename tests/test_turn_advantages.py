"""Step-level advantages (gigpo, turn_grpo) on hand-computed batches, through both aggregators' real rows."""

import dataclasses
import hashlib
import math

import numpy as np
import pytest
from pytest import approx
import torch
from agl_plugin_traces.trajectory import trajectory_batch
from agl_plugin_traces.transition import transition_batch

from agl_core.algorithms import advantages as A
from agl_core.algorithms import turn_advantages as T
from agl_core.builtin import batch_calls as BC
from agl_core.builtin import estimators as E
from agl_core.components import Component, call_estimator
from agl_core.config import AlgorithmConfig
from agl_core.data import CALL_COLUMNS, state_key_ids
from agl_core.testing.rollouts import multi_turn_rollout


def game(rollout_id, task_id, rewards, keys, final_reward=1.0):
    """A rollout whose calls extend one context, each answering one token (:func:`multi_turn_rollout`)."""
    return multi_turn_rollout(rollout_id, task_id, rewards, keys, final_reward=final_reward)


def rows(rollouts, aggregator):
    batch = (trajectory_batch(rollouts, 2, 16)[0] if aggregator == "trajectory"
             else transition_batch(rollouts, 16, 2)[0])
    batch["token_level_rewards"] = batch["token_level_scores"]
    return batch


def per_call(batch, advantages):
    """{(rollout_id, turn): the advantage on that call's one token}."""
    out = {}
    for row, rollout_id in enumerate(batch["rollout_id"]):
        for position in torch.nonzero(batch["turn_ids"][row] >= 0).flatten().tolist():
            out[(rollout_id, int(batch["turn_ids"][row, position]))] = float(advantages[row, position])
    return out


def gigpo(batch, gamma, **settings):
    return E._gigpo(batch, AlgorithmConfig(estimator="gigpo", gamma=gamma), settings=E.GiGPOConfig(**settings))[0]


def turn_grpo(batch, gamma, norm=True):
    return E._turn_grpo(batch, AlgorithmConfig(estimator="turn_grpo", gamma=gamma, norm_adv_by_std_in_grpo=norm))[0]


# Task t: a (rewards 0, 1) and b (1, 0, 0; its last call has no state key); task u: c alone (a group of one).
GAMES = [game("a", "t", [0.0, 1.0], ["s0", "s1"]), game("b", "t", [1.0, 0.0, 0.0], ["s0", "s1", None]),
         game("c", "u", [0.5, 0.5], ["s0", "s0"])]


@pytest.mark.parametrize("aggregator", ["trajectory", "transition"])
def test_gigpo_by_hand(aggregator):
    """gamma 0.5, mean_norm. Episode returns: a 1, b 1 (mean 1: A^E = 0); c 1, alone in u: A^E = 1 (GRPO's
    convention). Returns-to-go: a (0.5, 1), b (1, 0, 0), c (0.75, 0.5). Step groups: (t, s0): a0 0.5, b0 1 ->
    -0.25, +0.25; (t, s1): a1 1, b1 0 -> +0.5, -0.5; b2 has no key: 0; (u, s0): c0 0.75, c1 0.5 -> +0.125,
    -0.125."""
    batch = rows(GAMES, aggregator)
    assert per_call(batch, gigpo(batch, 0.5)) == approx({
        ("a", 0): -0.25, ("a", 1): 0.5, ("b", 0): 0.25, ("b", 1): -0.5, ("b", 2): 0.0,
        ("c", 0): 1.125, ("c", 1): 0.875})
    # omega scales the step term; mean_std_norm divides both terms by their groups' std (+ eps).
    assert per_call(batch, gigpo(batch, 0.5, step_weight=2.0))[("a", 1)] == approx(1.0)
    std_norm = per_call(batch, gigpo(batch, 0.5, mode="mean_std_norm"))
    step = 0.25 / (math.sqrt(2 * 0.25 ** 2) + 1e-6)  # (0.5 - 0.75) / std of {0.5, 1}
    assert std_norm[("a", 0)] == approx(-step) and std_norm[("b", 2)] == 0.0
    assert std_norm[("c", 0)] == approx(1.0 + 0.125 / (math.sqrt(2 * 0.125 ** 2) + 1e-6))


def test_a_step_alone_in_its_state_or_without_a_key_gets_the_episode_term_only():
    games = [game("a", "t", [1.0, 0.0], ["x", "only-a"]), game("b", "t", [0.0, 0.0], ["x", None])]
    got = per_call(rows(games, "trajectory"), gigpo(rows(games, "trajectory"), 1.0))
    # Episode: 1 and 0, mean 0.5 -> +0.5, -0.5. Step (t, x): returns 1, 0 -> +0.5, -0.5.
    assert got == approx({("a", 0): 1.0, ("a", 1): 0.5, ("b", 0): -1.0, ("b", 1): -0.5})


def test_gigpo_without_state_keys_is_grpo_over_episode_returns():
    games = [game(f"r{i}", f"t{i % 2}", [float(i), 1.0, None][: 2 + i % 2], [None] * 3) for i in range(6)]
    batch = rows(games, "trajectory")
    got = gigpo(batch, 0.9, mode="mean_std_norm")
    returns = torch.tensor([[float(i) + 1.0] for i in range(6)])  # an episode's return: the sum of its rewards
    expected, _ = A.grpo(returns, torch.ones_like(returns), np.array([f"t{i % 2}" for i in range(6)], dtype=object))
    for row in range(6):
        on = batch["response_mask"][row].bool()
        assert torch.allclose(got[row][on], expected[row, 0].float().expand(int(on.sum())), atol=1e-5)


def test_turn_grpo_by_hand_and_with_one_call_it_is_grpo():
    """gamma 0.5: returns-to-go a (0.5, 1), b (1, 0, 0), c (0.75, 0.5). Groups (task, rank): (t, 0) {0.5, 1},
    (t, 1) {1, 0}: +-1/sqrt(2) with the std; (t, 2) = {b2} alone keeps 0; (u, 0), (u, 1) alone keep theirs."""
    batch = rows(GAMES, "trajectory")
    got = per_call(batch, turn_grpo(batch, 0.5))
    half = 0.25 / (math.sqrt(2 * 0.25 ** 2) + 1e-6)  # (t, 0): (1 - 0.75) / std {0.5, 1}
    one = 1 + 1e-6  # a group of one: std 1, + epsilon
    assert got == approx({("a", 0): -half, ("a", 1): 0.5 / (math.sqrt(0.5) + 1e-6), ("b", 0): half,
                          ("b", 1): -0.5 / (math.sqrt(0.5) + 1e-6), ("b", 2): 0.0,
                          ("c", 0): 0.75 / one, ("c", 1): 0.5 / one})
    single = [game(f"r{i}", "t", [None], [None], final_reward=float(i)) for i in range(4)]
    batch = rows(single, "transition")
    expected, _ = A.grpo(batch["token_level_rewards"], batch["response_mask"], batch["uid"])
    assert torch.allclose(turn_grpo(batch, 0.7), expected)


def test_without_own_rewards_the_rollout_reward_is_the_last_calls():
    """The fallback: no call has its own reward, so the rollout's reward is the last call's, discounted back."""
    games = [game("a", "t", [None, None, None], ["s0", "s1", "s2"], final_reward=1.0),
             game("b", "t", [None, None, None], ["s0", "s1", "s2"], final_reward=0.0)]
    for aggregator in ("trajectory", "transition"):
        batch = rows(games, aggregator)
        assert (batch["call_reward_sources"][batch["call_turns"] >= 0] == "rollout").all()
        got = per_call(batch, gigpo(batch, 0.5))
        # Episode: 1 vs 0 -> +-0.5. Steps: returns a (0.25, 0.5, 1), b (0, 0, 0) -> +-0.125, +-0.25, +-0.5.
        assert got == approx({("a", 0): 0.625, ("a", 1): 0.75, ("a", 2): 1.0,
                              ("b", 0): -0.625, ("b", 1): -0.75, ("b", 2): -1.0})


def test_a_rollout_with_some_own_rewards_scores_the_others_zero():
    reward = T.per_call_rewards(torch.tensor([0.3, 9.0, 9.0, 5.0], dtype=torch.float64),
                                torch.tensor([True, False, False, False]), torch.tensor([0, 0, 1, 1]),
                                torch.tensor([0, 1, 0, 1]), 2)
    assert reward.tolist() == [0.3, 0.0, 0.0, 5.0]  # rollout 1 has none of its own: its reward on its last call


def test_discounted_returns_follow_each_rollouts_order():
    # Calls given out of order: rollout 0 has ranks 1, 0; rollout 1 ranks 0, 2, 1.
    rollout, rank = torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1, 0, 0, 2, 1])
    reward = torch.tensor([1.0, 1.0, 2.0, 4.0, 0.0], dtype=torch.float64)
    got = T.discounted_returns(reward, rollout, rank, 2, 3, 0.5)
    assert got.tolist() == [1.0, 1.0 + 0.5 * 0.0 + 0.25 * 4.0, 2.0 + 0.5, 4.0, 0.0 + 0.5 * 4.0]
    ranks, length = T.call_ranks(torch.tensor([1, 0, 1, 0]), torch.tensor([7, 3, 2, 5]))
    assert ranks.tolist() == [1, 0, 0, 1] and length == 2


# Four rollouts of a task with two calls each: merged rows of equal length.
EVEN = [game(name, "t", [float(i), 1.0], ["s0", "s1"]) for i, name in enumerate("abcd")]


def test_rectangular_calls_give_the_same_bits_as_scattered_ones():
    """Calls laid out rollout-major, as many per rollout: the sums and scans along the matrix give what the
    scatter by rollout and rank gives, to the bit."""
    rng = np.random.default_rng(0)
    n, length = 50, 4
    reward = torch.from_numpy(rng.random(n * length).round(2))
    rollout, rank = torch.arange(n).repeat_interleave(length), torch.arange(length).repeat(n)
    episode_group = torch.arange(n) // 5
    state_group = torch.from_numpy(rng.integers(-1, 6, n * length)) + episode_group.repeat_interleave(length) * 6
    state_group[state_group % 6 == 5] = -1
    for rectangular in (False, True):
        assert torch.equal(T.discounted_returns(reward, rollout, rank, n, length, 0.9, rectangular),
                           T.discounted_returns(reward, rollout, rank, n, length, 0.9))
        assert torch.equal(T.gigpo(reward, rollout, rank, episode_group, state_group, n, length, 0.9,
                                   rectangular=rectangular),
                           T.gigpo(reward, rollout, rank, episode_group, state_group, n, length, 0.9))


@pytest.mark.parametrize("seed", range(8))
def test_on_random_batches_the_matrix_path_gives_the_general_paths_advantages(seed, monkeypatch):
    """Rollouts of as many calls, some without a reward or a state key, some with no reward of their own, the KL
    penalty in the reward, both normalizations: read as a matrix or scattered by rollout and rank, the same."""
    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 5))
    games = [game(f"r{r}", f"t{r % 3}",
                  [None if seed % 4 == 1 or rng.random() < 0.2 else float(rng.integers(0, 3)) for _ in range(length)],
                  [None if rng.random() < 0.3 else f"s{rng.integers(0, 3)}" for _ in range(length)],
                  final_reward=float(rng.integers(0, 2)))
             for r in range(int(rng.integers(1, 12)))]
    real = BC.batch_calls
    for aggregator in ("trajectory", "transition"):
        batch = rows(games, aggregator)
        batch["token_level_rewards"] = batch["token_level_scores"] - torch.rand_like(batch["token_level_scores"]) / 10
        assert real(batch).rectangular
        for estimator in (lambda b: gigpo(b, 0.9, mode="mean_std_norm" if seed % 2 else "mean_norm"),
                          lambda b: turn_grpo(b, 0.9)):
            as_matrix = estimator(batch)
            monkeypatch.setattr(BC, "batch_calls", lambda b: dataclasses.replace(real(b), rectangular=False))
            assert torch.equal(estimator(batch), as_matrix)
            monkeypatch.setattr(BC, "batch_calls", real)


def test_the_calls_are_rectangular_only_in_runs_of_equal_length_in_turn_order():
    """batch_calls says the calls are a (rollouts, length) matrix only when they are, with both aggregators;
    rollouts of different lengths or rows out of order take the general path, with the same advantages."""
    for aggregator in ("trajectory", "transition"):
        calls = BC.batch_calls(rows(EVEN, aggregator))
        assert calls.rectangular and calls.length == 2 and calls.rank.tolist() == [0, 1] * 4
        assert not BC.batch_calls(rows(GAMES, aggregator)).rectangular  # rollouts of 2, 3 and 2 calls
    batch = rows(EVEN, "transition")
    expected = per_call(batch, gigpo(batch, 0.5))
    shuffled = batch[torch.tensor([1, 0, 2, 3, 5, 4, 6, 7])]  # each rollout's second call listed first
    assert not BC.batch_calls(shuffled).rectangular
    assert per_call(shuffled, gigpo(shuffled, 0.5)) == expected


def test_the_kl_penalty_on_a_calls_tokens_is_part_of_its_reward():
    batch = rows([game("a", "t", [1.0, 0.0], ["s", "s2"]), game("b", "t", [0.0, 0.0], ["s", "s2"])], "transition")
    penalty = torch.zeros_like(batch["token_level_scores"])
    penalty[0, 0] = -0.5  # a's first call
    batch["token_level_rewards"] = batch["token_level_scores"] + penalty
    got = per_call(batch, gigpo(batch, 1.0))
    # Rewards a (0.5, 0), b (0, 0): episode +-0.25; step (t, s): 0.5 vs 0 -> +-0.25; (t, s2): 0 vs 0.
    assert got == approx({("a", 0): 0.5, ("a", 1): 0.25, ("b", 0): -0.5, ("b", 1): -0.25})


def test_rows_without_per_call_columns_are_one_call_each():
    """An aggregator that writes no per-call columns: each row is one call with its row's reward."""
    batch = rows(GAMES, "transition")
    for column in ("turn_ids", *CALL_COLUMNS):
        batch.pop(column)
    got = turn_grpo(batch, 1.0)
    assert got.shape == batch["responses"].shape and torch.isfinite(got).all()
    assert torch.equal(got != 0, batch["response_mask"].bool() & (got != 0))


class Recorder:
    def __init__(self):
        self.step_metrics = {}


def test_an_estimator_gets_ctx_only_when_it_declares_it():
    batch = rows(GAMES, "trajectory")
    config = AlgorithmConfig(estimator="gigpo")
    old = Component("estimator", "old", lambda batch, config: (batch["token_level_rewards"],) * 2, "someone")
    assert call_estimator(old, batch, config, ctx=Recorder())[0] is batch["token_level_rewards"]
    ctx = Recorder()
    new = Component("estimator", "gigpo", E.functools.partial(E._gigpo, settings=E.GiGPOConfig()), "estimators")
    call_estimator(new, batch, config, ctx=ctx)
    assert ctx.step_metrics["advantage/calls"] == 7 and ctx.step_metrics["advantage/calls_with_state_key"] == 6
    assert ctx.step_metrics["advantage/step_group_size_mean"] == 2.0  # (t,s0) 2, (t,s1) 2, (u,s0) 2
    assert ctx.step_metrics["advantage/rollouts_outcome_only"] == 0


def test_the_gigpo_recipe_trains_the_per_turn_game(tmp_path, monkeypatch):
    """examples/guess_number/recipe_gigpo.yaml at reduced size: every answer has its reward and state key."""
    import json
    from pathlib import Path

    from agl_core.cli import main

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # the recipe's paths are relative to the repository root
    run_dir = tmp_path / "run"
    assert main(["train", "examples/guess_number/recipe_gigpo.yaml", f"trainer.run_dir={run_dir}",
                 "trainer.total_steps=1", "trainer.test_freq=1", "trainer.save_freq=0", "trainer.progress=false",
                 "rollout.n=4", "algorithm.ppo_mini_batch_size=8"]) == 0
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["rollout/n_succeeded"] == 28
    assert last["advantage/calls"] == last["training/n_calls"] == last["training/n_call_rewards"]
    assert last["advantage/calls_with_state_key"] == last["advantage/calls"]
    assert last["advantage/rollouts_outcome_only"] == 0
    assert last["advantage/step_group_size_mean"] >= 4  # the 4 games of a secret share their first state
    assert 0 <= last["val/reward/mean"] <= 1


def test_a_token_of_a_call_the_row_does_not_list_is_an_error():
    batch = rows(GAMES, "trajectory")
    turn_ids = batch["turn_ids"].clone()
    turn_ids[1, 0] = 7  # rollout b has calls 0, 1, 2
    batch["turn_ids"] = turn_ids
    with pytest.raises(ValueError, match=r"row 1: turn_ids names a call that call_turns does not list \(\[7\]\)"):
        gigpo(batch, 1.0)


@pytest.mark.parametrize("aggregator, row, position, turn", [
    ("transition", 3, 0, 0),  # row 3 is b's call 1: turn 0 is before its first (and only) call
    ("transition", 3, 0, 2),  # ... turn 2 after its last
    ("transition", 0, 0, 1),  # row 0 is a's call 0: turn 1 is the next row's call, not this row's
    ("trajectory", 1, 0, 3),  # b's merged row lists calls 0, 1, 2
])
def test_a_token_outside_its_rows_calls_is_an_error_naming_the_row(aggregator, row, position, turn):
    batch = rows(GAMES, aggregator)
    turn_ids = batch["turn_ids"].clone()
    assert turn_ids[row, position] >= 0
    turn_ids[row, position] = turn
    batch["turn_ids"] = turn_ids
    with pytest.raises(ValueError, match=rf"row {row}: turn_ids names a call that call_turns does not list "
                                         rf"\(\[{turn}\]\)"):
        gigpo(batch, 1.0)


@pytest.mark.parametrize("turn, message", [
    (2, r"row 2: turn_ids names a call that call_turns does not list \(\[2\]\)"),
    (-3, r"row 2: turn_ids holds -3; a token no call generated holds -1"),
])
def test_merged_rows_of_equal_length_check_every_token(turn, message):
    """Rows whose calls all run from turn 0 to the same last turn are checked by the batch's extrema, and the
    error still names the row."""
    batch = rows(EVEN, "trajectory")
    turn_ids = batch["turn_ids"].clone()
    turn_ids[2, -1] = turn
    batch["turn_ids"] = turn_ids
    with pytest.raises(ValueError, match=message):
        gigpo(batch, 1.0)


@pytest.mark.parametrize("aggregator", ["trajectory", "transition"])
def test_a_turn_id_below_minus_one_is_an_error(aggregator):
    batch = rows(GAMES, aggregator)
    turn_ids = batch["turn_ids"].clone()
    turn_ids[2, -1] = -3
    batch["turn_ids"] = turn_ids
    with pytest.raises(ValueError, match=r"row 2: turn_ids holds -3; a token no call generated holds -1"):
        turn_grpo(batch, 1.0)


def test_a_token_on_a_turn_its_rows_calls_skip_is_an_error():
    """A row whose calls are turns 0 and 2 (turn 1 was another policy's, say): a token of turn 1 is refused."""
    batch = rows(GAMES, "trajectory")
    call_turns = batch["call_turns"].copy()
    call_turns[1] = [0, 2, -1]
    turn_ids = batch["turn_ids"].clone()
    turn_ids[1] = torch.where(turn_ids[1] == 2, -1, turn_ids[1])  # b's call 2 dropped; its call 1 stays on turn 1
    batch["call_turns"], batch["turn_ids"] = call_turns, turn_ids
    with pytest.raises(ValueError, match=r"row 1: turn_ids names a call that call_turns does not list \(\[1\]\)"):
        gigpo(batch, 1.0)


def test_calls_out_of_turn_order_are_an_error():
    batch = rows(GAMES, "trajectory")
    call_turns = batch["call_turns"].copy()
    call_turns[1, :3] = [1, 0, 2]
    batch["call_turns"] = call_turns
    with pytest.raises(ValueError, match=r"row 1: call_turns lists its calls out of turn order"):
        turn_grpo(batch, 1.0)


@pytest.mark.parametrize("aggregator", ["trajectory", "transition"])
def test_a_trained_token_no_call_generated_gets_no_advantage(aggregator):
    """A token in ``response_mask`` whose turn id is -1 (no call generated it) gets 0, whatever its row's calls."""
    batch = rows(GAMES, aggregator)
    turn_ids = batch["turn_ids"].clone()
    row = len(batch) - 1
    turn_ids[row, 0] = -1
    batch["turn_ids"] = turn_ids
    for advantages in (gigpo(batch, 0.5), turn_grpo(batch, 0.5)):
        assert advantages[row, 0] == 0.0 and advantages.abs().sum() > 0


def test_the_estimators_run_on_one_thread_and_give_the_threads_back(monkeypatch):
    """Their per-call vectors are too short for intra-op threads to pay; the process's setting is restored after
    each call, also after an error."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen, real = [], T.gigpo
        monkeypatch.setattr(T, "gigpo",
                            lambda *args, **kwargs: seen.append(torch.get_num_threads()) or real(*args, **kwargs))
        gigpo(rows(GAMES, "trajectory"), 1.0)
        assert seen == [1] and torch.get_num_threads() == 2
        batch = rows(GAMES, "trajectory")
        turn_ids = batch["turn_ids"].clone()
        turn_ids[1, 0] = 7
        batch["turn_ids"] = turn_ids
        with pytest.raises(ValueError):
            turn_grpo(batch, 1.0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("distinct", [0, 1, 3, 24, 200, 5000])
def test_numbered_is_np_unique_inverse(distinct):
    """State ids numbered by their low bits where those tell the distinct ids apart, else by a sort: the same ids
    either way. Digests (random 63-bit), and multiples of 2^20, whose low bits all agree."""
    rng = np.random.default_rng(distinct)
    for values in (rng.integers(0, 2**63 - 1, distinct), np.arange(distinct, dtype=np.int64) << 20):
        keys = values[rng.integers(0, distinct, 3000)] if distinct else values
        ids, n = T.numbered(keys)
        expected, inverse = np.unique(keys, return_inverse=True)
        assert n == len(expected) and ids.tolist() == inverse.tolist()
