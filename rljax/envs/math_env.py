"""A multi-step math task that needs a tool: compute an expression with the calculator (or Python), then
answer with the number.

Conversation (Qwen chat format; the tiny test tokenizer has the same special tokens):
    <|im_start|>user\\nUse the calculator tool to compute: 713 * 58 + 9<|im_end|>\\n<|im_start|>assistant\\n
    [prefill] <tool_call>{"name": "calculator", "arguments": {"expression": "713 * 58 + 9     (prompt)
    [model]   "}}</tool_call>                                                                  (mask 1)
    [env]     <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n41363\\n</tool_response><|im_end|>\\n
              <|im_start|>assistant\\n                                                            (mask 0)
    [model]   41363<|im_end|>                                                                 (mask 1)
`prefill` puts the opening of the call into the prompt: "none" (the model must write the whole call),
"call" (up to the argument's opening quote) or "expression" (the expression too: the model only has to
close the call, which is what a tiny model can learn in a few hundred SFT steps). Rewards: 0 for tool
steps; the final answer turn (the last turn without a tool call) is handed to the driver as
`StepResult.grade`, which the run's reward functions score (`reward.functions`, default `math`) in the
reward pool's worker processes, where a grade that hangs is killed at `reward.timeout_s`. A
malformed or failed call gets an error observation and the episode goes on (up to the driver's turn limit).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from rljax.envs.base import StepResult
from rljax.envs.driver import ENVS, EnvSpec
from rljax.envs.parsing import OPEN, MalformedCall, parse_tool_call
from rljax.envs.tools import run_tool

USER_TURN = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
TOOL_RESPONSE = (
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)
_CHAT_MARKERS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
_ARGUMENT = {"calculator": ("expression", "{expr}"), "python": ("code", "print({expr})")}


def answer_text(message: str) -> str:
    """The final answer turn without chat markers."""
    for marker in _CHAT_MARKERS:
        message = message.replace(marker, " ")
    return message.strip()


@dataclasses.dataclass
class ToolMathEnv:
    """One episode of the math-with-a-tool task; needs examples with "expr" and "answer" (the
    `arithmetic` data source has both)."""

    tool: str = "calculator"
    prefill: str = "expression"
    tool_timeout_s: float = 5.0
    _example: dict[str, Any] | None = None
    _message: str = ""  # the current assistant message so far (prefill + model text), for parsing

    def __post_init__(self):
        if self.tool not in _ARGUMENT:
            raise ValueError(f"ToolMathEnv.tool must be one of {sorted(_ARGUMENT)}, got {self.tool!r}")
        if self.prefill not in ("none", "call", "expression"):
            raise ValueError(f"ToolMathEnv.prefill must be none, call or expression, got {self.prefill!r}")

    def prefill_text(self, example: dict[str, Any]) -> str:
        """The opening of the tool call placed at the end of the prompt (see the module docstring)."""
        if self.prefill == "none":
            return ""
        key, value = _ARGUMENT[self.tool]
        opening = f'{{"name": {json.dumps(self.tool)}, "arguments": {{{json.dumps(key)}: "'
        argument = value.format(expr=example["expr"]) if self.prefill == "expression" else ""
        return OPEN + opening + argument

    def reset(self, example: dict[str, Any]) -> str:
        self._example = example
        self._message = self.prefill_text(example)
        question = f"Use the {self.tool} tool to compute: {example['expr']}"
        return USER_TURN.format(content=question) + self._message

    def step(self, action: str) -> StepResult:
        if self._example is None:
            raise RuntimeError("ToolMathEnv.step before reset")
        message, self._message = self._message + action, ""
        call = parse_tool_call(message)
        if call is None:
            info = {"tool": None, "tool_status": None}
            return StepResult("", 0.0, True, info, grade=answer_text(message))
        if isinstance(call, MalformedCall):
            output = f"error: malformed tool call: {call.reason}"
            return StepResult(TOOL_RESPONSE.format(output=output), 0.0, False, {"tool_status": "malformed"})
        outcome = run_tool(call.name, call.arguments, timeout_s=self.tool_timeout_s)
        info = {"tool": call.name, "tool_status": outcome.status}
        return StepResult(TOOL_RESPONSE.format(output=outcome.text), 0.0, False, info)


ENVS.add("calculator_math", EnvSpec(functools.partial(ToolMathEnv, "calculator", "expression")))
ENVS.add("calculator_math_open", EnvSpec(functools.partial(ToolMathEnv, "calculator", "call")))
ENVS.add("python_math", EnvSpec(functools.partial(ToolMathEnv, "python", "expression", 10.0)))
