"""Reasoning programs in SGLang's frontend language (sglang.lang), run against a VaSE server.

Two programs, both plain ``@sgl.function``s that work with any SGLang server; served with
``--kv-evict-policy`` they decode under the KV budget, and each response's ``meta_info`` says how
many tokens were evicted (``kv_evicted_tokens``, per layer and KV head).

* ``solve``: one step-by-step answer, then answer extraction (vase_sglang.serving.answers).
* ``self_consistency``: ``fork(k)`` branches sampled at temperature 0.6, top-p 0.95 (the VaSE
  paper's sampling), majority vote over their extracted answers. The fork first commits the
  prompt to the server, so the k branches find it in the radix cache (``cached_tokens``) and
  share its KV; the tokens each branch generates are private to it and evicted on their own.

Use from Python::

    import sglang as sgl
    from reasoning import run_solve, run_self_consistency   # this folder on sys.path
    backend = connect("http://127.0.0.1:30000")
    print(run_solve(backend, "What is 17 + 25?")["answer"])

or from the command line: examples/solve.py, examples/self_consistency.py.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Optional

import sglang as sgl

from vase_sglang.serving.answers import ANSWER_INSTRUCTION, extract

# Frontend programs format chat turns with the backend's chat template, which RuntimeEndpoint
# guesses from the model path. A converted folder like ~/.cache/vase-sglang/qwen2.5-0.5b/hf does
# not match its "qwen.*instruct" rule and would fall back to a plain "USER:" template the model
# was never trained on: pick chatml-style Qwen when the path says qwen.


def connect(url: str, chat_template: Optional[str] = None) -> "sgl.RuntimeEndpoint":
    backend = sgl.RuntimeEndpoint(url)
    if chat_template is None and backend.chat_template.name == "default":
        path = backend.model_info.get("model_path", "").lower()
        chat_template = "qwen" if "qwen" in path else "chatml"
    if chat_template is not None:
        from sglang.lang.chat_template import get_chat_template

        backend.chat_template = get_chat_template(chat_template)
    return backend


def _without_turn_end(backend):
    """The backend with a chat template that has no stop strings. sglang.lang adds the template's
    end-of-turn strings (e.g. "<|im_end|>") to the stop list of every gen, and SGLang matches
    stop strings on the decoded text even with ignore_eos: a sampled end-of-turn token would end
    a branch early although the caller asked for exactly max_tokens."""
    backend = copy.copy(backend)  # the caller's backend keeps its template
    backend.chat_template = dataclasses.replace(backend.chat_template, stop_str=())
    return backend


def _meta(meta: Optional[dict]) -> dict:
    meta = meta or {}
    return {
        "completion_tokens": meta.get("completion_tokens"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "kv_evicted_tokens": meta.get("kv_evicted_tokens"),  # None: not a VaSE server
        "finish_reason": meta.get("finish_reason"),
    }


@sgl.function
def solve(s, question, max_tokens=512, temperature=0.0, top_p=1.0, ignore_eos=False):
    s += sgl.user(question + "\n" + ANSWER_INSTRUCTION)
    s += sgl.assistant(sgl.gen("reasoning", max_tokens=max_tokens, temperature=temperature,
                               top_p=top_p, ignore_eos=ignore_eos))


@sgl.function
def self_consistency(s, question, k=5, max_tokens=512, temperature=0.6, top_p=0.95,
                     ignore_eos=False):
    s += sgl.user(question + "\n" + ANSWER_INSTRUCTION)
    # fork() sends the prompt to the server first (a max_new_tokens=0 request that puts it in
    # the radix cache), but only if the prompt text is already built: sglang.lang builds it on a
    # worker thread, so without this sync the fork can see an empty text and skip the commit,
    # and the k branches then prefill the whole prompt each.
    s.sync()
    branches = s.fork(k)
    branches += sgl.assistant(sgl.gen("reasoning", max_tokens=max_tokens, temperature=temperature,
                                      top_p=top_p, ignore_eos=ignore_eos))
    results = []
    for b in branches:  # read each branch's text and meta_info before join() ends them
        results.append({"text": b["reasoning"], **_meta(b.get_meta_info("reasoning"))})
    branches.join()
    s.set_var("branches", results)


def majority_vote(answers: list[Optional[str]]) -> tuple[Optional[str], dict]:
    """Most frequent extracted answer (None ignored); ties go to the answer seen first."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return None, {}
    best = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == best)
    return winner, dict(counts)


# The programs' sampling arguments are bound, not passed to .run(): SglFunction.run has its own
# temperature / top_p / ignore_eos keywords (default sampling parameters) and would swallow
# them, leaving the program's defaults in its gen() calls.


def run_solve(backend, question: str, **kwargs) -> dict:
    if kwargs.get("ignore_eos"):
        backend = _without_turn_end(backend)
    state = solve.bind(**kwargs).run(question=question, backend=backend)
    if state.error():
        raise RuntimeError(f"solve failed: {state.error()}")
    text = state["reasoning"]
    ex = extract(text)
    return {"question": question, "text": text, "answer": ex.answer, "answer_source": ex.source,
            **_meta(state.get_meta_info("reasoning"))}


def run_self_consistency(backend, question: str, k: int = 5, **kwargs) -> dict:
    if kwargs.get("ignore_eos"):
        backend = _without_turn_end(backend)
    state = self_consistency.bind(k=k, **kwargs).run(question=question, backend=backend)
    if state.error():
        raise RuntimeError(f"self_consistency failed: {state.error()}")
    branches = state["branches"]
    for b in branches:
        ex = extract(b["text"])
        b["answer"], b["answer_source"] = ex.answer, ex.source
    winner, votes = majority_vote([b["answer"] for b in branches])
    return {"question": question, "answer": winner, "votes": votes, "k": k, "branches": branches}
