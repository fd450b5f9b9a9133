"""agl_core.data: the records and Batch, checked against verl's DataProto where they overlap."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from tensordict import TensorDict

from agl_core.data import Batch, Rollout, Span, Task, Triplet


def make_batch(n: int = 6, width: int = 4) -> Batch:
    return Batch(
        tensors={
            "input_ids": torch.arange(n * width).reshape(n, width),
            "scores": torch.arange(n, dtype=torch.float32) / 2,
        },
        non_tensors={
            "uid": np.array([f"u{i}" for i in range(n)], dtype=object),
            "turn_index": np.arange(n),
        },
        meta={"step": 3},
    )


def assert_rows(batch: Batch, source: Batch, rows: list[int]) -> None:
    assert len(batch) == len(rows)
    assert batch.keys() == source.keys()
    for name in source.tensors.keys():
        assert torch.equal(batch[name], source[name][torch.as_tensor(rows, dtype=torch.long)])
    for name in source.non_tensors:
        assert list(batch[name]) == [source[name][i] for i in rows]


def assert_same_as_dataproto(batch: Batch, data) -> None:
    """Same columns (values, dtypes), same non-tensor entries and same meta as a verl DataProto."""
    assert len(batch) == len(data)
    assert set(batch.tensors.keys()) == set(data.batch.keys())
    for name in batch.tensors.keys():
        assert batch[name].dtype == data.batch[name].dtype
        assert torch.equal(batch[name], data.batch[name]), name
    assert set(batch.non_tensors) == set(data.non_tensor_batch)
    for name, values in batch.non_tensors.items():
        assert values.dtype == data.non_tensor_batch[name].dtype
        assert np.array_equal(values, data.non_tensor_batch[name]), name
    assert batch.meta == data.meta_info


# ---------------------------------------------------------------------------- records


def test_records_validate_and_forbid_extra_fields():
    task = Task(id="t1", input={"question": "2+2?"})
    assert task.split == "train" and task.metadata == {}
    span = Span(rollout_id="r1", sequence_id=0, kind="llm_call", prompt_token_ids=[1, 2],
                response_token_ids=[3], response_logprobs=[-0.1])
    assert span.attempt_id == "0" and span.reward is None and span.start_time is None
    triplet = Triplet(prompt_ids=[1], response_ids=[2, 3], rollout_id="r1", turn_index=0, reward=1.0)
    assert triplet.response_logprobs is None and triplet.metadata == {}
    rollout = Rollout(rollout_id="r1", task_id="t1", status="succeeded", spans=[span], triplets=[triplet])
    assert rollout.sample_index == 0 and rollout.final_reward is None and rollout.error is None
    assert Rollout.model_validate_json(rollout.model_dump_json()) == rollout

    with pytest.raises(ValidationError, match="extra"):
        Task(id="t", input={}, unknown=1)
    with pytest.raises(ValidationError):
        Span(rollout_id="r", sequence_id=0, kind="tool_call")
    with pytest.raises(ValidationError):
        Rollout(rollout_id="r", task_id="t", status="done")
    with pytest.raises(ValidationError, match="2 entries for 1 response tokens"):
        Span(rollout_id="r", sequence_id=0, kind="llm_call", response_token_ids=[1], response_logprobs=[0.0, 0.0])
    with pytest.raises(ValidationError, match="1 entries for 2 response tokens"):
        Triplet(prompt_ids=[], response_ids=[1, 2], response_logprobs=[0.0], rollout_id="r", turn_index=0)


def test_record_defaults_are_not_shared():
    a, b = Task(id="a", input={}), Task(id="b", input={})
    a.metadata["x"] = 1
    assert b.metadata == {}


# ---------------------------------------------------------------------------- construction


def test_construction_and_columns():
    batch = make_batch()
    assert len(batch) == 6
    assert isinstance(batch.tensors, TensorDict) and batch.tensors.batch_size == torch.Size([6])
    assert batch.keys() == ["input_ids", "scores", "uid", "turn_index"]
    assert "uid" in batch and "input_ids" in batch and "nope" not in batch
    assert batch["input_ids"].shape == (6, 4)
    assert batch["uid"][2] == "u2"
    assert batch.meta == {"step": 3}
    assert "Batch(len=6" in repr(batch)


def test_construction_from_tensordict_keeps_tensors():
    ids = torch.zeros(3, 2)
    batch = Batch(TensorDict({"ids": ids}, batch_size=[3]))
    assert batch["ids"] is ids and len(batch) == 3
    assert len(Batch(TensorDict({}, batch_size=[5]))) == 5


def test_lists_become_one_object_per_row():
    batch = Batch(non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]], "names": ("a", "b", "c")})
    assert batch["pairs"].shape == (3,) and batch["pairs"].dtype == object
    assert batch["pairs"][1] == [3, 4]
    assert batch["names"].dtype == object


def test_constructor_errors_name_the_column():
    with pytest.raises(ValueError, match=r"column 'b' has length 3, but column 'a' has length 2"):
        Batch({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"column 'uid' has length 4, but column 'a' has length 2"):
        Batch({"a": torch.zeros(2)}, {"uid": np.zeros(4)})
    with pytest.raises(TypeError, match="tensor column 'a' must be a torch.Tensor"):
        Batch({"a": np.zeros(2)})
    with pytest.raises(TypeError, match="column 'u'"):
        Batch(non_tensors={"u": 3})
    with pytest.raises(ValueError, match="scalar"):
        Batch({"a": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="scalar"):
        Batch(non_tensors={"u": np.array(1)})
    with pytest.raises(ValueError, match="both as tensors and as non-tensors"):
        Batch({"a": torch.zeros(2)}, {"a": np.zeros(2)})


def test_empty_batch():
    batch = Batch.empty()
    assert len(batch) == 0 and batch.keys() == [] and batch.meta == {}
    assert len(batch[[]]) == 0
    assert [len(c) for c in batch.chunk(4)] == [0, 0, 0, 0]
    padded, pad_size = batch.pad_to_divisor(4)
    assert pad_size == 0 and len(padded) == 0


def test_setitem_routes_and_checks_length():
    batch = make_batch()
    batch["adv"] = torch.ones(6, 4)
    assert "adv" in batch.tensors.keys()
    batch["tag"] = ["x"] * 6
    assert batch.non_tensors["tag"].dtype == object
    batch["arr"] = np.arange(6)
    assert "arr" in batch.non_tensors
    # Replacing a column moves it between tensors and non-tensors.
    batch["uid"] = torch.arange(6)
    assert "uid" in batch.tensors.keys() and "uid" not in batch.non_tensors
    batch["scores"] = np.zeros(6)
    assert "scores" in batch.non_tensors and "scores" not in batch.tensors.keys()
    with pytest.raises(ValueError, match=r"column 'bad' has length 5, but the batch has 6 rows"):
        batch["bad"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"column 'bad' has length 2"):
        batch["bad"] = ["a", "b"]
    with pytest.raises(TypeError, match="column 'bad'"):
        batch["bad"] = {"a": 1}
    with pytest.raises(ValueError, match="scalar"):
        batch["bad"] = torch.tensor(1.0)
    with pytest.raises(TypeError, match="rows cannot be assigned"):
        batch[0] = torch.zeros(4)
    with pytest.raises(KeyError, match="no column 'missing'"):
        batch["missing"]


def test_first_column_sets_the_length_of_a_columnless_batch():
    batch = Batch(meta={"rollouts": []})
    batch["ids"] = torch.zeros(5, 3)
    assert len(batch) == 5 and batch.tensors.batch_size == torch.Size([5])
    batch["ids"] = torch.zeros(7, 3)  # the only column: replacing it may change the length
    assert len(batch) == 7
    other = Batch()
    other["uid"] = ["a", "b"]
    assert len(other) == 2


# ---------------------------------------------------------------------------- rows


@pytest.mark.parametrize(
    "index, rows",
    [
        ([4, 0, 2], [4, 0, 2]),
        (np.array([5, 5, 1]), [5, 5, 1]),
        (torch.tensor([3, 1]), [3, 1]),
        (np.array([True, False, True, False, False, True]), [0, 2, 5]),
        (torch.tensor([False, True, False, False, False, True]), [1, 5]),
        ([True, False, False, False, False, False], [0]),
        ([-1, -6], [5, 0]),
        (3, [3]),
        (np.int64(2), [2]),
        (slice(1, 5, 2), [1, 3]),
        (slice(None, None, -1), [5, 4, 3, 2, 1, 0]),
        ([], []),
        (np.array([], dtype=np.int64), []),
        (np.zeros(6, dtype=bool), []),
    ],
)
def test_select(index, rows):
    batch = make_batch()
    selected = batch[index]
    assert_rows(selected, batch, rows)
    assert_rows(batch.select(index), batch, rows)
    assert selected.meta == batch.meta and selected.meta is not batch.meta


def test_zero_row_select_keeps_columns_and_shapes():
    selected = make_batch()[[]]
    assert len(selected) == 0
    assert selected["input_ids"].shape == (0, 4)
    assert selected["uid"].shape == (0,)


def test_slices_are_views_and_gathers_are_copies():
    batch = make_batch()
    assert batch[1:3]["input_ids"].data_ptr() == batch["input_ids"][1].data_ptr()
    gathered = batch[[1, 2]]
    gathered["input_ids"][0, 0] = -1
    assert batch["input_ids"][1, 0] != -1


def test_select_errors():
    batch = make_batch()
    with pytest.raises(IndexError, match="out of range for a batch of 6 rows"):
        batch[[0, 6]]
    with pytest.raises(IndexError, match="out of range"):
        batch[[-7]]
    with pytest.raises(IndexError, match="boolean mask has length 3, the batch has 6 rows"):
        batch[np.array([True, False, True])]
    with pytest.raises(IndexError, match="1-D"):
        batch[np.zeros((2, 2), dtype=np.int64)]
    with pytest.raises(TypeError, match="integers or booleans"):
        batch[np.array([0.5])]
    with pytest.raises(TypeError, match="cannot select rows with a"):
        batch[{1, 2}]
    with pytest.raises(TypeError):
        batch[True]


def test_reorder():
    batch = make_batch()
    order = [5, 3, 1, 0, 2, 4]
    assert_rows(batch.reorder(order), batch, order)
    assert_rows(batch.reorder(torch.tensor(order)), batch, order)
    assert_rows(batch, make_batch(), list(range(6)))  # not in place
    with pytest.raises(ValueError, match=r"permutation of range\(6\)"):
        batch.reorder([0, 0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="permutation"):
        batch.reorder([0, 1])


def test_concat():
    batch = make_batch()
    joined = Batch.concat([batch[[0, 1]], batch[[5]], batch[[2, 3, 4]]])
    assert_rows(joined, batch, [0, 1, 5, 2, 3, 4])
    assert joined.meta == {"step": 3}
    assert len(Batch.concat([batch[[]], batch[[]]])) == 0
    assert_rows(Batch.concat([batch]), batch, list(range(6)))


def test_concat_errors():
    batch = make_batch()
    other = make_batch()
    other["extra"] = torch.zeros(6)
    with pytest.raises(ValueError, match=r"batch 1 has different columns .* \(missing \[\], extra \['extra'\]"):
        Batch.concat([batch, other])
    moved = make_batch()
    moved["uid"] = torch.arange(6)
    with pytest.raises(ValueError, match="tensor in one"):
        Batch.concat([batch, moved])
    different_meta = make_batch()
    different_meta.meta["step"] = 4
    with pytest.raises(ValueError, match="meta key 'step'"):
        Batch.concat([batch, different_meta])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_chunk():
    batch = make_batch()
    chunks = batch.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert_rows(chunks[1], batch, [2, 3])
    assert all(c.meta == batch.meta for c in chunks)
    assert len(batch.chunk(1)) == 1
    with pytest.raises(ValueError, match=r"cannot split a batch of 6 rows into 4 equal chunks \(6 % 4 = 2\)"):
        batch.chunk(4)
    with pytest.raises(ValueError, match=">= 1"):
        batch.chunk(0)


@pytest.mark.parametrize("n, k, pad_rows", [(6, 4, [0, 1]), (6, 3, []), (6, 1, []), (2, 7, [0, 1, 0, 1, 0]),
                                            (1, 4, [0, 0, 0]), (6, 8, [0, 1])])
def test_pad_and_unpad(n, k, pad_rows):
    batch = make_batch(n)
    padded, pad_size = batch.pad_to_divisor(k)
    assert pad_size == len(pad_rows) and len(padded) % k == 0
    assert_rows(padded, batch, list(range(n)) + pad_rows)
    assert_rows(padded.unpad(pad_size), batch, list(range(n)))


def test_pad_unpad_errors():
    batch = make_batch()
    with pytest.raises(ValueError, match="divisor"):
        batch.pad_to_divisor(0)
    with pytest.raises(ValueError, match=r"pad_size must be in \[0, 6\]"):
        batch.unpad(7)


def test_union():
    batch = make_batch()
    other = Batch({"values": torch.ones(6, 4), "scores": batch["scores"].clone()},
                  {"uid": batch["uid"].copy(), "tag": np.array(["t"] * 6, dtype=object)}, {"extra": True, "step": 3})
    merged = batch.union(other)
    assert set(merged.keys()) == {"input_ids", "scores", "uid", "turn_index", "values", "tag"}
    assert merged.meta == {"step": 3, "extra": True}
    assert "values" not in batch  # not in place
    assert len(Batch.empty().union(batch)) == 6


def test_union_nan_and_object_equality():
    values = np.array([float("nan"), 1.0])
    objects = np.array([[1, 2], float("nan")], dtype=object)
    a = Batch(non_tensors={"v": values, "o": objects})
    b = Batch(non_tensors={"v": values.copy(), "o": np.array([[1, 2], float("nan")], dtype=object)})
    assert a.union(b).keys() == ["v", "o"]


def test_union_conflicts():
    batch = make_batch()
    with pytest.raises(ValueError, match="column 'scores' differs"):
        batch.union(Batch({"scores": torch.zeros(6)}))
    with pytest.raises(ValueError, match="column 'uid' differs"):
        batch.union(Batch(non_tensors={"uid": np.array(["z"] * 6, dtype=object)}))
    with pytest.raises(ValueError, match="column 'uid' differs"):
        batch.union(Batch({"uid": torch.zeros(6)}))
    with pytest.raises(ValueError, match="meta key 'step'"):
        batch.union(Batch({"scores": batch["scores"]}, meta={"step": 9}))
    with pytest.raises(ValueError, match="union of batches with 6 and 2 rows"):
        batch.union(Batch({"x": torch.zeros(2)}))


# ---------------------------------------------------------------------------- verl


def verl_batch(n: int) -> Batch:
    generator = torch.Generator().manual_seed(n)
    return Batch(
        tensors={
            "input_ids": torch.randint(0, 1000, (n, 24), generator=generator),
            "attention_mask": torch.randint(0, 2, (n, 24), generator=generator),
            "old_log_probs": torch.randn(n, 8, generator=generator),
            "is_drop_mask": torch.rand(n, generator=generator) > 0.5,
        },
        non_tensors={
            "uid": np.array([f"task-{i // 4}" for i in range(n)], dtype=object),
            "turn_index": np.arange(n),
            "payload": np.fromiter(({"i": i} for i in range(n)), dtype=object, count=n),
        },
        meta={"global_token_num": list(range(n)), "temperature": 1.0},
    )


def test_dataproto_round_trip_is_lossless_and_zero_copy():
    from verl import DataProto

    batch = verl_batch(4096)
    data = batch.to_dataproto()
    assert isinstance(data, DataProto)
    assert_same_as_dataproto(batch, data)
    back = Batch.from_dataproto(data)
    assert_same_as_dataproto(back, data)
    for name in batch.tensors.keys():
        assert data.batch[name].data_ptr() == batch[name].data_ptr()
        assert back[name].data_ptr() == batch[name].data_ptr()
    for name in batch.non_tensors:
        assert back[name] is batch[name]


def test_dataproto_does_not_alias_the_batch_containers():
    batch = verl_batch(8)
    data = batch.to_dataproto()
    data.batch["new"] = torch.zeros(8)
    data.non_tensor_batch["new"] = np.zeros(8)
    data.meta_info["new"] = 1
    assert "new" not in batch and "new" not in batch.meta


def test_from_dataproto_without_tensors():
    from verl import DataProto

    data = DataProto(batch=None, non_tensor_batch={"uid": np.array(["a", "b"], dtype=object)})
    batch = Batch.from_dataproto(data)
    assert len(batch) == 2 and batch.keys() == ["uid"]
    assert len(batch.to_dataproto()) == 2


@pytest.mark.parametrize("n, k", [(10, 4), (12, 4), (3, 8), (1, 5), (4096, 7)])
def test_pad_matches_verl(n, k):
    from verl.protocol import pad_dataproto_to_divisor, unpad_dataproto

    batch = verl_batch(n)
    padded, pad_size = batch.pad_to_divisor(k)
    verl_padded, verl_pad_size = pad_dataproto_to_divisor(batch.to_dataproto(), k)
    assert pad_size == verl_pad_size
    assert_same_as_dataproto(padded, verl_padded)
    assert_same_as_dataproto(padded.unpad(pad_size), unpad_dataproto(verl_padded, verl_pad_size))


def test_select_concat_chunk_union_match_verl():
    from verl import DataProto

    batch = verl_batch(12)
    data = batch.to_dataproto()
    rows = np.array([11, 0, 5, 5, 2])
    assert_same_as_dataproto(batch[rows], data[rows])
    assert_same_as_dataproto(batch[3:9:2], data[3:9:2])
    mask = torch.arange(12) % 3 == 0
    assert_same_as_dataproto(batch[mask], data[mask])
    for ours, theirs in zip(batch.chunk(4), data.chunk(4)):
        assert_same_as_dataproto(ours, theirs)
    assert_same_as_dataproto(Batch.concat(batch.chunk(3)), DataProto.concat(data.chunk(3)))
    extra = Batch({"values": torch.randn(12, 8)}, meta={"temperature": 1.0})
    assert_same_as_dataproto(batch.union(extra), batch.to_dataproto().union(extra.to_dataproto()))


def test_missing_verl_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)
    with pytest.raises(ImportError, match=r"pip install 'agl-core\[verl\]'"):
        make_batch().to_dataproto()



# ---------------------------------------------------------------- lazy row selection


def _numbered(n=10):
    return Batch({"a": torch.arange(n), "b": torch.arange(n * 3).reshape(n, 3).float()},
                 {"uid": np.array([str(i) for i in range(n)], dtype=object)})


def test_chained_selections_gather_each_column_once_when_read():
    batch = _numbered()
    picked = batch[[9, 1, 5, 3]][np.array([True, False, True, True])][[2, 0]]
    assert len(picked) == 2 and sorted(picked.keys()) == ["a", "b", "uid"] and "b" in picked
    assert set(picked._pending) == {"a", "b"}  # nothing copied yet
    assert picked["a"].tolist() == [3, 9]
    assert set(picked._pending) == {"b"}  # only the column that was read
    assert torch.equal(picked["b"], batch["b"][[3, 9]])
    assert picked["uid"].tolist() == ["3", "9"]


def test_lazy_batch_slices_chunks_pads_pops_and_converts():
    batch = _numbered()[[4, 3, 2, 1, 0]]
    assert batch[1:3]["a"].tolist() == [3, 2]
    assert [c["a"].tolist() for c in batch.chunk(5)] == [[4], [3], [2], [1], [0]]
    padded, pad = batch.pad_to_divisor(4)
    assert pad == 3 and padded["a"].tolist() == [4, 3, 2, 1, 0, 4, 3, 2]
    assert padded.unpad(pad)["a"].tolist() == [4, 3, 2, 1, 0]
    assert batch.pop("a").tolist() == [4, 3, 2, 1, 0] and "a" not in batch
    assert set(batch.tensors.keys()) == {"b"} and not batch._pending
    assert torch.equal(Batch.from_dataproto(batch.to_dataproto())["b"], batch["b"])


def test_writing_a_column_of_a_lazy_batch_replaces_the_pending_one():
    batch = _numbered()[[0, 1]]
    batch["a"] = torch.tensor([7, 8])
    assert batch["a"].tolist() == [7, 8]
    assert Batch.concat([batch, batch])["a"].tolist() == [7, 8, 7, 8]


def test_the_per_call_columns_follow_their_rows():
    """(rows, C) NumPy call columns (NaN, "" and None pads) go with their rows through every row operation."""
    from agl_core.data import CALL_COLUMNS

    turns = np.array([[0, 1], [2, -1], [0, -1]])
    batch = Batch(tensors={"turn_ids": torch.tensor([[0, 1], [2, -1], [0, 0]], dtype=torch.int32)},
                  non_tensors={"call_turns": turns, "call_rewards": np.where(turns >= 0, 0.5, np.nan),
                               "call_reward_sources": np.where(turns >= 0, "call", ""),
                               "call_state_keys": np.array([["a", None], ["b", None], [None, None]], dtype=object),
                               "call_state_ids": np.where(turns >= 0, 7, -1)})
    assert set(CALL_COLUMNS) <= set(batch.keys())
    picked = batch.select([2, 0])
    assert picked["call_turns"].tolist() == [[0, -1], [0, 1]] and picked["turn_ids"].tolist() == [[0, 0], [0, 1]]
    assert picked["call_state_keys"].tolist() == [[None, None], ["a", None]]
    assert picked["call_state_ids"].tolist() == [[7, -1], [7, 7]]
    padded, pad = batch.pad_to_divisor(2)
    assert pad == 1 and padded.unpad(pad)["call_reward_sources"].tolist() == batch["call_reward_sources"].tolist()
    both = Batch.concat([batch, batch])
    assert both["call_rewards"].shape == (6, 2) and np.isnan(both["call_rewards"][4, 1])
    assert batch.union(batch)["call_turns"] is turns  # NaN pads compare equal
