"""Stress: mixed requests against one evicting server (tiny fp32 Qwen3 on CPU, loopback,
bounded: every call has a timeout and the request list is fixed). CI runs 200 requests; the
full 500 are a slow test (pytest -m slow tests/test_stress.py).

Mix: random prompt lengths (4-120 tokens) and output lengths (1-48), prompts sharing three
long prefixes, per-request settings (own budget, another policy, eviction off), streamed
requests cut off mid-generation by closing the connection or by /abort_request. The server
runs the overlap scheduler (SGLang's default), SGLang's strict memory checks
(servers.STRICT_ENV: conservation every busy step, page ownership, the idle leak check) and
forced retraction (SGLANG_TEST_RETRACT=1: every SGLANG_TEST_RETRACT_INTERVAL forward steps
the scheduler retracts all but one running request, compacted ones included).

Checks: the server survives and its pool is whole again when idle (SGLang's own used-token
count is 0); every request not aborted returns exactly max_new_tokens tokens (ignore_eos);
with a deterministic policy (snapkv), every shared-prefix request that was not retracted gives
the same tokens as when run alone. (A retracted request re-prefills its true length
uncompacted, so its later tokens legitimately differ from an uninterrupted run.)
"""

import http.client
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from servers import Server

BUDGET, WINDOW = 16, 4
# (requests in all, shared-prefix requests, streamed requests cut off, forward steps between
# forced retractions) per size: the CI run retracts twice as often, as it runs half as long.
SIZES = {"ci": (200, 30, 30, 20), "full": (500, 60, 60, 40)}
OWN = {"budget": 12, "window": 4}  # per-request settings mixed into the same batches
VARIANTS = [None, None, OWN, {"policy": "streaming", "budget": 20}, False]


def _requests(total, n_shared, n_abort):
    rng = random.Random(1234)
    prefixes = [[rng.randrange(30, 900) for _ in range(n)] for n in (48, 64, 80)]
    reqs = []
    for i in range(n_shared):
        suffix = [rng.randrange(30, 900) for _ in range(rng.randrange(1, 12))]
        reqs.append(dict(kind="shared", ids=prefixes[i % 3] + suffix, n=rng.randrange(24, 49),
                         kv=VARIANTS[i % len(VARIANTS)]))
    for i in range(n_abort):
        reqs.append(dict(kind="close" if i % 2 else "abort", n=300, cut=rng.randrange(2, 40),
                         ids=[rng.randrange(30, 900) for _ in range(rng.randrange(4, 60))],
                         kv=VARIANTS[i % len(VARIANTS)]))
    for i in range(total - n_shared - n_abort):
        ids = [rng.randrange(30, 900) for _ in range(rng.randrange(4, 121))]
        if i % 4 == 0:  # short prefix overlaps between plain requests too
            ids = prefixes[i % 3][: rng.randrange(8, 40)] + ids
        reqs.append(dict(kind="plain", ids=ids, n=rng.randrange(1, 49),
                         kv=VARIANTS[i % len(VARIANTS)]))
    rng.shuffle(reqs)
    # SGLang's /abort_request aborts every request whose rid *starts with* the given one, so
    # aborting "stress-1" would also abort "stress-10".."stress-199": fixed-width rids.
    for i, r in enumerate(reqs):
        r["rid"] = f"stress-{i:04d}"
    rids = [r["rid"] for r in reqs]
    assert not [a for a in rids for b in rids if a != b and b.startswith(a)]
    return reqs


def _payload(r, stream=False):
    params = {"max_new_tokens": r["n"], "temperature": 0, "ignore_eos": True}
    if r["kv"] is not None:
        params["custom_params"] = {"kv_evict": r["kv"]}
    return {"input_ids": r["ids"], "sampling_params": params, "rid": r["rid"], "stream": stream}


def _post(port, payload, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/generate", json.dumps(payload), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _run_streamed(port, r):
    """Stream, and after `cut` chunks either drop the connection (SGLang sees the client
    disconnect and aborts) or ask /abort_request and read the stream to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/generate", json.dumps(_payload(r, stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    chunks, last = 0, None
    try:
        while True:
            line = resp.readline()
            if not line:
                break
            if not line.startswith(b"data:") or b"[DONE]" in line:
                continue
            last = json.loads(line[5:])
            chunks += 1
            if chunks == r["cut"]:
                if r["kind"] == "close":
                    return {"kind": "close", "chunks": chunks}
                _abort(port, r["rid"])
    finally:
        conn.close()
    return {"kind": "abort", "chunks": chunks, "last": last}


def _abort(port, rid):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/abort_request", json.dumps({"rid": rid}),
                     {"Content-Type": "application/json"})
        conn.getresponse().read()
    finally:
        conn.close()


def _run(port, r):
    if r["kind"] in ("close", "abort"):
        return _run_streamed(port, r)
    status, out = _post(port, _payload(r))
    assert status == 200, out
    return out


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("size", ["ci", pytest.param("full", marks=pytest.mark.slow)])
def test_stress_mixed_requests_aborts_retraction(tiny_model_fp32, size):
    total, n_shared, n_abort, retract_interval = SIZES[size]
    reqs = _requests(total, n_shared, n_abort)
    args = ["--dtype", "float32", "--kv-evict-policy", "snapkv", "--kv-evict-budget", str(BUDGET),
            "--kv-evict-window", str(WINDOW), "--max-running-requests", "48",
            "--max-total-tokens", "3072"]
    env = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(retract_interval)}
    with Server(tiny_model_fp32, args, env=env, max_total_tokens=3072,
                timeout=600) as server:
        start = time.time()
        with ThreadPoolExecutor(48) as pool:
            results = list(pool.map(lambda r: _run(server.port, r), reqs))
        took = time.time() - start
        server.wait_idle_checked()
        used = server.used_tokens()
        shared = [(r, out) for r, out in zip(reqs, results)
                  if r["kind"] == "shared" and out["meta_info"]["num_retractions"] == 0]
        alone = [_post(server.port, dict(_payload(r), rid=r["rid"] + "-alone"))[1]["output_ids"]
                 for r, _ in shared]
        server.wait_idle_checked(1)
        log = server.output()

    finished = [(r, out) for r, out in zip(reqs, results) if r["kind"] in ("plain", "shared")]
    retracted = sum(out["meta_info"]["num_retractions"] > 0 for _, out in finished)
    evicting = sum(out["meta_info"]["kv_evicted_tokens"] > 0 for _, out in finished)
    print(f"{len(reqs)} requests in {took:.0f} s; {retracted} retracted, {evicting} evicted, "
          f"{len(shared)} shared-prefix compared alone")
    assert "Testing retraction" in log or retracted > 0
    assert retracted > 0 and evicting > total // 10
    # Every request not aborted returns its full output.
    for r, out in finished:
        assert len(out["output_ids"]) == r["n"], (r["rid"], out["meta_info"])
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        if r["kv"] is False:
            assert out["meta_info"]["kv_evicted_tokens"] == 0
    # Aborted streams ended (and were cut before their 300 tokens).
    for r, out in zip(reqs, results):
        if r["kind"] == "abort":
            assert out["chunks"] >= r["cut"] and out["last"] is not None
            assert out["last"]["meta_info"]["completion_tokens"] < r["n"]
    # No slot leaked or double-freed: the scheduler's checks ran all along (it would have
    # died) and the pool is whole again when idle.
    assert used == 0, f"{used} tokens still in use when idle"
    # Deterministic policy: a shared-prefix request's output does not depend on its company.
    assert len(shared) >= n_shared // 2
    mismatched = [r["rid"] for (r, out), ids in zip(shared, alone) if out["output_ids"] != ids]
    assert not mismatched, mismatched
