"""The same calculator, answering after 200 ms (a tool that waits on a service, a compiler, a
sandbox): the same name and schema as fast.py, so that both runs sample the same episodes."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "agents"))
from calculator import calculator as _calculator  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "123 * 456".
    """
    time.sleep(0.2)
    return _calculator(expression)
