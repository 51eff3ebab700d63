"""Tools for bench/agent_step.sh: the calculator of examples/agents/calculator.py, answering at
once or after 200 ms (a tool that waits on a service, a compiler, a sandbox)."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "agents"))
from calculator import calculator as _calculator  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "123 * 456".
    """
    return _calculator(expression)


def slow_calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "123 * 456".
    """
    time.sleep(0.2)
    return _calculator(expression)
