"""Tools a policy calls during a multi-turn rollout: a name, a JSON schema of its arguments, and
``call(arguments) -> str``. Built in: ``calculator`` and ``python`` (a sandboxed executor); a user's tool is an
object or class in a Python file (``models.reward.tools: [path/to/file.py:name]``), loaded as reward functions are.
"""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

import jsonschema

from mcore_rl.agent.sandbox import Sandbox, SandboxConfig
from mcore_rl.userfile import UserCodeError, load_attribute

KEY = "models.reward.tools"


class ToolError(UserCodeError):
    """A tool that cannot be loaded, or one call's failure (its message becomes the policy's observation; its
    ``kind`` is counted in ``agent/tool_errors/<kind>``)."""

    def __init__(self, message: str, kind: str = "raised"):
        super().__init__(message)
        self.kind = kind


class Calculator:
    """Exact arithmetic on one expression: + - * / // % ** and parentheses over integers and decimals."""

    name = "calculator"
    description = "Evaluate an arithmetic expression exactly, e.g. (12 + 7) * 3 / 4. Returns the number."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression, e.g. 3 * (4 + 5)"}},
        "required": ["expression"],
    }
    _BINARY = {
        ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    }  # fmt: skip
    _UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}

    MAX_CHARS = 1000  # of an expression
    MAX_BITS = 1000  # of a result's numerator or denominator (about 300 digits): work stays microseconds

    def call(self, arguments: dict) -> str:
        expression = arguments["expression"]
        if len(expression) > self.MAX_CHARS:
            raise ToolError(f"the expression is longer than {self.MAX_CHARS} characters", "arguments")
        try:
            value = self._eval(ast.parse(expression.replace("^", "**"), mode="eval").body)
        except (SyntaxError, ValueError):  # ValueError: a float literal of inf or nan
            raise ToolError(f"not an arithmetic expression: {expression!r}") from None
        except (RecursionError, MemoryError):
            raise ToolError("the expression is nested too deep") from None
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if value.denominator == 1:
            return str(value.numerator)
        return f"{float(value):.10g}"

    def _eval(self, node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and type(node.op) in self._UNARY:
            return self._UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in self._BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow):
                if right.denominator != 1 or abs(right) > 64:
                    raise ToolError("exponents must be whole numbers of at most 64")
                self._check_size(self._bits(left) * abs(right.numerator))  # before computing it
            value = self._BINARY[type(node.op)](left, right)
            self._check_size(self._bits(value))
            return value
        raise ToolError(f"unsupported in an arithmetic expression: {ast.unparse(node)[:200]!r}")

    @staticmethod
    def _bits(value: Fraction) -> int:
        return max(value.numerator.bit_length(), value.denominator.bit_length())

    def _check_size(self, bits: int) -> None:
        if bits > self.MAX_BITS:
            raise ToolError(f"the result is too large (more than {self.MAX_BITS} bits)")


class PythonTool:
    """Run a Python program in the sandbox (:mod:`mcore_rl.agent.sandbox`); the result is what it prints."""

    name = "python"
    description = (
        "Run a Python 3 program (standard library only; no network; files only in its working directory) and "
        "return what it prints. Print the values you need."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program"}},
        "required": ["code"],
    }

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def call(self, arguments: dict) -> str:
        return self.sandbox.run(arguments["code"])


BUILTIN_TOOLS = (Calculator.name, PythonTool.name)


def load_tool(spec: str, sandbox: SandboxConfig, key: str = KEY):
    """A built-in tool by name, or a user's tool (an object, or a class built with no arguments) from a file."""
    if spec == Calculator.name:
        return Calculator()
    if spec == PythonTool.name:
        return PythonTool(Sandbox.start(sandbox))
    tool = load_attribute(key, spec, "tool", "a tool object with name, parameters and call(arguments)", ToolError)
    if isinstance(tool, type):
        tool = tool()
    problems = [
        f"{attr} ({expected})"
        for attr, ok, expected in (
            ("name", isinstance(getattr(tool, "name", None), str) and tool.name, "a non-empty string"),
            ("parameters", isinstance(getattr(tool, "parameters", None), dict), "a JSON schema object"),
            ("call", callable(getattr(tool, "call", None)), "a method call(arguments) -> str"),
        )
        if not ok
    ]
    if problems:
        raise ToolError(f"{key}: {spec!r} is not a tool: it lacks " + ", ".join(problems))
    try:
        jsonschema.Draft202012Validator.check_schema(tool.parameters)
    except jsonschema.SchemaError as err:
        raise ToolError(f"{key}: {spec!r}: parameters is not a valid JSON schema: {err.message}") from None
    return tool


def load_tools(specs: list[str], sandbox: SandboxConfig) -> dict:
    """The tools by name; two tools of one name are an error."""
    tools = {}
    for i, spec in enumerate(specs):
        tool = load_tool(spec, sandbox, f"{KEY}[{i}]")
        if tool.name in tools:
            raise ToolError(f"{KEY}[{i}]={spec!r}: a second tool named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def schema(tool) -> dict:
    """The tool as chat templates take it (the OpenAI function format)."""
    description = getattr(tool, "description", None) or (type(tool).__doc__ or "").strip()
    return {
        "type": "function",
        "function": {"name": tool.name, "description": description, "parameters": tool.parameters},
    }


def invoke(tool, arguments: dict) -> str:
    """One checked call: arguments against the tool's schema, the result a string; anything else is a
    :class:`ToolError` whose message the policy reads."""
    try:
        jsonschema.validate(arguments, tool.parameters)
    except jsonschema.ValidationError as err:
        raise ToolError(f"invalid arguments for {tool.name}: {err.message[:500]}", "arguments") from None
    except RecursionError:
        raise ToolError(f"invalid arguments for {tool.name}: nested too deep", "arguments") from None
    try:
        result = tool.call(arguments)
    except ToolError:
        raise
    except Exception as err:  # noqa: BLE001 - the tool's failure is the policy's observation
        raise ToolError(f"{tool.name} raised {type(err).__name__}: {err}") from None
    if not isinstance(result, str):
        raise ToolError(f"{tool.name} returned {type(result).__name__}, not text", "bad_output")
    return result
