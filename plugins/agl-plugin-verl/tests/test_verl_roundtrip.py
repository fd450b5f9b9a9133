"""Batch ↔ DataProto moves no tensor data, and the padding the loop does is verl's."""

from __future__ import annotations

import numpy as np
import torch

from agl_core.data import Batch

from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

ROWS, PROMPT, RESPONSE = 4096, 64, 96


def big_batch() -> Batch:
    generator = torch.Generator().manual_seed(0)
    response_mask = (torch.rand(ROWS, RESPONSE, generator=generator) > 0.2).long()
    attention_mask = torch.cat([torch.ones(ROWS, PROMPT, dtype=torch.long), response_mask], 1)
    return Batch(
        tensors={"input_ids": torch.randint(0, 32000, (ROWS, PROMPT + RESPONSE), generator=generator),
                 "attention_mask": attention_mask, "position_ids": attention_mask.cumsum(-1) - 1,
                 "prompts": torch.randint(0, 32000, (ROWS, PROMPT), generator=generator),
                 "responses": torch.randint(0, 32000, (ROWS, RESPONSE), generator=generator),
                 "response_mask": response_mask,
                 "token_level_scores": torch.randn(ROWS, RESPONSE, generator=generator),
                 "old_log_probs": torch.randn(ROWS, RESPONSE, generator=generator, dtype=torch.float64),
                 "is_drop_mask": torch.rand(ROWS, generator=generator) > 0.9},
        non_tensors={"uid": np.array([f"task-{i // 8}" for i in range(ROWS)], dtype=object),
                     "rollout_id": np.array([f"r{i}" for i in range(ROWS)], dtype=object),
                     "turn_index": np.arange(ROWS) % 3},
        meta={"global_token_num": [1, 2, 3], "temperature": 0.7})


def test_round_trip_is_lossless_and_zero_copy():
    batch = big_batch()
    data = batch.to_dataproto()
    assert isinstance(data, DataProto) and len(data) == ROWS
    back = Batch.from_dataproto(data)
    assert back.keys() == batch.keys() and back.meta == batch.meta
    for name, tensor in batch.tensors.items():
        for other in (data.batch[name], back[name]):
            assert other.data_ptr() == tensor.data_ptr(), name
            assert other.dtype == tensor.dtype and other.shape == tensor.shape and torch.equal(other, tensor)
    for name, array in batch.non_tensors.items():
        assert data.non_tensor_batch[name] is array and back[name] is array, name


def test_dataproto_gets_its_own_containers():
    """verl's in-place edits of the DataProto (union, pop, a new column) leave the Batch alone."""
    batch = big_batch()
    data = batch.to_dataproto()
    data.batch["advantages"] = torch.zeros(ROWS, RESPONSE)
    data.non_tensor_batch.pop("uid")
    data.meta_info["extra"] = 1
    assert "advantages" not in batch and "uid" in batch and "extra" not in batch.meta


def test_loop_padding_matches_verls():
    batch = big_batch()[:4093]
    padded, pad_size = batch.pad_to_divisor(8)
    verl_padded, verl_pad_size = pad_dataproto_to_divisor(batch.to_dataproto(), 8)
    assert pad_size == verl_pad_size == 3
    for name in batch.tensors.keys():
        assert torch.equal(padded[name], verl_padded.batch[name]), name
    assert np.array_equal(padded["uid"], verl_padded.non_tensor_batch["uid"])
    unpadded = unpad_dataproto(verl_padded, verl_pad_size)
    assert torch.equal(padded.unpad(pad_size)["responses"], unpadded.batch["responses"])
