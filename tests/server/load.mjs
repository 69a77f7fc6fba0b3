// Load test of `lockstep serve` (run by tests/test_server.sh; loopback only,
// bounded): N concurrent streaming clients for D seconds, prompts of mixed
// lengths on both endpoints, staggered arrivals, greedy. Checks: zero errors,
// every stream complete (one finish_reason, then data: [DONE]), every output
// identical to the same request run alone before the load, the batch really
// ran several sequences at once, and (with --pid) the server's RSS flat after
// warm-up.
//   node load.mjs --url URL [--pid PID] [--clients 32] [--duration 60] [--label load]
//                 [--seed 1] [--rss-pct 10] [--rss-mb 8] [--warmup 0.3]
import fs from 'node:fs';
import { parseArgs, report, step, failures, short, post, streamRaw, metrics, sleep } from './lib.mjs';

const A = parseArgs();
const U = A.url, PID = A.pid ? Number(A.pid) : 0;
const N = Number(A.clients || 32), D = Number(A.duration || 60), tag = A.label || 'load';
const RSS_PCT = Number(A['rss-pct'] || 10), RSS_MB = Number(A['rss-mb'] || 8), WARM = Number(A.warmup || 0.3);
if (!U) {
    console.error('usage: node load.mjs --url URL [--pid PID] [--clients N] [--duration S] [--label NAME]');
    process.exit(2);
}
const T = (n) => `${tag}/${n}`;

// a small deterministic generator (xorshift32)
let seed = (Number(A.seed || 1) * 2654435761) >>> 0 || 1;
const rnd = () => { seed ^= seed << 13; seed >>>= 0; seed ^= seed >>> 17; seed ^= seed << 5; seed >>>= 0; return seed / 4294967296; };
const pickOf = (xs) => xs[Math.floor(rnd() * xs.length)];

// ---- the requests: mixed prompt lengths, both endpoints, shared prefixes ----
const SENT = ['Once upon a time there was a little girl named Lily.', 'She loved to play outside in the park.',
    'One day she saw a big red ball under a tree.', 'Tom was her best friend and he liked to run.',
    'The sun was warm and the birds sang in the sky.', 'Her mom made a cake for the party.',
    'The dog barked at the cat, and the cat ran up the tree.', 'They went to the beach and built a sand castle.'];
const story = (k, off) => Array.from({ length: k }, (_, i) => SENT[(i + off) % SENT.length]).join(' ');
const SYS = 'You are a friendly storyteller who tells short, happy stories for small children. ' + story(4, 0);
const CASES = [];
for (const [k, off, n] of [[0, 0, 24], [1, 0, 48], [1, 3, 16], [3, 1, 64], [6, 2, 32], [12, 0, 40], [20, 5, 24], [28, 1, 96]]) {
    const prompt = k === 0 ? 'Once upon a time' : story(k, off);
    CASES.push({ path: '/completions', body: { prompt, max_tokens: n, temperature: 0 } });
}
for (const [user, k, n] of [['Tell me a story.', 0, 32], ['Tell me about a dog.', 2, 48], ['What did Lily do?', 8, 24], ['Once upon a time', 0, 80]]) {
    const messages = [{ role: 'system', content: SYS }];
    if (k) messages.push({ role: 'user', content: story(k, 1) }, { role: 'assistant', content: 'That is a nice story.' });
    messages.push({ role: 'user', content: user });
    CASES.push({ path: '/chat/completions', body: { messages, max_tokens: n, temperature: 0 } });
}

// ---- RSS sampling ----
const rss = [];   // [ms since the load began, kB]
function rssNow() {
    try {
        const m = /VmRSS:\s+(\d+) kB/.exec(fs.readFileSync(`/proc/${PID}/status`, 'utf8'));
        return m ? Number(m[1]) : 0;
    } catch { return 0; }
}

// ---- alone, one after another: the expected outputs ----
const expect = [];
await step(T('baseline'), async () => {
    const why = [];
    for (const [i, c] of CASES.entries()) {
        const r = await post(U, c.path, c.body);
        if (r.status !== 200) { why.push(`case ${i}: ${r.status} ${short(r.text)}`); expect.push(null); continue; }
        const ch = r.json.choices[0];
        expect.push({ text: c.path === '/completions' ? ch.text : ch.message.content, finish: ch.finish_reason,
                      n: r.json.usage.completion_tokens, prompt: r.json.usage.prompt_tokens });
    }
    report(T('baseline'), why.length === 0, ...why);
    const lens = expect.filter(Boolean).map((e) => e.prompt);
    console.log(`  ${CASES.length} requests alone: prompts of ${Math.min(...lens)} to ${Math.max(...lens)} tokens`);
});
if (failures()) process.exit(1);

// ---- the load ----
const stats = { requests: 0, errors: [], incomplete: [], mismatches: [], tokens: 0, maxRunning: 0, maxInflight: 0 };
let inflight = 0;
const t0 = Date.now(), deadline = t0 + D * 1000;
const sampler = setInterval(() => { if (PID) rss.push([Date.now() - t0, rssNow()]); }, 250);
const watcher = (async () => {
    while (Date.now() < deadline) {
        try { stats.maxRunning = Math.max(stats.maxRunning, (await metrics(U)).lockstep_running_sequences || 0); } catch { /* counted below */ }
        await sleep(500);
    }
})();

async function client(id) {
    await sleep(rnd() * Math.min(3000, D * 250));   // staggered arrivals
    while (Date.now() < deadline) {
        const ci = Math.floor(rnd() * CASES.length), c = CASES[ci], e = expect[ci];
        const usage = rnd() < 0.5;
        const body = usage ? { ...c.body, stream_options: { include_usage: true } } : c.body;
        inflight++;
        stats.maxInflight = Math.max(stats.maxInflight, inflight);
        let r;
        try {
            r = await streamRaw(U, c.path, body, { signal: AbortSignal.timeout(120000) });
        } catch (err) {
            stats.errors.push(`client ${id} case ${ci}: ${err}`);
            inflight--;
            continue;
        }
        inflight--;
        stats.requests++;
        if (r.status !== 200 || r.error) { stats.errors.push(`client ${id} case ${ci}: ${r.status} ${short(r.error || r.raw)}`); continue; }
        if (!r.done || r.afterDone || r.nFinish !== 1 || (usage && !r.usage))
            stats.incomplete.push(`client ${id} case ${ci}: done ${r.done}, ${r.nFinish} finish reasons, usage ${short(r.usage)}; ends ${short(r.raw.slice(-200))}`);
        else if (r.text !== e.text || r.finish !== e.finish || (usage && r.usage.completion_tokens !== e.n))
            stats.mismatches.push(`client ${id} case ${ci}: got ${short(r.text)} (${r.finish}), alone ${short(e.text)} (${e.finish})`);
        stats.tokens += e.n;
        await sleep(rnd() * 200);
    }
}
await Promise.all(Array.from({ length: N }, (_, i) => client(i)));
const wall = (Date.now() - t0) / 1000;
clearInterval(sampler);
await watcher;

console.log(`  ${N} clients, ${wall.toFixed(1)} s: ${stats.requests} streams, ${stats.tokens} tokens (${(stats.tokens / wall).toFixed(0)} tok/s), ` +
            `at most ${stats.maxInflight} in flight and ${stats.maxRunning} running at once`);
report(T('no_errors'), stats.errors.length === 0 && stats.requests >= N, `${stats.errors.length} errors in ${stats.requests} requests`, ...stats.errors.slice(0, 5));
report(T('streams_complete'), stats.incomplete.length === 0, `${stats.incomplete.length} incomplete`, ...stats.incomplete.slice(0, 5));
report(T('outputs_identical_to_alone'), stats.mismatches.length === 0, `${stats.mismatches.length} differ`, ...stats.mismatches.slice(0, 5));
report(T('concurrent'), stats.maxInflight >= Math.min(N, 4) && stats.maxRunning >= 2,
       `at most ${stats.maxInflight} requests in flight, ${stats.maxRunning} sequences running at once`);

// the server is idle again and still answers
await step(T('after'), async () => {
    const t = Date.now();
    let m;
    do { m = await metrics(U); if (m.lockstep_running_sequences === 0 && m.lockstep_queue_depth === 0) break; await sleep(100); } while (Date.now() - t < 5000);
    report(T('idle_after'), m.lockstep_running_sequences === 0 && m.lockstep_queue_depth === 0, `metrics: running ${m.lockstep_running_sequences}, queue ${m.lockstep_queue_depth}`);
    const r = await post(U, CASES[0].path, CASES[0].body);
    report(T('served_after'), r.status === 200 && r.json.choices[0].text === expect[0].text, `got ${r.status} ${short(r.text)}`);
});

if (PID) {
    // flat after warm-up: nothing after it above the warm-up's peak by more than RSS_PCT % or RSS_MB MB
    const warm = rss.filter(([t]) => t <= WARM * D * 1000), after = rss.filter(([t]) => t > WARM * D * 1000);
    const peakWarm = Math.max(...warm.map(([, k]) => k)), peakAfter = Math.max(...after.map(([, k]) => k));
    const last = rss.length ? rss[rss.length - 1][1] : 0;
    const allow = Math.max(peakWarm * RSS_PCT / 100, RSS_MB * 1024);
    const mb = (k) => (k / 1024).toFixed(1);
    console.log(`  RSS: ${rss.length} samples; peak ${mb(peakWarm)} MB in the first ${(WARM * D).toFixed(0)} s, ` +
                `peak ${mb(peakAfter)} MB after, ${mb(last)} MB at the end`);
    report(T('rss_flat'), warm.length > 0 && after.length > 0 && peakWarm > 0 && peakAfter - peakWarm <= allow,
           `RSS after warm-up rose from ${mb(peakWarm)} MB to ${mb(peakAfter)} MB (allowed: +${mb(allow)} MB)`,
           `samples (s, MB): ${rss.filter((_, i) => i % Math.ceil(rss.length / 12) === 0).map(([t, k]) => `${(t / 1000).toFixed(0)}:${mb(k)}`).join(' ')}`);
}

process.exit(failures() ? 1 : 0);
