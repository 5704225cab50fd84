"""A scripted stand-in for the verifier service, to test what the client does when calls fail:
it drops replies, breaks streams, fills the pool and records what each call carried. Its "model"
accepts every draft and adds bonus token 1; results are stored per request id, as the real server
stores them, so a resent step gets the stored result."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from verifier import rpc


class ScriptedVerifier:
    def __init__(self):
        self.lock = threading.Lock()
        self.fail_next = {}  # method name -> how many of its next calls fail UNAVAILABLE (after running)
        self.step_status = {}  # request id -> status code its step reports once, then it runs
        self.pool_full = False
        self.calls = []  # (method, metadata dict, request)
        self.sessions = {}  # id -> position
        self.results = {}  # request id -> StepResult
        self.opened = {}  # request id -> OpenSessionResponse

    def _record(self, method, request, context):
        with self.lock:
            self.calls.append((method, dict(context.invocation_metadata()), request))

    def _maybe_drop(self, method, context):
        # The work is done, the reply is lost: what a retry must not repeat.
        with self.lock:
            if self.fail_next.get(method, 0) > 0:
                self.fail_next[method] -= 1
                context.abort(grpc.StatusCode.UNAVAILABLE, f"scripted: {method} reply dropped")

    def GetModelInfo(self, request, context):
        self._record("GetModelInfo", request, context)
        self._maybe_drop("GetModelInfo", context)
        return rpc.ModelInfo(protocol_version=rpc.PROTOCOL_VERSION, model_id="scripted", vocab_size=16, max_context=64, max_k=4)

    def OpenSession(self, request, context):
        self._record("OpenSession", request, context)
        if self.pool_full:
            context.set_trailing_metadata(((rpc.RETRY_AFTER_KEY, "250"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no free slot (n_slots 1)")
        with self.lock:
            if request.request_id not in self.opened:
                sid = f"s{len(self.sessions)}"
                self.sessions[sid] = len(request.prompt_ids)
                self.opened[request.request_id] = rpc.OpenSessionResponse(
                    session_id=sid, position=len(request.prompt_ids), first_token=1, prompt_ids=request.prompt_ids)
            response = self.opened[request.request_id]
        self._maybe_drop("OpenSession", context)
        return response

    def _run(self, step):
        with self.lock:
            if step.request_id in self.step_status:
                code = self.step_status.pop(step.request_id)
                return rpc.StepResult(status=rpc.Status(code=code.value[0], message="scripted", current_position=7),
                                      session_id=step.session_id, request_id=step.request_id)
            if step.request_id in self.results:
                return self.results[step.request_id]
            position = self.sessions[step.session_id]
            if step.expected_position != position:
                return rpc.StepResult(status=rpc.Status(code=grpc.StatusCode.ABORTED.value[0], message="stale expected_position",
                                                        current_position=position), session_id=step.session_id, request_id=step.request_id)
            tokens = [*step.draft_ids, 1]
            self.sessions[step.session_id] = position + len(tokens)
            result = rpc.StepResult(status=rpc.Status(code=0), session_id=step.session_id, request_id=step.request_id,
                                    accepted=len(step.draft_ids), tokens=tokens, position=position + len(tokens))
            self.results[step.request_id] = result
            return result

    def Verify(self, request, context):
        self._record("Verify", request, context)
        response = rpc.VerifyResponse(results=[self._run(s) for s in request.steps])
        self._maybe_drop("Verify", context)
        return response

    def VerifyStream(self, requests, context):
        for step in requests:
            self._record("VerifyStream", step, context)
            result = self._run(step)
            self._maybe_drop("VerifyStream", context)
            yield result

    def VerifyRounds(self, requests, context):
        for request in requests:
            self._record("VerifyRounds", request, context)
            response = rpc.VerifyResponse(results=[self._run(s) for s in request.steps])
            self._maybe_drop("VerifyRounds", context)
            yield response

    def CloseSession(self, request, context):
        self._record("CloseSession", request, context)
        with self.lock:
            return rpc.CloseSessionResponse(closed=self.sessions.pop(request.session_id, None) is not None)

    def Generate(self, request, context):
        self._record("Generate", request, context)
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    def GetStats(self, request, context):
        self._record("GetStats", request, context)
        return rpc.Stats(steps=len(self.results), drafted_per_position=[3, 2], rows_per_batch=rpc.Histogram(upper_bounds=[1.0], counts=[2, 1], count=3))

    def requests_of(self, method):
        return [request for name, _, request in self.calls if name == method]

    def attempts(self):
        """(method, the request ids it carried) for every call and every stream message, in order:
        what two clients' tries are compared by."""
        def ids(method, request):
            if method in ("Verify", "VerifyRounds"):
                return tuple(step.request_id for step in request.steps)
            return (request.request_id,) if method in ("OpenSession", "VerifyStream") else ()
        return [(method, ids(method, request)) for method, _, request in self.calls]


class ScriptedServer:
    """Context manager: serves a ScriptedVerifier on a free loopback port (`.address`)."""

    def __init__(self, verifier: ScriptedVerifier | None = None):
        self.verifier = verifier if verifier is not None else ScriptedVerifier()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers([rpc.servicer_handler(self.verifier)])
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"

    def __enter__(self):
        self._server.start()
        return self

    def __exit__(self, *exc):
        self._server.stop(grace=None)
