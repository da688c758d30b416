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


def test_query_ring_rows_are_what_the_pool_beside_them_can_run():
    from vase_sglang_patches.footprint import charge_len
    from vase_sglang import EvictionConfig
    from vase_sglang.plan import ring_bytes
    from vase_sglang_patches.memory import DEFAULT_MAX_ROWS, ring_rows

    # The case: Qwen2.5-0.5B shapes, window 64, bf16 (~2.75 MB per ring row) and
    # budget 128; 2 GiB to share between the ring and a pool of 12 KiB per token.
    cfg = EvictionConfig(policy="snapkv", budget=128, window=64)
    per_row = ring_bytes(24, 1, 64, 14, 64, 2)
    per_token = 24 * 2 * 2 * 64 * 2
    available = 2 * 2**30
    rows, cap = ring_rows(available, per_row, None, charge_len(cfg), per_token)
    assert cap == rows - 1
    # The ring's rows and the pool left beside them serve the same number of requests:
    # the pool holds `cap` requests at admission's charge, and not one more row fits.
    pool = available - rows * per_row
    assert cap <= pool // (charge_len(cfg) * per_token) < cap + 2
    assert (rows + 1) * per_row + (cap + 1) * charge_len(cfg) * per_token > available
    # The server: a pool capped at 2,048 tokens runs 12 requests at budget 128, and
    # the ring gets 13 rows (~36 MB), not the old fixed 15 % share (2 GiB / 13 GiB free).
    rows, cap = ring_rows(13 * 2**30, per_row, None, charge_len(cfg), per_token, 2048)
    assert (rows, cap) == (13, 12)
    # An explicit --max-running-requests is served as asked, uncapped.
    assert ring_rows(available, per_row, 2048, charge_len(cfg), per_token) == (2049, None)
    # A small ring on a big pool: SGLang's own default table size, no cap.
    assert ring_rows(2**40, 1024, None, 1, 1) == (DEFAULT_MAX_ROWS + 1, None)


def test_query_ring_rows_count_the_prompts_the_pool_also_holds():
    """Issue 22's case: Qwen3-4B shapes (36 layers, 32 query / 8 KV heads, head dim 128, bf16),
    T = 1024, window 64, 4k-token prompts, 60 GiB to share. Sized for the private cycle alone
    the ring reserved rows for 5x more requests than the pool can hold with their prompts:
    gigabytes of ring that never run. With the prompt length assumed, no row is idle."""
    from vase_sglang import EvictionConfig
    from vase_sglang_patches.footprint import charge_len
    from vase_sglang.plan import ring_bytes
    from vase_sglang_patches.memory import ring_rows, ring_tokens_per_request
    from vase_sglang_patches.settings import DEFAULT_PROMPT_LEN, prompt_len_from_values

    cfg = EvictionConfig(policy="vase-attnv", budget=1024, window=64)
    per_row = ring_bytes(36, 1, 64, 32, 128, 2)
    per_token = 36 * 2 * 8 * 128 * 2
    available = 60 * 2**30
    prompt = 4096

    def idle_ring_bytes(tokens_per_request):
        rows, cap = ring_rows(available, per_row, None, tokens_per_request, per_token)
        runnable = (available - rows * per_row) // ((prompt + charge_len(cfg)) * per_token)
        return max(0, cap - runnable) * per_row

    assert ring_tokens_per_request(cfg, 1, prompt) == prompt + charge_len(cfg)
    assert idle_ring_bytes(ring_tokens_per_request(cfg, 1, prompt)) <= per_row
    assert idle_ring_bytes(ring_tokens_per_request(cfg, 1, 0)) > 4 * 2**30  # the old sizing
    # The assumption is a flag with a default; 0 keeps the old sizing.
    assert prompt_len_from_values({}) == DEFAULT_PROMPT_LEN > 0
    assert prompt_len_from_values({"expected-prompt-len": "0"}) == 0
