// Sluice's Generation API as a Node.js client meets it: the protos load with proto-loader,
// a stream is read to its end, a cancelled call frees its KV, Abort ends a request by the id
// from the initial metadata, standard health answers, reflection v1 and v1alpha list the
// service, a missing key is UNAUTHENTICATED and a bad field INVALID_ARGUMENT with a
// google.rpc.BadRequest detail. Prints one JSON object of named checks.
//
//   node client_check.js HOST:PORT API_KEY PROTO_ROOT
'use strict';

const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const health = require('grpc-health-check');
const { GrpcReflection } = require('grpc-js-reflection-client');

const [address, apiKey, protoRoot] = process.argv.slice(2);
const checks = {};

function keyed() {
  const md = new grpc.Metadata();
  md.set('authorization', `Bearer ${apiKey}`);
  return md;
}

function loadApi() {
  const definition = protoLoader.loadSync('sluice/v1/generation.proto', {
    includeDirs: [protoRoot],
    keepCase: true,
    enums: String,
    longs: Number,
    defaults: false,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(definition).sluice.v1;
}

function unary(client, method, request, metadata = keyed()) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

function request(i, maxTokens) {
  const ids = Array.from({ length: 20 }, (_, k) => 1000 + i * 7 + k);
  return { token_ids: { ids }, sampling_params: { temperature: 0, max_tokens: maxTokens, ignore_eos: true } };
}

function stream(client, req, onMessage) {
  const call = client.Generate(req, keyed());
  const result = { messages: [], metadata: null, status: null, error: null };
  const done = new Promise((resolve) => {
    call.on('metadata', (md) => { result.metadata = md.getMap(); });
    call.on('data', (m) => { result.messages.push(m); if (onMessage) onMessage(call, m, result); });
    call.on('status', (s) => { result.status = s; });
    call.on('error', (e) => { result.error = e; });
    call.on('close', () => resolve(result));
  });
  return { call, done };
}

async function idle(client) {
  for (let i = 0; i < 200; i++) {
    const s = await unary(client, 'GetStats', {});
    const used = (s.workers || []).reduce((a, w) => a + (w.gpu_blocks_used || 0), 0);
    if (!s.num_running && !s.num_waiting && used === 0) return true;
    await new Promise((r) => setTimeout(r, 50));
  }
  return false;
}

function badRequestField(err) {
  const root = protobuf.parse(`
    syntax = "proto3";
    package google.rpc;
    message Any { string type_url = 1; bytes value = 2; }
    message Status { int32 code = 1; string message = 2; repeated Any details = 3; }
    message BadRequest { message FieldViolation { string field = 1; string description = 2; }
                         repeated FieldViolation field_violations = 1; }`, { keepCase: true }).root;
  const raw = err.metadata.get('grpc-status-details-bin')[0];
  const status = root.lookupType('google.rpc.Status').decode(raw);
  const detail = status.details.find((d) => d.type_url.endsWith('google.rpc.BadRequest'));
  return detail ? root.lookupType('google.rpc.BadRequest').decode(detail.value).field_violations[0].field : null;
}

async function main() {
  const api = loadApi();
  checks.protos_load = typeof api.GenerationService === 'function';
  const client = new api.GenerationService(address, grpc.credentials.createInsecure());

  const whole = await stream(client, request(0, 8)).done;
  const last = whole.messages[whole.messages.length - 1];
  const tokens = whole.messages.reduce((a, m) => a + (m.token_ids || []).length, 0);
  checks.stream = whole.status.code === grpc.status.OK && last.finish_reason === 'FINISH_REASON_LENGTH' && tokens === 8;
  checks.x_request_id_in_initial_metadata = !!whole.metadata['x-request-id'] && whole.metadata['x-max-tokens'] === '8';

  const cancelled = await stream(client, request(1, 500), (call) => call.cancel()).done;
  checks.cancel = cancelled.error.code === grpc.status.CANCELLED && (await idle(client));

  const aborted = await stream(client, request(2, 500), (call, m, r) => {
    if (r.messages.length === 1) unary(client, 'Abort', { request_ids: [r.metadata['x-request-id']] });
  }).done;
  const end = aborted.messages[aborted.messages.length - 1];
  checks.abort_by_metadata_id = end.finish_reason === 'FINISH_REASON_ABORT' && aborted.status.code === grpc.status.OK;

  const Health = grpc.makeClientConstructor(health.service, 'Health');
  const probe = new Health(address, grpc.credentials.createInsecure());
  const liveness = await new Promise((resolve, reject) =>
    probe.check({ service: 'sluice.v1.GenerationService' }, (e, r) => (e ? reject(e) : resolve(r))));
  checks.health = liveness.status === 'SERVING';

  for (const version of ['v1', 'v1alpha']) {
    const reflection = new GrpcReflection(address, grpc.credentials.createInsecure(), {}, version);
    const services = await reflection.listServices('*', keyed());
    const methods = await reflection.listMethods('sluice.v1.GenerationService', keyed());
    checks[`reflection_${version}`] =
      services.includes('sluice.v1.GenerationService') && methods.some((m) => m.name === 'Generate');
  }

  try {
    await unary(client, 'GetStats', {}, new grpc.Metadata());
    checks.unauthenticated = false;
  } catch (e) {
    checks.unauthenticated = e.code === grpc.status.UNAUTHENTICATED;
  }

  const invalid = await stream(client, { text: 'hi', sampling_params: { top_p: 0 } }).done;
  checks.invalid_argument_with_bad_request =
    invalid.error.code === grpc.status.INVALID_ARGUMENT && badRequestField(invalid.error) === 'sampling_params.top_p';

  process.stdout.write(JSON.stringify(checks) + '\n');
  client.close();
  probe.close();
}

main().catch((e) => {
  process.stdout.write(JSON.stringify({ ...checks, crashed: String(e && e.stack ? e.stack : e) }) + '\n');
  process.exit(1);
});
