"""The retry policy of both clients, written once and free of I/O.

Each operation is a generator of decisions. It yields what to do next: `Call` a unary method, send a
step on the VerifyStream (`StreamStep`), or `Wait`; it is sent back what a Call or a StreamStep got:
the reply message, or the VerifierError it failed with (the transport turns grpc errors, timeouts and
a stream the server ended into VerifierError, and drops a broken stream so that the next StreamStep
opens a new one). The generator returns the operation's result or raises the VerifierError the
caller gets. `Plan` hands the decisions out one by one; the blocking client (drafter/client.py)
carries them out with blocking calls and time.sleep, the asyncio client (drafter/aio_client.py) with
awaits and asyncio.sleep, and neither decides anything itself.

Why resending is safe: every step and every OpenSession carries a request id fixed before the first
try, and the server stores each result under its request id and never advances a session twice
(DESIGN.md section 8). So a resend reuses the id, always.
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections.abc import Generator, Iterator
from dataclasses import dataclass

import grpc

from verifier import rpc

from .messages import Step, StepOutcome, VerifierError

# A failed call with one of these codes may not have reached the engine, or its answer was lost on
# the way back; the same codes as a step's status mean the step did not run. Nothing else is resent.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for UNAVAILABLE / DEADLINE_EXCEEDED."""

    attempts: int = 5  # tries in all, the first included
    backoff_s: float = 0.1  # wait before the second try; doubles each time
    max_backoff_s: float = 2.0

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be at least 1, got {self.attempts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("RetryPolicy.backoff_s and max_backoff_s must be >= 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number `attempt` (0-based)."""
        return min(self.max_backoff_s, self.backoff_s * (2 ** attempt))

    def tries(self) -> Iterator[tuple[int, bool]]:
        """(attempt, whether a retryable failure of it may be retried), for every try the policy allows."""
        for attempt in range(self.attempts):
            yield attempt, attempt + 1 < self.attempts


@dataclass(frozen=True)
class Call:
    """Call unary `method` of the stub with `request` (the client adds its deadline and metadata)."""

    method: str
    request: object


@dataclass(frozen=True)
class StreamStep:
    """Send `request` (rpc.VerifyStep) on the VerifyStream, opening one first if none is open, and
    wait for its rpc.StepResult."""

    request: object


@dataclass(frozen=True)
class Wait:
    seconds: float


Action = Call | StreamStep | Wait
Reply = object  # a reply message, or VerifierError
Decisions = Generator[Action, Reply | None, object]


class Plan:
    """One operation's decisions to carry out: iterate for the actions, answer each Call / StreamStep
    with reply(what it got) before the next; when the iteration ends, `result` is the operation's
    result. A VerifierError the operation raises comes out of the iteration."""

    def __init__(self, decisions: Decisions):
        self._decisions = decisions
        self._reply: Reply | None = None
        self.result = None

    def __iter__(self) -> Iterator[Action]:
        while True:
            try:
                action = self._decisions.send(self._reply)
            except StopIteration as done:
                self.result = done.value
                return
            self._reply = None
            yield action

    def reply(self, got: Reply) -> None:
        self._reply = got


# Request ids: 128 random bits drawn once per process, then a counter. As unique as a uuid4 per
# request, without a system call and a UUID object per step (a visible share of a drafter's time
# per step when one Verify carries a step of every session).
_ID_PREFIX = uuid.uuid4().hex
_ID_COUNTER = itertools.count()


def _redraw_id_prefix() -> None:  # a forked child must not repeat its parent's ids
    global _ID_PREFIX, _ID_COUNTER
    _ID_PREFIX, _ID_COUNTER = uuid.uuid4().hex, itertools.count()


os.register_at_fork(after_in_child=_redraw_id_prefix)


def new_request_id() -> str:
    return f"{_ID_PREFIX}-{next(_ID_COUNTER):x}"


def with_request_id(step: Step) -> Step:
    """The step with a request id of its own, fixed before the first try so that every retry reuses it."""
    if step.request_id:
        return step
    return Step(step.session_id, step.expected_position, step.draft_ids, step.draft_probs, new_request_id(), step.return_logits)


def unary(policy: RetryPolicy, method: str, request) -> Decisions:
    """A unary call, resent unchanged (same request id) while it fails with a retryable code."""
    for attempt, may_retry in policy.tries():
        got = yield Call(method, request)
        if not isinstance(got, VerifierError):
            return got
        if got.code not in RETRYABLE or not may_retry:
            raise got
        yield Wait(policy.delay(attempt))
    raise AssertionError("unreachable: the last attempt returns or raises")


def verify(policy: RetryPolicy, steps: list[Step]) -> Decisions:
    """Verify: one outcome per step, in order. The call itself retries as `unary`; then the steps whose
    status is retryable are resent, alone, with their request ids, until none is left or the attempts
    are spent (their outcomes then keep that status)."""
    steps = [with_request_id(s) for s in steps]
    outcomes: list[StepOutcome | None] = [None] * len(steps)
    todo = list(range(len(steps)))  # indices into steps still without a final outcome
    for attempt, may_retry in policy.tries():
        response = yield from unary(policy, "Verify", rpc.VerifyRequest(steps=[steps[i].to_proto() for i in todo]))
        _check_result_count(len(response.results), len(todo))
        for i, result in zip(todo, response.results):
            outcomes[i] = StepOutcome.from_proto(result)
        todo = [i for i in todo if outcomes[i].code in RETRYABLE]
        if not todo or not may_retry:
            break
        yield Wait(policy.delay(attempt))
    return outcomes


def stream_step(policy: RetryPolicy, step: Step) -> Decisions:
    """One step on the VerifyStream: resent with the same request id after a broken stream (which the
    transport has dropped, so the resend reopens it) or a retryable status; the final outcome is
    checked, so a non-OK status raises VerifierError."""
    step = with_request_id(step)
    for attempt, may_retry in policy.tries():
        got = yield StreamStep(step.to_proto())
        if isinstance(got, VerifierError):
            if got.code in RETRYABLE and may_retry:
                yield Wait(policy.delay(attempt))
                continue
            raise got
        outcome = StepOutcome.from_proto(got)
        if outcome.code in RETRYABLE and may_retry:
            yield Wait(policy.delay(attempt))
            continue
        return outcome.check()
    raise AssertionError("unreachable: the last attempt returns or raises")


def _check_result_count(got: int, sent: int) -> None:
    if got != sent:
        raise VerifierError(grpc.StatusCode.INTERNAL, f"VerifyResponse.results has {got} results for {sent} steps")
