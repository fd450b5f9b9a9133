"""The recipe section ``plugins.lora``: the adapter's shape and where it goes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class LoraSettings(BaseModel):
    """The section ``plugins.lora``; the keys are those of verl's LoRA options, so one recipe serves every backend."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(8, ge=1, description="rank r of the low-rank update B @ A")
    alpha: float = Field(16.0, gt=0, description="scaling numerator: the update is (alpha / rank) * B @ A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, v_proj]), or all-linear: every linear "
                                  "layer but the output head")
    modules_to_save: list[str] = Field(
        default_factory=list, description="modules trained in full next to the adapter (peft's modules_to_save, "
                                          "e.g. [norm]): a copy trains, the original stays for the reference")
