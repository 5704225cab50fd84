// A client written as an outside author would, in Node.js with @grpc/grpc-js loading the .proto
// as is: one session stepped with unary Verify calls, one over a VerifyStream, each drafting from
// a hint of the continuation (every other step's last draft made wrong). Prints JSON:
// {"unary": [tokens], "stream": [tokens]} (the first token included).
//   node client.js ADDRESS PROTO_PATH '{"prompt": [...], "maxNew": N, "hint": [...], "vocab": V}'
'use strict';
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');

const [address, protoPath, argsJson] = process.argv.slice(2);
const { prompt, maxNew, hint, vocab } = JSON.parse(argsJson);
// keepCase: the wire's snake_case names (without it, prompt_ids would be dropped silently);
// longs: Number for uint64 positions (exact far beyond any context)
const definition = loader.loadSync(protoPath, { keepCase: true, longs: Number, enums: String, defaults: true });
const verifier = grpc.loadPackageDefinition(definition).verifier.v1;
const client = new verifier.Verifier(address, grpc.credentials.createInsecure());
const unary = (method, request) => new Promise((resolve, reject) =>
  client[method](request, { deadline: Date.now() + 30000 }, (error, reply) => (error ? reject(error) : resolve(reply))));

function drafts(emitted, step) {
  const next = hint.slice(emitted, emitted + 3);
  if (step % 2 === 1 && next.length) next[next.length - 1] = (next[next.length - 1] + 1) % vocab;
  return next;
}

function check(result) {
  if (result.status && result.status.code) throw new Error(`step failed: ${result.status.code} ${result.status.message}`);
}

async function overUnary() {
  const opened = await unary('OpenSession', { prompt_ids: prompt, max_new_tokens: maxNew });
  const tokens = [opened.first_token];
  let position = opened.position;
  let finished = opened.finish_reason !== 'FINISH_REASON_UNSPECIFIED';
  for (let step = 0; !finished; step++) {
    const reply = await unary('Verify', { steps: [{ session_id: opened.session_id, expected_position: position,
                                                    draft_ids: drafts(tokens.length, step) }] });
    const result = reply.results[0];
    check(result);
    tokens.push(...result.tokens);
    position = result.position;
    finished = result.finish_reason !== 'FINISH_REASON_UNSPECIFIED';
  }
  await unary('CloseSession', { session_id: opened.session_id });
  return tokens;
}

async function overStream() {
  const opened = await unary('OpenSession', { prompt_ids: prompt, max_new_tokens: maxNew });
  const tokens = [opened.first_token];
  if (opened.finish_reason !== 'FINISH_REASON_UNSPECIFIED') return tokens;
  const stream = client.VerifyStream();
  let step = 0;
  const send = (position) => stream.write({ session_id: opened.session_id, expected_position: position,
                                            draft_ids: drafts(tokens.length, step++) });
  await new Promise((resolve, reject) => {
    stream.on('data', (result) => {
      try {
        check(result);
        tokens.push(...result.tokens);
        if (result.finish_reason !== 'FINISH_REASON_UNSPECIFIED') stream.end();
        else send(result.position);
      } catch (error) { reject(error); }
    });
    stream.on('error', reject);
    stream.on('end', resolve);
    send(opened.position);
  });
  await unary('CloseSession', { session_id: opened.session_id });
  return tokens;
}

(async () => {
  const result = { unary: await overUnary(), stream: await overStream() };
  process.stdout.write(JSON.stringify(result) + '\n');
  client.close();
})().catch((error) => { process.stderr.write(`${error.stack || error}\n`); process.exit(1); });
