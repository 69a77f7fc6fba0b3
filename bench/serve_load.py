#!/usr/bin/env python3
"""Load generator for OpenAI-compatible servers (lockstep serve, llama-server).

C client threads, each sending streaming /v1/completions requests one after
another until N requests are done; prints one JSON line: aggregate decode
tok/s (completion tokens of all requests / wall time), time to first token
p50/p99, per-request decode tok/s (median) and errors. Every request has its
own prompt (a numbered opening, so no two share a cached prefix) and decodes
exactly --max-tokens tokens (ignore_eos), greedy. Standard library only, so
the same client runs against both servers on any machine with python3.

  bench/serve_load.py --url http://127.0.0.1:8080 -c 16 [-n 32] [--max-tokens 64] [--prompt-words 48]
"""
import argparse, http.client, json, statistics, sys, threading, time, urllib.parse

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--url", "-u", default="http://127.0.0.1:8080")
ap.add_argument("--concurrency", "-c", type=int, default=1)
ap.add_argument("--requests", "-n", type=int, default=0, help="requests in all (default max(2c, 4))")
ap.add_argument("--max-tokens", "-t", type=int, default=64)
ap.add_argument("--prompt-words", "-p", type=int, default=48)
ap.add_argument("--model", "-m", default="default")
a = ap.parse_args()
N = a.requests or max(2 * a.concurrency, 4)
u = urllib.parse.urlparse(a.url)
FILLER = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old green tree by the river".split()


def prompt(i):
    w = [f"Story number {i}:"]
    k = 0
    while len(w) < a.prompt_words:
        w.append(FILLER[(i * 7 + k) % len(FILLER)])
        k += 1
    return " ".join(w)


def one(i):
    body = json.dumps({"model": a.model, "prompt": prompt(i), "max_tokens": a.max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    c = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=600)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
    first = 0.0
    chunks = 0
    usage = None
    done = False
    for line in r:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        j = json.loads(data)
        if "error" in j:
            raise RuntimeError(json.dumps(j["error"]))
        if j.get("usage"):
            usage = j["usage"]
        ch = j.get("choices") or []
        if ch and ch[0].get("text"):
            if not first:
                first = time.perf_counter()
            chunks += 1
    t1 = time.perf_counter()
    c.close()
    if not done:
        raise RuntimeError("stream ended without [DONE]")
    toks = usage["completion_tokens"] if usage else chunks
    return {"ttft": first - t0, "toks": toks, "decode_s": t1 - first}


results, errors, lock = [], [], threading.Lock()
nxt = [0]


def worker():
    while True:
        with lock:
            i = nxt[0]
            if i >= N:
                return
            nxt[0] += 1
        try:
            r = one(i)
            with lock:
                results.append(r)
        except Exception as e:  # counted and reported
            with lock:
                errors.append(str(e))


t0 = time.perf_counter()
th = [threading.Thread(target=worker) for _ in range(a.concurrency)]
for t in th:
    t.start()
for t in th:
    t.join()
wall = time.perf_counter() - t0


def q(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))] if s else float("nan")


toks = sum(r["toks"] for r in results)
per = [(r["toks"] - 1) / r["decode_s"] for r in results if r["decode_s"] > 0]
print(json.dumps({"concurrency": a.concurrency, "requests": N, "ok": len(results), "errors": len(errors),
                  "max_tokens": a.max_tokens, "wall_s": round(wall, 2), "agg_tok_s": round(toks / wall, 2),
                  "ttft_p50_s": round(q([r["ttft"] for r in results], 0.5), 3),
                  "ttft_p99_s": round(q([r["ttft"] for r in results], 0.99), 3),
                  "per_req_tok_s_p50": round(statistics.median(per), 2) if per else None,
                  "first_error": errors[0] if errors else None}))
sys.exit(1 if errors else 0)
