"""fp32 arbiter of two bf16 engine runs: the tiny checkpoint in fp32 through transformers, the exact model both
engines approximate. Used by integration/test_vllm_engine_gpu.py (when two runs part away from a near tie) and by
`sglang_run.py compare --fp32-model`.

A greedy flip between two correct bf16 engines is expected where the two tokens' logprobs are closer than the
engines' own error against the exact model (on the tiny random model a correct engine is up to ~0.4 nats off fp32
at single tokens), so such a flip cannot be blamed on either run by comparing the runs with each other; their
distance from fp32 can. fp32_verdict() states the criteria.

With an FP8 KV cache every cached value is rounded to e4m3, so FP8 runs are judged by their distance from fp32 alone:
fp8_no_worse() compares two runs' mean |logprob - fp32| (the engine test's FP8 cases).
"""
from __future__ import annotations

# ours' mean |logprob - fp32| may exceed the reference's by this factor + slack.
FP32_ERR_RATIO = 1.5
FP32_ERR_SLACK = 0.005
# FP8 KV caches: "no worse than the reference" = ours' mean |logprob - fp32| <= FP8_ERR_RATIO x the reference's +
# FP8_ERR_SLACK. The allowance is for the spread between two correct runs, which comes from the different tokens each
# run teacher-forces after a near-tie flip (bf16, SGLang engine check on the tiny model: ours 0.0304 vs Triton 0.0282
# nats, 8 % apart); it stays below that spread.
FP8_ERR_RATIO = 1.05
FP8_ERR_SLACK = 0.005


class Fp32Oracle:
    """The checkpoint in fp32 through transformers: the exact model the bf16 engines approximate."""

    def __init__(self, model_dir: str, prompts: list):
        import torch
        import transformers

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = self.model.to(self.device).eval()
        self.prompts = prompts

    def logprobs(self, i: int, tokens: list[int]):
        """fp32 log-softmax at every generated position of prompt i followed by `tokens`: [len(tokens), vocab]."""
        assert tokens, "logprobs of an empty continuation"
        ids = self.torch.tensor([list(self.prompts[i]) + list(tokens)], device=self.device)
        with self.torch.no_grad():
            logits = self.model(ids).logits[0, len(self.prompts[i]) - 1:-1]
        return self.torch.log_softmax(logits.float(), -1).cpu()

    def run_error(self, run: dict) -> list[float]:
        """|logprob the engine reported - fp32 logprob| of every token the run chose (teacher-forced on its own
        tokens, so every position counts, also after a divergence from another run)."""
        return [e for errs in self.prompt_errors(run) for e in errs]

    def prompt_errors(self, run: dict) -> list[list[float]]:
        """run_error() prompt by prompt: one list per prompt, in generation order (empty for a prompt without
        generated tokens)."""
        out = []
        for i, o in enumerate(run["outputs"]):
            if not o["token_ids"]:
                out.append([])
                continue
            lp = self.logprobs(i, o["token_ids"])
            out.append([abs(o["logprobs"][p][str(t)] - float(lp[p, t])) for p, t in enumerate(o["token_ids"])])
        return out

    def divergence(self, a: dict, ref: dict, i: int, first: int) -> dict:
        """fp32 logprobs of the two competing tokens where prompt i's runs first differ (shared context)."""
        x, y = a["outputs"][i]["token_ids"], ref["outputs"][i]["token_ids"]
        lp = self.logprobs(i, y[:first + 1])[first]
        return {"position": first, "lp_ours": float(lp[x[first]]), "lp_ref": float(lp[y[first]]),
                "fp32_gap": abs(float(lp[x[first]] - lp[y[first]])), "fp32_top": int(lp.argmax()),
                "ours_token": x[first], "ref_token": y[first]}


def fp32_verdict(oracle: Fp32Oracle, ours: dict, ref: dict, r: dict) -> bool:
    """Accuracy against the fp32 model instead of against the other engine:
      1. ours' mean |logprob - fp32| <= FP32_ERR_RATIO x the reference's (+ FP32_ERR_SLACK), and
      2. every divergence beyond the tie gap lies where the fp32 model's gap between the two tokens is within
         twice the largest error the reference engine itself shows (two bf16 engines, each that far off the
         exact model, can order such tokens either way),
    together with the pairwise figures (match fraction, mean and max |logprob diff| where they agree)."""
    e_ours, e_ref = oracle.run_error(ours), oracle.run_error(ref)
    m_ours, m_ref = sum(e_ours) / len(e_ours), sum(e_ref) / len(e_ref)
    noise = max(e_ref)
    print(f"[fp32 oracle] |logprob - fp32| of each run's chosen tokens: {ours['name']} mean "
          f"{m_ours:.4f} max {max(e_ours):.4f} ({len(e_ours)} tokens); {ref['name']} mean {m_ref:.4f} max "
          f"{noise:.4f} ({len(e_ref)} tokens)", flush=True)
    accurate = m_ours <= FP32_ERR_RATIO * m_ref + FP32_ERR_SLACK
    ties = True
    for i, first, _ in r["bad_divergences"]:
        v = oracle.divergence(ours, ref, i, first)
        near = v["fp32_gap"] <= 2 * noise
        ties = ties and near
        print(f"[fp32 oracle] fp32 view of prompt {i} token {v['position']}: logprob of ours' token {v['ours_token']} "
              f"{v['lp_ours']:.3f}, of the reference's {v['ref_token']} {v['lp_ref']:.3f}: gap {v['fp32_gap']:.3f} "
              f"{'<=' if near else '>'} 2 x {noise:.3f} (fp32 top token {v['fp32_top']})", flush=True)
    others = r["figures_ok"]
    ok = accurate and ties and others
    print(f"[fp32 oracle] fp32 verdict: ours as accurate as the reference ({m_ours:.4f} <= {FP32_ERR_RATIO} x "
          f"{m_ref:.4f} + {FP32_ERR_SLACK}): {accurate}; divergences within engine noise: {ties}; pairwise figures: "
          f"{others} -> {'AGREE' if ok else 'DISAGREE'}", flush=True)
    return ok


def shared_prefix_errors(a: dict, b: dict, errs_a: list[list[float]], errs_b: list[list[float]]
                         ) -> tuple[list[float], list[float]]:
    """The two runs' per-token errors (prompt_errors()) restricted to the tokens both chose, prompt by prompt up to
    the first position where their tokens differ. There both runs decode the same context, so what separates
    their errors is the two engines' arithmetic alone; after a difference each run teacher-forces its own text, and
    the mean over all tokens also carries which text each run happened to follow."""
    xa, xb = [], []
    for i, (oa, ob) in enumerate(zip(a["outputs"], b["outputs"])):
        ta, tb = oa["token_ids"], ob["token_ids"]
        n = next((p for p, (u, v) in enumerate(zip(ta, tb)) if u != v), min(len(ta), len(tb)))
        xa += errs_a[i][:n]
        xb += errs_b[i][:n]
    return xa, xb


def mean_error(errs: list[float]) -> float:
    if not errs:
        raise ValueError("no generated tokens to compare with the fp32 model")
    return sum(errs) / len(errs)


def fp8_no_worse(name: str, m_ours: float, ref_name: str, m_ref: float, ratio: float = FP8_ERR_RATIO,
                 slack: float = FP8_ERR_SLACK) -> bool:
    """Whether run `name`'s mean |logprob - fp32| is no worse than `ref_name`'s: m_ours <= ratio x m_ref + slack.
    Prints the comparison."""
    bound = ratio * m_ref + slack
    ok = m_ours <= bound
    rel = f" ({(m_ours / m_ref - 1) * 100:+.1f} %)" if m_ref > 0 else ""
    print(f"[fp32 oracle] {name} mean |logprob - fp32| {m_ours:.4f} vs {ref_name} {m_ref:.4f}{rel}: "
          f"{'<=' if ok else '>'} {ratio} x {m_ref:.4f} + {slack} = {bound:.4f} -> {'no worse' if ok else 'WORSE'}",
          flush=True)
    return ok
