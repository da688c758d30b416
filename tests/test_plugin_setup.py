"""Plugin wiring without a server: settings channel, hook plan, target checks, and the
offline `sgl.Engine` path (a real engine in a subprocess)."""

import os
import subprocess
import sys
import textwrap

import pytest

import vase_sglang_patches as plugin
from vase_sglang import EvictionConfig
from vase_sglang_patches import settings

from servers import server_env


def test_env_channel_round_trip(monkeypatch):
    for suffix in settings.FLAGS:
        # setenv first so monkeypatch restores the variable (absent) after configure() wrote it:
        # nothing leaks into the tests that follow
        monkeypatch.setenv(settings.env_name(suffix), "")
        monkeypatch.delenv(settings.env_name(suffix))
    assert settings.ServerSettings.from_env().config is None
    cfg = plugin.configure(policy="vase-dkv", budget=256, window=32, seed=9)
    assert cfg == EvictionConfig(policy="vase-dkv", budget=256, window=32, seed=9)
    assert os.environ["VASE_KV_EVICT_BUDGET"] == "256"
    assert settings.ServerSettings.from_env().config == cfg
    with pytest.raises(ValueError, match="^budget:"):
        plugin.configure(policy="vase-dkv", budget=16, window=32)
    with pytest.raises(ValueError, match="^budgt:"):
        plugin.configure(policy="vase-dkv", budgt=16)


def test_every_planned_hook_target_exists_in_the_installed_sglang():
    hooks = plugin.planned_hooks(EvictionConfig())
    targets = {t for t, _, _ in hooks}
    assert "sglang.srt.managers.scheduler.Scheduler.update_running_batch" in targets
    assert "sglang.srt.layers.radix_attention.RadixAttention.forward" in targets
    plugin.check_targets(hooks)  # raises SystemExit if one is missing
    # Without eviction only the flags, meta_info and CPU enablement hooks are planned.
    assert not {t for t, _, _ in plugin.planned_hooks(None)} & {
        "sglang.srt.managers.scheduler.Scheduler.update_running_batch"}


def test_a_missing_target_stops_the_process():
    with pytest.raises(SystemExit, match="hook targets missing"):
        plugin.check_targets([("sglang.srt.managers.scheduler.Scheduler.no_such_method", "AFTER", None)])


def test_every_planned_hook_registers_and_the_code_shapes_hold():
    """Each hook is a (target, kind, function) SGLang's HookRegistry accepts, and the code the
    admission hooks rely on beyond their targets' names (footprint.SHAPES) is in this SGLang;
    a shape it lacks stops the process, naming what changed."""
    from sglang.srt.plugins.hook_registry import HookType

    from vase_sglang_patches import footprint

    for target, kind, fn in plugin.planned_hooks(EvictionConfig()):
        assert kind in HookType.__members__ and callable(fn), (target, kind)
    assert footprint.check_shapes() == []
    changed = [(footprint.TARGET_ADD_ONE_REQ, "if req.sampling_params.ignore_eos and tree:",
                "the no-radix branch")]
    assert footprint.check_shapes(changed) == [
        f"{footprint.TARGET_ADD_ONE_REQ} no longer contains `if req.sampling_params.ignore_eos "
        f"and tree:` (the no-radix branch)"]
    with pytest.raises(SystemExit, match="no longer contains"):
        plugin.check_targets(footprint.HOOKS, changed)


ENGINE_SCRIPT = textwrap.dedent('''
    import json, sys
    import sglang as sgl
    if __name__ == "__main__":
        llm = sgl.Engine(model_path=sys.argv[1], device="cpu", attention_backend="torch_native",
                         disable_cuda_graph=True, max_total_tokens=4096, sleep_on_idle=True)
        out = llm.generate(["Hello world", "KV cache eviction"],
                           {"max_new_tokens": 120, "temperature": 0, "ignore_eos": True})
        llm.shutdown()
        print("RESULT", json.dumps([[len(o["output_ids"]), o["meta_info"].get("kv_evicted_tokens")] for o in out]))
''')


def test_offline_engine_evicts_with_environment_settings(tiny_model, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = server_env({"VASE_KV_EVICT_POLICY": "vase-attnv", "VASE_KV_EVICT_BUDGET": "32",
                      "VASE_KV_EVICT_WINDOW": "8"})
    proc = subprocess.run([sys.executable, str(script), tiny_model], env=env, capture_output=True,
                          text=True, timeout=300)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-3000:]
    import json

    for length, evicted in json.loads(line[len("RESULT"):]):
        # 120 tokens, trigger at 40 private tokens, then every 8: 10 rounds of 8.
        assert length == 120 and evicted == 80


def test_a_query_ring_costs_its_request_a_row_of_its_own_bytes_in_pool_slots():
    """Issue 51: the ring is held in the pool's slots by the requests that read queries, so a
    request costs P + T + R + its ring, whatever the prompts: nothing is reserved for rows the
    pool cannot run, and nothing caps the running requests. A ring of one request holds
    layers x W x H_q x D queries in the model's dtype, in slots of layers x 2 x H_kv x D."""
    import torch

    from vase_sglang.plan import ring_bytes
    from vase_sglang.pool_ring import slots_per_request

    def slots(window, q_heads, kv_heads, head_dim, q_dtype, kv_itemsize, page=1):
        return slots_per_request(window, q_heads, head_dim, q_dtype, kv_heads, kv_itemsize, page)

    # Qwen3-4B (36 layers, 32 query / 8 KV heads, head dim 128, bf16), W = 64: the issue's
    # "18 MiB = the K/V of 128 tokens", exactly.
    qwen3 = slots(64, 32, 8, 128, torch.bfloat16, 2)
    assert qwen3 == 128
    assert ring_bytes(36, 1, 64, 32, 128, 2) == qwen3 * 36 * 2 * 8 * 128 * 2 == 18 * 2**20
    # fp8 KV: the ring keeps bf16, twice the slots; pages round up.
    assert slots(64, 32, 8, 128, torch.bfloat16, 1) == 256
    assert slots(64, 32, 8, 128, torch.bfloat16, 2, page=48) == 144
    # Qwen2.5-0.5B (14 query / 2 KV heads: G = 7), W = 32: 112 slots, as the issue counts.
    assert slots(32, 14, 2, 64, torch.bfloat16, 2) == 112
    # At 256-token prompts the pool left for K/V is what the old ring, sized for 256-token
    # prompts, left (within a row), and at short prompts the requests the pool runs are
    # memory / (P + T + R + ring), not capped at the 256-token guess.
    from vase_sglang import EvictionConfig
    from vase_sglang_patches.footprint import charge_len

    cfg = EvictionConfig(policy="vase-attnv", budget=1024, window=64)
    slots_total = 60 * 2**30 // (36 * 2 * 8 * 128 * 2)
    old_rows = slots_total // (256 + charge_len(cfg) + qwen3)  # the old sizing, same memory
    kv_left_old = slots_total - old_rows * qwen3
    running = slots_total // (256 + charge_len(cfg) + qwen3)
    kv_used_new = running * (256 + charge_len(cfg))
    assert abs(kv_used_new - kv_left_old) <= (256 + charge_len(cfg) + qwen3)
    assert slots_total // (17 + charge_len(cfg) + qwen3) > 1.15 * old_rows
