"""The calculator of examples/agents/calculator.py, answering at once (bench/agent_step.sh)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "agents"))
from calculator import calculator as _calculator  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression.

    Args:
        expression: The expression to evaluate, e.g. "123 * 456".
    """
    return _calculator(expression)
