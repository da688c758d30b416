"""Learned retention (vase_sglang.gates and vase_sglang.training.retention, through their shared
old import path vase_sglang.retention): the soft-eviction maths, the training on the tiny
model (loss falls, resume is exact), the gates file checks, and the transformers reference
running trimkv against an independent replay of the eviction in plain Python."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from vase_sglang import EvictionConfig
from vase_sglang import retention as R
from vase_sglang.serving.hf_reference import ReferenceDecoder

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fp32_model(tiny_model_fp32):
    return AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()


# ---------------------------------------------------------------- soft eviction maths


def test_soft_eviction_multiplies_attention_weights_by_beta_power_age():
    """softmax(logits + log β_i (t - i)) == w_ti β_i^(t - i) / sum_j w_tj β_j^(t - j), causal,
    checked with plain loops in double."""
    gen = torch.Generator().manual_seed(0)
    t, h = 7, 2
    logits = torch.randn(1, h, t, t, generator=gen)
    log_beta = torch.nn.functional.logsigmoid(torch.randn(1, t, h, generator=gen) * 2)
    got = torch.softmax(logits + R.soft_eviction_bias(log_beta), dim=-1)
    for head in range(h):
        for q in range(t):
            raw = [math.exp(logits[0, head, q, i].item()) * math.exp(log_beta[0, i, head].item()) ** (q - i)
                   for i in range(q + 1)]
            total = sum(raw)
            for i in range(t):
                expected = raw[i] / total if i <= q else 0.0
                assert abs(got[0, head, q, i].item() - expected) < 1e-6, (head, q, i)


def test_expected_retained_and_capacity_loss_by_hand():
    """Constant β per head: R_t = sum_{k=0..t} β^k (a geometric sum); the capacity loss is the
    mean over heads and steps of max(0, R_t - M) / M."""
    t, memory = 9, 3
    betas = [0.9, 0.5]
    log_beta = torch.log(torch.tensor(betas)).expand(1, t, 2)
    r = R.expected_retained(log_beta)
    for h, b in enumerate(betas):
        for step in range(t):
            assert abs(r[0, h, step].item() - sum(b ** k for k in range(step + 1))) < 1e-5
    expected = sum(max(0.0, sum(b ** k for k in range(s + 1)) - memory)
                   for b in betas for s in range(t)) / (2 * t) / memory
    assert abs(R.capacity_loss([log_beta], memory).item() - expected) < 1e-6
    assert expected > 0  # β = 0.9 overflows M = 3 after 4 steps: the case is not trivial


def test_global_capacity_loss_by_hand():
    """scope global: one budget L·H·M over all layers and heads, mean over steps of
    max(0, sum R_t - L·H·M) / (L·H·M). A head far over M next to heads under it costs nothing
    globally while the per-head loss charges it."""
    t, memory = 9, 3
    layers = [[0.9, 0.2], [0.5, 0.1]]
    log_betas = [torch.log(torch.tensor(b)).expand(1, t, 2) for b in layers]

    def r(b, s):
        return sum(b ** k for k in range(s + 1))

    slots = memory * 4
    expected = sum(max(0.0, sum(r(b, s) for lb in layers for b in lb) - slots)
                   for s in range(t)) / t / slots
    got = R.capacity_loss(log_betas, memory, "global").item()
    assert abs(got - expected) < 1e-6
    assert expected == 0.0 and R.capacity_loss(log_betas, memory).item() > 0
    # all heads over M: the global loss charges the sum
    hot = [torch.log(torch.tensor([0.9, 0.8])).expand(1, t, 2)] * 2
    expected = sum(max(0.0, 2 * (r(0.9, s) + r(0.8, s)) - slots) for s in range(t)) / t / slots
    assert expected > 0
    assert abs(R.capacity_loss(hot, memory, "global").item() - expected) < 1e-6
    with pytest.raises(ValueError, match="capacity scope"):
        R.capacity_loss(hot, memory, "layer")
    with pytest.raises(ValueError, match="capacity_scope"):
        R.TrainConfig(capacity_scope="layer")


def test_training_attention_without_retention_is_the_model(fp32_model):
    """The attention implementation used for training, with no log β set, equals the model's
    own (the teacher is the frozen model); with log β set it differs (the student)."""
    model = AutoModelForCausalLM.from_pretrained(fp32_model.name_or_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, 33), generator=torch.Generator().manual_seed(1))
    stock = model(input_ids=ids, use_cache=False).logits
    R.install_training_attention(model)
    plain = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(plain, stock, rtol=1e-5, atol=1e-5)
    gates = R.RetentionGates.for_model(model.config, bias_init=0.0)
    _, kl, _, _ = R.losses(model, gates, ids, memory=8, cap_weight=1.0)
    assert kl.item() > 1e-3


# ---------------------------------------------------------------- training


def _cfg(model_path, **kw):
    base = dict(model=model_path, memory=16, steps=24, lr=0.02, bias_init=4.0, problems=3,
                gen_tokens=24, max_len=160, seed=3, save_every=4)
    base.update(kw)
    return R.TrainConfig(**base)


def _quiet(it, **kw):
    return it


def test_tiny_gates_train_in_seconds_and_the_loss_falls(tiny_model_fp32, tmp_path):
    out = tmp_path / "gates"
    summary = R.train(_cfg(tiny_model_fp32), out, progress=_quiet, log=lambda *_: None)
    history = json.loads((out / "history.json").read_text())
    assert len(history) == 24
    first = sum(r["loss"] for r in history[:4]) / 4
    last = sum(r["loss"] for r in history[-4:]) / 4
    assert last < 0.5 * first, (first, last)
    # The capacity term did the work: the heads went from holding (nearly) every token to
    # about the memory size.
    assert history[0]["retained"] > 2 * 16 and history[-1]["retained"] < 1.5 * 16
    assert (out / "loss.png").stat().st_size > 1000
    gates = R.load_gates(summary["gates"], tiny_model_fp32)
    assert gates.layers == 2 and gates.kv_heads == 2


def test_resume_from_checkpoint_ends_identical(tiny_model_fp32, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    R.train(_cfg(tiny_model_fp32, steps=8), whole, progress=_quiet, log=lambda *_: None)
    split.mkdir()
    shutil.copy(whole / "data.json", split / "data.json")  # the same data, not generated again
    R.train(_cfg(tiny_model_fp32, steps=4), split, progress=_quiet, log=lambda *_: None)
    logs = []
    R.train(_cfg(tiny_model_fp32, steps=8), split, progress=_quiet, log=logs.append)
    assert any("resuming from step 4" in line for line in logs)
    a = R.load_gates(whole / "gates.safetensors", tiny_model_fp32)
    b = R.load_gates(split / "gates.safetensors", tiny_model_fp32)
    for name in R.TENSORS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(SystemExit, match="other settings"):
        R.train(_cfg(tiny_model_fp32, steps=8, memory=9), split, progress=_quiet, log=lambda *_: None)


def test_the_general_mix_holds_no_evaluation_task():
    """Gates trained on the general mix are evaluated out of distribution: none of its
    families is a task the harness scores, and it has at least four families."""
    for name, families in R.MIXES.items():
        assert len(set(families)) >= 4, name
        assert not set(families) & set(R.EVALUATION_TASKS), name
        assert R.task_families(name) == families
    assert R.task_families("gsm_symbolic") == ("gsm_symbolic",)
    assert R.task_families("word_sorting, prose") == ("word_sorting", "prose")


def test_prose_and_code_prompts_are_seeded_and_distinct(tiny_model_fp32):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_fp32)
    for family, (forms, subjects) in R.TEXT_FAMILIES.items():
        a = R.problem_prompts(tok, family, 12, seed=1)
        assert a == R.problem_prompts(tok, family, 12, seed=1)
        assert len({tuple(p) for p in a}) == 12
        assert a != R.problem_prompts(tok, family, 12, seed=2)
        with pytest.raises(SystemExit, match="distinct prompts"):
            R.problem_prompts(tok, family, len(forms) * len(subjects) + 1, seed=1)
    with pytest.raises(SystemExit, match="neither a reasoning-gym task"):
        R.problem_prompts(tok, "no_such_family", 2, seed=1)
    split = [f for f, _ in R.training_prompts(tok, "word_sorting,prose,code", 7, seed=1)]
    assert split == ["word_sorting"] * 3 + ["prose"] * 2 + ["code"] * 2


def test_general_gates_record_their_mix_recipe_and_data(tiny_model_fp32, tmp_path):
    out = tmp_path / "general"
    cfg = _cfg(tiny_model_fp32, task="general", problems=7, gen_tokens=12, steps=4, gen_batch=3)
    logs = []
    summary = R.train(cfg, out, progress=_quiet, log=logs.append)
    # the data estimate comes from a batch whose answers ran to the limit
    assert any(line.startswith("data: at most about") for line in logs), logs
    meta = R.read_metadata(summary["gates"])
    mix = json.loads(meta["data_mix"])
    assert list(mix) == list(R.MIXES["general"])
    assert all(r["sequences"] == 1 and r["generated"] >= 1 for r in mix.values())
    assert abs(sum(r["share"] for r in mix.values()) - 1) < 1e-3
    data = json.loads((out / "data.json").read_text())
    assert meta["data_sha256"] == R.data_sha256(data["sequences"])
    assert json.loads(meta["recipe"]) == R.recipe_key(cfg)
    # answers decoded together are the model's own greedy answers: one of them decoded alone
    # (the longest prompt: no padding in front of it in its batch) is the same sequence
    k = max(range(7), key=lambda i: (data["prompt_lengths"][i], -i))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_fp32, dtype=torch.float32).eval()
    prompt = data["sequences"][k][: data["prompt_lengths"][k]]
    eos = {t for t in [model.generation_config.eos_token_id] if isinstance(t, int)}
    alone = R.greedy_batch(model, [prompt], 12, eos, pad=0)[0]
    assert alone == data["sequences"][k]


def test_load_or_train_trains_once_then_serves_the_cached_gates(tiny_model_fp32, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.setitem(R.RECIPES, "general", dict(task="general", problems=7, gen_tokens=12,
                                                   steps=4, memory=16, max_len=160))
    monkeypatch.setenv("VASE_SGLANG_CACHE", str(tmp_path / "cache"))
    logs = []
    path = R.load_or_train(str(tiny_model_fp32), progress=_quiet, log=logs.append)
    assert path == tmp_path / "cache" / "retention" / Path(tiny_model_fp32).name / "general" / \
        "gates.safetensors"
    assert any("training them once" in line for line in logs)
    stamp = path.stat().st_mtime_ns
    # the command: the cached path on stdout, nothing trained again
    R.main(["load-or-train", "--model", str(tiny_model_fp32)])
    captured = capsys.readouterr()
    assert captured.out.strip() == str(path) and "(cached)" in captured.err
    assert path.stat().st_mtime_ns == stamp
    # gates cached before the bytes were canonical: rewritten once, then served as they are
    canonical = path.read_bytes()
    path.write_bytes(_reordered(canonical))
    logs.clear()
    assert R.load_or_train(str(tiny_model_fp32), progress=_quiet, log=logs.append) == path
    assert path.read_bytes() == canonical
    assert any("canonical order" in line for line in logs)
    # another version of the recipe: trained again
    monkeypatch.setitem(R.RECIPES, "general", dict(R.RECIPES["general"], steps=5))
    logs.clear()
    R.load_or_train(str(tiny_model_fp32), progress=_quiet, log=logs.append)
    assert any("another version" in line for line in logs)
    assert json.loads(R.read_metadata(path)["recipe"])["steps"] == 5
    # gates of another model in that place are refused, not overwritten
    other = AutoConfig.from_pretrained(tiny_model_fp32, num_hidden_layers=3)
    R.save_gates(path, R.RetentionGates.for_model(other), other)
    with pytest.raises(SystemExit, match="trained for another model"):
        R.main(["load-or-train", "--model", str(tiny_model_fp32)])
    assert R.read_metadata(path)["layers"] == "3"


def test_global_recipe_trains_on_the_general_recipes_data(tiny_model_fp32, tmp_path, monkeypatch):
    """load-or-train --recipe general-global: the general recipe's answers are reused (not
    generated again), the gates record the global scope, the training differs; the per-head
    recipe's key is what it was before the scope existed (cached gates stay valid)."""
    small = dict(task="general", problems=7, gen_tokens=12, steps=6, memory=16, max_len=160)
    monkeypatch.setitem(R.RECIPES, "general", small)
    monkeypatch.setitem(R.RECIPES, "general-global", dict(small, capacity_scope="global"))
    monkeypatch.setenv("VASE_SGLANG_CACHE", str(tmp_path / "cache"))
    per_head = R.load_or_train(str(tiny_model_fp32), "general", progress=_quiet, log=lambda *_: None)
    logs = []
    glob = R.load_or_train(str(tiny_model_fp32), "general-global", progress=_quiet, log=logs.append)
    assert glob.parent.name == "general-global"
    assert any("(copied)" in line for line in logs) and not any("data: 7 prompts" in line for line in logs)
    assert (glob.parent / "data.json").read_text() == (per_head.parent / "data.json").read_text()
    assert json.loads(R.read_metadata(glob)["recipe"])["capacity_scope"] == "global"
    assert "capacity_scope" not in json.loads(R.read_metadata(per_head)["recipe"])
    a, b = (json.loads((p.parent / "history.json").read_text()) for p in (per_head, glob))
    assert [x["kl"] for x in a][0] == [x["kl"] for x in b][0]  # same data, same start
    assert [x["capacity"] for x in a] != [x["capacity"] for x in b]


def test_gates_of_a_fetched_model_folder_go_by_the_models_name(tmp_path, monkeypatch):
    """The demo and the benchmarks pass the fetched folder (…/smollm2-135m/hf): its gates are
    the model's (retention/smollm2-135m), not a shared retention/hf another model would clash
    with; any other folder goes by its own name."""
    from vase_sglang.serving.models import model_dir

    monkeypatch.setenv("VASE_SGLANG_CACHE", str(tmp_path))
    for name in ("smollm2-135m", "qwen2.5-0.5b"):
        assert R.default_out(str(model_dir(name))) == tmp_path / "retention" / name
        assert R.default_out(name) == tmp_path / "retention" / name
    assert R.default_out(str(tmp_path / "mine" / "hf")) == tmp_path / "retention" / "hf"
    assert R.default_out(str(tmp_path / "my-model")) == tmp_path / "retention" / "my-model"


# ---------------------------------------------------------------- gates files


# Saves seeded gates with metadata in a fresh interpreter (safetensors' header order is seeded
# per process, so two saves in one process would not show the defect).
_SAVE_IN_A_NEW_PROCESS = """
import sys
import torch
from transformers import AutoConfig
from vase_sglang import gates as G
config = AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(0)
gates = G.RetentionGates.for_model(config)
with torch.no_grad():
    for name in G.TENSORS:
        getattr(gates, name).normal_()
G.save_gates(sys.argv[2], gates, config, seed=0, steps=3, task="general", memory_size=16,
             recipe='{"a": 1}', data_mix='{"b": 2}', model_path="/m", problems=7)
"""


def _reordered(raw: bytes) -> bytes:
    """The same safetensors file with its header's keys (and metadata keys) in reverse order:
    what safetensors may write in some process."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header = {k: (dict(reversed(v.items())) if k == "__metadata__" else v)
              for k, v in reversed(header.items())}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def test_the_same_gates_saved_by_two_processes_have_the_same_bytes(tiny_model_fp32, tmp_path):
    """Benchmarks name gates by their file's SHA-256 and pair records by it: the same tensors
    and metadata must give the same file, whatever process writes it."""
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for path in paths:
        subprocess.run([sys.executable, "-c", _SAVE_IN_A_NEW_PROCESS, str(tiny_model_fp32),
                        str(path)], check=True)
    assert paths[0].read_bytes() == paths[1].read_bytes() == paths[2].read_bytes()


def test_info_prints_the_metadata_and_the_hash_benchmarks_name_the_gates_by(
        tiny_model_fp32, tmp_path, capsys):
    import hashlib

    config = AutoConfig.from_pretrained(tiny_model_fp32)
    _, path = _saved(tmp_path, config)
    R.main(["info", str(path)])
    shown = json.loads(capsys.readouterr().out)
    assert shown["file_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    meta = json.loads(json.dumps(R.read_metadata(path), default=list))  # shapes: tuples
    assert {k: v for k, v in shown.items() if k != "file_sha256"} == meta
    with pytest.raises(SystemExit, match="no such file"):
        R.main(["info", str(tmp_path / "missing.safetensors")])


def test_a_gates_file_in_another_header_order_is_rewritten_canonically(tiny_model_fp32, tmp_path):
    """A file cached before saving was canonical: rewritten once to exactly what save_gates
    writes, loading to the same tensors and metadata; a canonical file is left alone."""
    config = AutoConfig.from_pretrained(tiny_model_fp32)
    gates, path = _saved(tmp_path, config)
    with torch.no_grad():
        gates.w1.normal_(generator=torch.Generator().manual_seed(3))
    R.save_gates(path, gates, config, note="x")
    canonical = path.read_bytes()
    old = tmp_path / "old.safetensors"
    old.write_bytes(_reordered(canonical))
    assert old.read_bytes() != canonical
    assert R.read_metadata(old) == R.read_metadata(path)
    assert R.canonicalize_gates_file(old) is True
    assert old.read_bytes() == canonical
    assert R.canonicalize_gates_file(old) is False
    loaded = R.load_gates(old, config)
    assert torch.equal(loaded.w1, gates.w1) and torch.equal(loaded.b2, gates.b2)


def _saved(tmp_path, config, **kw):
    gates = R.RetentionGates.for_model(config, **kw)
    return gates, R.save_gates(tmp_path / "g.safetensors", gates, config)


def test_gates_round_trip(tiny_model_fp32, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model_fp32)
    gates, path = _saved(tmp_path, config, gate_hidden=8, seed=5)
    loaded = R.load_gates(path, config)
    for name in R.TENSORS:
        assert torch.equal(getattr(loaded, name), getattr(gates, name))
    meta = R.read_metadata(path)
    assert (meta["layers"], meta["kv_heads"], meta["hidden_size"]) == ("2", "2", "128")
    assert meta["architecture"] == "Qwen3ForCausalLM"


def test_bad_gate_files_are_refused(tiny_model_fp32, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model_fp32)
    with pytest.raises(R.GatesError, match="no such file"):
        R.load_gates(tmp_path / "missing.safetensors", config)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(R.GatesError, match="not a readable safetensors file"):
        R.load_gates(junk, config)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w1": torch.zeros(1)}, str(foreign), metadata={"format": "something-else"})
    with pytest.raises(R.GatesError, match="is not a vase-retention-gates file"):
        R.load_gates(foreign, config)

    # Gates of another model: 3 layers instead of 2, then 4 KV heads instead of 2.
    for change in (dict(num_hidden_layers=3), dict(num_key_value_heads=4)):
        other = AutoConfig.from_pretrained(tiny_model_fp32, **change)
        _, path = _saved(tmp_path, other)
        with pytest.raises(R.GatesError, match="trained for another model"):
            R.load_gates(path, config)

    # Right model in the metadata, wrong tensor shapes / missing tensor / not finite.
    gates, path = _saved(tmp_path, config, gate_hidden=8)
    meta = {k: v for k, v in R.read_metadata(path).items() if not k.startswith("_")}
    tensors = {n: getattr(gates, n).detach().clone() for n in R.TENSORS}
    bad_shape = dict(tensors, w2=torch.zeros(2, 3, 8))
    save_file(bad_shape, str(tmp_path / "shape.safetensors"), metadata=meta)
    with pytest.raises(R.GatesError, match=r"'w2' has shape \(2, 3, 8\), expected \(2, 2, 8\)"):
        R.load_gates(tmp_path / "shape.safetensors", config)
    missing = {k: v for k, v in tensors.items() if k != "b2"}
    save_file(missing, str(tmp_path / "missing_t.safetensors"), metadata=meta)
    with pytest.raises(R.GatesError, match="'b2' is missing"):
        R.load_gates(tmp_path / "missing_t.safetensors", config)
    nan = dict(tensors, b1=torch.full_like(tensors["b1"], float("nan")))
    save_file(nan, str(tmp_path / "nan.safetensors"), metadata=meta)
    with pytest.raises(R.GatesError, match="not finite"):
        R.load_gates(tmp_path / "nan.safetensors", config)


def test_reference_refuses_trimkv_without_gates(fp32_model):
    cfg = EvictionConfig(policy="trimkv", budget=12, window=4, sinks=2)
    with pytest.raises(ValueError, match="needs retention gates"):
        ReferenceDecoder(fp32_model, cfg)


# ---------------------------------------------------------------- the reference runs trimkv


def _replay_layer0(model, gates, cfg, tokens, prompt_len, steps, protect_prompt):
    """TRIM-KV eviction of layer 0, replayed in plain Python from the definition: layer 0's
    attention input depends on the token alone, so log β (and V, for the value slots) of
    every token is known without running the decode. Returns the kept positions per head."""
    layer = model.model.layers[0]
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(torch.tensor(tokens)))
        log_beta = gates.log_beta(0, x).double().tolist()  # [T][H]
        heads = model.config.num_key_value_heads
        v = layer.self_attn.v_proj(x).view(len(tokens), heads, -1)
        value_range = (v.amax(-1) - v.amin(-1)).double().tolist()
    prefix = prompt_len if protect_prompt else 0
    sinks = max(0, cfg.sinks - prefix)
    keep = cfg.budget - cfg.window
    caches = [list(range(prompt_len)) for _ in range(heads)]
    for step in range(steps):
        if step > 0:
            for cache in caches:
                cache.append(prompt_len + step - 1)
        if step == steps - 1:
            break
        private = len(caches[0]) - prefix
        if step < 1 or private < cfg.trigger_len:
            continue
        n = private - cfg.window
        now = prompt_len + step  # the position of the next token
        for h, cache in enumerate(caches):
            cand = cache[prefix: prefix + n]
            forced = list(range(min(sinks, n)))
            others = [i for i in range(n) if i not in forced]
            by_range = sorted(others, key=lambda i: (-value_range[cand[i]][h], i))
            forced += by_range[: cfg.n_value_slots]
            rest = [i for i in range(n) if i not in forced]
            score = {i: log_beta[cand[i]][h] * (now - cand[i]) for i in rest}
            chosen = forced + sorted(rest, key=lambda i: (-score[i], i))[: keep - len(forced)]
            cache[prefix: prefix + n] = [cand[i] for i in sorted(chosen)]
    return caches


@pytest.mark.parametrize("value_slots, protect_prompt", [(0, False), (3, False), (0, True)])
def test_reference_trimkv_matches_a_replay_of_the_definition(fp32_model, tmp_path, value_slots,
                                                             protect_prompt):
    # Widely spread β (gate weights 0.5, bias 2), so that retention, not age, decides.
    gates = R.RetentionGates.for_model(fp32_model.config, gate_hidden=8, bias_init=2.0,
                                       init_std=0.5, seed=7)
    path = R.save_gates(tmp_path / "g.safetensors", gates, fp32_model.config)
    cfg = EvictionConfig(policy="trimkv", budget=20, window=4, sinks=2, value_slots=value_slots)
    prompt = [5, 17, 99, 3, 250, 7, 41, 8, 600, 12]
    steps = 84  # 15 eviction rounds
    decoder = ReferenceDecoder(fp32_model, cfg, protect_prompt=protect_prompt, gates=path)
    out = decoder.run(prompt, max_new_tokens=steps)
    assert out["rounds"] >= 12
    tokens = prompt + out["tokens"][:-1]
    expected = _replay_layer0(fp32_model, decoder.gates, cfg, tokens, len(prompt), steps,
                              protect_prompt)
    got = decoder._positions[0].tolist()
    assert got == expected
    # Negative control: the newest tokens (streaming) are not what trimkv keeps here.
    stream = ReferenceDecoder(fp32_model, cfg.replace(policy="streaming", value_slots=None),
                              protect_prompt=protect_prompt)
    assert stream.run(prompt, max_new_tokens=steps)["logprobs"] != out["logprobs"]


# ---------------------------------------------------------------- servers and trimkv


def test_servers_need_gates_for_trimkv_at_startup_and_per_request():
    """A launch naming trimkv without --kv-evict-retention-gates fails like argparse; a request
    asking for it on a server without gates gets the ValueError that SGLang answers with HTTP
    400; with gates, both are accepted (per-request value_slots included)."""
    from vase_sglang_patches.request_control import effective_config
    from vase_sglang_patches.settings import config_from_values

    with pytest.raises(ValueError, match="--kv-evict-policy: trimkv needs retention gates: set "
                                         "--kv-evict-retention-gates"):
        config_from_values({"policy": "trimkv", "budget": "64", "window": "16"})
    with pytest.raises(ValueError, match="--kv-evict-retention-gates: set --kv-evict-policy too"):
        config_from_values({"retention-gates": "g.safetensors"})
    served = config_from_values({"policy": "trimkv", "budget": "64", "window": "16",
                                 "retention-gates": "g.safetensors"})
    assert served.policy == "trimkv" and served.n_value_slots == 0

    server = config_from_values({"policy": "vase-attnv", "budget": "64", "window": "16"})
    with pytest.raises(ValueError, match="kv_evict.policy: 'trimkv' needs retention gates, which "
                                         "this server did not load"):
        effective_config({"kv_evict": {"policy": "trimkv"}}, server)
    assert effective_config({"kv_evict": {"policy": "snapkv"}}, server).policy == "snapkv"
    hybrid = effective_config({"kv_evict": {"policy": "trimkv", "value_slots": 8}}, server,
                              has_gates=True)  # on the grid (a quarter of the window: 4)
    assert (hybrid.policy, hybrid.n_value_slots) == ("trimkv", 8)
    assert effective_config({"kv_evict": {"policy": "trimkv"}}, server,
                            has_gates=True).n_value_slots == 0


def test_engine_users_set_gates_through_configure(monkeypatch):
    """sgl.Engine users: configure(retention_gates=...) writes the variable the schedulers
    read; trimkv without it is refused naming the keyword."""
    import vase_sglang_patches as plugin
    from vase_sglang_patches import settings

    for suffix in (*settings.FLAGS, *settings.SERVER_FLAGS):  # restored after the test
        monkeypatch.setenv(settings.env_name(suffix), "")
    with pytest.raises(ValueError, match="^policy: trimkv needs retention gates: set "
                                         "retention_gates"):
        plugin.configure(policy="trimkv", budget=64, window=16)
    cfg = plugin.configure(policy="trimkv", budget=64, window=16, retention_gates="/g.safetensors")
    server = settings.ServerSettings.from_env()
    assert server.gates_path == "/g.safetensors"
    assert server.config == cfg and cfg.policy == "trimkv"


def test_server_gates_check_names_the_flag(tiny_model_fp32, tmp_path):
    """The check each scheduler (and the launcher) runs on --kv-evict-retention-gates: the
    file's own reason, prefixed with the flag."""
    from vase_sglang_patches.settings import load_server_gates

    config = AutoConfig.from_pretrained(tiny_model_fp32)
    _, good = _saved(tmp_path, config)
    assert load_server_gates(good, config).layers == config.num_hidden_layers
    with pytest.raises(ValueError, match="^--kv-evict-retention-gates: retention gates: .*no such file"):
        load_server_gates(tmp_path / "missing.safetensors", config)
    other = AutoConfig.from_pretrained(tiny_model_fp32, num_key_value_heads=4)
    with pytest.raises(ValueError, match="^--kv-evict-retention-gates: .*trained for another model"):
        load_server_gates(_saved(tmp_path / "other", other)[1], config)


def test_launch_server_refuses_a_bad_gates_file(tiny_model, tmp_path):
    """On a real `python -m sglang.launch_server`: gates of another model stop the launch with
    the flag and the reason."""
    from servers import run_launch_server_expect_failure

    other = AutoConfig.from_pretrained(tiny_model, num_hidden_layers=3)
    _, path = _saved(tmp_path, other)
    code, output = run_launch_server_expect_failure(
        tiny_model, ["--kv-evict-policy", "trimkv", "--kv-evict-budget", "64",
                     "--kv-evict-window", "16", "--kv-evict-retention-gates", str(path)])
    assert code != 0
    assert "--kv-evict-retention-gates: retention gates:" in output, output[-3000:]
    assert "trained for another model" in output, output[-3000:]
    assert "fired up and ready" not in output
