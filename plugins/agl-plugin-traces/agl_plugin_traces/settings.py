"""The recipe section ``plugins.traces``: which aggregator, its limits, and the filters after it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TracesConfig(BaseModel):
    """Settings of the traces plugin; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    aggregator: str = Field(
        "transition", description="registered aggregator that turns rollouts into rows: transition | trajectory")
    trajectory_max_prompt_length: int | None = Field(
        None, ge=1, description="prompt width of trajectory rows (None: data.max_prompt_length)")
    trajectory_max_response_length: int | None = Field(
        None, ge=1, description="response width of trajectory rows (None: data.max_response_length)")
    later_prompt_overflow: Literal["response", "drop"] = Field(
        "response",
        description="a trajectory row that starts at a later call with a prompt over the limit: 'response' moves "
                    "the overflow into the response with mask 0 (context, never trained on); 'drop' marks the "
                    "row in is_drop_mask")
    per_call_rewards: bool = Field(
        False, description="score a call with the reward it emitted (reward span) instead of the rollout's reward")
    missing_reward: float | None = Field(
        0.0, description="reward of a succeeded rollout that reported none (None: skip such rollouts)")
    pad_token_id: int = Field(0, ge=0, description="token id written in padded positions")
    tokenizer: str | None = Field(
        None, description="Hugging Face tokenizer name or path, to classify the prefix breaks of calls the gateway "
                          "did not classify (exact contexts off): template / retokenization / other; without it "
                          "they are counted as 'unclassified'")
    mismatch_log_dir: str | None = Field(
        None, description="append every prefix break to <dir>/mismatches.jsonl (relative to the run directory)")
    drop_zero_variance_groups: bool = Field(
        False, description="drop the rows of groups (uid) whose rollouts all have the same reward")
    max_rows_per_rollout: int | None = Field(
        None, ge=1, description="keep at most this many rows of one rollout (a seeded random subset)")
