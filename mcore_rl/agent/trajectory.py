"""A multi-turn trajectory as the trainer sees it, and the statistics logged about an episode's trajectories."""

from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.rollout.engine import Completion

# Why a trajectory stopped: the environment (or the agent program) said done; max_turns or max_total_tokens
# reached; a turn cut at max_new_tokens; its environment failed or timed out; its agent program raised, crashed or
# returned garbage, or passed its deadline.
STOP_REASONS = ("done", "max_turns", "max_tokens", "length", "env_error", "agent_error", "agent_timeout")


@dataclass(frozen=True)
class Segment:
    """A training sample a trajectory ended when its chat template rewrote the history (``rewritten_history:
    new_sample``): the context it started from and what followed, up to the observation after which the template
    renders the conversation differently."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]


@dataclass(frozen=True)
class Trajectory(Completion):
    """Everything after the opening prompt (``token_ids``, ``logprobs`` and ``loss_mask`` over all of it;
    ``versions`` of the sampled tokens), with ``finish_reason`` the stop reason. Where the template rewrote the
    history, ``prompt_ids`` is the last rewritten context, what follows it is the last segment, ``segments`` are the
    ones before, and ``versions`` cover every segment's sampled tokens."""

    prompt_ids: list[int] = field(default_factory=list)  # the environment's opening messages, rendered
    segments: tuple[Segment, ...] = ()  # earlier training samples, in order
    messages: list[dict] = field(default_factory=list)  # the conversation, for the rollout records
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)  # by kind
    tool_seconds: list[float] = field(default_factory=list)
    env_errors: int = 0

    @property
    def response_ids(self) -> list[int]:
        """Every segment's ids after its prompt, in order: what the policy sampled and observed."""
        return [t for segment in self.segments for t in segment.token_ids] + self.token_ids


@dataclass
class TrajectoryBuilder:
    """A trajectory as it grows: the opening prompt, then sampled turns and observations appended, never
    re-tokenised (what the engine sampled is what is trained on, and the context of its next turn)."""

    prompt_ids: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)  # the latest turn's sampled ids
    reward: float = 0.0
    stats: dict = field(default_factory=lambda: dict(turns=0, tool_calls=0, tool_errors={}, env_errors=0))
    tool_seconds: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        """The token ids of the whole trajectory so far: the next turn's prompt."""
        return self.prompt_ids + self.ids

    def add_turn(self, completion: Completion, message: dict) -> None:
        self.stats["turns"] += 1
        self.last_turn = completion.token_ids
        self.ids += completion.token_ids
        self.logprobs += completion.logprobs
        self.mask += [1] * len(completion.token_ids)
        self.versions += completion.versions
        self.messages.append(message)

    def add_observation(self, ids: list[int], messages: list[dict]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.messages += messages

    def new_segment(self, prompt_ids: list[int], messages: list[dict]) -> None:
        """End the current training sample and continue from ``prompt_ids``, the conversation (which ``messages``
        end) as the template renders it now."""
        self.segments.append(Segment(self.prompt_ids, self.ids, self.logprobs, self.mask))
        self.prompt_ids, self.ids, self.logprobs, self.mask = prompt_ids, [], [], []
        self.messages += messages

    def add_tool_call(self, error: str, seconds: float) -> None:
        """A call and its error's kind ("" for none)."""
        self.stats["tool_calls"] += 1
        if error:
            self.stats["tool_errors"][error] = self.stats["tool_errors"].get(error, 0) + 1
        if seconds:
            self.tool_seconds.append(seconds)

    def build(self, stop: str) -> Trajectory:
        return Trajectory(
            token_ids=self.ids, logprobs=self.logprobs, finish_reason=stop, versions=self.versions,
            loss_mask=self.mask, prompt_ids=self.prompt_ids, messages=self.messages, reward=self.reward,
            tool_seconds=self.tool_seconds, segments=tuple(self.segments), **self.stats,
        )  # fmt: skip


def trajectory_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per trajectory: turns, tool calls, tool errors, training samples (segments); tool latency over all calls;
    environment errors; the share of each stop reason; the share of trajectory tokens that are observations
    (masked)."""
    n = len(trajectories)
    latencies = [s for t in trajectories for s in t.tool_seconds]
    masks = [m for t in trajectories for m in (t.loss_mask, *(s.loss_mask for s in t.segments))]
    tokens = sum(map(len, masks))
    stats = {
        "agent/turns_mean": sum(t.turns for t in trajectories) / n,
        "agent/turns_max": float(max(t.turns for t in trajectories)),
        "agent/tool_calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "agent/tool_errors": float(sum(sum(t.tool_errors.values()) for t in trajectories)),
        "agent/tool_latency_mean_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "agent/tool_latency_max_s": max(latencies, default=0.0),
        "agent/env_errors": float(sum(t.env_errors for t in trajectories)),
        "agent/observation_token_fraction": sum(m.count(0) for m in masks) / max(tokens, 1),
        "agent/segments_mean": sum(1 + len(t.segments) for t in trajectories) / n,
    }
    kinds = sorted({kind for t in trajectories for kind in t.tool_errors})
    stats |= {f"agent/tool_errors/{k}": float(sum(t.tool_errors.get(k, 0) for t in trajectories)) for k in kinds}
    return stats | {
        f"agent/stop_{r}_fraction": sum(t.finish_reason == r for t in trajectories) / n for r in STOP_REASONS
    }
