"""A short real GRPO run with TRL's GRPOTrainer, with and without DualKV, side by side.

Both runs start from the same random model (saved to a temporary folder), the same dataset of
random-word prompts, the same reward and the same seed; generation is transformers' own
(``model.generate`` with SDPA) in both. Per step it prints the step time (and how much of it was
generation), TRL's logged loss and reward, and for DualKV the token reduction of its packed
passes; then how far the two runs' rewards and losses are apart. The first step's generations
are the same in both runs (same seed and sampling path), so its reward must agree exactly; later
steps agree as long as the two runs' parameters stay equal to sampling precision.

    python bench/trl_grpo.py --device cpu --model-preset tiny --steps 3
    bash scripts/gpu_check.sh build trl      # on the GPU machine: the Qwen3-0.6B-shaped run

The GPU image has accelerate, pandas and pyarrow but not trl, datasets, dill or multiprocess:
carry them as cp312 wheels in ``.whl/trl`` (about 2 MB)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl/trl trl==1.16.0 datasets==5.2.0 dill==0.4.1 \\
        multiprocess==0.70.19 fsspec==2026.9.0

(datasets 5.2.0 needs pyarrow >= 24 and fsspec <= 2026.9.0; if the image's pyarrow is older, add
``pyarrow==26.0.1``, a 55 MB wheel.)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch

from dualkv.demos.grpo_step import PRESETS as DEMO_PRESETS

PRESETS: dict[str, dict[str, Any]] = {
    # a tiny Qwen3 (runs in seconds on CPU; smaller than the demo's "tiny")
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    ),
    # Qwen3-0.6B's and Qwen3-1.7B's shapes (random weights): the demo's presets
    "qwen3-0.6b": DEMO_PRESETS["0.6b"],
    "qwen3-1.7b": DEMO_PRESETS["1.7b"],
}  # fmt: skip

PAD, EOS = 0, 1


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model-preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    p.add_argument("--prompts-per-step", type=int, default=2, help="prompt groups per step")
    p.add_argument("--num-generations", type=int, default=4, help="completions per prompt (N)")
    p.add_argument("--prompt-len", type=int, default=24, help="tokens per prompt (P)")
    p.add_argument("--max-completion-length", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no ref model)")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="trl,dualkv", help="comma list of trl, dualkv")
    p.add_argument("--json", default=None, help="also write the per-step results to this file")
    return p.parse_args(argv)


def make_model_dir(args: argparse.Namespace, folder: str) -> int:
    """A random Qwen3 of the preset's shape saved to ``folder``; returns the vocabulary size."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        max_position_embeddings=args.prompt_len + args.max_completion_length + 16,
        eos_token_id=EOS, pad_token_id=PAD, **PRESETS[args.model_preset],
    )  # fmt: skip
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        model.get_input_embeddings().weight[EOS] *= 3.0  # some completions end early
    model.save_pretrained(folder)
    return int(cfg.vocab_size)


def make_tokenizer(vocab_size: int) -> Any:
    """A WordLevel tokenizer over ``w3 .. w{V-1}`` (no hub access)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def reward_even(completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of completion words with an even id (a reward the policy can move)."""
    out = []
    for c in completions:
        words = [w for w in c.split() if w.startswith("w")]
        out.append(sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words)))
    return out


@dataclasses.dataclass
class StepLog:
    step: int
    step_time: float  # seconds from the step's first micro-batch to the optimizer step
    gen_time: float  # of which: generation (model.generate)
    loss: float
    reward: float
    token_reduction: float | None
    peak_gib: float | None = None  # the run's peak GPU memory (whole run: generation included)


def timing_subclass(base: type) -> type:
    """``base`` with wall-clock timing of generation and of each optimizer step."""
    from transformers import TrainerCallback

    class Timed(base):  # type: ignore[misc,valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.gen_seconds = 0.0

        def _generate(self, prompts: list) -> Any:
            sync()
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                sync()
                self.gen_seconds += time.perf_counter() - t0

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.times: list[tuple[float, float]] = []
            self.trainer: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            self.t0 = time.perf_counter()
            self.gen0 = self.trainer.gen_seconds

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            sync()
            gen = self.trainer.gen_seconds - self.gen0
            self.times.append((time.perf_counter() - self.t0, gen))

    return Timed, Clock


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(mode: str, args: argparse.Namespace, model_dir: str, vocab: int) -> list[StepLog]:
    from datasets import Dataset
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    from dualkv.integrations.trl import DualKVGRPOTrainer

    base = DualKVGRPOTrainer if mode == "dualkv" else GRPOTrainer
    Timed, Clock = timing_subclass(base)
    rng = random.Random(args.seed)
    n_prompts = args.prompts_per_step * args.steps
    prompts = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(args.prompt_len))
               for _ in range(n_prompts)]  # fmt: skip
    data = Dataset.from_dict({"prompt": prompts})
    rows_per_step = args.prompts_per_step * args.num_generations
    if rows_per_step % args.grad_accum:
        raise SystemExit("prompts-per-step * num-generations must be a multiple of grad-accum")
    dtype = getattr(torch, args.dtype)
    cfg = GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), f"dualkv-trl-grpo-{mode}"),
        per_device_train_batch_size=rows_per_step // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum, num_generations=args.num_generations,
        max_completion_length=args.max_completion_length, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=args.beta,
        loss_type=args.loss_type, temperature=args.temperature, report_to=[], logging_steps=1,
        save_strategy="no", use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16",
        seed=args.seed, gradient_checkpointing=args.gradient_checkpointing,
        model_init_kwargs={"attn_implementation": "sdpa", "dtype": dtype},
        shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    set_seed(args.seed)
    trainer = Timed(
        model=model_dir, reward_funcs=reward_even, args=cfg, train_dataset=data,
        processing_class=make_tokenizer(vocab),
    )  # fmt: skip
    clock = Clock()
    clock.trainer = trainer
    trainer.add_callback(clock)
    set_seed(args.seed)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    logs = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    out = []
    for i, (h, (st, gen)) in enumerate(zip(logs, clock.times, strict=True)):
        tr = h.get("dualkv/token_reduction")
        out.append(StepLog(i + 1, st, gen, float(h["loss"]), float(h["reward"]), tr, peak))
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def run(argv: list[str] | None = None, out: Any = None) -> dict[str, list[StepLog]]:
    out = out or sys.stdout
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in ("trl", "dualkv"):
            raise SystemExit(f"unknown mode {m!r}")
    results: dict[str, list[StepLog]] = {}
    with tempfile.TemporaryDirectory() as folder:
        vocab = make_model_dir(args, folder)
        dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"TRL GRPO, preset {args.model_preset} ({args.dtype}) on {dev}: "
              f"{args.prompts_per_step} prompts x N={args.num_generations} per step, "
              f"P={args.prompt_len}, completions <= {args.max_completion_length}, "
              f"{args.grad_accum} micro-batches, beta={args.beta}, loss {args.loss_type}",
              file=out)  # fmt: skip
        for mode in modes:
            results[mode] = run_mode(mode, args, folder, vocab)
    print(f"{'step':>4} {'mode':>7} {'step s':>8} {'gen s':>7} {'train s':>8} "
          f"{'loss':>12} {'reward':>9} {'rho':>6}", file=out)  # fmt: skip
    for i in range(args.steps):
        for mode in modes:
            if i >= len(results[mode]):
                continue
            s = results[mode][i]
            rho = f"{s.token_reduction:6.2f}" if s.token_reduction else "     -"
            print(f"{s.step:4d} {mode:>7} {s.step_time:8.3f} {s.gen_time:7.3f} "
                  f"{s.step_time - s.gen_time:8.3f} {s.loss:12.5g} {s.reward:9.5f} {rho}",
                  file=out)  # fmt: skip
    for mode in modes:
        if results[mode] and results[mode][0].peak_gib is not None:
            print(f"{mode}: peak GPU memory {results[mode][0].peak_gib:.2f} GiB", file=out)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": dev,
                       "runs": {m: [dataclasses.asdict(s) for s in r] for m, r in results.items()}},
                      f, indent=1)  # fmt: skip
    if {"trl", "dualkv"} <= results.keys():
        a, b = results["trl"], results["dualkv"]
        d_reward = [abs(x.reward - y.reward) for x, y in zip(a, b, strict=False)]
        d_loss = [abs(x.loss - y.loss) for x, y in zip(a, b, strict=False)]
        med = sorted((x.step_time - x.gen_time) / max(1e-9, y.step_time - y.gen_time)
                     for x, y in zip(a, b, strict=False))[len(a) // 2]  # fmt: skip
        print(f"agreement: step-1 reward diff {d_reward[0]:.3g} (same generations), max reward "
              f"diff {max(d_reward):.3g}, max loss diff {max(d_loss):.3g}; median train-time "
              f"(step - generation) ratio trl/dualkv {med:.2f}x", file=out)  # fmt: skip
    return results


if __name__ == "__main__":
    run()
