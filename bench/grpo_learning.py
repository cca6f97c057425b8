"""GRPO that learns: TRL's GRPOTrainer and DualKVGRPOTrainer on the same task, side by side.

The task has a verifiable reward and a long shared prompt: each prompt is a few hundred to a few
thousand filler words (irrelevant to the answer) followed by a question ``question 3 7 + 4 8 =``;
the answer is the sum written least-significant digit first (``5 8`` for 85: the order in which a
left-to-right model can carry), then ``<eos>``. The reward gives credit per correct digit
(``matching positions / max(len(answer), len(completion))``, so 1.0 is an exact answer); the
exact-match rate is logged beside it (a reward function of weight 0). With ``num_generations``
completions per prompt, the prompt dominates the tokens of a group: rho is large.

1. A tiny Qwen3-shaped model (random init from a config, a word-level tokenizer of its own: no hub
   access) is fitted by a plain supervised loop on the task's format (prompt lengths drawn up to
   ``--prompt-len``) until its *sampled* exact-match rate (temperature 1) on full-length prompts
   reaches ``--warmup-target``: above zero, far from perfect, so GRPO's group advantages are not
   all zero. (The sums are learnt in a sudden drop of the loss after a long plateau; the target
   stops the warm-up early in that drop.)
2. GRPO runs for ``--steps`` steps twice from that model, with the same seed and data: TRL's
   ``GRPOTrainer`` (SDPA on the padded rows) and ``DualKVGRPOTrainer`` (packed prompt groups).
   Generation is transformers' ``model.generate`` with SDPA in both, so the first step's
   completions, and hence its rewards, are the same; afterwards the runs drift apart by rounding
   (in float32 they stay equal for many steps; in bf16 they part sooner, and the reward curves
   then agree within their sampling noise).
3. Per step: mean reward, exact-match rate, loss, gradient norm, step time and its generation
   part (the rest is the trainer's log-prob passes, loss, backward and optimizer step; DualKV
   changes only that part). Written to ``--out``: ``grpo_learning.json`` (both curves and the
   settings) and ``grpo_learning.png`` (reward and step time per step, both trainers; needs
   matplotlib, else ``--plot JSON`` later). The summary printed last: reward over the first and
   last 10 steps, median step / generation / rest times, the last-20-step reward gap against its
   standard error, and DualKV's speed-up of the step and of the rest.

    python bench/grpo_learning.py --preset toy --out /tmp/grpo-toy        # CPU, seconds
    python bench/grpo_learning.py --preset cpu --out /tmp/grpo-cpu        # CPU, ~5 min
    python bench/grpo_learning.py --preset gpu --out .out/grpo-learning   # one H200

On the GPU machine trl and datasets are carried as wheels (``.whl/trl``: see bench/trl_grpo.py's
docstring; ``scripts/gpu_check.sh learn`` installs them and runs the gpu preset).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_grpo import timing_subclass  # noqa: E402  (bench/trl_grpo.py)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
DIGITS = [str(d) for d in range(10)]
QUESTION = "question"
FILLER = (
    "the a of and to in is it on was for as with by at from this that are be or an not but all "
    "can had her one our out day get has him his how man new now old see two way who boy did its"
).split()
VOCAB = [PAD, EOS, UNK, *DIGITS, "+", "=", QUESTION, *FILLER]

# Each preset fills the options left unset. "toy": the CPU test (seconds); "cpu": a CPU learning
# check (~5 min on 2 free cores); "gpu": one H200, a few minutes. GRPO's learning rate is a tenth
# of the warm-up's, ramped up over 10 steps (--lr-warmup): on the cpu preset a third of it made
# the reward fall (2 seeds of 2), so did a tenth without the ramp (1 of 2).
PRESETS: dict[str, dict[str, Any]] = {
    "toy": dict(
        hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64, digits=2,
        prompt_len=40, warmup_steps=30, warmup_batch=16, warmup_lr=2e-2, warmup_target=1.0,
        warmup_eval_every=30, eval_prompts=4, steps=3, prompts_per_step=2, num_generations=8,
        grad_accum=2, lr=1e-3, dtype="float32",
    ),
    "cpu": dict(
        hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, digits=2,
        prompt_len=24, warmup_steps=3000, warmup_batch=64, warmup_lr=3e-3, warmup_target=0.25,
        warmup_eval_every=50, eval_prompts=128, steps=100, prompts_per_step=4,
        num_generations=8, grad_accum=2, lr=3e-4, dtype="float32",
    ),
    "gpu": dict(
        hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1536, digits=2,
        prompt_len=2048, warmup_steps=3000, warmup_batch=32, warmup_lr=1e-3, warmup_target=0.25,
        warmup_eval_every=25, eval_prompts=64, steps=100, prompts_per_step=4,
        num_generations=16, grad_accum=2, lr=1e-4, dtype="bfloat16",
    ),
}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    p.add_argument("--out", default=None, help="folder for grpo_learning.json / .png")
    p.add_argument("--plot", default=None, metavar="JSON", help="only plot this JSON, then exit")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if any")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="trl,dualkv", help="comma list of trl, dualkv")
    g = p.add_argument_group("model (Qwen3 shape)")
    for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate"):
        g.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    g = p.add_argument_group("task")
    g.add_argument("--digits", type=int, default=None, help="digits per operand")
    g.add_argument("--prompt-len", type=int, default=None, help="filler + question tokens")
    g = p.add_argument_group("supervised warm-up")
    g.add_argument("--warmup-steps", type=int, default=None, help="at most this many steps")
    g.add_argument("--warmup-batch", type=int, default=None)
    g.add_argument("--warmup-lr", type=float, default=None)
    g.add_argument("--warmup-target", type=float, default=None,
                   help="stop once the sampled exact-match rate reaches this")  # fmt: skip
    g.add_argument("--warmup-eval-every", type=int, default=None)
    g.add_argument("--eval-prompts", type=int, default=None)
    g = p.add_argument_group("GRPO")
    g.add_argument("--steps", type=int, default=None)
    g.add_argument("--prompts-per-step", type=int, default=None)
    g.add_argument("--num-generations", type=int, default=None)
    g.add_argument("--grad-accum", type=int, default=None, help="micro-batches per step")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--lr-warmup", type=int, default=10, help="steps of linear learning-rate ramp")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="bfloat16: fp32 weights, bf16 autocast (TRL's bf16=True)")  # fmt: skip
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# --- the task ---------------------------------------------------------------------------------
def question_len(digits: int) -> int:
    return 2 * digits + 3  # "question", the operands' digits, "+", "="


def completion_len(digits: int) -> int:
    return digits + 2  # the sum has at most digits + 1 digits, then <eos>


def make_example(rng: random.Random, digits: int, prompt_len: int) -> tuple[str, str]:
    """(prompt, answer) as space-separated tokens: filler words, then the question."""
    fill = prompt_len - question_len(digits)
    if fill < 1:
        raise ValueError(f"--prompt-len {prompt_len} leaves no room for filler")
    a, b = (rng.randrange(10 ** (digits - 1), 10**digits) for _ in range(2))
    words = rng.choices(FILLER, k=fill)
    prompt = " ".join([*words, QUESTION, *str(a), "+", *str(b), "="])
    return prompt, " ".join(reversed(str(a + b)))


def digit_credit(completion: str, answer: str) -> float:
    """Matching positions over the longer of the two token lists (1.0: exact)."""
    got, want = completion.split(), answer.split()
    return sum(g == w for g, w in zip(got, want)) / max(len(got), len(want))


def reward_digits(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    return [digit_credit(c, a) for c, a in zip(completions, answer, strict=True)]


def reward_exact(completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    return [float(c.split() == a.split()) for c, a in zip(completions, answer, strict=True)]


def make_tokenizer() -> Any:
    """A WordLevel tokenizer over :data:`VOCAB`, split on spaces (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )


def make_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, tie_word_embeddings=True,
        max_position_embeddings=args.prompt_len + completion_len(args.digits),
        pad_token_id=VOCAB.index(PAD), eos_token_id=VOCAB.index(EOS),
        bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


# --- supervised warm-up ------------------------------------------------------------------------
def autocast(args: argparse.Namespace) -> Any:
    return torch.autocast(args.device, torch.bfloat16, enabled=args.dtype == "bfloat16")


def sampled_rewards(
    model: Any, tok: Any, examples: list[tuple[str, str]], args: argparse.Namespace
) -> tuple[float, float]:
    """(digit credit, exact-match rate) of one sampled completion (temperature 1) per prompt."""
    model.eval()
    ids = tok([p for p, _ in examples], return_tensors="pt")["input_ids"].to(args.device)
    with torch.no_grad(), autocast(args):
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
            top_k=0, top_p=1.0, max_new_tokens=completion_len(args.digits),
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
    model.train()
    texts = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    answers = [a for _, a in examples]
    digits, exact = reward_digits(texts, answers), reward_exact(texts, answers)
    return statistics.fmean(digits), statistics.fmean(exact)


def warm_up(model: Any, tok: Any, args: argparse.Namespace, out: Any) -> dict[str, Any]:
    """Supervised steps on the answers (loss on answer and <eos> only) until the sampled
    exact-match rate on ``args.eval_prompts`` prompts of the full length reaches
    ``args.warmup_target`` or ``args.warmup_steps`` are done."""
    rng = random.Random(args.seed + 1)  # GRPO's prompts come from seed + 2
    examples = [make_example(rng, args.digits, args.prompt_len) for _ in range(args.eval_prompts)]
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, weight_decay=0.0)
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50))
    log: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step = 0
    while step < args.warmup_steps:
        step += 1
        # each batch's prompt length is drawn up to --prompt-len: short prompts teach the sums
        # quickly, long ones to find the question behind the filler
        length = rng.randint(question_len(args.digits) + 1, args.prompt_len)
        width = length + completion_len(args.digits)
        ids = torch.full((args.warmup_batch, width), tok.pad_token_id, dtype=torch.int64)
        labels = torch.full_like(ids, -100)
        texts = []
        for _ in range(args.warmup_batch):
            prompt, answer = make_example(rng, args.digits, length)
            texts.append(f"{prompt} {answer} {EOS}")
        for i, row in enumerate(tok(texts)["input_ids"]):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, length : len(row)] = ids[i, length : len(row)]
        with autocast(args):
            loss = model(input_ids=ids.to(args.device), labels=labels.to(args.device)).loss
        loss.backward()
        opt.step()
        ramp.step()
        opt.zero_grad(set_to_none=True)
        if step % args.warmup_eval_every == 0 or step == args.warmup_steps:
            digits, exact = sampled_rewards(model, tok, examples, args)
            log.append(dict(step=step, loss=loss.item(), reward=digits, exact=exact))
            seconds = time.perf_counter() - t0
            print(f"warm-up step {step:5d}: loss {loss.item():.4f}, sampled reward {digits:.3f}, "
                  f"exact {exact:.3f} ({seconds:.0f} s)", file=out, flush=True)  # fmt: skip
            if exact >= args.warmup_target:
                break
        elif step == 1:
            log.append(dict(step=step, loss=loss.item()))
    model.cpu()
    return {"steps": step, "seconds": time.perf_counter() - t0, "log": log}


# --- GRPO runs ---------------------------------------------------------------------------------
@dataclasses.dataclass
class StepLog:
    step: int
    reward: float  # mean digit credit of the step's completions
    exact: float  # exact-match rate
    loss: float
    grad_norm: float
    step_time: float  # seconds from the step's start to its optimizer step
    gen_time: float  # of which: generation (model.generate)
    completion_len: float
    token_reduction: float | None  # DualKV: rows' tokens / packed tokens


def grpo_data(args: argparse.Namespace) -> Any:
    from datasets import Dataset

    rng = random.Random(args.seed + 2)
    n = args.steps * args.prompts_per_step
    rows = [make_example(rng, args.digits, args.prompt_len) for _ in range(n)]
    return Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})


def run_trainer(mode: str, args: argparse.Namespace, model_dir: str, data: Any) -> list[StepLog]:
    from transformers import PrinterCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    from dualkv.integrations.trl import DualKVGRPOTrainer

    timed, clock_cls = timing_subclass(DualKVGRPOTrainer if mode == "dualkv" else GRPOTrainer)
    rows = args.prompts_per_step * args.num_generations
    if rows % args.grad_accum:
        raise SystemExit("prompts-per-step * num-generations must be a multiple of grad-accum")
    cfg = GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), f"dualkv-grpo-learning-{mode}"),
        per_device_train_batch_size=rows // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
        max_completion_length=completion_len(args.digits), max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant_with_warmup",
        warmup_steps=args.lr_warmup, beta=0.0, loss_type="dapo", temperature=1.0, top_k=0,
        top_p=1.0, reward_weights=[1.0, 0.0], report_to=[], logging_steps=1, save_strategy="no",
        use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", seed=args.seed,
        model_init_kwargs={"attn_implementation": "sdpa", "dtype": torch.float32},
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    set_seed(args.seed)
    trainer = timed(
        model=model_dir, reward_funcs=[reward_digits, reward_exact], args=cfg,
        train_dataset=data, processing_class=make_tokenizer(),
    )  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts: summarized below instead
    clock = clock_cls()
    clock.trainer = trainer
    trainer.add_callback(clock)
    set_seed(args.seed)  # both runs sample from the same random state
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    out = []
    for i, (h, (st, gen)) in enumerate(zip(logs, clock.times, strict=True)):
        out.append(StepLog(
            step=i + 1, reward=float(h["reward"]), exact=float(h["rewards/reward_exact/mean"]),
            loss=float(h["loss"]), grad_norm=float(h["grad_norm"]), step_time=st, gen_time=gen,
            completion_len=float(h["completions/mean_length"]),
            token_reduction=h.get("dualkv/token_reduction"),
        ))  # fmt: skip
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


# --- summary and plot --------------------------------------------------------------------------
def window_mean(values: list[float], first: bool, k: int = 10) -> float:
    part = values[:k] if first else values[-k:]
    return statistics.fmean(part)


def summarize(runs: dict[str, list[StepLog]]) -> dict[str, Any]:
    """Per trainer: reward over the first and last 10 steps, median step and train times; and,
    with both, the last-20-step reward gap against its noise (standard error of the difference)."""
    summary: dict[str, Any] = {}
    for mode, logs in runs.items():
        rewards = [s.reward for s in logs]
        summary[mode] = {
            "reward_first10": window_mean(rewards, True),
            "reward_last10": window_mean(rewards, False),
            "exact_first10": window_mean([s.exact for s in logs], True),
            "exact_last10": window_mean([s.exact for s in logs], False),
            # the first step runs the first calls (allocations, kernel selection): left out
            "median_step_s": statistics.median(s.step_time for s in logs[1:] or logs),
            "median_train_s": statistics.median(s.step_time - s.gen_time for s in logs[1:] or logs),
            "median_gen_s": statistics.median(s.gen_time for s in logs[1:] or logs),
        }
    if {"trl", "dualkv"} <= runs.keys():
        a = [s.reward for s in runs["trl"]][-20:]
        b = [s.reward for s in runs["dualkv"]][-20:]
        se = (statistics.pvariance(a) / len(a) + statistics.pvariance(b) / len(b)) ** 0.5
        summary["last20_reward_gap"] = statistics.fmean(b) - statistics.fmean(a)
        summary["last20_gap_noise"] = se
        summary["step1_reward_diff"] = runs["dualkv"][0].reward - runs["trl"][0].reward
        t, d = summary["trl"], summary["dualkv"]
        summary["step_speedup"] = t["median_step_s"] / d["median_step_s"]
        summary["train_speedup"] = t["median_train_s"] / d["median_train_s"]
    return summary


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # TRL wide and solid, DualKV narrow and dashed on top: where the curves agree both show
    style = {"trl": dict(color="tab:blue", lw=3.0), "dualkv": dict(color="tab:orange", lw=1.5)}
    names = {"trl": "TRL GRPOTrainer (SDPA rows)", "dualkv": "DualKVGRPOTrainer (packed)"}
    fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    for mode, logs in result["runs"].items():
        steps = [s["step"] for s in logs]
        rewards = [s["reward"] for s in logs]
        smooth = [statistics.fmean(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
        dash = "--" if mode == "dualkv" else "-"
        ax_r.plot(steps, rewards, color=style[mode]["color"], alpha=0.3, lw=0.8)
        ax_r.plot(steps, smooth, ls=dash, label=f"{names[mode]}, 10-step mean", **style[mode])
        ax_t.plot(steps, [s["step_time"] for s in logs], ls=dash, label=f"{names[mode]}: step",
                  **style[mode])  # fmt: skip
        ax_t.plot(steps, [s["step_time"] - s["gen_time"] for s in logs], ls=":", alpha=0.8,
                  color=style[mode]["color"], lw=1.5,
                  label=f"{names[mode]}: step minus generation")  # fmt: skip
    a = result["args"]
    ax_r.set(xlabel="GRPO step", ylabel="reward (digit credit)", ylim=(0, 1.02),
             title=f"reward, {a['prompts_per_step']} prompts x {a['num_generations']} "
             f"completions per step")  # fmt: skip
    ax_t.set(xlabel="GRPO step", ylabel="seconds", ylim=(0, None),
             title=f"step time ({result['device']}, prompt {a['prompt_len']} tokens)")  # fmt: skip
    for ax in (ax_r, ax_t):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(result: dict[str, Any], out: Any) -> None:
    runs, summary = result["runs"], result["summary"]
    modes = list(runs)
    print(f"{'step':>4} " + " ".join(f"{m + ' reward':>14} {m + ' exact':>12} {m + ' step s':>13} "
                                     f"{m + ' gen s':>12}" for m in modes), file=out)  # fmt: skip
    n = max(len(r) for r in runs.values())
    for i in sorted({0, 1, n - 1} | set(range(9, n, 10))):
        cells = []
        for m in modes:
            s = runs[m][i] if i < len(runs[m]) else None
            cells.append(f"{s['reward']:14.3f} {s['exact']:12.3f} {s['step_time']:13.3f} "
                         f"{s['gen_time']:12.3f}" if s else " " * 54)  # fmt: skip
        print(f"{i + 1:4d} " + " ".join(cells), file=out)
    for m in modes:
        s = summary[m]
        print(f"{m}: reward {s['reward_first10']:.3f} (first 10 steps) -> {s['reward_last10']:.3f} "
              f"(last 10), exact {s['exact_first10']:.3f} -> {s['exact_last10']:.3f}; median step "
              f"{s['median_step_s']:.3f} s = generation {s['median_gen_s']:.3f} s + rest "
              f"{s['median_train_s']:.3f} s", file=out)  # fmt: skip
    if "step_speedup" in summary:
        print(f"step-1 reward diff {summary['step1_reward_diff']:.3g} (same generations); "
              f"last-20-step reward gap dualkv - trl {summary['last20_reward_gap']:+.3f} "
              f"(noise: standard error {summary['last20_gap_noise']:.3f}); DualKV step "
              f"{summary['step_speedup']:.2f}x faster, step minus generation "
              f"{summary['train_speedup']:.2f}x", file=out)  # fmt: skip


def save(result: dict[str, Any], folder: str | None) -> str:
    """Write ``result`` to ``folder/grpo_learning.json`` (nothing without a folder); its path."""
    if not folder:
        return ""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "grpo_learning.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


def run(argv: list[str] | None = None, out: Any = None) -> dict[str, Any]:
    out = out or sys.stdout
    args = parse(argv)
    if args.plot:
        with open(args.plot) as f:
            saved: dict[str, Any] = json.load(f)
        plot(saved, os.path.splitext(args.plot)[0] + ".png")
        return saved
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"trl", "dualkv"}:
        raise SystemExit(f"--modes: trl and/or dualkv, got {args.modes!r}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    # Generation runs on the float32 weights outside autocast (TRL's bf16=True, both trainers):
    # TF32 matmuls there, as training's own matmuls are bf16.
    if args.device == "cuda":
        torch.set_float32_matmul_precision("high")
    tok = make_tokenizer()
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    print(f"GRPO learning run ({args.preset}) on {device}: Qwen3 shape, {params / 1e6:.2f}M params "
          f"({args.layers} layers, hidden {args.hidden}); prompt {args.prompt_len} tokens, "
          f"{args.digits}-digit sums, {args.prompts_per_step} prompts x {args.num_generations} "
          f"completions per step, {args.steps} steps, {args.dtype}", file=out)  # fmt: skip
    warm = warm_up(model, tok, args, out)
    result: dict[str, Any] = {"args": vars(args), "device": device, "params": params,
                              "warmup": warm, "runs": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        data = grpo_data(args)
        for mode in modes:
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            logs = run_trainer(mode, args, folder, data)
            seconds = time.perf_counter() - t0
            result["runs"][mode] = [dataclasses.asdict(s) for s in logs]
            peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else None
            result.setdefault("peak_gib", {})[mode] = peak
            memory = f", peak GPU memory {peak:.1f} GiB" if peak is not None else ""
            print(f"{mode}: {len(logs)} steps in {seconds:.0f} s{memory}", file=out, flush=True)
            save(result, args.out)  # each run as it ends: a run cut short keeps the ones before
    result["summary"] = summarize(
        {m: [StepLog(**s) for s in logs] for m, logs in result["runs"].items()}
    )
    if args.out:
        path = save(result, args.out)
        try:
            plot(result, os.path.join(args.out, "grpo_learning.png"))
        except ImportError:
            print(f"matplotlib not installed: no plot (later: --plot {path})", file=out)
    report(result, out)
    return result


if __name__ == "__main__":
    run()
