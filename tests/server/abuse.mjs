// Bad input for `lockstep serve` (run by tests/test_server.sh): each case
// gets a clear 4xx with an OpenAI-style error object, and a normal request
// succeeds after it.
//   node abuse.mjs --url URL --noreuse-url URL2 [--queue-url URL3] [--queue0-url URL4]
//                  [--timeout S] [--ctx N] [--max-body-kb KB]
// URL: a server started with --ctx N (256), --max-body-kb KB (16) and
// --timeout S (3); URL2: one with --no-kv-reuse (every page of a finished
// or cancelled request goes back to free) and a context of 2048, for the
// clients that go away mid-request.
import net from 'node:net';
import { parseArgs, report, step, failures, short, post, streamRaw, isErrorObj, rawExchange, rawBody, portOf, metrics, sleep }
    from './lib.mjs';

const A = parseArgs();
const U = A.url, U2 = A['noreuse-url'];
const TIMEOUT = Number(A.timeout || 3), CTX = Number(A.ctx || 256), MAXBODY = 1024 * Number(A['max-body-kb'] || 16);
if (!U || !U2) {
    console.error('usage: node abuse.mjs --url URL --noreuse-url URL2 [--timeout S] [--ctx N] [--max-body-kb KB]');
    process.exit(2);
}
const PORT = portOf(U);

// A normal request on `url` succeeds (after each bad one).
async function okAfter(name, url = U) {
    const r = await post(url, '/completions', { prompt: 'Once upon a time', max_tokens: 2, temperature: 0 });
    const good = r.status === 200 && r.json && r.json.choices && r.json.usage.completion_tokens === 2;
    if (!good) report(`${name}_then_ok`, false, `a normal request after it: ${r.status} ${short(r.text)}`);
    return good;
}

// A bad request: its status, an error object (with param and message as given).
async function bad(name, path, body, status, { param, msgRe } = {}) {
    await step(name, async () => {
        const r = await post(U, path, body);
        const ok = r.status === status && isErrorObj(r.json) && (param === undefined || r.json.error.param === param) &&
            (!msgRe || msgRe.test(r.json.error.message));
        const then = await okAfter(name);
        report(name, ok && then, `want ${status}${param !== undefined ? ` param ${param}` : ''}${msgRe ? ` message ~ ${msgRe}` : ''}`,
               `got ${r.status} ${short(r.text)}`);
    });
}

const C = '/completions', CH = '/chat/completions';
const P = { prompt: 'Once upon a time', max_tokens: 4 };
const CM = { messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 };

// ---- malformed JSON, not an object ------------------------------------------------
await bad('malformed_json', C, '{"prompt": "Once upon a time", "max_tokens": ', 400, { msgRe: /not valid JSON/ });
await bad('malformed_json_chat', CH, '{"messages": [{"role": "user", "content": "hi"}', 400, { msgRe: /not valid JSON/ });
await bad('json_trailing_garbage', C, '{"prompt": "x"} xyz', 400, { msgRe: /JSON/ });
await bad('empty_body', C, '', 400);
await bad('json_not_object', C, '[1, 2, 3]', 400, { msgRe: /object/ });
await bad('json_invalid_utf8', C, Buffer.from([0x7b, 0x22, 0x70, 0x72, 0x6f, 0x6d, 0x70, 0x74, 0x22, 0x3a, 0x22, 0xff, 0xfe, 0x22, 0x7d]), 400);

// ---- wrong types ----------------------------------------------------------------------
await bad('type_prompt_number', C, { ...P, prompt: 5 }, 400, { param: 'prompt' });
await bad('type_prompt_object', C, { ...P, prompt: { a: 1 } }, 400, { param: 'prompt' });
await bad('type_prompt_mixed_list', C, { ...P, prompt: [1, 'two'] }, 400, { param: 'prompt' });
await bad('type_max_tokens_string', C, { ...P, max_tokens: 'ten' }, 400, { param: 'max_tokens' });
await bad('type_max_tokens_float', C, { ...P, max_tokens: 1.5 }, 400, { param: 'max_tokens' });
await bad('type_temperature_string', C, { ...P, temperature: 'hot' }, 400, { param: 'temperature' });
await bad('type_stream_string', C, { ...P, stream: 'yes' }, 400, { param: 'stream' });
await bad('type_stop_number', C, { ...P, stop: 7 }, 400, { param: 'stop' });
await bad('type_seed_string', C, { ...P, seed: 'abc' }, 400, { param: 'seed' });
await bad('type_stream_options', C, { ...P, stream: true, stream_options: 'usage' }, 400, { param: 'stream_options' });
await bad('type_messages_string', CH, { ...CM, messages: 'hi' }, 400, { param: 'messages' });
await bad('type_message_not_object', CH, { ...CM, messages: ['hi'] }, 400, { param: 'messages' });
await bad('type_content_number', CH, { ...CM, messages: [{ role: 'user', content: 5 }] }, 400, { param: 'messages' });
await bad('type_role_missing', CH, { ...CM, messages: [{ content: 'hi' }] }, 400, { param: 'messages' });
await bad('type_logprobs_string', CH, { ...CM, logprobs: 'yes' }, 400, { param: 'logprobs' });
await bad('type_tools', CH, { ...CM, tools: 'none' }, 400, { param: 'tools' });
await bad('nan_temperature', C, '{"prompt": "x", "temperature": NaN}', 400);

// ---- unknown fields --------------------------------------------------------------------
await bad('unknown_field', C, { ...P, frobnicate: 1 }, 400, { param: 'frobnicate', msgRe: /frobnicate/ });
await bad('unknown_field_chat', CH, { ...CM, wibble: true }, 400, { param: 'wibble', msgRe: /wibble/ });
await bad('unknown_message_field', CH, { ...CM, messages: [{ role: 'user', content: 'hi', mood: 'happy' }] }, 400, { msgRe: /mood/ });
await bad('unknown_stream_option', C, { ...P, stream: true, stream_options: { include_usage: true, extra: 1 } }, 400, { msgRe: /extra/ });
await bad('chat_field_on_completions', C, { ...P, messages: [] }, 400, { msgRe: /messages/ });

// ---- max_tokens: negative, zero, huge ------------------------------------------------------
for (const [name, v] of [['negative', -1], ['very_negative', -1000000], ['zero', 0], ['huge', 2 ** 40], ['int32_overflow', 2 ** 31],
                         ['beyond_double', '18446744073709551617'], ['over_context', CTX * 10]])
    // (an integer beyond 64 bits is refused by the JSON parser: no param then)
    await bad(`max_tokens_${name}`, C, typeof v === 'string' ? `{"prompt": "x", "max_tokens": ${v}}` : { ...P, max_tokens: v }, 400,
              typeof v === 'string' ? {} : { param: 'max_tokens' });
await bad('max_completion_tokens_negative', CH, { ...CM, max_tokens: undefined, max_completion_tokens: -5 }, 400, { param: 'max_completion_tokens' });
await bad('max_tokens_over_context_names_it', C, { ...P, max_tokens: CTX + 1 }, 400, { msgRe: new RegExp(`${CTX + 1}.*context of ${CTX}`) });

// ---- bodies over the limit ----------------------------------------------------------------
const bigBody = JSON.stringify({ prompt: 'x'.repeat(MAXBODY + 1000), max_tokens: 1 });
await bad('body_over_limit', C, bigBody, 413, { msgRe: new RegExp(`${MAXBODY}`) });
await step('body_over_limit_chunked', async () => {
    // no Content-Length: the limit is found while reading; the answer is still a 413
    const head = 'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n';
    const parts = [head];
    for (let i = 0; i < bigBody.length; i += 4096) {
        const p = bigBody.slice(i, i + 4096);
        parts.push(`${p.length.toString(16)}\r\n${p}\r\n`, 5);
    }
    parts.push('0\r\n\r\n');
    const r = await rawExchange(PORT, parts, 8000);
    let j = null;
    try { j = JSON.parse(rawBody(r.data)); } catch { /* not JSON */ }
    const then = await okAfter('body_over_limit_chunked');
    report('body_over_limit_chunked', r.status === 413 && isErrorObj(j) && then,
           `want 413 and an error object; got status ${r.status} after ${r.ms} ms (closed ${r.closed}, ${r.error || 'no socket error'}): ${short(r.data)}`);
});
await step('body_just_under_limit', async () => {
    // a body at the limit is read (and the prompt then is over the context: 400, not 413)
    const body = JSON.stringify({ prompt: 'x'.repeat(MAXBODY - 100), max_tokens: 1 });
    const r = await post(U, C, body);
    report('body_just_under_limit', r.status === 400 && isErrorObj(r.json) && /context/.test(r.json.error.message), `got ${r.status} ${short(r.text)}`);
});
await step('header_over_limit', async () => {
    const r = await rawExchange(PORT, [`GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(64 * 1024)}\r\n\r\n`], 8000);
    const then = await okAfter('header_over_limit');
    let j = null;
    try { j = JSON.parse(r.data.slice(r.data.indexOf('\r\n\r\n') + 4)); } catch { /* not JSON */ }
    report('header_over_limit', r.status === 431 && isErrorObj(j) && /headers take \d+ bytes, over the limit of 32768/.test(j.error.message) && then,
           `want 431 with an error object; got ${r.status}: ${short(r.data)}`);
});
await step('header_far_over_limit', async () => {
    // past libmicrohttpd's own buffer: its plain 431, and the server goes on
    const r = await rawExchange(PORT, [`GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: ${'a'.repeat(256 * 1024)}\r\n\r\n`], 8000);
    const then = await okAfter('header_far_over_limit');
    report('header_far_over_limit', r.status === 431 && then, `want 431; got ${r.status}: ${short(r.data)}`);
});

// ---- prompts over the context ---------------------------------------------------------------
await bad('prompt_ids_over_context', C, { prompt: Array(CTX + 44).fill(300), max_tokens: 4 }, 400,
          { param: 'prompt', msgRe: new RegExp(`${CTX + 44} tokens.*context is ${CTX} tokens`) });
await bad('prompt_ids_at_context', C, { prompt: Array(CTX).fill(300), max_tokens: 4 }, 400,
          { param: 'prompt', msgRe: new RegExp(`${CTX} tokens.*context is ${CTX} tokens`) });
await step('prompt_text_over_context', async () => {
    const r = await post(U, C, { prompt: 'Once upon a time there was a dog. '.repeat(40), max_tokens: 4 });
    const m = r.json && isErrorObj(r.json) && /the prompt has (\d+) tokens.*context is (\d+) tokens/.exec(r.json.error.message);
    const then = await okAfter('prompt_text_over_context');
    report('prompt_text_over_context', r.status === 400 && m && Number(m[1]) > CTX && Number(m[2]) === CTX && then,
           `want 400 naming the prompt's length (> ${CTX}) and ${CTX}; got ${r.status} ${short(r.text)}`);
});
await step('chat_over_context', async () => {
    const r = await post(U, CH, { messages: [{ role: 'user', content: 'Tell me a story about a cat. '.repeat(40) }], max_tokens: 4 });
    const m = r.json && isErrorObj(r.json) && /(\d+) tokens.*context is (\d+) tokens/.exec(r.json.error.message);
    const then = await okAfter('chat_over_context');
    report('chat_over_context', r.status === 400 && m && Number(m[1]) > CTX && Number(m[2]) === CTX && r.json.error.param === 'messages' && then,
           `got ${r.status} ${short(r.text)}`);
});
await step('prompt_fills_context', async () => {
    // a prompt that fits but leaves little room: it runs, and stops when the context is full
    const r = await post(U, C, { prompt: Array(CTX - 8).fill(300), max_tokens: 100, ignore_eos: true });
    const u = r.json && r.json.usage;
    report('prompt_fills_context', r.status === 200 && r.json.choices[0].finish_reason === 'length' && u.prompt_tokens === CTX - 8 &&
           u.completion_tokens >= 1 && u.completion_tokens <= 9, `got ${r.status} ${short(r.text)}`);
});

// ---- slow clients (1 byte per second): 408 after --timeout, the others served meanwhile -----------
await step('slow_clients', async () => {
    const req = 'POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n';
    const trickle = (s) => s.split('').flatMap((ch) => [ch, 1000]);
    const maxMs = (TIMEOUT + 6) * 1000;
    const slowHead = rawExchange(PORT, trickle(req), maxMs);
    const slowBody = rawExchange(PORT, [req, ...trickle('{"prompt": "Once upon a time", "max_tokens": 2}')], maxMs);
    // others are served while they trickle
    let served = 0, errs = [];
    const t0 = Date.now();
    while (Date.now() - t0 < (TIMEOUT - 0.5) * 1000) {
        const r = await post(U, C, { prompt: 'Once upon a time', max_tokens: 2 });
        if (r.status === 200) served++;
        else errs.push(`${r.status} ${short(r.text)}`);
        await sleep(200);
    }
    report('slow_clients_others_served', served >= 3 && errs.length === 0, `served ${served}, errors ${short(errs)}`);
    for (const [name, p] of [['slow_header_408', slowHead], ['slow_body_408', slowBody]]) {
        const r = await p;
        let j = null;
        try { j = JSON.parse(rawBody(r.data)); } catch { /* not JSON */ }
        report(name, r.status === 408 && r.closed && r.ms >= (TIMEOUT - 0.5) * 1000 && r.ms <= (TIMEOUT + 3) * 1000 && isErrorObj(j),
               `want 408 with an error object and the socket closed after about ${TIMEOUT} s; got ${r.status} after ${r.ms} ms (closed ${r.closed}): ${short(r.data)}`);
    }
    await okAfter('slow_clients');
});

// ---- 500 idle connections at once --------------------------------------------------------------
await step('idle_500', async () => {
    const N = 500;
    const socks = [];
    let connected = 0, closed = 0, got408 = 0;
    await new Promise((resolve) => {
        for (let i = 0; i < N; i++) {
            const s = net.connect(PORT, '127.0.0.1');
            s.setNoDelay(true);
            let data = '';
            s.on('connect', () => { if (++connected === N) resolve(); });
            s.on('data', (d) => { data += d; });
            s.on('error', () => {});
            s.on('close', () => { closed++; if (/^HTTP\/1\.1 408/.test(data)) got408++; });
            socks.push(s);
        }
        setTimeout(resolve, 5000);
    });
    const tOpen = Date.now();
    report('idle_500_connected', connected === N, `${connected} of ${N} connected`);
    // normal requests succeed while they are open (the idle ones hold connections, not the scheduler)
    let ok = 0;
    const errs = [];
    for (let i = 0; i < 5; i++) {
        const t = Date.now();
        const r = await post(U, C, { prompt: 'Once upon a time', max_tokens: 4 });
        if (r.status === 200 && Date.now() - t < 2000) ok++;
        else errs.push(`${r.status} in ${Date.now() - t} ms: ${short(r.text)}`);
    }
    const h = await fetch(U.replace(/\/v1$/, '') + '/health');
    const elapsed = Date.now() - tOpen;
    report('idle_500_others_served', ok === 5 && h.status === 200 && elapsed < TIMEOUT * 1000,
           `${ok} of 5 served quickly, health ${h.status}, in ${elapsed} ms (must be within --timeout ${TIMEOUT} s to be meaningful)`, ...errs);
    // the server closes them after --timeout (they never sent a request): each gets a 408
    const t0 = Date.now();
    while (closed < N && Date.now() - t0 < (TIMEOUT + 4) * 1000) await sleep(100);
    report('idle_500_reaped', closed === N && got408 === N, `after ${Date.now() - tOpen} ms: ${closed} of ${N} closed by the server, ${got408} with a 408`);
    for (const s of socks) s.destroy();
    await okAfter('idle_500');
});

// ---- a client that goes away mid-request: cancelled, its pages freed ------------------------------
// On URL2 (no prefix reuse, so every page of a finished or cancelled request goes back to free).
async function settle(before, limitMs) {
    const t0 = Date.now();
    let m;
    for (;;) {
        m = await metrics(U2);
        if (m.lockstep_running_sequences === 0 && m.lockstep_kv_pages_used === 0 && m.lockstep_kv_pages_free === before.lockstep_kv_pages_free &&
            m.lockstep_queue_depth === 0)
            return { ok: true, ms: Date.now() - t0, m };
        if (Date.now() - t0 > limitMs) return { ok: false, ms: Date.now() - t0, m };
        await sleep(50);
    }
}
const pick = (m) => short({ running: m.lockstep_running_sequences, used: m.lockstep_kv_pages_used, free: m.lockstep_kv_pages_free,
                            queue: m.lockstep_queue_depth, steps: m.lockstep_steps_total, generated: m.lockstep_generated_tokens_total });
const LONG = 1500;   // tokens it would make if not cancelled (seconds of work)
await step('disconnect_mid_stream', async () => {
    const before = await metrics(U2);
    const ac = new AbortController();
    const r = await fetch(U2 + '/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, signal: ac.signal,
        body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: LONG, ignore_eos: true, temperature: 0, stream: true }),
    });
    let seen = '';
    const dec = new TextDecoder();
    try {
        for await (const part of r.body) {
            seen += dec.decode(part, { stream: true });
            if (/"text":"[^"]/.test(seen)) break;   // the first token's text
        }
    } finally { ac.abort(); }
    const mid = await metrics(U2);
    const s = await settle(before, 2500);
    const steps = s.m.lockstep_steps_total - before.lockstep_steps_total;
    report('disconnect_mid_stream_freed', r.status === 200 && seen.length > 0 && s.ok,
           `within 2.5 s of the hang-up: want 0 running, 0 queued, pages back to ${before.lockstep_kv_pages_free} free;`,
           `right after: ${pick(mid)}`, `after ${s.ms} ms: ${pick(s.m)}`);
    report('disconnect_mid_stream_cancelled', steps < LONG && s.m.lockstep_generated_tokens_total - before.lockstep_generated_tokens_total < LONG,
           `the request ran on: ${steps} steps, ${s.m.lockstep_generated_tokens_total - before.lockstep_generated_tokens_total} tokens counted`);
    await okAfter('disconnect_mid_stream', U2);
});
await step('disconnect_waiting_response', async () => {
    // not streaming: the client gives up waiting for the whole response
    const before = await metrics(U2);
    const ac = new AbortController();
    const p = fetch(U2 + '/completions', {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, signal: ac.signal,
        body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: LONG, ignore_eos: true, temperature: 0 }),
    }).then((x) => x.status, (e) => e.name);
    // wait until it runs, then hang up
    const t0 = Date.now();
    let running = 0;
    while (Date.now() - t0 < 5000 && !(running = (await metrics(U2)).lockstep_running_sequences)) await sleep(20);
    ac.abort();
    const how = await p;
    const s = await settle(before, 2500);
    const steps = s.m.lockstep_steps_total - before.lockstep_steps_total;
    report('disconnect_waiting_freed', running === 1 && how === 'AbortError' && s.ok,
           `running ${running} before the hang-up, client saw ${how}; after ${s.ms} ms: ${pick(s.m)} (before: ${pick(before)})`);
    report('disconnect_waiting_cancelled', steps < LONG, `the request ran on: ${steps} steps`);
    await okAfter('disconnect_waiting_response', U2);
});

// ---- a bounded queue: past --parallel running and --queue waiting, 429 ------------------------------
// QUEUE_URL: --parallel 2 --queue 1; QUEUE0_URL: --parallel 1 --queue 0 (none may wait, one runs).
async function burst(url, n) {
    const body = { prompt: 'Once upon a time', max_tokens: 600, ignore_eos: true, temperature: 0 };
    return Promise.all(Array.from({ length: n }, () => post(url, C, body)));
}
for (const [name, url, parallel, queue] of [['queue', A['queue-url'], 2, 1], ['queue0', A['queue0-url'], 1, 0]]) {
    if (!url) continue;
    await step(name, async () => {
        const alone = await post(url, C, { prompt: 'Once upon a time', max_tokens: 2 });
        report(`${name}_idle_serves`, alone.status === 200, `one request on an idle server (--parallel ${parallel} --queue ${queue}): ${alone.status} ${short(alone.text)}`);
        const rs = await burst(url, 6);
        const ok = rs.filter((r) => r.status === 200), busy = rs.filter((r) => r.status === 429);
        const msgs = busy.every((r) => isErrorObj(r.json) && r.json.error.type === 'rate_limit_error' && /--queue/.test(r.json.error.message));
        report(`${name}_burst_429`, ok.length === parallel + queue && busy.length === 6 - parallel - queue && msgs,
               `6 at once: want ${parallel + queue} served and ${6 - parallel - queue} x 429 (rate_limit_error naming --queue);`,
               `got ${rs.map((r) => r.status).join(' ')}: ${short([...new Set(rs.filter((r) => r.status !== 200).map((r) => r.text))])}`);
        await okAfter(name, url);
    });
}

process.exit(failures() ? 1 : 0);
