// Functional tests of `lockstep serve` through the official openai client
// (run by tests/test_server.sh against one node and a --local 2 --tp 2
// cluster, the server started with --temp 0):
//   node client.mjs --url http://127.0.0.1:PORT/v1 --lockstep BIN --model FILE --label NAME [--key KEY] [--threads N]
// Prints PASS/FAIL lines named NAME/check. Greedy completions are compared
// with `lockstep run -m FILE -p PROMPT -n N --temp 0` on one node (its stdout
// is the generated text and a newline).
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import { parseArgs, report, step, failures, short, post, streamRaw, isErrorObj, rootOf, metrics, sleep } from './lib.mjs';

const A = parseArgs();
const URL_ = A.url, L = A.lockstep, M = A.model, tag = A.label || 'server';
if (!URL_ || !L || !M) {
    console.error('usage: node client.mjs --url URL --lockstep BIN --model FILE [--label NAME] [--key KEY]');
    process.exit(2);
}
// -t for `lockstep run` (a spinning thread pool on an oversubscribed machine is slow, not different)
const threads = A.threads ? ['-t', String(A.threads)] : [];
const key = typeof A.key === 'string' ? A.key : 'unused';
// no retries: a failure must show, not be hidden by a second attempt
const client = new OpenAI({ baseURL: URL_, apiKey: key, maxRetries: 0, timeout: 120000 });
const authHeaders = { Authorization: `Bearer ${key}` };
const T = (n) => `${tag}/${n}`;
const eq = (name, got, want) => report(T(name), got === want, `got:  ${short(got, 600)}`, `want: ${short(want, 600)}`);

// Expects fn to throw an APIError with `status`; checks the error object.
async function expectError(name, status, fn, { param, msgRe } = {}) {
    try {
        const r = await fn();
        report(T(name), false, `no error; got ${short(r)}`);
    } catch (e) {
        const ok = e instanceof OpenAI.APIError && e.status === status && e.error && typeof e.error.message === 'string' &&
            e.error.message.length > 0 && typeof e.type === 'string' && (param === undefined || e.param === param) &&
            (!msgRe || msgRe.test(e.error.message));
        report(T(name), ok, `want APIError ${status}${param !== undefined ? ` param ${param}` : ''}${msgRe ? ` message ~ ${msgRe}` : ''}`,
               `got ${e && e.constructor && e.constructor.name} status ${e && e.status}: ${short(e && e.error ? e.error : String(e))}`);
    }
}

async function collect(stream) {
    const chunks = [];
    for await (const c of stream) chunks.push(c);
    return chunks;
}

// ---- models, health -----------------------------------------------------------
await step(T('models'), async () => {
    const page = await client.models.list();
    const ids = page.data.map((m) => m.id);
    report(T('models_list'), page.data.length === 1 && ids[0] === 'stories260K' && page.data[0].object === 'model',
           `got ${short(page.data)}`);
    const one = await client.models.retrieve('stories260K');
    report(T('models_retrieve'), one.id === 'stories260K', `got ${short(one)}`);
    await expectError('models_retrieve_unknown', 404, () => client.models.retrieve('no-such-model'), { param: 'model' });
    const h = await fetch(rootOf(URL_) + '/health');
    const hj = await h.json();
    report(T('health'), h.status === 200 && hj.status === 'ok', `got ${h.status} ${short(hj)}`);
});

// ---- completions: greedy text equals `lockstep run` ------------------------------
const RUN_CASES = [
    ['Once upon a time', 48],
    ['Lily and Tom went to the park. They saw a big', 40],
    ['The cat sat on the mat and', 30],
];
for (const [prompt, n] of RUN_CASES) {
    await step(T(`run_equal "${prompt.slice(0, 16)}"`), async () => {
        const ref = execFileSync(L, ['run', '-m', M, '-p', prompt, '-n', String(n), '--temp', '0', ...threads],
                                 { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'], timeout: 120000 });
        const c = await client.completions.create({ model: 'stories260K', prompt, max_tokens: n, temperature: 0 });
        const ch = c.choices[0];
        eq(`completion_equals_run "${prompt.slice(0, 16)}" -n ${n}`, ch.text + '\n', ref);
        report(T(`completion_shape "${prompt.slice(0, 16)}"`),
               c.object === 'text_completion' && /^cmpl-/.test(c.id) && ch.index === 0 &&
               (ch.finish_reason === 'length' ? c.usage.completion_tokens === n : ch.finish_reason === 'stop' && c.usage.completion_tokens < n) &&
               c.usage.total_tokens === c.usage.prompt_tokens + c.usage.completion_tokens && c.usage.prompt_tokens > 0,
               `got ${short(c, 800)}`);
    });
}

// ---- completions: streaming equals non-streaming, usage ------------------------
await step(T('completion_stream'), async () => {
    const req = { model: 'stories260K', prompt: 'One day, a little bird', max_tokens: 40, temperature: 0 };
    const full = await client.completions.create(req);
    const chunks = await collect(await client.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }));
    const text = chunks.map((c) => c.choices.map((x) => x.text).join('')).join('');
    eq('completion_stream_equals', text, full.choices[0].text);
    const fin = chunks.flatMap((c) => c.choices.filter((x) => x.finish_reason).map((x) => x.finish_reason));
    report(T('completion_stream_finish'), fin.length === 1 && fin[0] === full.choices[0].finish_reason, `finish reasons ${short(fin)}`);
    const last = chunks[chunks.length - 1];
    report(T('completion_stream_usage'), last && last.choices.length === 0 && last.usage &&
           last.usage.completion_tokens === full.usage.completion_tokens && last.usage.prompt_tokens === full.usage.prompt_tokens &&
           chunks.slice(0, -1).every((c) => !c.usage),
           `last chunk ${short(last)}; want usage ${short(full.usage)}`);
    const noUsage = await collect(await client.completions.create({ ...req, stream: true }));
    report(T('completion_stream_no_usage'), noUsage.every((c) => !c.usage), 'a chunk had usage without stream_options.include_usage');
    // the raw stream ends with data: [DONE] and nothing after it
    const raw = await streamRaw(URL_, '/completions', req, { headers: authHeaders });
    report(T('completion_stream_done'), raw.status === 200 && raw.done && raw.afterDone === 0 && raw.text === full.choices[0].text &&
           raw.nFinish === 1, `status ${raw.status} done ${raw.done} text ${short(raw.text)} raw ${short(raw.raw.slice(-300))}`);
});

// ---- chat: streaming equals non-streaming ------------------------------------
await step(T('chat'), async () => {
    const req = { model: 'stories260K', messages: [{ role: 'system', content: 'You tell stories.' },
                                                   { role: 'user', content: 'Tell me about a dog.' }], max_tokens: 48, temperature: 0 };
    const full = await client.chat.completions.create(req);
    const ch = full.choices[0];
    report(T('chat_shape'), full.object === 'chat.completion' && /^chatcmpl-/.test(full.id) && ch.message.role === 'assistant' &&
           typeof ch.message.content === 'string' && ch.message.content.length > 0 && ['stop', 'length'].includes(ch.finish_reason) &&
           full.usage.total_tokens === full.usage.prompt_tokens + full.usage.completion_tokens &&
           (ch.finish_reason === 'length') === (full.usage.completion_tokens === 48), `got ${short(full, 800)}`);
    const chunks = await collect(await client.chat.completions.create({ ...req, stream: true, stream_options: { include_usage: true } }));
    const text = chunks.map((c) => c.choices.map((x) => x.delta.content || '').join('')).join('');
    eq('chat_stream_equals', text, ch.message.content);
    report(T('chat_stream_shape'), chunks.length > 2 && chunks.every((c) => c.object === 'chat.completion.chunk' && c.id === chunks[0].id) &&
           chunks[0].choices[0].delta.role === 'assistant', `chunks ${short(chunks.slice(0, 2))}`);
    const fin = chunks.flatMap((c) => c.choices.filter((x) => x.finish_reason).map((x) => x.finish_reason));
    report(T('chat_stream_finish'), fin.length === 1 && fin[0] === ch.finish_reason, `finish reasons ${short(fin)}`);
    const last = chunks[chunks.length - 1];
    report(T('chat_stream_usage'), last.choices.length === 0 && last.usage && last.usage.completion_tokens === full.usage.completion_tokens &&
           last.usage.prompt_tokens === full.usage.prompt_tokens, `last ${short(last)} want ${short(full.usage)}`);
    // max_completion_tokens is max_tokens' newer name
    const mct = await client.chat.completions.create({ ...req, max_tokens: undefined, max_completion_tokens: 5 });
    report(T('chat_max_completion_tokens'), mct.choices[0].finish_reason === 'length' && mct.usage.completion_tokens === 5,
           `got ${short(mct)}`);
    // the same conversation again reuses its prefix and gives the same text
    const again = await client.chat.completions.create(req);
    eq('chat_repeat_equal', again.choices[0].message.content, ch.message.content);
});

// ---- max_tokens -> length -------------------------------------------------------
await step(T('length'), async () => {
    for (const n of [1, 3]) {
        const c = await client.completions.create({ model: 'stories260K', prompt: 'Once upon a time', max_tokens: n, temperature: 0 });
        report(T(`max_tokens_${n}_length`), c.choices[0].finish_reason === 'length' && c.usage.completion_tokens === n,
               `got ${short(c)}`);
    }
});

// ---- seed: sampling with a seed repeats ---------------------------------------------
await step(T('seed'), async () => {
    const req = { model: 'stories260K', prompt: 'Once upon a time', max_tokens: 24, temperature: 1, top_p: 1, top_k: 0, min_p: 0, seed: 1234 };
    const a = await client.completions.create(req);
    const b = await client.completions.create(req);
    eq('seed_repeats', b.choices[0].text, a.choices[0].text);
});

// ---- logprobs ---------------------------------------------------------------------
const near = (a, b) => Math.abs(a - b) <= 1e-4;
await step(T('chat_logprobs'), async () => {
    const req = { model: 'stories260K', messages: [{ role: 'user', content: 'Say something.' }], max_tokens: 16, temperature: 0,
                  logprobs: true, top_logprobs: 5 };
    const r = await client.chat.completions.create(req);
    const ch = r.choices[0];
    const lp = ch.logprobs && ch.logprobs.content;
    const why = [];
    if (!Array.isArray(lp) || lp.length !== r.usage.completion_tokens) why.push(`content has ${lp && lp.length} entries for ${r.usage.completion_tokens} tokens`);
    for (const [i, e] of (lp || []).entries()) {
        const tops = e.top_logprobs || [];
        const bytes = Buffer.from(e.token, 'utf8');
        if (typeof e.token !== 'string' || !(e.logprob <= 0)) why.push(`[${i}] token/logprob ${short(e)}`);
        if (!Array.isArray(e.bytes) || Buffer.compare(Buffer.from(e.bytes), bytes)) why.push(`[${i}] bytes ${short(e.bytes)} for ${short(e.token)}`);
        if (tops.length !== 5) why.push(`[${i}] ${tops.length} top_logprobs, want 5`);
        for (let k = 1; k < tops.length; k++) if (tops[k].logprob > tops[k - 1].logprob) why.push(`[${i}] top_logprobs not sorted`);
        if (tops.length && (tops[0].token !== e.token || !near(tops[0].logprob, e.logprob)))
            why.push(`[${i}] greedy token ${short(e.token)} (${e.logprob}) is not the most likely ${short(tops[0])}`);
        if (tops.some((t) => t.logprob > e.logprob + 1e-6)) why.push(`[${i}] a candidate beats the greedy token`);
        const p = tops.reduce((s, t) => s + Math.exp(t.logprob), 0);
        if (!(p <= 1 + 1e-5 && p > 0)) why.push(`[${i}] top probabilities sum to ${p}`);
    }
    if (lp && lp.map((e) => e.token).join('') !== ch.message.content) why.push(`tokens join to ${short(lp.map((e) => e.token).join(''))}, content ${short(ch.message.content)}`);
    report(T('chat_logprobs_structure'), why.length === 0, ...why.slice(0, 8));
    // streamed: the same entries, spread over the chunks
    const chunks = await collect(await client.chat.completions.create({ ...req, stream: true }));
    const slp = chunks.flatMap((c) => c.choices.flatMap((x) => (x.logprobs && x.logprobs.content) || []));
    report(T('chat_logprobs_stream_equal'), lp && slp.length === lp.length &&
           slp.every((e, i) => e.token === lp[i].token && near(e.logprob, lp[i].logprob) && e.top_logprobs.length === 5),
           `stream ${short(slp.map((e) => [e.token, e.logprob]))}`, `full ${short(lp && lp.map((e) => [e.token, e.logprob]))}`);
    // without logprobs: null; top_logprobs alone is refused
    const none = await client.chat.completions.create({ ...req, logprobs: undefined, top_logprobs: undefined });
    report(T('chat_logprobs_absent'), none.choices[0].logprobs === null || none.choices[0].logprobs === undefined, `got ${short(none.choices[0])}`);
    await expectError('chat_top_logprobs_alone', 400, () => client.chat.completions.create({ ...req, logprobs: undefined }), { param: 'top_logprobs' });
    await expectError('chat_top_logprobs_over', 400, () => client.chat.completions.create({ ...req, top_logprobs: 1000 }), { param: 'top_logprobs' });
});

await step(T('completion_logprobs'), async () => {
    const req = { model: 'stories260K', prompt: 'Once upon a time', max_tokens: 12, temperature: 0, logprobs: 3 };
    const r = await client.completions.create(req);
    const ch = r.choices[0], lp = ch.logprobs;
    const why = [];
    if (!lp || lp.tokens.length !== 12 || lp.token_logprobs.length !== 12 || lp.top_logprobs.length !== 12 || lp.text_offset.length !== 12)
        why.push(`lengths: ${short(lp)}`);
    else {
        if (lp.tokens.join('') !== ch.text) why.push(`tokens join to ${short(lp.tokens.join(''))}, text ${short(ch.text)}`);
        for (let i = 0; i < 12; i++) {
            const tops = Object.entries(lp.top_logprobs[i]);
            const best = Math.max(...tops.map(([, v]) => v));
            if (tops.length < 1 || tops.length > 3) why.push(`[${i}] ${tops.length} top entries`);
            if (!near(lp.token_logprobs[i], best) || !(lp.token_logprobs[i] <= 0)) why.push(`[${i}] greedy logprob ${lp.token_logprobs[i]}, best ${best}`);
            if (!(lp.tokens[i] in lp.top_logprobs[i])) why.push(`[${i}] ${short(lp.tokens[i])} not among ${short(lp.top_logprobs[i])}`);
            const p = tops.reduce((s, [, v]) => s + Math.exp(v), 0);
            if (!(p <= 1 + 1e-5)) why.push(`[${i}] probabilities sum to ${p}`);
            if (i && lp.text_offset[i] !== lp.text_offset[i - 1] + lp.tokens[i - 1].length) why.push(`text_offset ${short(lp.text_offset)}`);
        }
    }
    report(T('completion_logprobs_structure'), why.length === 0, ...why.slice(0, 8));
    await expectError('completion_logprobs_over', 400, () => client.completions.create({ ...req, logprobs: 6 }), { param: 'logprobs' });
});

// ---- stop strings -----------------------------------------------------------------
await step(T('stop'), async () => {
    const base = { model: 'stories260K', prompt: 'Once upon a time', max_tokens: 48, temperature: 0 };
    const full = (await client.completions.create(base)).choices[0].text;
    // a stop of several tokens that begins in the middle of the text
    const words = full.split(' ');
    const mid = Math.floor(words.length / 2);
    const stop = ' ' + words.slice(mid, mid + 2).join(' ');
    const at = full.indexOf(stop);
    if (at <= 0 || words.length < 6) { report(T('stop_setup'), false, `text too short for the stop tests: ${short(full)}`); return; }
    const s1 = await client.completions.create({ ...base, stop: [stop] });
    eq('stop_cut', s1.choices[0].text, full.slice(0, at));
    report(T('stop_finish'), s1.choices[0].finish_reason === 'stop' && s1.usage.completion_tokens < 48, `got ${short(s1)}`);
    // streaming: the concatenation is the same, so nothing of the stop string was ever sent
    const st = await collect(await client.completions.create({ ...base, stop: stop, stream: true }));
    const stext = st.map((c) => c.choices.map((x) => x.text).join('')).join('');
    eq('stop_stream_holds_back', stext, full.slice(0, at));
    report(T('stop_stream_finish'), st.some((c) => c.choices.some((x) => x.finish_reason === 'stop')), `chunks ${short(st.slice(-2))}`);
    // a stop whose beginning appears but not its end: held back, then released whole
    const partial = stop + 'QQQ';
    const s2 = await collect(await client.completions.create({ ...base, stop: [partial], stream: true }));
    eq('stop_partial_released', s2.map((c) => c.choices.map((x) => x.text).join('')).join(''), full);
    const s2f = await client.completions.create({ ...base, stop: [partial] });
    report(T('stop_partial_length'), s2f.choices[0].text === full && s2f.choices[0].finish_reason === 'length', `got ${short(s2f)}`);
    // the earliest of several stops wins
    const early = ' ' + words[Math.floor(mid / 2)];
    const at2 = Math.min(full.indexOf(early) < 0 ? Infinity : full.indexOf(early), at);
    const s3 = await client.completions.create({ ...base, stop: [stop, early] });
    eq('stop_earliest', s3.choices[0].text, full.slice(0, at2));
    // chat, streamed
    const creq = { model: 'stories260K', messages: [{ role: 'user', content: 'Tell me a story.' }], max_tokens: 40, temperature: 0 };
    const cfull = (await client.chat.completions.create(creq)).choices[0].message.content;
    const cw = cfull.split(' ');
    if (cw.length >= 4) {
        const cstop = cw[Math.floor(cw.length / 2)] + ' ' + cw[Math.floor(cw.length / 2) + 1];
        const cat = cfull.indexOf(cstop);
        const cs = await collect(await client.chat.completions.create({ ...creq, stop: [cstop], stream: true }));
        eq('chat_stop_stream', cs.map((c) => c.choices.map((x) => x.delta.content || '').join('')).join(''), cfull.slice(0, cat));
        report(T('chat_stop_finish'), cs.some((c) => c.choices.some((x) => x.finish_reason === 'stop')), `chunks ${short(cs.slice(-2))}`);
    } else report(T('chat_stop_setup'), false, `chat text too short: ${short(cfull)}`);
    await expectError('stop_too_many', 400, () => client.completions.create({ ...base, stop: Array.from({ length: 17 }, (_, i) => `s${i}`) }), { param: 'stop' });
    await expectError('stop_empty', 400, () => client.completions.create({ ...base, stop: [''] }), { param: 'stop' });
});

// ---- errors: 4xx with OpenAI-style objects ------------------------------------------
await step(T('errors'), async () => {
    const chat = { model: 'stories260K', messages: [{ role: 'user', content: 'hi' }], max_tokens: 4 };
    await expectError('err_no_messages', 400, () => client.chat.completions.create({ model: 'stories260K' }), { param: 'messages' });
    await expectError('err_empty_messages', 400, () => client.chat.completions.create({ ...chat, messages: [] }), { param: 'messages' });
    await expectError('err_bad_role', 400, () => client.chat.completions.create({ ...chat, messages: [{ role: 'wizard', content: 'x' }] }),
                      { param: 'messages', msgRe: /wizard/ });
    await expectError('err_temperature', 400, () => client.chat.completions.create({ ...chat, temperature: 5 }), { param: 'temperature', msgRe: /temperature/ });
    await expectError('err_top_p', 400, () => client.chat.completions.create({ ...chat, top_p: -0.5 }), { param: 'top_p' });
    await expectError('err_n', 400, () => client.chat.completions.create({ ...chat, n: 2 }), { param: 'n' });
    await expectError('err_max_tokens_zero', 400, () => client.chat.completions.create({ ...chat, max_tokens: 0 }), { param: 'max_tokens' });
    await expectError('err_unknown_field', 400, () => client.chat.completions.create({ ...chat, frobnicate: true }), { param: 'frobnicate', msgRe: /frobnicate/ });
    await expectError('err_no_prompt', 400, () => client.completions.create({ model: 'stories260K', max_tokens: 4 }), { param: 'prompt' });
    await expectError('err_bad_token_id', 400, () => client.completions.create({ model: 'stories260K', prompt: [1, 999999], max_tokens: 4 }), { param: 'prompt' });
    await expectError('err_prompt_over_context', 400, () => client.completions.create({ model: 'stories260K', prompt: Array(5000).fill(300), max_tokens: 4 }),
                      { param: 'prompt', msgRe: /5000 tokens.*context is \d+ tokens/ });
    await expectError('err_stream_bad', 400, () => client.chat.completions.create({ ...chat, stream: true, temperature: -1 }), { param: 'temperature' });
    await expectError('err_no_route', 404, () => client.get('/no/such/route'));
    await expectError('err_method', 405, () => client.get('/chat/completions'));
    if (typeof A.key === 'string') {
        const bad = new OpenAI({ baseURL: URL_, apiKey: 'wrong-key-123', maxRetries: 0 });
        await expectError('err_wrong_api_key', 401, () => bad.chat.completions.create(chat));
        await expectError('err_wrong_api_key_models', 401, () => bad.models.list());
    }
    // the server still answers
    const ok = await client.chat.completions.create(chat);
    report(T('after_errors_ok'), ok.choices[0].message.content.length > 0 || ok.usage.completion_tokens > 0, `got ${short(ok)}`);
});

// ---- /metrics: every rank's compute and network seconds (workers' by their heartbeats) ----
await step(T('metrics_per_rank'), async () => {
    const ranks = Number(A.ranks || 1);
    let m = await metrics(URL_);
    const t0 = Date.now(); // a worker's figures are up to 250 ms behind
    while (Date.now() - t0 < 3000 && !(m[`lockstep_rank_compute_seconds_total{rank="${ranks - 1}"}`] > 0)) {
        await sleep(100);
        m = await metrics(URL_);
    }
    for (let r = 0; r < ranks; r++) {
        const c = m[`lockstep_rank_compute_seconds_total{rank="${r}"}`], w = m[`lockstep_rank_comm_seconds_total{rank="${r}"}`];
        report(T(`metrics_rank${r}`), c > 0 && w >= 0 && (ranks === 1 || w > 0), `rank ${r}: compute ${c} s, network ${w} s`);
    }
    report(T('metrics_no_extra_rank'), m[`lockstep_rank_compute_seconds_total{rank="${ranks}"}`] === undefined, `rank ${ranks} listed`);
});

process.exit(failures() ? 1 : 0);
