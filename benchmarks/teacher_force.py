"""Teacher forcing through a real SGLang server, during decode (where eviction happens).

SGLang applies a custom logit processor in place before it computes the logprobs it returns,
so a processor that forces a token makes the returned logprobs those of the forced
distribution (one-hot), whatever SGLANG_RETURN_ORIGINAL_LOGPROB says (that variable only skips
the temperature). This processor therefore measures the model's own distribution itself,
before forcing, and writes one JSON line per step to a file named in the request:

    {"t": step, "lp": logprob of the forced token, "top1": argmax id,
     "ref_lp": [logprobs of the reference ids of this step], "top_ids": [...], "top_lp": [...]}

Request parameters (sampling_params.custom_params):
    tf_forced: token ids to force, one per step (send max_new_tokens = len, ignore_eos = True)
    tf_out:    path of the per-request JSON-lines file (the scheduler runs on this machine)
    tf_ref:    optional flat list, len(tf_forced) * tf_k ids whose logprobs to report per step
    tf_k:      how many reference ids per step / top ids to keep (default 20)

The step index is len(req.output_ids) when the processor runs, so the server must run with
--disable-overlap-schedule; the harness checks that the returned output equals tf_forced.
"""

from __future__ import annotations

import json

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class TeacherForceProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        if not custom_param_list:
            return logits
        for i, p in enumerate(custom_param_list):
            if not p or "tf_forced" not in p:
                continue
            req = p["__req__"]
            forced = p["tf_forced"]
            t = len(req.output_ids)
            if t >= len(forced):
                continue
            k = int(p.get("tf_k", 20))
            lp = torch.log_softmax(logits[i].float(), dim=-1)
            top_lp, top_ids = lp.topk(k)
            rec = {"t": t, "lp": float(lp[forced[t]]), "top1": int(top_ids[0]),
                   "top_ids": top_ids.tolist(), "top_lp": [round(x, 6) for x in top_lp.tolist()]}
            ref = p.get("tf_ref")
            if ref:
                ids = torch.tensor(ref[t * k:(t + 1) * k], dtype=torch.long, device=lp.device)
                rec["ref_lp"] = lp[ids].tolist()
            with open(p["tf_out"], "a") as f:
                f.write(json.dumps(rec) + "\n")
            logits[i].fill_(float("-inf"))
            logits[i, forced[t]] = 0.0
        return logits
