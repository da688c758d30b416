"""Eviction beyond one process, on CPU with real SGLang servers and strict memory checks:
tensor parallel (each rank holds half of the KV heads and evicts them with no collective) and
data parallel (two schedulers, each with its own eviction runtime and query ring)."""

import os
import re
import threading
import urllib.request

import pytest
import torch

from servers import Server, masked_logprobs
from vase_sglang import EvictionConfig
from vase_sglang.serving.hf_reference import ReferenceDecoder

BUDGET, WINDOW, SEED = 32, 8, 5
TOL = 1e-4  # as the single-process faithfulness test: fp32 on both sides, summation order
TP_POLICIES = ["snapkv", "vase-attnv", "vase-dkv", "random", "streaming", "trimkv"]
# Two ranks on this 1-NUMA-node machine: SGLang needs their cores named explicitly.
TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
torch.set_num_threads(1)


def _args(*extra):
    # snapkv records the window queries, so every policy can be asked for per request.
    return ["--dtype", "float32", "--kv-evict-policy", "snapkv", "--kv-evict-budget", str(BUDGET),
            "--kv-evict-window", str(WINDOW), "--kv-evict-seed", str(SEED), *extra]


def _served(server, prompt_ids, n, policy, seed):
    out = server.generate(input_ids=prompt_ids, max_new_tokens=n, return_logprob=True,
                          sampling_params={"ignore_eos": True, "sampling_seed": seed,
                                           "custom_params": {"kv_evict": {"policy": policy}}})
    return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], out["meta_info"]


@pytest.fixture(scope="module")
def gates_file(tiny_model_fp32, tmp_path_factory):
    """trimkv gates with widely spread β, different per KV head: each rank must use the gate
    rows of its own head."""
    from transformers import AutoConfig

    from vase_sglang import gates as R

    config = AutoConfig.from_pretrained(tiny_model_fp32)
    gates = R.RetentionGates.for_model(config, gate_hidden=8, bias_init=2.0, init_std=0.5, seed=7)
    return R.save_gates(tmp_path_factory.mktemp("gates") / "g.safetensors", gates, config)


@pytest.fixture(scope="module")
def tp2_server(tiny_model_fp32, gates_file):
    """tp = 2, trimkv's gates loaded, and tests/fault_policy.py (a step that fails at a chosen
    stage, on rank 1 only for `test-fault-select-rank1`)."""
    args = _args("--tp-size", "2", "--kv-evict-retention-gates", str(gates_file))
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**TWO_RANKS, "VASE_KV_EVICT_PLUGINS": "fault_policy",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    with Server(tiny_model_fp32, args, env=env) as server:
        yield server


@pytest.mark.parametrize("policy", TP_POLICIES)
def test_tp2_equals_the_single_process_reference(tp2_server, hf_model, gates_file, policy):
    """tp=2 serves what one process computes: logprobs teacher-forced within TOL, and the same
    greedy text as the reference decoding on its own (one process, all KV heads). The
    tiny model has 2 KV heads, so each rank evicts one of them; its random draws must be
    those of that head in a single process (keyed by the global KV head)."""
    prompt = [(17 * i + 3) % 900 + 10 for i in range(12)]
    seed = 31
    tokens, logprobs, meta = _served(tp2_server, prompt, 200, policy, seed)
    cfg = EvictionConfig(policy=policy, budget=BUDGET, window=WINDOW, seed=SEED)
    gates = gates_file if policy == "trimkv" else None
    ref = ReferenceDecoder(hf_model, cfg, gates=gates)
    forced = ref.run(prompt, forced_ids=tokens, request_key=seed)
    assert forced["rounds"] >= 3 and meta["kv_evicted_tokens"] == forced["evicted"] > 0
    diff = max(abs(a - b) for a, b in zip(logprobs, forced["logprobs"]))
    assert diff < TOL, f"{policy}: max logprob diff {diff:.3g}"
    assert ref.run(prompt, max_new_tokens=200, request_key=seed)["tokens"] == tokens
    # Negative control: a reference that keeps more tokens diverges after its evictions.
    other = ReferenceDecoder(hf_model, cfg.replace(budget=BUDGET + WINDOW, value_slots=None),
                             gates=gates)
    other_lp = other.run(prompt, forced_ids=tokens, request_key=seed)["logprobs"]
    assert max(abs(a - b) for a, b in zip(logprobs, other_lp)) > 1e-2


def test_tp2_global_budget_is_each_ranks_heads_sharing_its_part(tp2_server, tiny_model_fp32,
                                                                 gates_file):
    """trimkv with budget_scope global on two ranks: each rank's KV heads (here one) share
    its part of the budget, L · (H / tp) · K cells, with no collective; the served logprobs
    equal the reference's global row split by rank (benchmarks/global_budget.py, ranks=2),
    and differ from the one-process global row (the ranks do not trade budget)."""
    prompt = [(17 * i + 3) % 900 + 10 for i in range(12)]
    out = tp2_server.generate(input_ids=prompt, max_new_tokens=120, return_logprob=True,
                              sampling_params={"ignore_eos": True, "custom_params": {"kv_evict": {
                                  "policy": "trimkv", "budget_scope": "global"}}})
    tokens = out["output_ids"]
    served = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    per_rank, one_process = masked_logprobs(
        tiny_model_fp32, prompt, tokens, [{"scope": "global", "ranks": 2}, "global"],
        gates=gates_file, budget=BUDGET, window=WINDOW, seed=SEED)
    assert out["meta_info"]["kv_evicted_tokens"] > 0
    assert max(abs(a - b) for a, b in zip(served, per_rank)) < TOL
    assert max(abs(a - b) for a, b in zip(served, one_process)) > 1e-2
    tp2_server.wait_idle_checked()


def test_dp2_serves_the_global_budget_on_either_worker(dp2_server, tiny_model_fp32, gates_file):
    """--dp-size 2: each worker holds the cells of its own requests. The same global request
    on each worker at once (routed_dp_rank) and a per-head one beside them: both global ones
    equal the reference's one-process global row, and differ from its per-head row; every
    slot comes back on both workers (strict checks, pool empty)."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = [(19 * i + 7) % 800 + 10 for i in range(12)]

    def serve(scope, rank):
        out = dp2_server.generate(input_ids=prompt, max_new_tokens=100, return_logprob=True,
                                  routed_dp_rank=rank,
                                  sampling_params={"ignore_eos": True, "custom_params": {
                                      "kv_evict": {"policy": "trimkv", "budget_scope": scope}}})
        return out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]], \
            out["meta_info"]

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(serve, ["global", "global", "head"], [0, 1, 0]))
    dp2_server.wait_idle_checked()
    assert dp2_server.used_tokens() == 0
    assert got[0][0] == got[1][0]  # the same tokens on both workers: one reference run
    glob, head = masked_logprobs(tiny_model_fp32, prompt, got[0][0], ["global", "per-head"],
                                 gates=gates_file, budget=BUDGET, window=WINDOW, seed=SEED)
    for _tokens, served, meta in got[:2]:
        assert meta["kv_evicted_tokens"] > 0
        assert max(abs(a - b) for a, b in zip(served, glob)) < TOL
        assert max(abs(a - b) for a, b in zip(served, head)) > 1e-2


def test_tp2_frees_the_same_slots_on_every_rank(tp2_server):
    """Both ranks keep one allocator each and take the same eviction decisions from the same
    host-side lengths; a mismatch shows as a leak or a conservation error in SGLang's strict
    checks (on in every test server), which kill the scheduler."""
    prompts = [[(7 * i + j) % 500 + 20 for j in range(6 + i)] for i in range(5)]
    out = tp2_server.post("/generate", {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True}})
    assert [len(o["output_ids"]) for o in out] == [120] * 5
    assert all(o["meta_info"]["kv_evicted_tokens"] > 0 for o in out)
    tp2_server.wait_idle_checked()


def _scrape(server) -> list[tuple[str, dict, float]]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    rows = []
    for line in text.splitlines():
        m = re.match(r"^(vase:[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            rows.append((m.group(1), labels, float(m.group(3))))
    return rows


def _evictions(server) -> dict[str, float]:
    """vase:evictions_total per DP rank."""
    return {labels.get("dp_rank"): value for name, labels, value in _scrape(server)
            if name == "vase:evictions_total"}


@pytest.fixture(scope="module")
def dp2_server(tiny_model_fp32, gates_file):
    args = _args("--dp-size", "2", "--enable-metrics", "--kv-evict-retention-gates", str(gates_file))
    with Server(tiny_model_fp32, args, env=TWO_RANKS) as server:
        yield server


def test_dp2_each_worker_evicts_its_own_requests(dp2_server):
    """--dp-size 2: two schedulers, each with its own runtime and ring. Per-request settings
    and counts are right whichever worker serves a request; metrics carry the DP rank."""
    n = 100
    budgets = [BUDGET, 48, BUDGET, 48]
    server = dp2_server
    before = _evictions(server)  # counted from the server's start: other tests evict too
    results = [None] * len(budgets)

    def run(i):
        results[i] = server.generate(
            input_ids=[30 + i, 40, 50, 60], max_new_tokens=n,
            sampling_params={"ignore_eos": True,
                             "custom_params": {"kv_evict": {"budget": budgets[i]}}})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(budgets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.wait_idle_checked()
    for budget, out in zip(budgets, results):
        trigger = budget + WINDOW
        # First eviction before the step after `trigger` private tokens, then every WINDOW.
        rounds = 1 + (n - trigger - 2) // WINDOW
        assert len(out["output_ids"]) == n
        assert out["meta_info"]["kv_evicted_tokens"] == rounds * WINDOW
    after = _evictions(server)
    evictions = {rank: value - before.get(rank, 0) for rank, value in after.items()}
    # Requests are spread over both workers (round robin), and each reports its own.
    assert set(evictions) == {"0", "1"}, evictions
    assert all(v > 0 for v in evictions.values())
    expected = sum(1 + (n - b - WINDOW - 2) // WINDOW for b in budgets)
    assert sum(evictions.values()) == expected


STOCHASTIC = ["vase-attnv", "vase-dkv", "curdkv", "random"]


def test_the_same_request_gives_the_same_text_on_every_run_replica_and_tp(dp2_server, tp2_server):
    """Greedy and no rid or seed: the draws are keyed by the request's tokens (not by its
    random rid), so a request gives the same text on every run, on either data-parallel
    worker (tp = 1 schedulers: requests go round robin) and at tp = 2."""
    prompt = [(13 * i + 5) % 700 + 30 for i in range(10)]

    def text(server, policy, **sampling):
        out = server.generate(input_ids=prompt, max_new_tokens=150, sampling_params={
            "ignore_eos": True, "custom_params": {"kv_evict": {"policy": policy}}, **sampling})
        assert out["meta_info"]["kv_evicted_tokens"] > 0
        return out["output_ids"]

    for policy in STOCHASTIC:
        first = text(dp2_server, policy)
        assert text(dp2_server, policy) == first, policy  # the other worker
        assert text(tp2_server, policy) == first, policy
    # The draws decide the text (so the equalities above could fail): other keys, other texts.
    assert text(dp2_server, "random", sampling_seed=1) != text(dp2_server, "random",
                                                               sampling_seed=2)
    dp2_server.wait_idle_checked()


@pytest.mark.parametrize("fixture", ["tp2_server", "dp2_server"])
def test_elastic_pressure_on_every_rank(request, fixture):
    """Elastic requests on a 4096-token pool per scheduler grow until the next decode step does
    not fit, then are cut to a common level. Under tp=2 both ranks take the same pressure
    decisions from the same host-side lengths (a mismatch frees different slots: SGLang's
    strict checks stop the scheduler); under dp=2 each worker relieves its own pool."""
    server = request.getfixturevalue(fixture)
    n = 16 if fixture == "tp2_server" else 32  # dp: about 16 per worker
    before = len(server.output())
    out = server.post("/generate", {
        "text": [f"Parallel elastic request {i}: the quick brown fox" for i in range(n)],
        "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                            "custom_params": {"kv_evict": {"mode": "elastic"}}}})
    server.wait_idle_checked()
    log = server.output()[before:]
    assert [len(o["output_ids"]) for o in out] == [300] * n
    assert "early eviction freed" in log and "Retract requests" not in log
    assert any(o["meta_info"]["kv_evicted_tokens"] for o in out)
    assert all((o["meta_info"]["kv_min_budget"] or 10**9) >= BUDGET for o in out)


def test_tp2_a_step_failing_on_one_rank_finishes_its_requests_on_every_rank(tp2_server):
    """A fault that rank 1 alone sees (its select raises, rank 0's does not): both ranks
    finish the failing request (they agree on the failed set after the step, commit.agree),
    so their next batches stay equal; before, rank 1 dropped it and rank 0 kept it, and the
    ranks' collectives ran on different batches. The failing request gets an HTTP 500 naming
    the stage, the requests beside it the tokens they give alone, and the server serves on.
    Last in the module: on code without the agreement it leaves the server hung."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [[(11 * i + j) % 600 + 25 for j in range(8)] for i in range(3)]

    def greedy(prompt, policy=None):
        sampling = {"max_new_tokens": 90, "temperature": 0, "ignore_eos": True}
        if policy:
            sampling["custom_params"] = {"kv_evict": {"policy": policy}}
        return tp2_server.post_status("/generate", {"input_ids": prompt,
                                                    "sampling_params": sampling}, timeout=180)

    alone = [greedy(p)[1]["output_ids"] for p in prompts]
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        healthy = [pool.submit(greedy, p) for p in prompts]
        failing = pool.submit(greedy, prompts[0], "test-fault-select-rank1")
        healthy = [f.result() for f in healthy]
        status, body = failing.result()
    assert status == 500, (status, body)
    assert "KV eviction failed at stage 'select' on another tensor-parallel rank" in str(body)
    assert [(s, out["output_ids"]) for s, out in healthy] == [(200, want) for want in alone]
    tp2_server.wait_idle_checked()
    log = tp2_server.output()
    assert "injected fault at stage 'select' on rank 1" in log
    assert "Scheduler hit an exception" not in log
    assert [greedy(p)[1]["output_ids"] for p in prompts] == alone
    tp2_server.wait_idle_checked()
