"""The calculator agent: arithmetic word problems solved with a calculator tool, over the plain ``openai`` client.

The model sees the problem and two conventions: ``<calc>EXPRESSION</calc>``
asks the calculator (the agent answers ``<result>VALUE</result>`` in the next
user message) and ``<answer>NUMBER</answer>`` ends the episode. A text
protocol rather than OpenAI tool calls: it needs no tool-call parser in the
serving engine, and every turn stays a plain chat message, so the trajectory
aggregator can merge the turns into one training row. The reward is 1.0 for
the right answer within ``max_turns`` model calls, else 0.0.

Validation episodes are greedy (temperature 0), as verl validates; training
episodes use the recipe's sampling (``llm.sampling``).
"""

from __future__ import annotations

import ast
import logging
import math
import operator
import re

from openai import DefaultHttpxClient, OpenAI

from agl_core import agent, per_thread
from agl_core.data import Task

SYSTEM = ("Solve the arithmetic problem. To use the calculator, write <calc>EXPRESSION</calc> "
          "(numbers, + - * / ** and parentheses) and wait for the result. "
          "When you know the final number, write <answer>NUMBER</answer>.")
CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"<answer>\s*([-+]?[\d.,]+(?:[eE][-+]?\d+)?)\s*</answer>")

HTTP = per_thread(DefaultHttpxClient)
"""An HTTP client per worker thread, reused by its games (:func:`agl_core.per_thread` says why)."""
for _name in ("httpx", "httpx2"):
    logging.getLogger(_name).setLevel(logging.WARNING)

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, huge powers)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        return float(value(ast.parse(expression.replace("^", "**"), mode="eval").body))
    except (SyntaxError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(str(exc)) from None


def correct(answer: str, truth: float) -> bool:
    """Whether the number in ``answer`` equals ``truth`` (relative tolerance 1e-6)."""
    try:
        return math.isclose(float(answer.replace(",", "")), truth, rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def reply(text: str) -> tuple[str | None, str | None]:
    """``(final answer, calculator feedback)`` for a model message; exactly one of them is set."""
    found = ANSWER.search(text)
    if found:
        return found.group(1), None
    call = CALC.search(text)
    if call is None:
        return None, "Use <calc>EXPRESSION</calc>, or give the result as <answer>NUMBER</answer>."
    try:
        result = calculate(call.group(1))
    except ValueError as exc:
        return None, f"<result>error: {exc}</result>"
    return None, f"<result>{result:.10g}</result>"


@agent("calc")
def calc(task: Task, llm) -> float:
    """Solve one problem; 1.0 when the answer is right within ``max_turns`` model calls, else 0.0."""
    spec = task.input
    client = OpenAI(base_url=llm.base_url, api_key=llm.api_key, http_client=HTTP(), max_retries=0)
    temperature = 0.0 if task.split == "val" else llm.sampling.get("temperature", 1.0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": spec["question"]}]
    for _ in range(spec["max_turns"]):
        response = client.chat.completions.create(model=llm.model, messages=messages, temperature=temperature,
                                                  max_tokens=spec["max_tokens"])
        text = response.choices[0].message.content or ""
        answer, feedback = reply(text)
        if answer is not None:
            return 1.0 if correct(answer, spec["answer"]) else 0.0
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
    return 0.0
