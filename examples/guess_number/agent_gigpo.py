"""The guess-the-number agent with credit along the way: a reward per answer and the state of each answer.

The game of ``agent.py``; on top of it, the agent tells the trainer what it
knows turn by turn (docs/credit-assignment.md):

* before each answer, the interval still open ("1-7", then "5-7", ...) is
  the answer's state key (:func:`agl_core.emit_state_key`): answers given
  with the same interval open, in the games of one secret, faced the same
  situation, and GiGPO compares their returns;
* after each answer, its reward (:func:`agl_core.emit_reward`): 1.0 when it
  names the secret, :data:`CLOSER` when it is closer to the secret than the
  agent's last number (the first number in the range always is), else 0.0.

The game's result (1.0 when found, else 0.0) is still the rollout's reward
and the validation reward. Rollout-level estimators train on that alone;
``gigpo`` and ``turn_grpo`` on the answers' own rewards.
"""

from __future__ import annotations

from agl_core import agent, emit_reward, emit_state_key
from agl_core.data import Task
from examples.guess_number.agent import first_number, start

CLOSER = 0.2
"""Reward of an answer that misses the secret but comes closer to it than the agent's last number."""


@agent("guess_number_per_turn")
def guess_number_per_turn(task: Task, llm) -> float:
    """Play one game, emitting each answer's state key and reward; 1.0 when the secret is found, else 0.0."""
    spec = task.input
    game, client, temperature, messages = start(task, llm)
    distance = game.high - game.low + 1  # farther than any number in the range
    for _ in range(spec["max_turns"]):
        emit_state_key(f"{game.low}-{game.high}")
        reply = client.chat.completions.create(model=llm.model, messages=messages, temperature=temperature,
                                               max_tokens=spec["max_tokens"])
        answer = reply.choices[0].message.content or ""
        guess = first_number(answer)
        feedback = game.play(answer)
        if feedback is None:
            emit_reward(1.0)
            return 1.0
        closer = guess is not None and abs(guess - game.secret) < distance
        emit_reward(CLOSER if closer else 0.0)
        if closer:
            distance = abs(guess - game.secret)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": feedback}]
    return 0.0
