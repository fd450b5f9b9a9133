"""The trainer's math as pure torch functions, numerically equal to verl 0.9.1.

- ``advantages``: advantage estimators (GAE, GRPO, Pass@k GRPO, RLOO, REINFORCE++,
  REINFORCE++ with baseline, ReMax) and masked statistics.
- ``losses``: loss aggregation, PPO clipped loss, KL estimators, entropy, value loss.
- ``kl``: KL penalty in the reward and its fixed / adaptive coefficient controllers.
"""
