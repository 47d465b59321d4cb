"""The agent suite's plain agent program (``models.reward.agent``): the built-in calculator loop written as a user
writes one, with the ``openai`` client against the run's endpoint; its reward is the math reward of the answer."""

import json

import openai

from mcore_rl.agent.tools import Calculator, ToolError, invoke, schema
from mcore_rl.rewards.math import math_reward

MAX_TURNS = 3


def run(base_url: str, api_key: str, row: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=3600)
    calculator, messages = Calculator(), list(row["messages"])
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[schema(calculator)])
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return math_reward(message.content, row["answer"])
        if reply.choices[0].finish_reason == "length":
            return 0.0
        for call in message.tool_calls:
            try:
                result = invoke(calculator, json.loads(call.function.arguments))
            except ToolError as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
