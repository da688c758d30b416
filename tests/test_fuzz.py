"""Property-based fuzzing of hostile clients and hostile settings (issue 50), with hypothesis,
derandomized (the same examples on every run: a test that fails by chance would be a bug).

Settings (no server, in-process, as tests/test_bad_inputs.py): every `--kv-evict-*` flag
(settings.FLAGS and SERVER_FLAGS), also as its VASE_KV_EVICT_* variable, given hostile values
(huge ints 2**63, 2**64, negative ones, float strings, 'nan', empty-ish garbage, typed floats
and bools) is either accepted, and then the value is within sane bounds (a count of tokens,
slots or MiB in [0, 2**31), the seed in [0, 2**63)), or refused with a ValueError whose message
starts with that flag's name. Then one real launch with `--kv-evict-seed 2**63` must be refused.

Clients (one real server, started by this module: tiny fp32 Qwen3, snapkv, budget 32, window 8,
a 160-token pool (3 requests at once at the server's budget, 7 query rings beside it), context
128 tokens, SGLang's strict memory checks on): about 300 requests, 4-6 at a time, on /generate,
/v1/completions and /v1/chat/completions, drawn from a grammar of hostile values:
`custom_params.kv_evict` as false/true/null/{}/a dict of policy, budget, window, value_slots,
sinks, seed, mode (valid values, fixed and elastic, and hostile ones: huge, negative, float,
NaN/inf, strings, lists, nested dicts, bools, unknown fields, budget_scope; valid-leaning draws
include budgets down to 8 and windows down to 2, and crowds of 8-10 prompts in one /generate at
such budgets, so that more requests fit the pool than the query rings beside it hold, and trimkv
at the global and layer scopes, served with the server's gates) or as a string/list/number;
sampling parameters (max_new_tokens, temperature, top_p, top_k, sampling_seed, ignore_eos, n)
valid or hostile; some clients stream and hang up after the first chunk, some hang up at once.
Properties: every answer is 2xx or 4xx, never 5xx, a dropped connection or no answer (except for
the clients that hung up themselves), a stream read to its end ends with [DONE] and carries no
5xx error event; the server is alive after every batch; a fixed greedy request (temperature 0,
kv_evict with a fixed seed) served alone gives the same tokens before and after the storm; at
the end the idle leak check passes (wait_idle_checked) and the server's output holds no
traceback and no "Scheduler hit an exception". Only 127.0.0.1 is contacted. Shrinking is off:
every example costs a live batch, and once the server is dead every later example fails, so a
shrunk example would mislead; a failure prints the batch that broke the property and the end of
the server log.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from servers import Server
from vase_sglang import POLICY_NAMES
from vase_sglang.config import BUDGET_SCOPES, MODES
from vase_sglang_patches import settings as server_settings

# ---------------------------------------------------------------------------- hostile values

HUGE_INTS = [2**31, 2**32 + 7, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30,
             -1, -2, -(2**31), -(2**63), -(2**63) - 1, -(2**64)]
FLOATS = [0.0, -0.0, 0.5, 1.5, 8.0, 1e308, -1e308, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", " ", "7", "08", "-1", "1.5", "1e3", "nan", "NaN", "inf", "0x10", "null", "true",
           "9223372036854775808", "\u0663", "snapkv", "elastic"]
# Any JSON value, small: nested lists and objects of scalars.
JUNK = st.recursive(
    st.none() | st.booleans() | st.sampled_from(HUGE_INTS + FLOATS + STRINGS)
    | st.integers(-100, 100) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=5)


# Where integer checks break: int64 and uint64 limits, negatives.
EDGE_INTS = [2**63 - 1, 2**63, 2**64, -1, -(2**63)]


def hostile(valid):
    """A field's value: one of its valid values, or anything hostile."""
    return st.one_of(st.sampled_from(valid), st.sampled_from(valid), st.sampled_from(EDGE_INTS),
                     st.sampled_from(HUGE_INTS + FLOATS + STRINGS), st.integers(-20, 300), JUNK)


# ---------------------------------------------------------------------------- the settings

# Sane bounds of an accepted integer setting: counts of tokens, slots, MiB fit an int32 (no
# served context comes near), the seed is what the draws hash (an int64 >= 0).
COUNT_BOUND, SEED_BOUND = 2**31, 2**63
INT_FLAGS = [s for s, (_f, kind, _h) in server_settings.FLAGS.items() if kind is int]
FLAG_INTS = st.one_of(st.integers(-5, 64), st.sampled_from(HUGE_INTS),
                      st.integers(2**31, 2**70), st.integers(-(2**70), -(2**31)))
FLAG_VALUES = st.one_of(
    FLAG_INTS,                                       # typed (configure, Engine users)
    FLAG_INTS.map(str),                              # as the command line gives it
    st.sampled_from(STRINGS + ["-0", "+3", " 12 ", "1_0", "2**63", "1,5", "\t", "abc", "{}"]),
    st.sampled_from(FLOATS), st.booleans(), st.text(max_size=8),
)
GATE_PATHS = ["nan", "/nonexistent/gates.safetensors", "/", "/dev/null", "x" * 300, "-1",
              "2**63", " "]


def _parsed(cfg_settings, suffix):
    """The value a ServerSettings holds for one flag (None: not an int setting)."""
    cfg, limits = cfg_settings.config, cfg_settings.limits
    if suffix in server_settings.FLAGS:
        return getattr(cfg, server_settings.FLAGS[suffix][0]) if cfg is not None else None
    if suffix == server_settings.PROMPT_LEN:
        return cfg_settings.expected_prompt_len
    return getattr(limits, suffix.replace("-", "_")) if limits is not None else None


def _check_flag(suffix, raw, policy, source):
    values = {suffix: raw} if suffix == "policy" else {"policy": policy, suffix: raw}
    name = source(suffix)
    try:
        parsed = server_settings.ServerSettings.from_values(values, source=source)
    except ValueError as err:
        assert str(err).startswith(name + ":"), (
            f"{name}={raw!r} (policy {policy}) was refused naming another setting: {err}")
        return "refused"
    except Exception as err:  # anything but ValueError escapes the launch as a traceback
        raise AssertionError(f"{name}={raw!r} (policy {policy}) raised {err!r}, not a "
                             "ValueError naming the flag") from None
    if suffix == "policy":
        assert parsed.config is None or parsed.config.policy == str(raw), (raw, parsed)
    elif suffix == "mode":
        assert parsed.config.mode in MODES, (raw, parsed)
    elif suffix in INT_FLAGS or suffix in server_settings.INT_SERVER_FLAGS:
        value = _parsed(parsed, suffix)
        bound = SEED_BOUND if suffix == "seed" else COUNT_BOUND
        if value is not None:
            assert isinstance(value, int) and not isinstance(value, bool), (raw, value)
            assert 0 <= value < bound, (
                f"{name}={raw!r} (policy {policy}) was accepted as {value}, outside "
                f"[0, {bound}): it must be refused naming {name}")
    return "accepted"


FLAG_SUFFIXES = [s for s in (*server_settings.FLAGS, *server_settings.SERVER_FLAGS)
                 if s != server_settings.GATES]  # the gates file: its own test below


@settings(max_examples=400, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(suffix=st.sampled_from(FLAG_SUFFIXES), raw=FLAG_VALUES,
       policy=st.sampled_from(["snapkv", "vase-attnv"]),
       env=st.booleans())
def test_hostile_flag_values_are_refused_naming_the_flag(suffix, raw, policy, env):
    source = server_settings.env_name if env else server_settings.flag_name
    _check_flag(suffix, raw, policy, source)


@pytest.mark.parametrize("suffix", FLAG_SUFFIXES)
def test_huge_and_negative_values_of_every_flag(suffix):
    """The named cases, for every flag: the fuzzing above must not depend on what it drew."""
    for raw in ["9223372036854775808", "18446744073709551616", str(2**63 - 1), "-1",
                str(-(2**63)), "1.5", "nan", "inf", " ", "1e3"]:
        for policy in ("snapkv", "vase-attnv"):
            _check_flag(suffix, raw, policy, server_settings.flag_name)


@pytest.mark.parametrize("path", GATE_PATHS, ids=lambda p: p[:20])
def test_hostile_gates_paths_are_refused_naming_the_flag(tiny_model_fp32, path):
    """--kv-evict-retention-gates is checked where launch_server loads it (check_gates, before
    any process is spawned): a bad path is a ValueError naming the flag, never a traceback."""
    from transformers import AutoConfig

    name = server_settings.flag_name(server_settings.GATES)
    parsed = server_settings.ServerSettings.from_values(
        {"policy": "snapkv", server_settings.GATES: path})
    assert parsed.gates_path == path
    config = AutoConfig.from_pretrained(tiny_model_fp32)
    try:
        server_settings.load_server_gates(path, config)
    except ValueError as err:
        assert str(err).startswith(name + ":"), err
    except Exception as err:
        raise AssertionError(f"{name}={path[:40]!r} raised {err!r}, not a ValueError naming "
                             "the flag") from None
    else:
        raise AssertionError(f"{name}={path!r} was loaded")


HOSTILE_SEED = str(2**63)


def test_a_seed_beyond_int64_stops_the_launch(tiny_model_fp32):
    """The one real launch: --kv-evict-seed 2**63 must end the launch naming the flag. (Were it
    accepted, the server is asked for one evicting request to show what it does.)"""
    flags = ["--dtype", "float32", "--kv-evict-policy", "snapkv", "--kv-evict-budget", "32",
             "--kv-evict-window", "8", "--kv-evict-seed", HOSTILE_SEED]
    try:
        server = Server(tiny_model_fp32, flags, timeout=300)
    except RuntimeError as err:  # exited before it was ready: the output is in the message
        assert "--kv-evict-seed: " in str(err), str(err)[-3000:]
        return
    with server:
        try:
            status, body = _post(server.port, "/generate", {
                "text": "The quick brown fox", "sampling_params": {
                    "max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}, timeout=60)
            what = f"HTTP {status}: {body[:300]!r}"
        except (OSError, http.client.HTTPException) as err:
            what = f"no answer: {err!r}"
        alive = server.alive()
        log = server.output()
    pytest.fail(f"--kv-evict-seed {HOSTILE_SEED} was accepted; an evicting request then got "
                f"{what}; server alive: {alive}\n{_log_tail(log)}")


# ---------------------------------------------------------------------------- the clients

SERVER = {"policy": "snapkv", "budget": 32, "window": 8, "seed": 5}
POOL, CONTEXT = 160, 128  # a small pool (elastic requests meet pressure); cheap long requests
BATCHES, TIMEOUT = 60, 120  # ~300 requests; seconds one client waits for its whole answer
PROMPTS = ["The quick brown fox", "Hello world! This is", "0 1 2 3 4 5 6 7 8 9",
           "What is the capital of France?", "KV cache eviction policy radix tree prefix"]
# Served alone before and after the storm: greedy, its own stochastic policy and seed, evicting.
REFERENCE = {"text": "user assistant system: What is the capital of France? Paris",
             "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True,
                                 "custom_params": {"kv_evict": {
                                     "policy": "vase-attnv", "budget": 16, "window": 4,
                                     "seed": 1234}}}}

KV_FIELDS = {  # valid values on this server first, then anything
    "policy": st.one_of(st.sampled_from([*POLICY_NAMES, "trimkv"]),
                        st.sampled_from(["", "SNAPKV", "snapkv ", "nope"]), JUNK),
    "budget": hostile([8, 16, 24, 32, 48, 64, 256]),
    "window": hostile([2, 4, 8]),
    "value_slots": hostile([0, 2, 4]),
    "sinks": hostile([0, 1, 2, 4]),
    "seed": hostile([0, 1, 5, 2**31 - 1, 2**32, 2**63 - 1]),
    "mode": st.one_of(st.sampled_from(MODES), st.sampled_from(MODES), JUNK),
    "budget_scope": st.one_of(st.just("head"), st.just("head"), st.sampled_from(BUDGET_SCOPES),
                              st.sampled_from(["", "Global", "all", "heads"]), JUNK),
    "head_floor": hostile([0, 2, 4, 12]),
}
# Budgets down to 8 and windows down to 2 (the server's grid and least window): their requests
# are charged so little that more of them fit the pool than the query rings beside it hold
# (7 rings at the server's budget), so some wait for a ring (issue 58: they got HTTP 500).
# (budget, window) pairs valid on this server (None: the server's), the small ones twice.
SIZES = st.sampled_from([(8, 2), (8, 4), (12, 4), (8, 2), (8, 4), (12, 2), (16, 4), (16, None),
                         (24, None), (32, 4), (48, 8), (None, 4), (None, None)])


def _sized(kv_and_size):
    kv, (budget, window) = kv_and_size
    sized = {"budget": budget, "window": window}
    return {**kv, **{k: v for k, v in sized.items() if v is not None}}


VALID_KV = st.tuples(st.fixed_dictionaries({"mode": st.sampled_from(MODES)}, optional={
    "policy": st.sampled_from(["snapkv", "vase-attnv", "vase-dkv", "streaming", "random", "rkv",
                               "curdkv", "evict-large-values", "full"]),
    "seed": st.sampled_from([0, 7, 2**31 - 1, 2**32 + 1, 2**63 - 1]),
    "budget_scope": st.just("head"),
}), SIZES).map(_sized)
# A shared budget scope, served (trimkv with the server's gates, fixed mode, no value slots).
VALID_SHARED = st.tuples(st.fixed_dictionaries(
    {"policy": st.just("trimkv"), "budget_scope": st.sampled_from(["global", "layer"])},
    optional={"sinks": st.sampled_from([0, 2, 4]), "seed": st.sampled_from([0, 7, 2**63 - 1]),
              "head_floor": st.sampled_from([0, 1, 4, 64])}),
    SIZES).map(_sized)
HOSTILE_KV = st.fixed_dictionaries({}, optional=KV_FIELDS)
# Valid settings but one field: what a check that misses one field lets through.
ONE_HOSTILE = st.sampled_from(sorted(KV_FIELDS)).flatmap(
    lambda field: st.tuples(VALID_KV, KV_FIELDS[field]).map(lambda t: {**t[0], field: t[1]}))
UNKNOWN_FIELD = st.tuples(HOSTILE_KV, st.sampled_from(["budgte", "ceiling", "workspace_mb",
                                                       "temperature", "", "Policy", "seed "]),
                          JUNK).map(lambda t: {**t[0], t[1]: t[2]})


class _Absent:
    """No custom_params at all."""

    def __repr__(self):
        return "ABSENT"


ABSENT = _Absent()
KV_EVICT = st.one_of(st.just(ABSENT), st.sampled_from([False, True, None, {}]), VALID_KV,
                     VALID_KV, VALID_SHARED, ONE_HOSTILE, ONE_HOSTILE, ONE_HOSTILE, HOSTILE_KV,
                     UNKNOWN_FIELD, JUNK)
SAMPLING = st.fixed_dictionaries(
    {  # mostly long enough to evict (the server's cache reaches budget + window at 40)
        "max_new_tokens": st.one_of(st.sampled_from([60, 56, 48]), st.sampled_from([60, 44]),
                                    st.integers(0, 60),
                                    st.sampled_from([-1, 2**31, 2**63, 2**64, 1.5, "8",
                                                     float("nan"), None])),
        "ignore_eos": st.one_of(st.just(True), st.just(True), st.booleans(), JUNK),
    },
    optional={
        "temperature": hostile([0, 0, 0.7, 1.0]),
        "top_p": hostile([0.5, 0.9, 1.0]),
        "top_k": hostile([-1, 1, 5, 50]),
        "sampling_seed": hostile([0, 42, 2**63 - 1, -(2**63)]),
        "n": st.one_of(st.sampled_from([1, 1, 2, 3]), st.sampled_from([0, -1, 1.5, "2", None,
                                                                       True])),
    })
CLIENTS = ["read", "read", "read", "stream", "hangup", "hangup-at-once"]
ONE_CLIENT = st.fixed_dictionaries({
    "route": st.sampled_from(["/generate", "/generate", "/v1/completions",
                              "/v1/chat/completions"]),
    "client": st.sampled_from(CLIENTS),
    "prompt": st.one_of(st.sampled_from(PROMPTS), st.sampled_from(PROMPTS), st.text(max_size=12)),
    "kv_evict": KV_EVICT,
    "sampling": SAMPLING,
})
# A crowd: one /generate of 8-10 prompts at a small valid budget, more requests at once than
# there are query rings beside the pool (7): the ones without a ring wait for one.
CROWD = st.fixed_dictionaries({
    "route": st.just("/generate"), "client": st.just("read"),
    "prompt": st.lists(st.sampled_from(PROMPTS), min_size=8, max_size=10),
    "kv_evict": st.tuples(st.fixed_dictionaries({}, optional={
        "policy": st.sampled_from(["snapkv", "vase-attnv", "rkv"]),
        "seed": st.sampled_from([0, 7])}),
        st.sampled_from([(8, 2), (8, 4), (12, 4)])).map(_sized),
    "sampling": st.fixed_dictionaries({"max_new_tokens": st.sampled_from([40, 60]),
                                       "ignore_eos": st.just(True)}),
})
# A shared-scope request that is read to the end: ONE_CLIENT draws one in about 44 (a valid
# shared setting, /generate, a reading client), too few to be sure a storm serves any.
SHARED_CLIENT = st.fixed_dictionaries({
    "route": st.just("/generate"), "client": st.just("read"),
    "prompt": st.sampled_from(PROMPTS), "kv_evict": VALID_SHARED,
    "sampling": st.fixed_dictionaries({"max_new_tokens": st.sampled_from([48, 60]),
                                       "ignore_eos": st.just(True)}),
})
REQUEST = st.sampled_from(["one"] * 21 + ["shared"] * 2 + ["crowd"]).flatmap(  # in 24 draws
    lambda kind: {"one": ONE_CLIENT, "shared": SHARED_CLIENT, "crowd": CROWD}[kind])

STATS: Counter = Counter()


def _payload(req) -> tuple[str, dict]:
    """The request's route and JSON body; the OpenAI routes take custom_params at top level,
    their seed is sampling_seed and max_tokens max_new_tokens."""
    stream = req["client"] != "read"
    s = dict(req["sampling"])
    custom = {} if req["kv_evict"] is ABSENT else {"custom_params": {"kv_evict": req["kv_evict"]}}
    if req["route"] == "/generate":
        return "/generate", {"text": req["prompt"], "sampling_params": {**s, **custom},
                             "stream": stream}
    body = {"model": "default", "stream": stream, **custom}
    if req["route"] == "/v1/completions":
        body["prompt"] = req["prompt"]
    else:
        body["messages"] = [{"role": "user", "content": req["prompt"]}]
    names = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}
    body.update({names.get(k, k): v for k, v in s.items()})
    return req["route"], body


def _show(req) -> str:
    """A request as a reproducer: route, JSON body, how the client behaves."""
    route, body = _payload(req)
    return f"POST {route} {json.dumps(body)} [client: {req['client']}]"


def _post(port, route, body, timeout=TIMEOUT, client="read"):
    """POST a JSON body (NaN and Infinity as JSON literals) to 127.0.0.1: (status, raw body);
    a hanging-up client closes the connection at once or after the first stream event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
        if client == "hangup-at-once":
            return None, b""
        resp = conn.getresponse()
        if client == "hangup" and resp.status == 200:
            while True:
                line = resp.readline()
                if not line or line.startswith(b"data:"):
                    return resp.status, line
        return resp.status, resp.read()
    finally:
        conn.close()


def _serve(port, req) -> dict:
    route, body = _payload(req)
    try:
        status, raw = _post(port, route, body, client=req["client"])
    except (OSError, http.client.HTTPException) as err:  # timeouts are OSErrors too
        return {"error": repr(err)}
    return {"status": status, "raw": raw}


def _problems(req, out) -> list[str]:
    """What this answer breaks of the properties (empty: fine); counts what was served."""
    if "error" in out:
        return [f"dropped connection or no answer within {TIMEOUT} s: {out['error']}"]
    status, raw = out["status"], out["raw"]
    if req["client"] == "hangup-at-once":
        STATS["hung up at once"] += 1
        return []
    STATS[f"{req['route']} {status}"] += 1
    if not 200 <= status < 500:
        return [f"HTTP {status}: {raw[:500]!r}"]
    if status != 200:
        return []
    events = [line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:")]
    if req["client"] == "hangup":
        return _bad_events(events)
    if req["client"] == "stream":
        problems = _bad_events(events)
        if not events or events[-1] != b"[DONE]":
            problems.append(f"stream ended without [DONE]: {raw[-300:]!r}")
        return problems
    try:
        answer = json.loads(raw)
    except ValueError:
        return [f"HTTP 200 with a body that is not JSON: {raw[:300]!r}"]
    if req["route"] == "/generate":
        for one in answer if isinstance(answer, list) else [answer]:
            meta = one.get("meta_info", {})
            STATS["evicted tokens"] += meta.get("kv_evicted_tokens") or 0
            STATS["generate outputs"] += 1
            kv = req["kv_evict"]
            if isinstance(kv, dict) and kv.get("budget_scope") in ("global", "layer"):
                STATS["shared-scope outputs"] += 1
                STATS["shared-scope evicted tokens"] += meta.get("kv_evicted_tokens") or 0
    return []


def _bad_events(events) -> list[str]:
    problems = []
    for event in events:
        if event == b"[DONE]":
            continue
        try:
            data = json.loads(event)
        except ValueError:
            problems.append(f"stream event that is not JSON: {event[:300]!r}")
            continue
        error = data.get("error") if isinstance(data, dict) else None
        code = error.get("code", 400) if isinstance(error, dict) else 400
        if error is not None and isinstance(code, int) and code >= 500:
            problems.append(f"stream error event {code}: {event[:300]!r}")
    return problems


def _log_tail(log: str, lines: int = 40) -> str:
    """The end of a server's output, after the end of each of its first tracebacks (the
    innermost frames and the exception)."""
    out = log.splitlines()
    picked = []
    for i in [i for i, line in enumerate(out) if "Traceback (most recent call last)" in line][:3]:
        end = next((j for j in range(i + 1, len(out)) if out[j][:1] not in (" ", "")), i)
        picked += [out[i], "  ...", *out[max(i + 1, end - 12):end + 1]]
    return "\n".join(["--- server output: tracebacks ---", *picked,
                      "--- server output: the end ---", *out[-lines:]])


def _greedy_alone(server) -> list[int]:
    server.flush_cache()  # the same (uncached) prefill before and after
    status, raw = _post(server.port, "/generate", REFERENCE)
    assert status == 200, raw[:500]
    out = json.loads(raw)
    assert len(out["output_ids"]) == 60 and out["meta_info"]["kv_evicted_tokens"] > 0, out
    return out["output_ids"]


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_fp32, trimkv_gates_file):
    """The module's own evicting server (trimkv's gates loaded, so requests may ask for it and
    its shared budget scopes), and the reference request's tokens served alone on it before
    any hostile client came."""
    flags = ["--dtype", "float32", "--context-length", str(CONTEXT),
             "--kv-evict-retention-gates", str(trimkv_gates_file)]
    for key, value in SERVER.items():
        flags += ["--kv-evict-" + key, str(value)]
    with Server(tiny_model_fp32, flags, max_total_tokens=POOL, timeout=600) as server:
        yield server, _greedy_alone(server)


FIRST_FAILURE: list[str] = []  # the first batch that broke a property, as a report
PREVIOUS: list[dict] = []  # the last batch that passed


@settings(max_examples=BATCHES, derandomize=True, database=None, deadline=None,
          phases=[Phase.generate], report_multiple_bugs=False,
          print_blob=False, suppress_health_check=[HealthCheck.too_slow,
                                                   HealthCheck.data_too_large,
                                                   HealthCheck.large_base_example])
@given(batch=st.lists(REQUEST, min_size=4, max_size=6))
def _storm(server, batch):
    """One batch of clients at once. The first failure is kept and raised again as it was
    (hypothesis replays the failing example, against a server that may be dead by then)."""
    if not FIRST_FAILURE:
        failure = _batch_failure(server, batch)
        if failure:
            FIRST_FAILURE.append(failure)
    if FIRST_FAILURE:
        raise AssertionError(FIRST_FAILURE[0])


def _batch_failure(server, batch) -> str | None:
    """None if every client's answer keeps the properties and the server's output since the
    batch began holds no traceback; else a report: the batch, each client's problem, the
    batch before (a client that hung up may leave its request running into the next batch)
    and the end of the server's output."""
    start = len(server.output())
    with ThreadPoolExecutor(len(batch)) as pool:
        outs = list(pool.map(lambda r: _serve(server.port, r), batch))
    failed = [(req, problems) for req, out in zip(batch, outs)
              if (problems := _problems(req, out))]
    log = server.output()[start:]
    crashed = "Traceback" in log or "Scheduler hit an exception" in log
    if not failed and not crashed and server.alive():
        PREVIOUS[:] = batch
        return None
    report = "\n".join(f"{_show(req)}\n    -> {problems}" for req, problems in failed)
    return (f"{len(failed)} of {len(batch)} clients broke a property (server alive: "
            f"{server.alive()}, a traceback in its output during the batch: {crashed}); "
            f"the batch:\n" + "\n".join(_show(r) for r in batch)
            + f"\nthe failures:\n{report}\nthe batch before:\n"
            + "\n".join(_show(r) for r in PREVIOUS) + "\n" + _log_tail(server.output()))


@pytest.mark.timeout(900)
def test_hostile_clients_get_2xx_or_4xx_and_the_server_survives(fuzz_server):
    """BATCHES batches of 4-6 clients from the grammar above (about 2 minutes)."""
    server, _before = fuzz_server
    _storm(server)
    log = server.output()
    STATS["pressure cuts"] = log.count("early eviction")
    STATS["retractions"] = log.count("Retract requests")
    print(dict(STATS))
    # The storm was not all refusals: requests were served and caches evicted.
    assert STATS["/generate 200"] >= BATCHES // 2 and STATS["evicted tokens"] > 0, dict(STATS)
    assert STATS["shared-scope evicted tokens"] > 0, dict(STATS)  # shared scopes served


def test_after_the_storm_the_server_is_whole(fuzz_server):
    """Alive, the reference request's tokens unchanged, the idle leak check silent, no
    traceback and no scheduler exception in the server's output."""
    server, before = fuzz_server
    assert server.alive(), _log_tail(server.output())
    server.wait_idle_checked(2)
    assert _greedy_alone(server) == before
    server.wait_idle_checked(1)
    log = server.output()
    assert "Scheduler hit an exception" not in log and "Traceback" not in log, _log_tail(log)
