// Helpers shared by the server's client tests (client.mjs, abuse.mjs,
// load.mjs): arguments, PASS/FAIL lines (tests/run.sh counts them), raw HTTP
// and Server-Sent Events, /metrics. Loopback only.
import net from 'node:net';

// --name value pairs (and bare --flag) into an object.
export function parseArgs(argv = process.argv.slice(2)) {
    const a = {};
    for (let i = 0; i < argv.length; i++) {
        if (!argv[i].startsWith('--')) throw new Error(`unexpected argument ${argv[i]}`);
        const k = argv[i].slice(2);
        if (i + 1 < argv.length && !argv[i + 1].startsWith('--')) a[k] = argv[++i];
        else a[k] = true;
    }
    return a;
}

let nFail = 0;
export function failures() { return nFail; }

// Prints PASS name, or FAIL name and why (each detail on an indented line).
export function report(name, ok, ...why) {
    if (ok) {
        console.log(`PASS ${name}`);
    } else {
        nFail++;
        console.log(`FAIL ${name}`);
        for (const w of why) for (const l of String(w).split('\n').slice(0, 20)) console.log(`  ${l}`);
    }
    return ok;
}

// Runs fn (async); a throw is a FAIL with the error. The tag prefixes the names of its checks.
export async function step(name, fn) {
    try {
        await fn();
    } catch (e) {
        report(name, false, `threw: ${e && e.stack ? e.stack : e}`);
    }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export function short(x, n = 300) {
    const s = typeof x === 'string' ? x : JSON.stringify(x);
    return s.length > n ? s.slice(0, n) + '...' : s;
}

// The server's root (http://host:port) from its /v1 URL.
export function rootOf(url) { return url.replace(/\/v1\/?$/, ''); }

// /metrics as {name or name{labels}: number}.
export async function metrics(url) {
    const r = await fetch(rootOf(url) + '/metrics');
    const t = await r.text();
    const m = {};
    for (const line of t.split('\n')) {
        if (!line || line.startsWith('#')) continue;
        const i = line.lastIndexOf(' ');
        m[line.slice(0, i)] = Number(line.slice(i + 1));
    }
    return m;
}

// POST JSON (or a raw string) with fetch: {status, json, text}.
export async function post(url, path, body, headers = {}) {
    const r = await fetch(url + path, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', ...headers },
        body: typeof body === 'string' || body instanceof Uint8Array ? body : JSON.stringify(body),
    });
    const text = await r.text();
    let json = null;
    try { json = JSON.parse(text); } catch { /* not JSON */ }
    return { status: r.status, json, text, headers: r.headers };
}

// True when j is an OpenAI-style error object with a message.
export function isErrorObj(j) {
    return !!(j && j.error && typeof j.error.message === 'string' && j.error.message.length > 0 &&
              typeof j.error.type === 'string' && 'param' in j.error && 'code' in j.error);
}

// A streaming request read as raw Server-Sent Events: {status, events (parsed
// JSON objects), done (saw [DONE] as the last event), afterDone (events after
// it), text (the concatenated text of the choices), finish (the finish_reason
// seen, or null), nFinish, usage, error (an error event), raw}.
export async function streamRaw(url, path, body, { signal, headers = {} } = {}) {
    const r = await fetch(url + path, {
        method: 'POST',
        headers: { 'Content-Type': 'application/json', ...headers },
        body: JSON.stringify({ ...body, stream: true }),
        signal,
    });
    const out = { status: r.status, events: [], done: false, afterDone: 0, text: '', finish: null, nFinish: 0,
                  usage: null, error: null, raw: '' };
    if (r.status !== 200) {
        out.raw = await r.text();
        try { out.error = JSON.parse(out.raw).error; } catch { /* not JSON */ }
        return out;
    }
    const dec = new TextDecoder();
    let buf = '';
    const handle = (ev) => {
        const data = ev.split('\n').filter((l) => l.startsWith('data: ')).map((l) => l.slice(6)).join('\n');
        if (!data) return;
        if (out.done) { out.afterDone++; return; }
        if (data === '[DONE]') { out.done = true; return; }
        const j = JSON.parse(data);
        out.events.push(j);
        if (j.error) { out.error = j.error; return; }
        if (j.usage) out.usage = j.usage;
        for (const c of j.choices || []) {
            if (c.delta && typeof c.delta.content === 'string') out.text += c.delta.content;
            if (typeof c.text === 'string') out.text += c.text;
            if (c.finish_reason) { out.finish = c.finish_reason; out.nFinish++; }
        }
    };
    for await (const part of r.body) {
        const s = dec.decode(part, { stream: true });
        out.raw += s;
        buf += s;
        let k;
        while ((k = buf.indexOf('\n\n')) >= 0) {
            handle(buf.slice(0, k));
            buf = buf.slice(k + 2);
        }
    }
    if (buf.trim()) handle(buf);
    return out;
}

// A raw TCP exchange: sends `parts` (strings, or numbers = milliseconds to
// wait), then reads until the server closes or `maxMs` passes. Returns
// {data, closed, ms, status (of the first response line, or 0), error}.
export function rawExchange(port, parts, maxMs = 10000, host = '127.0.0.1') {
    return new Promise((resolve) => {
        const t0 = Date.now();
        const sock = net.connect(port, host);
        let data = '', closed = false, err = null, finished = false;
        const finish = () => {
            if (finished) return;
            finished = true;
            clearTimeout(timer);
            sock.destroy();
            const m = /^HTTP\/1\.[01] (\d{3})/.exec(data);
            resolve({ data, closed, ms: Date.now() - t0, status: m ? Number(m[1]) : 0, error: err });
        };
        const timer = setTimeout(finish, maxMs);
        sock.on('data', (d) => { data += d.toString('latin1'); });
        sock.on('error', (e) => { err = e.code || String(e); });
        sock.on('close', () => { closed = true; finish(); });
        sock.on('connect', async () => {
            for (const p of parts) {
                if (finished || sock.destroyed) return;
                if (typeof p === 'number') await sleep(p);
                else sock.write(p);
            }
        });
    });
}

// The body of a raw HTTP response (after the header; chunked bodies decoded).
export function rawBody(data) {
    const k = data.indexOf('\r\n\r\n');
    if (k < 0) return '';
    const head = data.slice(0, k).toLowerCase(), body = data.slice(k + 4);
    if (!head.includes('transfer-encoding: chunked')) return body;
    let out = '', i = 0;
    for (;;) {
        const e = body.indexOf('\r\n', i);
        if (e < 0) break;
        const n = parseInt(body.slice(i, e), 16);
        if (!(n > 0)) break;
        out += body.slice(e + 2, e + 2 + n);
        i = e + 2 + n + 2;
    }
    return out;
}

export function portOf(url) { return Number(new URL(url).port); }
