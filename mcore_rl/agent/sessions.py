"""Agent sessions: trajectories that an agent program outside the run drives through OpenAI-style chat requests
(:mod:`mcore_rl.agent.server` serves them over HTTP).

Each session is one trajectory, recorded as the built-in loop records its own (:class:`TrajectoryBuilder`): the
first request's messages rendered by the policy's chat template are its prompt; each later request must repeat
the session's messages so far exactly (the assistant turns as they were served) and add observations after the
last assistant turn (tool results, user messages), whose ids the template puts after the sampled ids, never
re-tokenising them. With ``rewritten_history: new_sample`` a history the agent changed (compacted, summarised),
or one the template renders differently once observations follow, is no error: the trajectory goes on from it
rendered anew, a new training sample. The policy's sampling settings are the run's: an agent may shorten a turn
(``max_tokens``), not change how the policy samples. A request that does not fit (another model, a changed history
or tool list, a finished session, a turn past the session's limits, malformed messages) is a
:class:`RequestError` with what was expected, which the server answers with an OpenAI-style 400.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import logging
import threading
import time
from dataclasses import dataclass, field

from mcore_rl.agent.chat import ChatFormat, clip
from mcore_rl.agent.tool_calls import KEY, call_ids, openai_tool_calls, parse_tool_calls, resolve_format
from mcore_rl.agent.trajectory import Trajectory, TrajectoryBuilder
from mcore_rl.rollout.engine import Completion, MultiTurnConfig, SamplingConfig

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
OBSERVATION_ROLES = ("user", "tool")  # what an agent may add after an assistant turn


class RequestError(Exception):
    """A request the session cannot take: answered with ``status`` and the message, the session unchanged."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError(f"{where}.content: expected a string or a list of text parts", param=where)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls as ``{"id", "name", "arguments": dict}``."""
    out = []
    for i, call in enumerate(calls or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{where}.tool_calls[{i}]: expected {{'function': {{'name', 'arguments'}}}}", param=where
            )
        arguments = function.get("arguments") or "{}"
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise RequestError(f"{where}.tool_calls[{i}].function.arguments: not JSON", param=where) from None
        out.append({"id": str(call.get("id", "")), "name": function["name"], "arguments": arguments})
    return out


def normalize(messages, where: str = "messages") -> list[dict]:
    """Request messages as the session compares and renders them: role, text content, and an assistant's tool
    calls or a tool message's call id; whatever else a client sends along (``refusal``, ``annotations``) is not
    part of the conversation."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"{where}: expected a non-empty list of messages", param=where)
    out = []
    for i, message in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise RequestError(f"{at}.role: expected one of {', '.join(ROLES)}", param=at)
        m = {"role": message["role"], "content": _text(message.get("content"), at)}
        if m["role"] == "assistant" and message.get("tool_calls"):
            m["tool_calls"] = _tool_calls(message["tool_calls"], at)
        if m["role"] == "tool":
            m["tool_call_id"] = str(message.get("tool_call_id", ""))
        out.append(m)
    return out


def _rendered(message: dict) -> dict:
    """A normalized message as chat templates read it (tool calls as ``{"type": "function", "function": ...}``)."""
    if "tool_calls" not in message:
        return message
    calls = [{"type": "function", "id": c["id"], "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in message["tool_calls"]]  # fmt: skip
    return {**message, "tool_calls": calls}


class EngineCalls:
    """Turns for many sessions at once on the rollout engines: handler threads wait on futures while one pump
    thread submits and collects, so the engines batch every session that is generating."""

    def __init__(self, rollout):
        self.rollout = rollout
        self._lock = threading.Lock()
        self._queued: list[tuple[str, list[int], SamplingConfig, int]] = []
        self._waiting: dict[str, concurrent.futures.Future] = {}
        self._keys = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._pump, name="agent-sessions", daemon=True)
        self._thread.start()

    def generate(self, context: list[int], sampling: SamplingConfig, replica: int) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            if self._error is not None or self._stop.is_set():
                raise RuntimeError(f"the engines stopped taking turns: {self._error}")
            key = f"s{next(self._keys)}"
            self._waiting[key] = future
            self._queued.append((key, context, sampling, replica))
        self._wake.set()
        return future

    def _pump(self) -> None:
        try:
            while not self._stop.is_set():
                with self._lock:
                    queued, self._queued = self._queued, []
                for key, context, sampling, replica in queued:
                    self.rollout.submit([(key, context)], sampling, replica)
                if not self._waiting:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for key, completions in self.rollout.collect(0.05 if self._queued else 0.5):
                    with self._lock:
                        future = self._waiting.pop(key)
                    future.set_result(completions[0])
        except BaseException as err:  # noqa: BLE001 - every waiting request gets it, none hangs
            log.error("agent sessions: the engines failed: %s", err)
            with self._lock:
                self._error = err
                for future in self._waiting.values():
                    future.set_exception(err)
                self._waiting.clear()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()


@dataclass
class Session:
    sid: str
    row: dict  # the prompt row the agent was given
    sampling: SamplingConfig
    replica: int
    index: int  # the session's number: its seeds
    traj: TrajectoryBuilder = field(default_factory=TrajectoryBuilder)
    served: list[dict] = field(default_factory=list)  # the conversation so far, normalized
    # the conversation as the template reads it (rewritten_history: new_sample), and each served assistant message
    # with the turn as sampled (what an earlier turn of a history the agent rewrote renders as)
    conversation: list[dict] = field(default_factory=list)
    turns: list[tuple[dict, dict]] = field(default_factory=list)
    tools: list | None = None  # the tool schemas of its first request, which every later one repeats
    chat: ChatFormat | None = None
    busy: bool = False
    closed: bool = False  # finished: its trajectory is built, nothing more is recorded
    stop: str = ""  # why it stopped; "" while it runs
    reward: float | None = None  # set through the endpoint, if at all
    lock: threading.Lock = field(default_factory=threading.Lock)


FORMATS_KEPT = 16  # tool lists whose chat formats the sessions keep


class Sessions:
    """The run's agent sessions over its rollout engines (``engine``: an :class:`EngineCalls`)."""

    def __init__(self, engine: EngineCalls, tokenizer, limits: MultiTurnConfig, max_model_len: int, model: str):
        self.engine, self.tokenizer, self.model = engine, tokenizer, model
        self.tool_format = resolve_format(KEY, limits.tool_format, tokenizer.chat_template)
        self.max_turns, self.max_tokens = limits.max_turns, limits.total_tokens(max_model_len)
        self.max_calls, self.max_chars = limits.max_tool_calls_per_turn, limits.max_observation_chars
        self.new_samples = limits.rewritten_history == "new_sample"
        self._sessions: dict[str, Session] = {}
        self._finished: dict[str, str] = {}  # session id -> why it stopped, for the errors of late requests
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._formats: dict[str, ChatFormat] = {}  # by the tools' JSON: sessions of one agent share theirs

    def _chat_format(self, tools: list[dict] | None) -> ChatFormat:
        """The chat format of sessions with ``tools`` (its template probes rendered once, not per session); the
        :data:`FORMATS_KEPT` latest tool lists are kept, the oldest dropped (an agent chooses its tools)."""
        key = json.dumps(tools or [], sort_keys=True, default=str)
        with self._lock:
            chat = self._formats.pop(key, None)
        chat = chat or ChatFormat(self.tokenizer, tools or [], self.tool_format, self.new_samples)
        with self._lock:
            self._formats[key] = chat  # now the latest
            while len(self._formats) > FORMATS_KEPT:
                del self._formats[next(iter(self._formats))]
        return chat

    def open(self, sid: str, row: dict, sampling: SamplingConfig, replica: int = 0) -> None:
        with self._lock:
            if sid in self._sessions:
                raise ValueError(f"agent session {sid!r} exists already")
            self._sessions[sid] = Session(sid, row, dataclasses.replace(sampling, n=1), replica, next(self._count))

    def check_running(self, sid: str) -> Session:
        """Session ``sid``, running; a :class:`RequestError` otherwise."""
        session = self._sessions.get(sid)
        stop = session.stop if session else self._finished.get(sid)
        if stop:
            raise RequestError(f"agent session {sid!r} has finished ({stop}); it takes no more requests")
        if session is None:
            raise RequestError(f"no agent session {sid!r}: expected the id of a running session", 404)
        return session

    def chat(self, sid: str, body: dict) -> dict:
        """An OpenAI chat completion for ``body`` in session ``sid``: one assistant turn, recorded."""
        session = self.check_running(sid)
        with session.lock:
            if session.busy:
                raise RequestError(f"agent session {sid!r} has a request in flight; send one at a time", 409)
            session.busy = True
        try:
            return self._chat(session, body)
        finally:
            session.busy = False

    def _chat(self, session: Session, body: dict) -> dict:
        if not isinstance(body, dict):
            raise RequestError("the request body: expected a JSON object")
        if body.get("model") != self.model:
            raise RequestError(f"model {body.get('model')!r}: this endpoint serves {self.model!r}", param="model")
        if body.get("stream"):
            raise RequestError("stream: streaming is off; send stream false", param="stream")
        if body.get("n", 1) != 1:
            raise RequestError("n: expected 1 (each request is one turn of the session)", param="n")
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise RequestError("max_tokens: expected a positive integer", param="max_tokens")
        messages, tools = normalize(body.get("messages")), check_tools(body.get("tools"))
        traj = session.traj
        with session.lock:  # against a finish while it is being extended or answered
            self._check_open(session)
            if traj.stats["turns"] >= self.max_turns:
                raise RequestError(f"agent session {session.sid!r} has had its max_turns={self.max_turns} turns")
            try:
                self._extend(session, messages, tools)
            except ValueError as err:  # the chat template refuses the conversation (its own raise_exception)
                raise RequestError(f"messages: {err}", param="messages") from None
            room = min(session.sampling.max_new_tokens, self.max_tokens - len(traj.context), cap or self.max_tokens)
            seed = session.sampling.seed
            seed = None if seed is None else seed + 1000 * session.index + traj.stats["turns"]
            context = list(traj.context)
        turn = dataclasses.replace(session.sampling, max_new_tokens=room, seed=seed)
        completion = self.engine.generate(context, turn, session.replica).result()
        with session.lock:
            self._check_open(session)
            return self._answer(session, completion, body)

    def _check_open(self, session: Session) -> None:
        if session.closed:
            raise RequestError(f"agent session {session.sid!r} has finished ({session.stop})")

    def _extend(self, session: Session, messages: list[dict], tools) -> None:
        """The session's context with ``messages``: its opening prompt, or the new observations after its last
        turn; the session is unchanged where they do not fit."""
        traj = session.traj
        if session.chat is None:  # the first request: its messages are the prompt
            if messages[-1]["role"] == "assistant":
                raise RequestError("messages: the last message is the assistant's; the policy writes its own turns")
            try:
                chat = self._chat_format(tools)
            except ValueError as err:
                raise RequestError(f"tools: {err}", param="tools") from None
            ids = chat.prompt([_rendered(m) for m in messages])
            if len(ids) >= self.max_tokens:
                raise RequestError(f"messages: {len(ids)} tokens leave no room in max_total_tokens={self.max_tokens}")
            session.chat, session.tools = chat, tools
            traj.prompt_ids, traj.messages, session.served = ids, list(messages), list(messages)
            session.conversation = chat.with_tools([_rendered(m) for m in messages])
            return
        served, chat = session.served, session.chat
        if tools != session.tools:
            raise RequestError("tools: expected the tools of the session's first request", param="tools")
        if messages[: len(served)] != served:
            first = next((i for i, (a, b) in enumerate(zip(messages, served, strict=False)) if a != b), len(messages))
            if self.new_samples:
                return self._restart(session, messages, first)
            raise RequestError(
                f"messages[{first}]: the session's history differs from here (or is shorter); each request repeats "
                "the conversation so far as it was served, and adds messages after the last assistant turn",
                param="messages",
            )
        new = messages[len(served) :]
        if not new or any(m["role"] not in OBSERVATION_ROLES for m in new):
            raise RequestError("messages: expected user or tool messages after the last assistant turn")
        new = chat.inert_messages([_rendered({**m, "content": clip(m["content"], self.max_chars)}) for m in new])
        ids, rewritten = chat.follow(session.conversation, traj.context, new, traj.last_turn)
        if len(ids) + (0 if rewritten else len(traj.context)) >= self.max_tokens:
            raise RequestError(f"messages: the session would pass max_total_tokens={self.max_tokens}")
        traj.new_segment(ids, new) if rewritten else traj.add_observation(ids, new)
        session.served, session.conversation = messages, session.conversation + new

    def _restart(self, session: Session, messages: list[dict], first: int) -> None:
        """A history the agent changed from ``messages[first]`` on (compacted, summarised): a new training sample
        from it, the assistant turns the session served rendered as they were sampled, every other text inert (and
        user and tool messages cut to max_observation_chars, as when appended)."""
        if messages[-1]["role"] == "assistant":
            raise RequestError("messages: the last message is the assistant's; the policy writes its own turns")
        chat, conversation = session.chat, []
        for m in messages:
            if m["role"] in OBSERVATION_ROLES:
                m = {**m, "content": clip(m["content"], self.max_chars)}
            view = next((view for served, view in session.turns if served == m), None)
            conversation.append(view or chat.inert_messages([_rendered(m)])[0])
        conversation = chat.with_tools(conversation)
        ids = chat.context(conversation)
        if len(ids) >= self.max_tokens:
            raise RequestError(f"messages: {len(ids)} tokens leave no room in max_total_tokens={self.max_tokens}")
        session.traj.new_segment(ids, messages[first:])
        session.served, session.conversation = messages, conversation

    def _answer(self, session: Session, completion: Completion, body: dict) -> dict:
        traj, turn = session.traj, session.traj.stats["turns"]
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        message: dict = {"role": "assistant", "content": text}
        calls = []
        if session.tools:  # read with the special tokens: several formats' markers are special tokens
            raw = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
            parsed = parse_tool_calls(raw, self.max_calls, self.tool_format, session.tools)
            for call in parsed:
                traj.add_tool_call(call.kind if call.error else "", 0.0)
            calls = [c for c in parsed if not c.error]
        if calls:
            message["tool_calls"] = openai_tool_calls(calls, call_ids(calls, f"call_{session.index}_{turn}"))
        served = normalize([message])[0]  # as the agent sends it back
        traj.add_turn(completion, served)
        session.served = [*session.served, served]
        if self.new_samples:  # only a rewritten history reads them (a pass over the turn's ids)
            sampled = session.chat.sampled(completion.token_ids)
            session.conversation = [*session.conversation, sampled]
            session.turns.append((served, sampled))
        finish = "tool_calls" if calls else completion.finish_reason
        if completion.finish_reason == "length" and len(traj.context) >= self.max_tokens:
            session.stop = "max_tokens"
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if body.get("logprobs"):
            pieces = [self.tokenizer.decode([t]) for t in completion.token_ids]
            choice["logprobs"] = {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                for p, lp in zip(pieces, completion.logprobs, strict=True)
            ]}  # fmt: skip
        if body.get("return_token_ids"):  # vLLM's extension: what the policy was given and what it sampled
            choice["token_ids"] = list(completion.token_ids)
        prompt_tokens = len(traj.context) - len(completion.token_ids)
        return {
            "id": f"chatcmpl-{session.sid}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(completion.token_ids),
                "total_tokens": len(traj.context),
            },
        }

    def set_reward(self, sid: str, reward) -> None:
        session = self.check_running(sid)
        if isinstance(reward, bool) or not isinstance(reward, int | float) or reward != reward:
            raise RequestError(f"reward {reward!r}: expected a number", param="reward")
        session.reward = float(reward)

    def finish(self, sid: str, stop: str = "done") -> tuple[Trajectory, Session]:
        """End session ``sid`` (``stop``: why, unless a limit ended it first); its trajectory."""
        with self._lock:
            session = self._sessions.pop(sid)
        with session.lock:  # a turn in flight is not recorded after this
            session.closed, session.stop = True, session.stop or stop
            with self._lock:
                self._finished[sid] = session.stop
            return session.traj.build(session.stop), session


def check_tools(tools) -> list[dict] | None:
    """A request's ``tools``: OpenAI's ``{"type": "function", "function": {"name", ...}}`` each; None for none."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools: expected a list of functions", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise RequestError(
                f"tools[{i}]: expected {{'type': 'function', 'function': {{'name', ...}}}}", param="tools"
            )
    return tools
