"""A toy reward a tiny random model can learn: the fraction of lowercase vowels in its response."""


def reward_fn(messages, answer):
    text = messages[-1]["content"]
    return sum(c in "aeiou" for c in text) / max(len(text), 1)
