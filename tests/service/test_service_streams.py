"""Many concurrent drafters through one server: every session's tokens and logits bytes equal
in-process plain decoding (K = 0 on a separate engine), whatever the drafts, the K, the other
sessions in the batch, and whether steps come by Verify or VerifyStream."""

import asyncio
import random

import grpc
import numpy as np

from verifier import rpc
from verifier.params import SamplingParams

from .helpers import logits_array, step

VOCAB, MAX_CONTEXT, MAX_K = 90, 96, 8
N_DRAFTERS = 18


def _spec(i):
    rng = random.Random(100 + i)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 24))]
    sampled = i % 4 == 3
    sampling = SamplingParams(temperature=0.8, top_k=30, seed=i) if sampled else None
    return dict(prompt=prompt, n=rng.randint(12, 30), sampling=sampling, drafts=("random", "oracle", "mixed")[i % 3],
                via=("verify", "stream")[i % 2], seed=i)


def _propose(kind, rng, expected, done, k):
    if kind == "random":
        return [rng.randrange(VOCAB) for _ in range(k)]
    truth = expected.tokens[done : done + k]
    truth += [rng.randrange(VOCAB) for _ in range(k - len(truth))]  # past the end: anything
    if kind == "mixed" and truth and rng.random() < 0.6:
        at = rng.randrange(len(truth))
        truth[at] = (truth[at] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
    return truth


async def _drive(stub, spec, expected):
    rng = random.Random(spec["seed"])
    await asyncio.sleep(rng.random() * 0.05)  # start at different times: sessions sit at different positions
    s = spec["sampling"]
    sampling = rpc.Sampling(temperature=s.temperature, top_k=s.top_k, seed=s.seed) if s else None
    opened = await stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=spec["prompt"], max_new_tokens=spec["n"],
                                                           sampling=sampling, return_logits=True))
    tokens, rows, position = [opened.first_token], [logits_array(opened.logits)], opened.position
    finish, ks = opened.finish_reason, []
    call = stub.VerifyStream() if spec["via"] == "stream" else None
    while not finish:
        k = min(rng.randint(0, MAX_K), MAX_CONTEXT - position - 1)
        ks.append(k)
        request = step(opened.session_id, position, _propose(spec["drafts"], rng, expected, len(tokens), k),
                       request_id=f"step-{len(ks)}", return_logits=True)
        if call is None:
            (result,) = (await stub.Verify(rpc.VerifyRequest(steps=[request]))).results
        else:
            await call.write(request)
            result = await call.read()
        assert result.status.code == 0, result.status.message
        assert result.position == position + len(result.tokens)
        tokens += result.tokens
        rows.append(logits_array(result.logits))
        position, finish = result.position, result.finish_reason
    if call is not None:
        await call.done_writing()
    assert (await stub.CloseSession(rpc.CloseSessionRequest(session_id=opened.session_id))).closed
    return tokens, np.concatenate(rows), ks


async def _run_all(address, specs, expected):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = rpc.VerifierStub(channel)
        return await asyncio.gather(*(_drive(stub, spec, exp) for spec, exp in zip(specs, expected)))


def test_concurrent_drafters_equal_plain_decoding(server, stub, plain):
    specs = [_spec(i) for i in range(N_DRAFTERS)]
    expected = [plain(s["prompt"], s["n"], s["sampling"]) for s in specs]
    before = stub.GetStats(rpc.GetStatsRequest())
    outcomes = asyncio.run(_run_all(server.address, specs, expected))
    for spec, exp, (tokens, logits, ks) in zip(specs, expected, outcomes):
        assert tokens == exp.tokens, spec
        assert logits.dtype == np.float32 and logits.tobytes() == exp.logits.numpy().astype("<f4").tobytes(), spec
        assert len(set(ks)) > 1  # K varied within the session
    after = stub.GetStats(rpc.GetStatsRequest())
    steps = after.steps - before.steps
    assert steps == sum(len(ks) for _, _, ks in outcomes)
    assert after.engine_steps - before.engine_steps < steps  # sessions shared engine batches
    assert after.accepted_tokens > before.accepted_tokens  # the oracle drafters were accepted
    assert after.open_sessions == before.open_sessions


def test_one_stream_can_carry_several_sessions(server, stub, plain):
    """Steps of three sessions written back to back on one stream run in one engine batch and
    come back in order."""
    prompts = [[3, 4, 5], [30, 31], [60, 61, 62, 63]]
    expected = [plain(p, 6) for p in prompts]
    opened = [stub.OpenSession(rpc.OpenSessionRequest(prompt_ids=p, max_new_tokens=6)) for p in prompts]

    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = rpc.VerifierStub(channel).VerifyStream()
            positions = [o.position for o in opened]
            tokens = [[o.first_token] for o in opened]
            for _ in range(2):
                for o, exp, pos, toks in zip(opened, expected, positions, tokens):
                    await call.write(step(o.session_id, pos, exp.tokens[len(toks):len(toks) + 2]))
                for i in range(3):
                    result = await call.read()
                    assert result.session_id == opened[i].session_id and result.status.code == 0
                    tokens[i] += result.tokens
                    positions[i] = result.position
            await call.done_writing()
            return tokens

    tokens = asyncio.run(run())
    for toks, exp in zip(tokens, expected):
        assert toks == exp.tokens
    for o in opened:
        stub.CloseSession(rpc.CloseSessionRequest(session_id=o.session_id))


def test_a_stream_that_never_reads_holds_a_bounded_server(text_checkpoint):
    """A client sends steps on a VerifyStream and never reads: the server reads at most its window
    of requests ahead of what the client took (then HTTP/2 flow control stops the client), instead
    of answering everything into a pile of unread replies. Each step names no session, so each is
    answered at once and counted as an error: the count is what the server read. The session ids
    are long so that the answers, which repeat them, fill gRPC's send buffers within the test."""
    import threading
    import time

    from verifier.server.testing import LoopbackServer

    with LoopbackServer(text_checkpoint, n_slots=2, max_seq_len=64, max_k=2) as server:
        window = server.run_on_loop(lambda: server.server.service.stream_window)
        with grpc.insecure_channel(server.address) as channel:
            stub = rpc.VerifierStub(channel)
            sent = [0]

            def requests():
                for i in range(200_000):
                    sent[0] = i
                    yield step(f"{i % 7}" * 8192, 0, [1])

            call = stub.VerifyStream(requests())  # never iterated: no answer is read
            threading.Thread(target=lambda: call.initial_metadata(), daemon=True).start()
            time.sleep(3.0)
            read = stub.GetStats(rpc.GetStatsRequest()).errors
            call.cancel()
    # the server read its window and what gRPC took off its hands into its send buffers (a few MiB of
    # 8 KiB answers): hundreds, where a server that reads on would have taken every request sent
    assert window == 4 and read < 1_000, (read, sent[0])
