"""A tiny deterministic HF Trainer run checkpointing through ucl (run as a child by test_hf_trainer.py).

    python hf_driver.py OUTDIR OUT [--kill-at STEP] [--resume]

A 2-layer Llama built from its config (no download) on random tokens; a checkpoint every 3 steps.
With --kill-at it writes OUTDIR/killme once global_step reaches STEP and blocks for the parent's
SIGKILL; with --resume it trains with resume_from_checkpoint=True. At the end it writes the final
parameters and optimizer state to OUT (torch.save).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    TrainerCallback,
    TrainingArguments,
    set_seed,  # noqa: E402
)

from ucl.adapters.hf import UclTrainer  # noqa: E402

MAX_STEPS, EVERY = 10, 3


class KillAt(TrainerCallback):
    def __init__(self, root: str, step: int) -> None:
        self.root, self.step = root, step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            from ucl.adapters.hf import latest_step

            while (latest_step(os.path.join(self.root, "ucl")) or 0) < self.step - self.step % EVERY:
                time.sleep(0.05)  # "after some checkpoints": the last one before STEP is committed
            with open(os.path.join(self.root, "killme"), "w") as f:
                f.write(str(state.global_step))
            time.sleep(120)  # the parent SIGKILLs us here


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("out")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    a = ap.parse_args()
    set_seed(0)
    cfg = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 101, (16, 12), generator=g)]
    args = TrainingArguments(output_dir=a.outdir, max_steps=MAX_STEPS, per_device_train_batch_size=4,
                             save_strategy="steps", save_steps=EVERY, save_total_limit=2, logging_steps=1,
                             report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True,
                             learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=2)
    cbs = [KillAt(a.outdir, a.kill_at)] if a.kill_at is not None else []
    trainer = UclTrainer(model=model, args=args, train_dataset=data, callbacks=cbs)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": trainer.optimizer.state_dict(), "global_step": trainer.state.global_step}, a.out)


if __name__ == "__main__":
    sys.exit(main())
