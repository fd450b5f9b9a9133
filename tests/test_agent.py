"""The agent API: naming and loading agents, emitting rewards and annotations."""

import math
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
import torch

import agl_core
from agl_core.rollout.agents import (LLM, RolloutScope, agent, agent_name, as_reward, emit_annotation, emit_reward,
                             emit_state_key, load_agent, rollout_scope)
from agl_core.builtin.memory_store import MemoryStore
from agl_core.data import Rollout, Task
from agl_core.rollout.store import NewRollout

AGENT_MODULE = """
from agl_core import agent

@agent(name="guesser")
def play(task, llm):
    return 1.0

async def async_play(task, llm):
    return 0.5

def no_llm(task):
    return 0.0

class Box:
    def run(self, task, llm):
        return None

box = Box()
"""


@pytest.fixture
def agents_module(tmp_path, monkeypatch):
    (tmp_path / "my_agents.py").write_text(AGENT_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_agents", raising=False)
    return "my_agents"


def test_the_public_api_is_exported():
    assert agl_core.emit_reward is emit_reward and agl_core.LLM is LLM and agl_core.agent is agent


def test_load_agent_by_import_path(agents_module):
    play = load_agent("my_agents:play")
    assert play(None, None) == 1.0 and agent_name(play) == "guesser"
    assert agent_name(load_agent("my_agents:async_play")) == "async_play"
    assert load_agent("my_agents:box.run")(None, None) is None


@pytest.mark.parametrize("spec, message", [
    ("no_such_module:agent", "cannot import 'no_such_module'"),
    ("my_agents:missing", "has no attribute 'missing'"),
    ("my_agents:no_llm", "must accept (task, llm)"),
    ("unregistered", "no agent of that name"),
])
def test_load_agent_errors_say_what_is_wrong(agents_module, spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_agent(spec)


def test_load_agent_by_registered_name(tmp_path, monkeypatch):
    (tmp_path / "named_agent.py").write_text("def run(task, llm):\n    return 2.0\n")
    info = tmp_path / "named_agent_dist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: named-agent-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[agl_core.agents]\nnamed = named_agent:run\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_agent("named")(None, None) == 2.0


def test_the_decorator_checks_the_signature():
    with pytest.raises(TypeError, match=r"must accept \(task, llm\)"):
        agent()(lambda task: None)

    @agent()
    def solve(task, llm, *, retries=2):
        return None

    assert agent_name(solve) == "solve"


@pytest.mark.parametrize(("value", "expected"), [
    (1, 1.0), (True, 1.0), (0.25, 0.25), (Fraction(1, 4), 0.25), (Decimal("0.25"), 0.25),
    (np.float32(0.25), 0.25), (np.float64(0.25), 0.25), (np.int64(3), 3.0), (np.bool_(True), 1.0),
    (np.array(0.25), 0.25), (torch.tensor(0.25), 0.25), (torch.tensor(2), 2.0), (None, None)])
def test_a_reward_is_any_real_number_or_a_0d_array_of_one(value, expected):
    reward = as_reward(value, "r")
    assert reward == expected and (reward is None or type(reward) is float)


@pytest.mark.parametrize(("value", "named"), [
    ("1.0", "str '1.0'"), ([1.0], "list [1.0]"), ({"reward": 1}, "dict"), (1 + 2j, "complex (1+2j)"),
    (np.complex64(1), "numpy.complex64"), (np.array([1.0, 2.0]), "numpy.ndarray of shape (2,)"),
    (np.array([1.0]), "numpy.ndarray of shape (1,)"), (torch.tensor([1.0]), "torch.Tensor of shape (1,)"),
    (torch.tensor(1 + 1j), "torch.Tensor of shape () and dtype torch.complex64")])
def test_other_types_are_refused_with_the_type_named(value, named):
    with pytest.raises(ValueError, match=f"r must be a real number or None, got {re.escape(named)}"):
        as_reward(value, "r")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), np.float64("inf"),
                                   torch.tensor(math.nan), Decimal("NaN"), Decimal("sNaN"), Decimal("1e400"),
                                   10 ** 400])
def test_a_reward_must_be_finite(value):
    with pytest.raises(ValueError, match="r must be finite"):
        as_reward(value, "r")


def test_emit_outside_a_rollout_is_an_error():
    with pytest.raises(RuntimeError, match="emit_reward was called outside a rollout"):
        emit_reward(1.0)


def test_emit_records_spans_in_order_with_the_agent_name():
    store = MemoryStore()
    store.enqueue([NewRollout("r", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    with rollout_scope(RolloutScope("r", attempt.attempt_id, store, "guesser", lease=attempt.lease)) as scope:
        emit_annotation(tool="search", hits=3)
        emit_reward(0.25, stage="first")
        emit_reward(1)
        with pytest.raises(ValueError, match="must be finite"):
            emit_reward(math.nan)
        with pytest.raises(TypeError, match="JSON-serializable"):
            emit_annotation(obj=object())
    assert scope.last_reward == 1.0
    spans = store._entries["r"].spans
    assert [(s.sequence_id, s.kind, s.reward) for s in spans] == [(0, "annotation", None), (1, "reward", 0.25),
                                                                 (2, "reward", 1.0)]
    assert spans[0].attributes == {"agent_name": "guesser", "tool": "search", "hits": 3}
    assert spans[1].attributes["stage"] == "first" and spans[1].attempt_id == "1"


def test_a_state_key_is_an_annotation_that_the_aggregators_attach_to_the_next_call():
    from agl_plugin_traces.calls import TraceCounts, rollout_calls

    store = MemoryStore()
    store.enqueue([NewRollout("r", Task(id="t", input={}))])
    attempt = store.dequeue("w", 30)
    with rollout_scope(RolloutScope("r", attempt.attempt_id, store, "guesser", lease=attempt.lease)):
        emit_state_key("1-7")
        with pytest.raises(TypeError, match="takes a str.*json.dumps"):
            emit_state_key(("1", "7"))
    (span,) = store._entries["r"].spans
    assert span.kind == "annotation" and span.attributes == {"agent_name": "guesser", "state_key": "1-7"}
    call = span.model_copy(update={"kind": "llm_call", "sequence_id": 1, "attributes": {},
                                   "prompt_token_ids": [1], "response_token_ids": [2]})
    calls = rollout_calls(Rollout(rollout_id="r", task_id="t", status="succeeded", spans=[span, call]), TraceCounts())
    assert [c.state_key for c in calls] == ["1-7"]
    assert agl_core.emit_state_key is emit_state_key


def test_an_agent_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "cwd_agent.py").write_text("def run(task, llm):\n    return 3.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "cwd_agent", raising=False)
    assert load_agent("cwd_agent:run")(None, None) == 3.0


def test_per_thread_makes_one_object_per_thread_and_reuses_it():
    made = []
    http = agl_core.per_thread(lambda: made.append(object()) or made[-1])
    mine = http()
    assert http() is mine
    with ThreadPoolExecutor(3) as pool:
        theirs = list(pool.map(lambda _: (http(), http()), range(9)))
    assert all(a is b and a is not mine for a, b in theirs)
    assert len({id(a) for a, _ in theirs}) <= 3 and len(made) == 1 + len({id(a) for a, _ in theirs})
