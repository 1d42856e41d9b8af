"""Tuning probe: which task, reward and lr make GRPO's mean reward rise clearly in few steps?

A single-process, plain-PyTorch GRPO loop on the embedded tiny Qwen3-MoE (fp32, one thread): per step
``train_batch_size`` prompts from PromptSampler, ``n`` sampled responses each (HF generate), rule reward,
GRPO advantages, one PPO-clip update (token-mean) with Adam. No Megatron: it sizes the real run's settings.

    .venv/bin/python -m probes.grpo_task_probe --max-operand 4 --lr 3e-3 --steps 60 --out /tmp/probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time

import numpy as np
import torch

from verl.models.tiny import make_tiny_hf_model
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_policy_loss
from verl.trainer.ppo.ray_trainer import response_text
from verl.utils.dataset import arithmetic
from verl.utils.dataset.arithmetic import PromptSampler, make_arithmetic_dataset, prompt_length
from verl.utils.reward_score.arithmetic import compute_score
from verl.utils.torch_functional import logprobs_from_logits, masked_mean

EOS_ID, PAD_ID = 2, 0
TASKS = {**arithmetic.TASKS, "max": max}  # max: a probe-only rule (its skewed answers reward a constant guess)


def retarget(rows: list[dict], task: str) -> list[dict]:
    """Same "a+b=" prompts, the ground truth replaced by ``task``'s rule (add keeps the sum)."""
    out = []
    for row in rows:
        a, b = int(row["prompt"][0]), int(row["prompt"][2])
        out.append({**row, "ground_truth": str(TASKS[task](a, b))})
    return out


def decode_response(tokenizer, ids: list[int]) -> str:
    """The trainer's reading of a response: one character per token, unknown ids as U+FFFD."""
    return response_text(tokenizer, ids)


def shaped_score(kind: str, text: str, ground_truth: str, format_score: float, score: float) -> float:
    """The reward variants under test. leading: ``compute_score`` (the leading integer must equal the answer);
    prefix: the response must start with the answer's digits (what follows is free); distance: ``score`` for the
    right leading integer, else ``format_score * max(0, 1 - |pred - answer| / 10)``, a dense signal towards it."""
    if kind == "leading":
        return compute_score(text, ground_truth, format_score=format_score, score=score)
    if kind == "exact":
        # the whole response (its EOS is not part of the text) must be the answer
        if text == ground_truth:
            return score
        return format_score if re.match(r"\d+", text) else 0.0
    stripped = text.lstrip()
    if kind == "prefix":
        if stripped.startswith(ground_truth):
            return score
        return format_score if stripped[:1].isdigit() else 0.0
    if kind == "distance":
        match = re.match(r"\d+", stripped)
        if match is None:
            return 0.0
        distance = abs(int(match.group()) - int(ground_truth))
        return score if distance == 0 else format_score * max(0.0, 1.0 - distance / 10)
    raise ValueError(f"unknown reward {kind!r}; use leading, prefix or distance")


def cut_after_eos(responses: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad responses to ``response_length``; mask keeps tokens up to and including the first EOS."""
    padded = torch.full((responses.shape[0], response_length), PAD_ID, dtype=responses.dtype)
    padded[:, : responses.shape[1]] = responses
    is_eos = padded == EOS_ID
    before_eos = (is_eos.long().cumsum(dim=-1) - is_eos.long()) == 0
    return torch.where(before_eos, padded, torch.full_like(padded, PAD_ID)), before_eos.float()


def run(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = make_tiny_hf_model(tempfile.mkdtemp(prefix="grpo_probe_"), kind="moe", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rows = retarget(make_arithmetic_dataset(seed=args.seed, max_operand=args.max_operand), args.task)
    plen = prompt_length(rows)
    sampler = PromptSampler(rows, batch_size=args.train_batch_size, seed=args.seed)
    torch.manual_seed(args.seed)
    history = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = [row for row in sampler.next_batch() for _ in range(args.n)]
        prompts = torch.tensor([tokenizer(row["prompt"])["input_ids"] for row in batch])
        assert prompts.shape[1] == plen
        model.eval()
        with torch.no_grad():
            out = model.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.response_length,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=EOS_ID,
                pad_token_id=PAD_ID,
            )
        responses, mask = cut_after_eos(out.sequences[:, plen:], args.response_length)
        gen_logits = torch.stack(out.logits, dim=1)
        old_log_prob = torch.zeros_like(mask)
        old_log_prob[:, : gen_logits.shape[1]] = logprobs_from_logits(gen_logits, responses[:, : gen_logits.shape[1]])
        t_gen = time.perf_counter()

        texts = [decode_response(tokenizer, r[m.bool()].tolist()) for r, m in zip(responses, mask, strict=True)]
        scores = [
            shaped_score(args.reward, text, row["ground_truth"], args.format_score, args.score)
            for text, row in zip(texts, batch, strict=True)
        ]
        # accuracy is always the strict rule (leading integer == answer), whatever reward trained
        correct = [compute_score(text, row["ground_truth"]) == 1.0 for text, row in zip(texts, batch, strict=True)]
        starts_right = [text.lstrip().startswith(row["ground_truth"]) for text, row in zip(texts, batch, strict=True)]
        token_level_rewards = torch.zeros_like(mask)
        last = mask.sum(dim=-1).long() - 1
        token_level_rewards[torch.arange(len(batch)), last] = torch.tensor(scores)
        index = np.repeat(np.arange(args.train_batch_size), args.n)
        advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, mask, index)

        model.train()
        sequences = torch.cat([prompts, responses], dim=1)
        logits = model(input_ids=sequences).logits[:, plen - 1 : -1]
        log_prob = logprobs_from_logits(logits, responses)
        rollout_diff = ((log_prob.detach() - old_log_prob).abs() * mask).max().item()
        pg_loss, clipfrac, ppo_kl, _ = compute_policy_loss(old_log_prob, log_prob, advantages, mask, cliprange=0.2)
        optimizer.zero_grad()
        pg_loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        t_end = time.perf_counter()
        record = {
            "step": step,
            "critic/score/mean": float(np.mean(scores)),
            "accuracy": float(np.mean(correct)),
            "accuracy_prefix": float(np.mean(starts_right)),
            "digit_first": float(np.mean([t.lstrip()[:1].isdigit() for t in texts])),
            "response_length/mean": masked_mean(torch.ones_like(mask), mask, axis=-1)
            .mul(args.response_length)
            .mean()
            .item(),
            "actor/pg_loss": pg_loss.item(),
            "actor/grad_norm": grad_norm,
            "actor/entropy_proxy": -masked_mean(old_log_prob, mask).item(),
            "rollout_logprob_max_diff": rollout_diff,
            "timing/gen": t_gen - t0,
            "timing/step": t_end - t0,
            "sample": texts[0],
        }
        history.append(record)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")
        if args.verbose:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}), flush=True)
    # final evaluation on every distinct prompt: greedy answer + a few samples at the training temperature
    model.eval()
    prompts = torch.tensor([tokenizer(row["prompt"])["input_ids"] for row in rows])
    final = {}
    with torch.no_grad():
        greedy = model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                max_new_tokens=args.response_length, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
        rep = prompts.repeat_interleave(4, dim=0)
        sampled = model.generate(rep, attention_mask=torch.ones_like(rep), do_sample=True,
                                 temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.response_length,
                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    g_resp, g_mask = cut_after_eos(greedy[:, plen:], args.response_length)
    s_resp, s_mask = cut_after_eos(sampled[:, plen:], args.response_length)
    g_texts = [decode_response(tokenizer, r[m.bool()].tolist()) for r, m in zip(g_resp, g_mask, strict=True)]
    s_texts = [decode_response(tokenizer, r[m.bool()].tolist()) for r, m in zip(s_resp, s_mask, strict=True)]
    for i, row in enumerate(rows):
        final[row["prompt"]] = {"gt": row["ground_truth"], "greedy": g_texts[i], "samples": s_texts[4 * i : 4 * i + 4]}
    run.final = final
    return history


def summarize(history: list[dict], window: int = 10) -> dict:
    first, last = history[:window], history[-window:]
    mean = lambda recs, key: round(float(np.mean([r[key] for r in recs])), 3)  # noqa: E731
    first_above = next((r["step"] for r in history if r["accuracy"] > 0.5), None)
    final = getattr(run, "final", {})
    greedy_ok = [compute_score(v["greedy"], v["gt"]) == 1.0 for v in final.values()]
    sample_ok = [compute_score(t, v["gt"]) == 1.0 for v in final.values() for t in v["samples"]]
    return {
        "first_step_acc_gt_0.5": first_above,
        "final_greedy_acc": round(float(np.mean(greedy_ok)), 3) if greedy_ok else None,
        "final_sample_acc": round(float(np.mean(sample_ok)), 3) if sample_ok else None,
        "final_distinct_greedy": len({v["greedy"] for v in final.values()}),
        "score_first": mean(first, "critic/score/mean"),
        "score_last": mean(last, "critic/score/mean"),
        "acc_first": mean(first, "accuracy"),
        "acc_last": mean(last, "accuracy"),
        "prefix_acc_first": mean(first, "accuracy_prefix"),
        "prefix_acc_last": mean(last, "accuracy_prefix"),
        "digit_first_last": mean(last, "digit_first"),
        "sec_per_step": mean(history[1:], "timing/step"),
        "max_rollout_logprob_diff": max(r["rollout_logprob_max_diff"] for r in history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-operand", type=int, default=9)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--task", choices=tuple(TASKS), default="add", help="answer rule for the a+b= prompts")
    parser.add_argument("--reward", choices=("leading", "prefix", "distance", "exact"), default="leading")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--show", type=int, default=12, help="print final greedy/samples for this many prompts")
    parser.add_argument("--format-score", type=float, default=0.1)
    parser.add_argument("--score", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-length", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="append one JSON line per step here")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    summary = summarize(run(args))
    for prompt, v in list(getattr(run, "final", {}).items())[: args.show]:
        print(f"  {prompt}{v['gt']:>3}  greedy={v['greedy']!r}  samples={v['samples']}")
    print(json.dumps({**{k: v for k, v in vars(args).items() if k not in ("out", "verbose")}, **summary}))


if __name__ == "__main__":
    main()
