"""GRPO for GLM-Image, in one file.

    pip install -r requirements.txt
    python grpo_glm.py --steps 10                        # tiny GLM-Image (see below), CPU, ~20 s
    python grpo_glm.py --steps 40 --out runs/demo        # long enough to see the red block drawn
    python grpo_glm.py --resume latest --out runs/demo --steps 60
    python grpo_glm.py --reward my_rewards.py:score --report-to tensorboard   # your reward, watched in TensorBoard
    python grpo_glm.py --model zai-org/GLM-Image --lora-rank 64 --height 512 --width 512
    python grpo_glm.py --plan --model zai-org/GLM-Image --height 1024 --width 1024   # memory plan, no GPU
    python grpo_glm.py --policy dit --steps 150 --inner-epochs 1 --group-size 8      # Flow-GRPO on the DiT
    torchrun --nproc_per_node 8 grpo_glm.py --prompts-per-step 8 ...   # 8 GPUs, same flags (section 21)

GLM-Image is a hybrid: an autoregressive (AR) transformer writes a grid of discrete image tokens,
and a diffusion transformer (DiT) paints pixels conditioned on those tokens. We treat the AR
model as the policy pi_theta and the DiT + VAE as a frozen, deterministic "renderer":

    prompt --AR samples tokens y ~ pi_theta(.|prompt)--> y --DiT+VAE--> image --reward--> r

GRPO (Group Relative Policy Optimization, Shao et al. 2024, DeepSeekMath) needs no value
network: for each prompt it samples a *group* of G answers, and each answer's advantage is its
reward standardised within the group, A_i = (r_i - mean(r)) / (std(r) + eps). The policy is
then pushed up on better-than-average samples with PPO's clipped surrogate (Schulman et al.
2017), optionally with a KL penalty towards the initial model.
--policy dit|both trains the other half too (Part II): the DiT becomes a policy over denoising
steps (Flow-GRPO), scored by the same advantage and loss functions.

`--model tiny` (the default) is GLM-Image at toy size, built from the real classes: a random AR
(GRPO trains its output layer, --ar-trainable; section 2 says why), and a renderer that paints
what its tokens say. A random DiT + VAE would paint colour noise
whatever the tokens, and nothing GRPO does would show in the pictures; so on first use the DiT
is pre-trained (7 s on 2 free cores) on a synthetic task, token grid -> its colour mosaic (codebook id k
paints the k-th of the demo's 8 colours, mod 8), the VAE decoder is set to paint its latent's
colour, and the pipeline is saved with save_pretrained to ~/.cache/grpo_glm (or $GRPO_GLM_CACHE,
or $XDG_CACHE_HOME/grpo_glm) and loaded back with from_pretrained, like any local checkpoint.
Learning what to paint from the prompt stays GRPO's job (section 20, tiny_pipeline_dir).

Reading map. The file reads in three parts:
    Part I   GRPO on the AR, in the order a step runs (one contiguous read, stop there and you have
             seen a whole run): 1. settings  2. model  3. prompts and targets  4. SAMPLE  5. DECODE
             6. REWARD  7. ADVANTAGE  8. log-probs  9. loss  10. UPDATE  11. the step and train().
    Part II  Flow-GRPO on the DiT (--policy dit|both): 12. the SDE step, DiT rollout and loss
             13. the DiT's step. It reuses Part I's advantage, loss and update functions.
    Part III plumbing, "skip on first read": 14. starting a run and flag checks  15. prompt files
             and images  16. reward plug-ins  17. LOG  18. Ctrl+C / SIGTERM  19. CHECKPOINT
             20. the tiny model's renderer  21. torchrun and --fsdp  22. memory plan  23. saving.
The pure functions (mse_reward, group_advantages, token_logprobs, grpo_loss) use no globals:
copy them out freely.
"""

import argparse
import contextlib
import copy
import datetime
import functools
import gc
import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import random
import re
import signal
import sys
import time
import traceback
import unicodedata
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw, ImageOps, UnidentifiedImageError

CHECKPOINT_FORMAT = "grpo_glm-checkpoint-v2"   # v2: + lr schedule, DiT weights (--policy)
TINY = "tiny"


class UsageError(Exception):
    """Bad input from the user: printed as one line on stderr, exit code 2, no traceback. Under
    torchrun every rank checks the same input and stops on the same error: rank 0 alone prints it,
    unless it is local to a rank (`local=True`: a reward failing on that rank's images), which
    that rank prints with its number."""

    def __init__(self, message, local=False):
        super().__init__(message)
        self.local = local


# #############################################################################################
# PART I. GRPO on the autoregressive half: one contiguous read, from the flags to the training loop
# #############################################################################################
# The AR model is the policy; DiT + VAE render its tokens. Stop at the end of this part and you
# have seen a whole run: sample, decode, reward, advantage, log-probs, loss, update, the loop.


# =============================================================================================
# 1. Settings
# =============================================================================================
# Flags that change what the algorithm computes. Resuming with different values would splice
# two different runs into one log, so --resume refuses them (unless --resume-force).

ALGORITHM_FLAGS = (
    "mode", "model", "prompts_sha256", "seed", "group_size", "prompts_per_step", "inner_epochs", "lr",
    "max_grad_norm", "clip_eps", "beta", "temperature", "height", "width", "num_inference_steps",
    "guidance_scale", "dit_noise", "loss_tokens", "lora_rank", "lora_alpha", "ar_trainable", "dtype",
    "reward", "weight_decay", "lr_scheduler", "lr_warmup_steps",
    "policy", "dit_lr", "dit_clip_eps", "dit_noise_level", "dit_train_steps", "dit_lora_rank", "dit_prior",
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="GRPO fine-tuning of GLM-Image's autoregressive model against image rewards (MSE to a "
                    "target by default, or your own --reward plug-ins).",
        formatter_class=HelpFormatter,
    )
    a = p.add_argument
    a("--mode", choices=["t2i", "i2i"], default="t2i", help="t2i: text to image; i2i: edit a source image "
      "(each prompt line then names a source too, see --prompts).")
    a("--model", default=TINY, help="'tiny' builds a small random-weight GLM-Image from the real classes; "
      "otherwise a hub id (zai-org/GLM-Image) or a local directory saved with save_pretrained.")
    a("--prompts", default="prompts.txt", help="Prompt file: one prompt per line, optionally '| target.png' "
      "after it (i2i: '| target.png | source.png'); a line starting with '#' is a comment. Without paths, the "
      "demo images are drawn from the prompt's colour/shape words.")
    a("--reward", action="append", metavar="SPEC", help="A reward: 'mse' (-MSE to the target image), "
      "'module:function' or 'path/to/file.py:function', optionally '=WEIGHT'. Repeat it for a weighted sum "
      "(see section 6 and the README for the signature). Default: mse.")
    a("--out", default="runs/grpo_glm", help="Directory for metrics.jsonl, samples/ and checkpoints/.")
    a("--steps", type=int, default=10, help="Number of GRPO steps to run (in total, counting resumed ones).")
    a("--seed", type=int, default=0, help="Seed for the tiny model, the prompt order, sampling and DiT noise.")
    a("--group-size", type=int, default=32, help="G: samples per prompt; advantages are normalised within a group. "
      "(The tiny demo's default: its AR decodes one token at a time, so 32 rows cost about what 16 do.)")
    a("--prompts-per-step", type=int, default=2, help="Prompts per step; the batch is prompts-per-step x G samples.")
    a("--inner-epochs", type=int, default=4, help="mu: optimisation passes over each batch. With 1 the PPO ratio "
      "is always 1 and clipping never acts.")
    a("--lr", type=float, default=2e-2, help="AdamW learning rate (the default suits the tiny demo's output "
      "head: 40 steps draw each prompt's layout; use ~1e-5 for the real model).")
    a("--lr-scheduler", choices=["constant", "cosine", "linear"], default="constant", help="Learning-rate "
      "schedule over --steps GRPO steps (diffusers' get_scheduler; one scheduler step per GRPO step). Resuming "
      "with another --steps reshapes the rest of a cosine or linear schedule.")
    a("--lr-warmup-steps", type=int, default=0, help="GRPO steps of linear warm-up from 0 to --lr.")
    a("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay.")
    a("--max-grad-norm", type=float, default=1.0, help="Clip the global gradient norm to this value.")
    a("--clip-eps", type=float, default=0.2, help="epsilon of the PPO clip: ratio is kept within [1-eps, 1+eps].")
    a("--beta", type=float, default=0.0, help="Weight of the k3 KL penalty towards the initial model (0 = none, "
      "as in TRL's default; no reference model is kept).")
    a("--temperature", type=float, default=1.0, help="Sampling temperature T; log-probs are computed from "
      "logits / T so the trained policy is exactly the sampling policy.")
    a("--height", type=int, default=128, help="Image height in pixels, a multiple of 32 (the tiny demo's 128 is a "
      "4x4 token grid, enough to show a shape in the middle of a field).")
    a("--width", type=int, default=128, help="Image width in pixels, a multiple of 32.")
    a("--num-inference-steps", type=int, default=4, help="DiT denoising steps when decoding samples.")
    a("--dit-noise", choices=["per-prompt", "per-step"], default="per-prompt", help="Initial DiT noise: "
      "one draw per prompt for the whole run, or a fresh draw per step (always shared within a group).")
    a("--guidance-scale", type=float, default=1.0, help="DiT classifier-free guidance scale (1 = off).")
    a("--loss-tokens", choices=["target", "all"], default="target", help="Which generated tokens the loss "
      "covers: 'target' = only the target grid the DiT decodes; 'all' = preview grid too (see section 9).")
    a("--lora-rank", type=int, default=0, help="LoRA rank on the AR's attention and MLP projections "
      "(0 = full fine-tuning).")
    a("--lora-alpha", type=float, default=None, help="LoRA alpha (default: equal to --lora-rank).")
    a("--ar-trainable", choices=["auto", "all", "head"], default="auto", help="Without LoRA, what of the AR trains: "
      "'all' its weights, 'head' only its output layer (lm_head) on a frozen body. auto = head for --model tiny, "
      "whose body is random (section 2 says why), all for a real model.")
    a("--policy", choices=["ar", "dit", "both"], default="ar", help="What GRPO trains: 'ar' the autoregressive "
      "token model (the DiT renders, frozen); 'dit' the diffusion decoder with Flow-GRPO (tokens shared per "
      "prompt); 'both' the two halves at once from one reward (Part II).")
    a("--dit-lr", type=float, default=3e-3, help="AdamW learning rate of the DiT (the default suits the tiny "
      "model's full fine-tuning; flow_grpo uses 3e-4 with LoRA on real models).")
    a("--dit-clip-eps", type=float, default=1e-4, help="PPO clip epsilon of the DiT's per-step ratio. Step "
      "log-probs are means over latent dims, so ratios stay within ~1e-3 of 1 (flow_grpo's value).")
    a("--dit-noise-level", type=float, default=0.7, help="a in Flow-GRPO's SDE, std_t = a sqrt(sigma / (1 - "
      "sigma)); 0 would be the deterministic ODE, which has no log-prob.")
    a("--dit-train-steps", type=int, default=None, help="How many denoising steps (from the first) run as SDE "
      "steps and enter the DiT loss; the rest run the ODE (default: all but the last).")
    a("--dit-prior", choices=["per-prompt", "per-step"], default="per-prompt", help="--policy dit: the AR "
      "token grid a prompt's group shares is drawn once per prompt for the whole run (seeded by the prompt), "
      "or afresh each step.")
    a("--dit-lora-rank", type=int, default=0, help="LoRA rank on the DiT's attention projections (0 = full "
      "fine-tuning of the DiT).")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float64"], default="auto",
      help="Weights dtype: auto = float32 on CPU, bfloat16 on CUDA. float64 is for checks: the whole step "
      "(rewards and advantages too) then rounds ~5e8 times less, e.g. to see that K processes train as one does "
      "(section 21).")
    a("--micro-batch-size", type=int, default=None, help="Samples per forward/backward in the update (and per "
      "decode call); gradients are accumulated over micro-batches. Default: --group-size, one group per pass.")
    a("--gradient-checkpointing", action="store_true", help="Recompute AR activations in the backward pass "
      "(less memory, ~30%% more compute).")
    a("--offload", action=argparse.BooleanOptionalAction, default=None, help="Offload the frozen DiT, VAE "
      "and text encoder to CPU between uses (default: on with CUDA; needs an accelerator).")
    a("--save-every", type=int, default=10, help="Write a checkpoint every N steps (and always at the end).")
    a("--checkpoints-total-limit", type=int, default=None, help="Keep only the newest K step checkpoints "
      "(default: keep all).")
    a("--sample-every", type=int, default=5, help="Save a PNG of the current samples every N steps (0 = never).")
    a("--report-to", choices=["none", "tensorboard", "wandb"], default="none", help="Also log metrics, "
      "sample sheets and flags to TensorBoard (<out>/logs) or Weights & Biases (works with WANDB_MODE=offline).")
    a("--resume", default=None, help="Checkpoint file to continue from, or 'latest' for the newest in --out.")
    a("--resume-force", action="store_true", help="Resume even if algorithm flags differ from the checkpoint's.")
    a("--save-pipeline", default=None, help="After training, write the whole pipeline (LoRA merged) to this "
      "directory for GlmImagePipeline.from_pretrained.")
    a("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda if available, else cpu.")
    a("--fsdp", action="store_true", help="Under torchrun: shard the trained weights, gradients and AdamW state "
      "over the processes (FSDP2, full fine-tuning of the AR and/or the DiT) instead of replicating them (DDP).")
    a("--dist-timeout", type=int, default=600, help="Under torchrun: seconds a rank waits for the others in a "
      "collective before it gives up with an error (a dead or hung rank then stops the run, no hang).")
    a("--plan", action="store_true", help="Print the memory plan of --model for --height x --width and the "
      "batch size, and exit (a hub id uses the real sizes, nothing is downloaded).")
    a("--plan-gpus", type=int, nargs="+", metavar="K", help="With --plan: also print the per-GPU bytes of --fsdp "
      "(full fine-tuning sharded over K GPUs, torchrun --nproc_per_node K) for each K given; --prompts-per-step "
      "is then the global count, as under torchrun.")
    args = p.parse_args(attach_negative_numbers(sys.argv[1:] if argv is None else argv))
    args.reward = args.reward or ["mse"]
    return args


# =============================================================================================
# 2. Model: GLM-Image = AR (transformers) + DiT/VAE/glyph encoder (diffusers)
# =============================================================================================
# The tiny model is the real architecture at toy size. Every class is the one the real
# checkpoint loads into, so `--model tiny` runs exactly the code path of `--model zai-org/GLM-Image`.
# Its sizes keep the real structure: the AR's output vocabulary is the VQ codebook plus a few
# special ids (real: 16384 + 128, image start = 16384, image end = 16385), the DiT's prior codebook
# equals the VQ codebook, M-RoPE splits the rotary half-dims 1:1.5:1.5 ([8, 12, 12] in the real one).

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]   # the AR's Linears


DIT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]               # the DiT's attention Linears


def load_pipeline(args):
    """Returns a GlmImagePipeline on args.device with the AR ready to train."""
    from diffusers import GlmImagePipeline

    dtype = getattr(torch, args.dtype)
    # 'tiny' is a directory too: built and cached on first use, then loaded like any saved pipeline.
    # Under torchrun rank 0 builds it while the others wait: transformers' save_pretrained writes
    # nothing on a rank other than 0 once torch.distributed is initialised.
    if args.model == TINY and rank() == 0:
        tiny_pipeline_dir(args.seed)
    all_ranks_agree(True)
    path = tiny_pipeline_dir(args.seed) if args.model == TINY else args.model
    try:
        with quiet_progress_bars() if args.model == TINY else contextlib.nullcontext():
            pipe = GlmImagePipeline.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise UsageError(f"--model {args.model} could not be loaded as a GlmImagePipeline: {str(e).splitlines()[0]}")
    # Only the AR is trained; the DiT, VAE and glyph encoder are frozen renderers here.
    for name in ("text_encoder", "transformer", "vae"):
        getattr(pipe, name).requires_grad_(False)
    if dtype == torch.float64:
        float64_throughout(pipe)
    pipe.processor.tokenizer.padding_side = "left"  # sampling code assumes prompts end at one column
    pipe.set_progress_bar_config(disable=True)      # the run prints its own progress, one line a step
    if args.offload:
        # diffusers' model offload hooks every component named in model_cpu_offload_seq and moves
        # it to the GPU when called, back to the CPU when the next one runs. The AR is trained: it
        # must stay on the GPU so its parameters, gradients and AdamW state never move under the
        # optimizer. So it leaves the sequence and is excluded (diffusers then places it on the
        # device once); the frozen glyph encoder, DiT and VAE take turns on the GPU.
        # With --policy dit|both the DiT is trained too and stays on the GPU for the same reason.
        trains_dit = args.policy != "ar"
        pipe.model_cpu_offload_seq = "text_encoder->vae" if trains_dit else "text_encoder->transformer->vae"
        pipe._exclude_from_cpu_offload = ["vision_language_encoder"] + (["transformer"] if trains_dit else [])
        pipe.enable_model_cpu_offload(device=args.device)
    else:
        pipe.to(args.device)
    return pipe


def prepare_policy(ar, args):
    """Marks what is trained: all AR weights, its output layer alone (--ar-trainable head), or LoRA
    adapters (transformers' PEFT integration)."""
    if args.lora_rank:
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig

        ar.requires_grad_(False)
        ar.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                  target_modules=LORA_TARGETS,
                                  exclude_modules=r".*visual.*|.*vqmodel.*"))
        # Adapters train in fp32 even on a bf16 base (diffusers' cast_training_params, as its
        # training scripts do): bf16 weights would round AdamW's small updates away. peft casts
        # the adapter's input to match. (A fp64 base keeps fp64 adapters.)
        cast_training_params(ar, dtype=torch.promote_types(ar.dtype, torch.float32))
    else:
        # The vision encoder and VQ tokenizer only read source images; keep them frozen.
        ar.requires_grad_(True)
        ar.model.visual.requires_grad_(False)
        ar.model.vqmodel.requires_grad_(False)
        if args.ar_trainable == "head":
            # Only lm_head trains: the policy is a linear read-out of the body's fixed features of
            # (prompt, cell). The tiny demo's default, because its body is random: trained along,
            # the body's cheapest move is the direction every cell of a prompt shares, so all 16
            # cells take the background colour (12 of them want it) before the 4 centre cells can
            # turn red, and the shape never appears (README, "The tiny model"). Frozen, each cell
            # keeps its own features and GRPO's per-cell credit shows. A pretrained body (the real
            # model) is worth training: all, or LoRA.
            ar.model.requires_grad_(False)
    if args.gradient_checkpointing:
        ar.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return [p for p in ar.parameters() if p.requires_grad]


# =============================================================================================
# 3. Prompts and targets
# =============================================================================================

def prompts_for_step(num_prompts, per_step, step, seed):
    """Indices of the prompts of step `step` (1-based): a fresh seeded shuffle per pass over the
    prompt file. A pure function of (seed, step), so a resumed run sees the same prompts."""
    indices = []
    position = (step - 1) * per_step
    while len(indices) < per_step:
        epoch, offset = divmod(position, num_prompts)
        order = list(range(num_prompts))
        random.Random(seed * 100003 + epoch).shuffle(order)
        indices.append(order[offset])
        position += 1
    return indices


def batch_targets(batch):
    """The step's target images [P, 3, H, W] in [0, 1], read now (PromptItem), or None if any is missing."""
    targets = [it.target for it in batch]
    return None if any(t is None for t in targets) else torch.stack([image_to_tensor(t) for t in targets])


def image_to_tensor(image):
    """PIL RGB -> float tensor [3, H, W] in [0, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)


# =============================================================================================
# 4. SAMPLE: a group of G token grids per prompt, with the log-prob of every sampled token
# =============================================================================================
# t2i: after the prompt `text<sop>H W<eop><sop>h w<eop><bos>` the AR generates
#     h*w preview tokens (a ~16x16 sketch) | H*W target-grid tokens | 1 end slot
# i2i: the prompt holds the source image's VQ tokens, `<start><image tokens><end>text<sop>H W<eop><bos>`,
#     and the AR generates H*W target-grid tokens | 1 end slot (no preview).
# (H x W = image side / 32.) Only the target grid reaches the DiT.

@dataclass
class Rollout:
    sequences: torch.Tensor      # [N, P+L] prompt (left-padded) + generated ids, N = prompts x G;
                                 # in i2i the source placeholders hold the source's VQ ids
    attention_mask: torch.Tensor  # [N, P+L-1] mask of the teacher-forced input (sequences[:, :-1])
    position_ids: torch.Tensor   # [3, N, P+L-1] M-RoPE positions of that input, as generate used them
    old_logp: torch.Tensor       # [N, L] log pi_old(token) at sampling time
    loss_mask: torch.Tensor      # [N, L] 1 for tokens the loss covers
    target_tokens: torch.Tensor  # [N, H*W] the target grid, row-major
    grid_hw: tuple               # (H, W) of the target grid in tokens
    prompt_len: int              # P
    source_prior: list = None    # i2i, per sample: (source VQ ids upsampled 2x, their grid [1, 3]) for the DiT


def processor_inputs(pipe, prompts, sources, height, width, device):
    """Tokenises prompts (and i2i source images) exactly as GlmImagePipeline.generate_prior_tokens
    does: same chat-template call and target size, left-padded into one batch."""
    def content(text, source):
        return ([{"type": "image", "image": source}] if source is not None else []) + [{"type": "text", "text": text}]
    messages = [[{"role": "user", "content": content(p, s)}] for p, s in zip(prompts, sources)]
    return pipe.processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": True, "target_h": height, "target_w": width}).to(device)


def repeat_samples(inputs, group_size):
    """Repeats each prompt's processor outputs G times, keeping each sample's rows together:
    [p0, p1] -> [p0 x G, p1 x G]. image_grid_thw has `images_per_sample` rows per sample, so it is
    repeated per sample block. (generate(num_return_sequences=G) instead repeat_interleaves the
    grid rows one by one, which hands samples the wrong grids and breaks their M-RoPE positions.)"""
    per_sample = inputs["images_per_sample"]
    grids = torch.split(inputs["image_grid_thw"], per_sample.tolist())
    return {
        "input_ids": inputs["input_ids"].repeat_interleave(group_size, 0),
        "attention_mask": inputs["attention_mask"].repeat_interleave(group_size, 0),
        "image_grid_thw": torch.cat([g.repeat(group_size, 1) for g in grids]),
        "images_per_sample": per_sample.repeat_interleave(group_size),
    }


def repeat_each(items, group_size):
    """[a, b] -> [a x G, b x G]: per-prompt things laid out like the batch rows."""
    return [x for x in items for _ in range(group_size)]


def generation_layout(pipe, inputs, is_t2i):
    """(tokens to generate, offset of the target grid among them, (H, W)), from the pipeline's
    own GlmImagePipeline._compute_generation_params on the first sample's grids."""
    grids = inputs["image_grid_thw"][: inputs["images_per_sample"][0]]
    num_generated, offset, H, W = pipe._compute_generation_params(grids, is_text_to_image=is_t2i)
    return num_generated, offset, (H, W)


def encode_sources(pipe, inputs, group_size):
    """i2i: the vision encoder + VQ run once per prompt (not per sample, not per epoch).
    Returns, per sample (each prompt's entry repeated G times): the features as
    generate(mm_encoder_outputs=) takes them (one [C, h, w] entry per batch row), the source's VQ
    ids (flat), and the DiT's condition: those ids upsampled 2x like the pipeline's
    generate_prior_tokens does, with their grid.
    (generate_prior_tokens itself torch.cat's the feature list before get_image_tokens, which then
    fails in diffusers 0.42.1; we pass the list.)"""
    ar = pipe.vision_language_encoder
    grids = ar.model.get_image_grids_for_generation(inputs["images_per_sample"], inputs["image_grid_thw"])
    features = list(ar.get_image_features(inputs["pixel_values"], grids).pooler_output)   # one per prompt
    ids = torch.split(ar.get_image_tokens(features), grids.prod(-1).tolist())
    prior = [(pipe._upsample_token_ids(t, h, w).squeeze(0), torch.tensor([[1, 2 * h, 2 * w]]))
             for t, (_, h, w) in zip(ids, grids.tolist())]
    return repeat_each(features, group_size), torch.cat(repeat_each(ids, group_size)), repeat_each(prior, group_size)


def image_token_suppression(ar, codebook_size):
    """Ids the policy may not emit inside a grid: everything past the VQ codebook (image
    start/end and the other special ids share the AR's output vocabulary). A mid-grid end
    token would crash the DiT's codebook lookup. Masking them in sampling *and* in the
    teacher-forced log-probs keeps the policy the loss trains identical to the one sampled."""
    return list(range(codebook_size, ar.config.text_config.vision_vocab_size))


def decode_position_ids(ar, inputs, num_generated):
    """M-RoPE positions [3, N, P + L - 1] for the teacher-forced input prompt + generated[:-1].

    GLM-Image gives image tokens 2-D positions (temporal, row, column) offset from the prompt, not
    the running index a plain forward would use; i2i source images get 2-D positions inside the
    prompt. transformers builds them in get_rope_index: it returns the prompt's positions and
    caches the positions of the grids to be generated on the model (a private attribute, the
    only place the library keeps them)."""
    model = ar.model
    prompt_positions, _ = model.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"],
                                                inputs["images_per_sample"], inputs["attention_mask"])
    decode = model._cached_decode_position_ids            # [N, 3, L]: one per generated token
    return torch.cat([prompt_positions, decode[:, :, : num_generated - 1].permute(1, 0, 2)], dim=-1)


class GumbelMax:
    """Makes generate's greedy argmax draw exactly from softmax(logits / T), each group's randomness
    coming from its own torch.Generator. (Any callable (input_ids, scores) -> scores is a transformers
    logits processor; generate runs it after its own suppress_tokens, which has set the special ids
    to -inf.)

    The Gumbel-max trick: with g_v = -log(-log(u_v)), u_v ~ U(0, 1) i.i.d. (standard Gumbel noise),
        argmax_v (l_v / T + g_v)   is distributed as   softmax(l / T)_v,
    exactly, over the ids whose l_v is finite: no top-k, no top-p (generate's own sampler would fill
    in top_k=50). Suppressed ids stay at -inf and are never drawn.
    Why not generate(do_sample=True): torch.multinomial draws from the global RNG row after row, so
    a row's random numbers depend on how many rows come before it in the batch, i.e. on how the
    step's prompts are split over ranks. Here group k's noise, [G, V] per token, comes from
    generators[k] alone, seeded by (seed, step, slot): a group gets the same noise whatever else
    shares its batch and in whatever order, on 1 GPU or K, and again after a resume (same tokens
    too if its logits are the same bits: see sample_groups)."""

    def __init__(self, generators, group_size, temperature):
        self.generators, self.group_size, self.temperature = generators, group_size, temperature

    def __call__(self, input_ids, scores):                    # scores [N, V] fp32, N = groups x G
        u = torch.cat([torch.rand(self.group_size, scores.shape[-1], generator=gen, device=gen.device,
                                  dtype=torch.float64) for gen in self.generators])   # [N, V]
        return scores.double() / self.temperature - torch.log(-torch.log(u))        # u = 0: -inf, never drawn


def left_pad(inputs, length, pad_id):
    """The processor's batch left-padded to `length` tokens (pad id, attention 0)."""
    extra = length - inputs["input_ids"].shape[1]
    if extra < 0:
        raise ValueError(f"prompt of {inputs['input_ids'].shape[1]} tokens does not fit in {length}")
    pad = lambda t, value: torch.nn.functional.pad(t, (extra, 0), value=value)
    return {**inputs, "input_ids": pad(inputs["input_ids"], pad_id), "attention_mask": pad(inputs["attention_mask"], 0)}


@torch.no_grad()
def sample_group(pipe, prompts, group_size, temperature, height, width, loss_tokens, sources=None,
                 record_logp=True, generators=None, prompt_len=None):
    """One batched generate() call for all prompts x G samples (i2i when `sources` is given).

    Tokens are drawn from exactly softmax(logits / T) over the allowed image tokens (GumbelMax),
    group k's from generators[k] (default: seeded from the global torch RNG). `prompt_len` left-pads
    every prompt to that many tokens (default: the longest of `prompts`).
    Old log-probs are read off generate's raw logits (output_logits: the model's fp32 logits before
    any processor), divided by T and with the suppressed ids at -inf, by the same token_logprobs
    the loss uses; never off the processed scores, which carry the Gumbel noise. Returns a Rollout."""
    from transformers import GenerationConfig
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ar = pipe.vision_language_encoder
    is_t2i = sources is None
    pad_id = ar.config.text_config.pad_token_id
    suppressed = image_token_suppression(ar, pipe.transformer.config.prior_vq_quantizer_codebook_size)
    inputs = processor_inputs(pipe, prompts, sources or [None] * len(prompts), height, width, ar.device)
    inputs = left_pad(inputs, prompt_len or inputs["input_ids"].shape[1], pad_id)
    batch = repeat_samples(inputs, group_size)
    source_prior, extra = None, {}
    if not is_t2i:
        features, vq_ids, source_prior = encode_sources(pipe, inputs, group_size)
        extra["mm_encoder_outputs"] = {"image": BaseModelOutputWithPooling(pooler_output=features)}
    num_generated, offset, (H, W) = generation_layout(pipe, inputs, is_t2i)
    if generators is None:
        generators = [torch.Generator(ar.device).manual_seed(int(torch.randint(2**62, ()))) for _ in prompts]
    # do_sample=False: generate takes the argmax of what GumbelMax returns, with no warper of its own.
    generation_config = GenerationConfig(
        do_sample=False, top_k=50, top_p=1.0, temperature=1.0,   # generate's defaults: its sampler is off
        max_new_tokens=num_generated, min_new_tokens=num_generated, suppress_tokens=suppressed,
        pad_token_id=pad_id, eos_token_id=None, return_dict_in_generate=True, output_logits=record_logp)
    out = ar.generate(**batch, **extra, generation_config=generation_config,
                      logits_processor=[GumbelMax(generators, group_size, temperature)])
    sequences = out.sequences
    if not is_t2i:
        # generate swapped the <|image|> placeholders for the source's VQ ids only inside its
        # forward; writing them into the ids lets every later pass skip the vision encoder.
        sequences = sequences.masked_scatter(sequences == ar.config.image_token_id, vq_ids.to(sequences.device))
    prompt_len = batch["input_ids"].shape[1]
    generated = sequences[:, prompt_len:]                                     # [N, L]
    old_logp = None
    if record_logp:      # one decode step at a time: no [N, L, V] copy of the logits
        old_logp = torch.cat([token_logprobs(logits[:, None], generated[:, t, None], temperature, suppressed)
                              for t, logits in enumerate(out.logits)], dim=1)  # [N, L]
    loss_mask = torch.zeros_like(generated, dtype=torch.float32)
    first = offset if loss_tokens == "target" else 0
    loss_mask[:, first: offset + H * W] = 1.0                                  # never the end slot
    attention_mask = torch.cat([batch["attention_mask"], torch.ones_like(generated[:, :-1])], dim=1)
    return Rollout(
        sequences=sequences, attention_mask=attention_mask,
        position_ids=decode_position_ids(ar, batch, num_generated), old_logp=old_logp, loss_mask=loss_mask,
        target_tokens=generated[:, offset: offset + H * W], grid_hw=(H, W), prompt_len=prompt_len,
        source_prior=source_prior)


def sampling_seed(seed, step, slot):
    """Seed of the AR sampling for the group at position `slot` of step `step`: the same number
    whichever rank draws that group, and different for every (step, slot)."""
    return seed * 1_000_000_007 + step * 100_003 + slot


def sample_groups(pipe, prompts, sources, slots, step, args, record_logp=True, prompt_len=None):
    """This rank's groups in one generate() call. The group at position `slot` of the step's
    prompt list draws its noise from a generator seeded by (seed, step, slot), so its samples are
    the same whether its rank holds 1 prompt or 8: a run samples the same on 1 GPU and on K.

    Same noise is not yet same tokens: the logits must be the same bits too, or a near-tie between
    two noisy scores can go the other way (a token flips with probability below 2 d / T when its
    logits move by d). A row's fp32 sums change with the batch around it: SDPA's masked sums
    depend on how many padding columns come first (~1e-7), and transformers drops the attention
    mask of a batch without any padding, whose rows then go through SDPA's causal kernel and another
    summation order (logits ~5e-6 apart on the tiny model). So every rank pads to one column more
    than the step's longest prompt (`prompt_len`, default: a MAX all-reduce of the ranks' longest,
    + 1): a group's rows are then the same tensors on any split, always on the masked path. On CPU
    its tokens and log-probs are then bit-identical (tested), given at least 4 rows per rank (below
    that the CPU matmul takes another kernel). Kernels that choose their summation order by batch
    size, common on GPUs, can still flip a near-tie: 1 GPU and K then agree only statistically."""
    ar = pipe.vision_language_encoder
    if prompt_len is None:
        prompt_len = longest_prompt_on_all_ranks(pipe, prompts, sources, args.height, args.width) + 1
    generators = [torch.Generator(ar.device).manual_seed(sampling_seed(args.seed, step, slot)) for slot in slots]
    return sample_group(pipe, prompts, args.group_size, args.temperature, args.height, args.width, args.loss_tokens,
                        sources, record_logp, generators, prompt_len)


def longest_prompt_on_all_ranks(pipe, prompts, sources, height, width):
    """Tokens in the step's longest prompt, over all ranks (a MAX all-reduce under torchrun; the
    processor runs once more for it, nothing next to generate)."""
    length = processor_inputs(pipe, prompts, sources or [None] * len(prompts), height, width, "cpu")["input_ids"].shape[1]
    if not is_ddp():
        return length
    t = torch.tensor(length, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def row_slices(num_samples, size):
    return [slice(start, min(start + size, num_samples)) for start in range(0, num_samples, size)]


def slice_rollout(rollout, rows):
    """Rows `rows` (a slice) of a Rollout, without the left-padding columns none of them needs,
    so a group's forward is the same tensors whatever else shares its rank's batch."""
    mask = rollout.attention_mask[rows]
    first = int(mask.any(dim=0).nonzero()[0])          # only prompt columns can be all padding
    return replace(
        rollout, sequences=rollout.sequences[rows, first:], attention_mask=mask[:, first:],
        position_ids=rollout.position_ids[:, rows, first:], loss_mask=rollout.loss_mask[rows],
        old_logp=None if rollout.old_logp is None else rollout.old_logp[rows],
        target_tokens=rollout.target_tokens[rows], prompt_len=rollout.prompt_len - first,
        source_prior=None if rollout.source_prior is None else rollout.source_prior[rows])


# =============================================================================================
# 5. DECODE: target-grid tokens -> DiT -> VAE -> pixels
# =============================================================================================

def group_noise(pipe, prompt_indices, group_size, height, width, seed, step, mode):
    """Initial DiT latents [N, C, h, w]: one draw per prompt, shared by its G samples.

    Within a group: on the tiny model the DiT noise alone moves the MSE ~27x more than the AR
    tokens do, so with independent noise per sample the group advantages would mostly rank noise
    draws, not tokens. Common noise leaves the tokens as the only difference.
    Across steps (--dit-noise): 'per-prompt' (default) keeps each prompt's draw for the whole
    run, so the renderer is a fixed function tokens -> image and the reward measures the policy
    alone: reward_mean then rises only if the policy improved. A random DiT passes its input
    noise straight into the image (a trained one cancels most of it), so on the tiny model fresh
    noise each step ('per-step') makes the best tokens change from step to step. 'per-step'
    trains for tokens that are good on average over noise. Seeds are pure functions of
    (seed, prompt, step), so a resumed run draws the same noise."""
    channels = pipe.transformer.config.in_channels
    shape = (channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    draws = []
    for index in prompt_indices:
        stream = index if mode == "per-prompt" else index + 1_000_003 * step
        draws.append(torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7_919 + stream)))
    return torch.stack(draws).repeat_interleave(group_size, 0)


@torch.no_grad()
def decode_images(pipe, prompts, rollout, noise, num_inference_steps, guidance_scale, sources=None):
    """Images [N, 3, H, W] in [0, 1] from the sampled target grids.

    The pipeline's own _upsample_token_ids doubles the 32-px token grid to the DiT's 16-px grid
    (nearest neighbour), and `prior_token_ids=` makes the pipeline skip its AR stage: it only runs
    the glyph encoder, the DiT and the VAE. `prompts` (and i2i `sources`) have one entry per sample.
    In i2i the pipeline VAE-encodes each source into the DiT's KV cache, conditioned on the
    source's VQ ids (`prior_token_image_ids`, `source_image_grid_thw`)."""
    H, W = rollout.grid_hw
    device = pipe._execution_device
    prior = torch.cat([pipe._upsample_token_ids(t, H, W) for t in rollout.target_tokens])   # [N, 4*H*W]
    i2i = {}
    if sources is not None:
        i2i = {"image": [[s] for s in sources],
               "prior_token_image_ids": [ids.to(device) for ids, _ in rollout.source_prior],
               "source_image_grid_thw": [grid.to(device) for _, grid in rollout.source_prior]}
    out = pipe(prompt=prompts, prior_token_ids=prior.to(device), height=H * 32, width=W * 32,
               latents=noise.to(device, pipe.transformer.dtype), num_inference_steps=num_inference_steps,
               guidance_scale=guidance_scale, output_type="pt", **i2i)
    return at_least_fp32(out.images).cpu()


# =============================================================================================
# 6. REWARD
# =============================================================================================

def mse_reward(images, targets):
    """r = -mean((image - target)^2) over channels and pixels.
    images, targets: float [N, 3, H, W] in [0, 1]  ->  rewards [N] in [-1, 0]; 0 = perfect."""
    return -((at_least_fp32(images) - at_least_fp32(targets)) ** 2).mean(dim=(1, 2, 3))
# Reward plug-ins. A reward is any function
#     fn(images: Tensor [N, 3, H, W] in [0, 1], prompts: list[str] (N), targets: Tensor [N, 3, H, W] | None)
#         -> Tensor [N] (or a list of N floats), higher = better
# named on the command line as `--reward module:fn` or `--reward path/to/file.py:fn`, optionally
# `=WEIGHT`. Row i of images, prompts and targets is the same sample (a prompt's G samples are
# consecutive). A function that reads `targets` says so with `fn.uses_targets = True`; only then do
# prompt lines need target images. A reward model (CLIP, HPS, PickScore, OCR) loads itself once at
# import time of its file; a reward served by another process is a plug-in that posts the images
# (README). Plug-ins are loaded before the model, so a bad spec fails in a second, not after loading.

@dataclass
class Reward:
    name: str                    # logged as rewards/<name>
    fn: object
    weight: float
    uses_targets: bool


def mse(images, prompts, targets):
    """The built-in demo reward as a plug-in: mse_reward against each prompt's target image."""
    return mse_reward(images, targets)


mse.uses_targets = True


def compute_rewards(rewards, images, prompts, targets):
    """Runs every reward on the batch. Returns (total [N], {name: [N]}), total = sum_k w_k * r_k.

    Sum, then standardise (in group_advantages): a reward's influence on the advantages is its
    weight times its spread, so a reward with a large within-group spread dominates. MixGRPO
    instead standardises each reward within the group first and then sums the z-scores, which
    makes weights mean "relative importance" whatever the scales; but a reward that is flat in a
    group gets its tiny noise blown up to full size. We sum, like TRL's GRPOTrainer: the weights
    stay what they say, and one reward alone gives exactly today's advantages.
    A reward that raises or returns the wrong shape stops the run with one line naming it. NaN
    values are reported by name and passed on: the NaN total then makes the loss non-finite and
    grpo_update skips the step, so they never reach the weights.

    Each reward gets its own copy of the batch: one that edits `images` in place (a normalisation
    with `sub_`, say) must not change what the next reward, or the sample sheet, sees."""
    total, per_reward = None, {}
    for reward in rewards:
        try:
            value = reward.fn(images.clone(), list(prompts), None if targets is None else targets.clone())
        except Exception as e:
            raise UsageError(f"reward {reward.name} raised {type(e).__name__}: {(str(e).splitlines() or [''])[0]}",
                             local=True)
        try:
            value = torch.as_tensor(value, dtype=images.dtype).detach().cpu()     # fp32 (fp64 for a fp64 model)
        except (TypeError, ValueError, RuntimeError):
            raise UsageError(f"reward {reward.name} returned {type(value).__name__}, not a tensor or list of floats",
                             local=True)
        if value.shape != (len(prompts),):
            raise UsageError(f"reward {reward.name} returned shape {list(value.shape)}, expected [{len(prompts)}] "
                             "(one value per image)", local=True)
        bad = (~torch.isfinite(value)).sum().item()
        if bad:
            print(f"warning: reward {reward.name} returned {bad} non-finite values of {len(prompts)}; "
                  "this step's update is skipped", file=sys.stderr)
        per_reward[reward.name] = value
        total = reward.weight * value if total is None else total + reward.weight * value
    return total, per_reward


# =============================================================================================
# 7. ADVANTAGE
# =============================================================================================

def group_advantages(rewards, group_size, eps=1e-4):
    """GRPO's advantage: A_i = (r_i - mean_group(r)) / (std_group(r) + eps).

    rewards [N] hold consecutive groups of `group_size` (N = prompts x G). A group whose rewards
    are all equal carries no preference and gets exactly 0. Pitfall: r - mean(r) is not exactly 0
    for such a group, since the float32 mean of 16 equal numbers can be one ulp off them; divided
    by std + eps that ulp became a spurious advantage of ~3e-4. So constant groups (max == min)
    are zeroed explicitly.
    eps is not tiny on purpose: MSE rewards within a group can differ by 1e-4, and a smaller eps
    would blow those differences up to full-size advantages. std is the unbiased one (as TRL)."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"got {rewards.numel()} rewards, not a multiple of group_size={group_size}")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    advantages = centred / (groups.std(dim=1, keepdim=True) + eps)
    return torch.where(constant_groups(groups), 0.0, advantages).view(-1)


def constant_groups(groups):
    """[P, G] -> [P, 1] bool: groups whose G rewards are all identical (no learning signal)."""
    return groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)


def score_groups(rewards_fns, images, prompts, targets, group_size):
    """REWARD then ADVANTAGE for N = P x G samples, the same path for every policy.
    images [N, 3, H, W]; prompts: one per sample; targets [P, 3, H, W] or None.
    Returns (rewards [N], advantages [N], metrics: TRL's names)."""
    per_sample_targets = None if targets is None else targets.repeat_interleave(group_size, 0)
    rewards, per_reward = compute_rewards(rewards_fns, images, prompts, per_sample_targets)   # [N], {name: [N]}
    advantages = group_advantages(rewards, group_size)                                        # [N]
    groups = rewards.view(-1, group_size)                                                     # [P, G]
    metrics = {"reward_mean": rewards.mean().item(), "reward_std": groups.std(dim=1).mean().item(),
               "frac_reward_zero_std": constant_groups(groups).float().mean().item(),   # groups with no signal
               **{f"rewards/{name}": value.mean().item() for name, value in per_reward.items()}}
    return rewards, advantages, metrics


# =============================================================================================
# 8. Log-probs with gradients
# =============================================================================================

def at_least_fp32(x):
    """bf16/fp16 -> fp32; fp32 and fp64 unchanged."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_entropy(logits, temperature, suppressed=()):
    """H = -sum_v p_v log p_v of softmax(logits / T) with `suppressed` ids at probability 0, in fp32
    (or fp64 for a fp64 model). logits [N, L, V] -> [N, L] nats; log(V - len(suppressed)) at
    uniform, 0 when one token has it all."""
    logits = at_least_fp32(logits) / temperature
    if len(suppressed):
        logits[..., list(suppressed)] = float("-inf")
    return torch.distributions.Categorical(logits=logits).entropy()    # treats -inf as p = 0


@torch.no_grad()
def loss_token_entropy_sum(logits, mask, temperature, suppressed=()):
    """sum of token_entropy over the loss tokens (mask [N, L]): a monitor, never differentiated."""
    return (token_entropy(logits, temperature, suppressed) * mask).sum()


def token_logprobs(logits, tokens, temperature, suppressed=()):
    """log pi(token) under softmax(logits / T), computed in fp32 (bf16 log-softmax loses ~1e-2;
    a fp64 model stays fp64). logits [N, L, V], tokens [N, L] -> [N, L]. `suppressed` ids get
    probability 0, as in sampling."""
    logits = at_least_fp32(logits) / temperature
    if len(suppressed):
        logits[..., list(suppressed)] = float("-inf")
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def policy_logits(ar, rollout):
    """One teacher-forced forward over prompt + generated[:-1] with the M-RoPE positions
    generate used; logits [N, L, V] of the last L positions predict the L generated tokens.
    A plain forward without position_ids would number image tokens like text (off by nats)."""
    num_generated = rollout.sequences.shape[1] - rollout.prompt_len
    return ar(input_ids=rollout.sequences[:, :-1], attention_mask=rollout.attention_mask,
              position_ids=rollout.position_ids, logits_to_keep=num_generated, use_cache=False).logits


def policy_logprobs(ar, rollout, temperature, suppressed):
    """log pi_theta of each generated token [N, L], differentiable."""
    return token_logprobs(policy_logits(ar, rollout), rollout.sequences[:, rollout.prompt_len:], temperature,
                          suppressed)


@torch.no_grad()
def logprobs_by_micro_batch(model, rollout, temperature, suppressed, size):
    """policy_logprobs without gradients, `size` samples per forward, concatenated [N, L]."""
    return torch.cat([policy_logprobs(model, slice_rollout(rollout, rows), temperature, suppressed)
                      for rows in row_slices(rollout.sequences.shape[0], size)])


# =============================================================================================
# 9. Loss
# =============================================================================================
# Which tokens: the reward depends only on the H*W target-grid tokens (the preview grid is a
# sketch the DiT never sees). The preview tokens do condition the target grid, so training them
# too ('all') is the unbiased trajectory-level gradient, but it adds h*w ~ 256 tokens whose
# credit is almost pure noise next to a handful of target tokens at small sizes. 'target' (the
# default) trades that bias for a far less noisy gradient.

def grpo_loss(logp, old_logp, advantages, mask, clip_eps, beta=0.0, ref_logp=None):
    """PPO-clipped GRPO objective, per token. Returns (loss, metrics).

        ratio    = exp(logp - old_logp)                         rho_t in the papers
        pg_loss1 = -A * ratio
        pg_loss2 = -A * clip(ratio, 1 - eps, 1 + eps)
        pg_loss  = max(pg_loss1, pg_loss2)                      = -min(rho A, clip(rho) A)
        kl       = exp(ref - logp) - (ref - logp) - 1           k3 estimator, >= 0, unbiased
        loss     = masked_mean(pg_loss + beta * kl)

    logp, old_logp, ref_logp, mask: [N, L]; advantages: [N] (one per sequence).
    Normalisation: the masked mean over all tokens of the batch (TRL's 'bnpo'). Every sample here
    has the same number of tokens (fixed by the image size), so 'grpo' (mean per sequence, then
    over sequences), 'bnpo' and 'dapo' give the same number; the choice only matters with ragged
    lengths."""
    adv = advantages.unsqueeze(1)                                     # [N, 1]
    ratio = torch.exp(logp - old_logp)
    pg_loss1 = -adv * ratio
    pg_loss2 = -adv * torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = torch.max(pg_loss1, pg_loss2)
    kl = torch.zeros_like(logp)
    if beta > 0:
        log_ratio_ref = ref_logp - logp
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1
        per_token = per_token + beta * kl
    n = mask.sum().clamp(min=1)
    loss = (per_token * mask).sum() / n
    clipped = ((ratio < 1 - clip_eps) & (adv < 0)) | ((ratio > 1 + clip_eps) & (adv > 0))
    metrics = {
        "ratio_mean": ((ratio * mask).sum() / n).item(),
        "clip_ratio": ((clipped.float() * mask).sum() / n).item(),
        "kl": ((kl * mask).sum() / n).item(),
    }
    return loss, metrics


# =============================================================================================
# 10. UPDATE: mu passes of clipped-surrogate ascent over the same batch (one loop for every policy)
# =============================================================================================

@torch.no_grad()
def reference_logprobs(ar, reference, rollout, temperature, suppressed, micro_batch_size=None):
    """log pi_ref for the KL term. With LoRA the reference is the same model with its adapters
    switched off (no second copy); for full fine-tuning it is a frozen copy of the initial AR.
    `ar` is the bare module, never the DDP wrapper: this pass has no gradients to average."""
    size = micro_batch_size or rollout.sequences.shape[0]
    if reference is None:
        ar.disable_adapters()
        try:
            return logprobs_by_micro_batch(ar, rollout, temperature, suppressed, size)
        finally:
            ar.enable_adapters()
    return logprobs_by_micro_batch(reference, rollout, temperature, suppressed, size)


def micro_batches(policy, num_samples, size):
    """Row slices of at most `size` samples for gradient accumulation (see sync_on_last)."""
    return sync_on_last(policy, row_slices(num_samples, size))


def sync_on_last(policy, pieces):
    """Yields `pieces` (micro-batches of rows, the DiT's denoising steps), each to be backpropagated
    before the next. Under DDP each backward all-reduces the gradients; inside no_sync() they only
    accumulate locally. So all pieces but the last run in no_sync, and the last backward averages
    the accumulated sum once. Every rank holds as many samples (and runs as many steps), hence
    runs as many backward passes (a missing one would leave the other ranks waiting)."""
    pieces = list(pieces)
    for k, piece in enumerate(pieces):
        accumulate_only = hasattr(policy, "no_sync") and k < len(pieces) - 1
        with policy.no_sync() if accumulate_only else contextlib.nullcontext():
            yield piece


def ar_loss_terms(policy, rollout, advantages, ref_logp, args, suppressed):
    """The AR's loss for grpo_update, in pieces: one per micro-batch of --micro-batch-size samples.
    The batch loss is the token mean over the whole batch, so a piece's weight is its share of the
    batch's loss tokens, and the accumulated gradient is the full-batch gradient.
    `policy` is the AR, or its DDP wrapper under torchrun (the forward must go through the wrapper
    for DDP to average the gradients). Returns terms(epoch) -> iterable of (loss, metrics, weight)."""
    advantages = advantages.to(rollout.old_logp.device)
    tokens = rollout.loss_mask.sum()

    def terms(epoch):
        for rows in micro_batches(policy, advantages.shape[0], args.micro_batch_size):
            part = slice_rollout(rollout, rows)
            logits = policy_logits(policy, part)                                   # [n, L, V]
            logp = token_logprobs(logits, part.sequences[:, part.prompt_len:], args.temperature, suppressed)
            loss, metrics = grpo_loss(logp, part.old_logp, advantages[rows], part.loss_mask, args.clip_eps,
                                      args.beta, None if ref_logp is None else ref_logp[rows])
            if epoch == 0:
                # The policy still equals pi_old: |logp - old_logp| is a live check of the bookkeeping.
                metrics["logp_diff_max"] = ((logp - part.old_logp).abs() * part.loss_mask).max().item()
                # Entropy collapse: GRPO sharpens the policy on whatever wins within a group. Once the
                # loss tokens' entropy nears 0, the G samples of a group are identical, every reward
                # ties, all advantages are 0 and learning stops for good (frac_reward_zero_std -> 1).
                metrics["entropy"] = (loss_token_entropy_sum(logits, part.loss_mask, args.temperature, suppressed)
                                      / part.loss_mask.sum()).item()
            yield loss, {**metrics, "loss": loss.item()}, (part.loss_mask.sum() / tokens).item()
    return terms


FIRST_PASS_ONLY = ("logp_diff_max", "entropy")   # measured while the policy still equals pi_old


def grpo_update(optimizer, halves, args):
    """mu = --inner-epochs optimiser steps on one batch: the one optimiser loop of every policy.

    halves: [(prefix, params, terms)], one per trained half ('' the AR, 'dit/' the DiT, Part II).
    terms(epoch) yields the half's loss in pieces (loss, metrics, weight) whose weights add up to 1:
    a micro-batch of samples for the AR, one denoising step for the DiT. Each piece is
    backpropagated as it is built, so only one piece's activations are alive at once, and the
    gradients add up to the gradient of the whole batch's loss. One optimizer.step then moves
    every half (one AdamW, a param group and learning rate per half). Gradients are clipped per
    half: the two losses live on different scales, and a joint norm would let one throttle the other.

    On the first pass the policy still equals pi_old, so ratio = 1 exactly and the clip cannot act;
    only from the second pass on, when the weights have moved, does clipping limit how far one
    batch pushes the policy (with mu = 1 it is dead code, as in several public GRPO scripts).
    Returns the metrics averaged over the passes that updated (the weighted mean of the pieces;
    logp_diff_max and entropy from the first pass), `skipped_updates`: passes whose loss or gradient
    was not finite, which never reach the weights, and `skipped_nonfinite_loss`: those of them whose
    loss was."""
    done, first, skipped, bad_loss = [], {}, 0, 0
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        metrics, loss_finite, finite = {}, True, True
        for prefix, params, terms in halves:
            for loss, piece, weight in terms(epoch):
                (loss * weight).backward()
                loss_finite &= math.isfinite(piece["loss"])
                for key, value in piece.items():
                    key = prefix + key
                    metrics[key] = (max(metrics.get(key, value), value) if key.endswith("logp_diff_max")
                                    else metrics.get(key, 0.0) + value * weight)
            norm = clip_gradients(params, args.max_grad_norm)
            finite &= loss_finite and bool(torch.isfinite(norm))
            metrics[prefix + "grad_norm"] = norm.item()
        if epoch == 0:
            first = {k: v for k, v in metrics.items() if k.endswith(FIRST_PASS_ONLY)}
        # Under DDP the loss is this rank's, the gradient everyone's: decide together.
        if not all_ranks_agree(finite):
            skipped += 1            # never let a NaN/inf reach the weights (or a checkpoint)
            bad_loss += not loss_finite
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.step()
        done.append({k: v for k, v in metrics.items() if not k.endswith(FIRST_PASS_ONLY)})
    keys = [k for k in metrics if not k.endswith(FIRST_PASS_ONLY)]
    averaged = {k: sum(m[k] for m in done) / len(done) if done else float("nan") for k in keys}
    return {**averaged, **first, "skipped_updates": skipped, "skipped_nonfinite_loss": bad_loss}


# =============================================================================================
# 11. One GRPO step, and the training loop
# =============================================================================================

@dataclass
class Trainer:
    """What the loop carries from step to step."""
    pipe: object                 # GlmImagePipeline; its vision_language_encoder is the policy
    optimizer: torch.optim.Optimizer
    params: list                 # the trainable parameters
    reference: object            # frozen initial AR for the KL term (full fine-tuning, beta > 0), else None
    suppressed: list             # ids outside the VQ codebook, never sampled inside a grid
    rewards: list = None         # the --reward plug-ins (section 6)
    lr_scheduler: object = None  # diffusers' get_scheduler: one step per GRPO step
    trained: torch.nn.Module = None   # what checkpoints hold: the AR, or {AR, DiT} with --policy dit|both
    dit_params: list = None      # the DiT's trainable parameters (--policy dit|both)
    dit_reference: object = None  # frozen initial DiT for the KL term (full fine-tuning, beta > 0)
    prompt_tokens: dict = None   # --policy dit --dit-prior per-prompt: prompt index -> its token grid
    policy: object = None        # what the AR's training forward runs through: the AR, or its DDP wrapper
    dit_policy: object = None    # the same for the DiT (--policy dit|both)
    before_update: object = None  # called right before each UPDATE (the stop handler's last chance to drop the step)


def setup_training(args, ckpt=None, ckpt_path=None, rewards=None):
    """Loads the model, marks what trains, builds AdamW and its learning-rate schedule, restores a
    checkpoint. Returns (Trainer, start step). `rewards`: the loaded --reward plug-ins (loaded here
    if not given; train loads them first, to know whether prompts need targets)."""
    from diffusers.optimization import get_scheduler

    pipe = load_pipeline(args)
    # Seeded after loading, so the sampling stream is the same however the model was made
    # (building the tiny model draws from the RNG, from_pretrained does not).
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    ar = pipe.vision_language_encoder
    suppressed = image_token_suppression(ar, pipe.transformer.config.prior_vq_quantizer_codebook_size)
    # For full fine-tuning with beta > 0, the KL reference is a frozen copy of the initial AR
    # (fine for the tiny model; at 9B use LoRA, whose reference is the base with adapters off).
    train_ar, dit = args.policy != "dit", pipe.transformer
    reference = copy.deepcopy(ar).requires_grad_(False) if train_ar and args.beta > 0 and not args.lora_rank else None
    params = shard_for_training(ar, prepare_policy(ar, args), args, reference) if train_ar else []
    groups, trained = [{"params": params, "lr": args.lr}], ar
    dit_params, dit_reference = None, None
    if args.policy != "ar":
        dit_reference = copy.deepcopy(dit).requires_grad_(False) if args.beta > 0 and not args.dit_lora_rank else None
        dit_params = shard_for_training(dit, prepare_dit_policy(dit, args), args, dit_reference)
        # one AdamW, one param group per half, each with its own learning rate
        groups = (groups if train_ar else []) + [{"params": dit_params, "lr": args.dit_lr}]
        trained = torch.nn.ModuleDict({"vision_language_encoder": ar, "transformer": dit} if train_ar
                                      else {"transformer": dit})
    optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    # The schedule spans --steps GRPO steps (each of --inner-epochs optimiser steps, all at the
    # step's lr). diffusers' 'constant' ignores warm-up, its 'constant_with_warmup' does not.
    with_warmup = args.lr_scheduler == "constant" and args.lr_warmup_steps
    lr_scheduler = get_scheduler("constant_with_warmup" if with_warmup else args.lr_scheduler, optimizer,
                                 num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.steps)
    start = 0
    if ckpt is not None:
        restore_checkpoint(ckpt, ckpt_path, trained, optimizer, lr_scheduler)
        start = ckpt["step"]
        if rank() == 0:
            print(f"Resuming from step {start} ({ckpt_path})")
    rewards = load_rewards(args.reward) if rewards is None else rewards
    return Trainer(pipe, optimizer, params, reference, suppressed, rewards, lr_scheduler, trained, dit_params,
                   dit_reference, {}, policy=wrap_for_training(ar, args.device) if train_ar else None,
                   dit_policy=wrap_for_training(dit, args.device) if args.policy != "ar" else None), start


def sample_tokens(trainer, prompts, sources, slots, step, args):
    """SAMPLE with the AR in eval mode; a Rollout with old log-probs. In bf16, generate's cached
    decode and a full teacher-forced pass differ by ~1e-2 per token; pi_old then comes from a no-grad
    teacher-forced pass, so that the first-epoch ratio is exactly 1 and only a real policy change
    moves it. In fp32 the two agree to ~1e-6 and the sampler's own log-probs are used. In fp64 the
    teacher-forced pass again: generate rounds the logits it returns to fp32 (~1e-7 per log-prob)."""
    ar = trainer.pipe.vision_language_encoder
    ar.eval()
    exact_fp32 = args.dtype == "float32"
    with whole_weights(ar):
        rollout = sample_groups(trainer.pipe, prompts, sources, slots, step, args, record_logp=exact_fp32)
        if not exact_fp32:
            rollout.old_logp = logprobs_by_micro_batch(ar, rollout, args.temperature, trainer.suppressed,
                                                       args.micro_batch_size)
    return rollout


def grpo_step(trainer, items, indices, step, args, slots=None):
    """One GRPO step on the prompts `items[indices]`, which sit at positions `slots` of the step's
    global prompt list (under torchrun, this rank's share; default: all of them).
    Returns (metrics row, rewards [N], images [N, 3, H, W], targets [P, 3, H, W] or None, sources or None,
    None): the last is grpo_step_dit's a = 0 decode, which the AR policy has not."""
    pipe, ar = trainer.pipe, trainer.pipe.vision_language_encoder
    batch = [items[i] for i in indices]
    prompts = [it.text for it in batch]
    sources = [it.source for it in batch] if args.mode == "i2i" else None
    slots = range(len(indices)) if slots is None else slots
    M = args.micro_batch_size
    # ---- SAMPLE ----------------------------------------------------------------------------
    rollout = sample_tokens(trainer, prompts, sources, slots, step, args)
    # ---- DECODE ----------------------------------------------------------------------------
    noise = group_noise(pipe, indices, args.group_size, args.height, args.width, args.seed, step, args.dit_noise)
    sample_prompts, sample_sources = repeat_each(prompts, args.group_size), sources and repeat_each(sources, args.group_size)
    images = torch.cat([decode_images(pipe, sample_prompts[rows], slice_rollout(rollout, rows), noise[rows],
                                      args.num_inference_steps, args.guidance_scale,
                                      sample_sources and sample_sources[rows])
                        for rows in row_slices(len(sample_prompts), M)])                  # [N, 3, H, W]
    # ---- REWARD + ADVANTAGE ----------------------------------------------------------------
    targets = batch_targets(batch)                                                        # [P, 3, H, W]
    rewards, advantages, reward_metrics = score_groups(trainer.rewards, images, sample_prompts, targets,
                                                       args.group_size)                  # [N], [N]
    # ---- UPDATE ----------------------------------------------------------------------------
    if trainer.before_update:
        trainer.before_update()
    ref_logp = (reference_logprobs(ar, trainer.reference, rollout, args.temperature, trainer.suppressed, M)
                if args.beta > 0 else None)
    ar.train()   # only switches gradient checkpointing on: GLM-Image's AR has no dropout, so the
                 # first pass still reproduces pi_old exactly
    terms = ar_loss_terms(trainer.policy, rollout, advantages, ref_logp, args, trainer.suppressed)
    update = grpo_update(trainer.optimizer, [("", trainer.params, terms)], args)
    row = {"step": step, **reward_metrics, **update}
    return row, rewards, images, targets, sources, None


def train(args):
    """The training loop. Each step: GRPO (grpo_step, or grpo_step_dit for --policy dit|both), then
    LOG, sample sheets and CHECKPOINT, each one call into the plumbing (Part III)."""
    run = open_run(args)                      # checks, --out lock, prompts, rewards, model, resume point
    if run is None:
        return None
    items, trainer, start, out, lead, lock = run
    tracker = start_logging(args, trainer, out, start) if lead else None
    step_fn = grpo_step if args.policy == "ar" else grpo_step_dit
    stop = StopAfterStep()                    # Ctrl+C / SIGTERM: finish or drop the step, checkpoint, exit
    trainer.before_update = stop.before_update
    last_saved, bad_steps, warned = start, [], False
    try:
        for step in range(start + 1, args.steps + 1):
            t0 = time.time()
            slots = rank_slots(args.prompts_per_step)            # this rank's share of the step's prompts
            indices = [prompts_for_step(len(items), args.prompts_per_step, step, args.seed)[s] for s in slots]
            step_rng = rng_state()
            try:
                stop.begin_step()
                row, rewards, images, targets, sources, ode = step_fn(trainer, items, indices, step, args, slots)
            except AbandonStep:               # a stop signal before the update: the weights are still step - 1's
                stop_before_update(stop, trainer, args, out, step, last_saved, step_rng)
            row = finish_row(row, trainer, args, t0)
            stopping = stop.agree()                              # a stop signal seen by any rank stops all
            # ---- LOG -------------------------------------------------------------------------
            if lead:
                warned = log_step(row, step, args, trainer, out, tracker, warned)
            bad_steps = bad_steps + [skip_cause(row)] if row["skipped_updates"] == args.inner_epochs else []
            if len(bad_steps) >= 5:
                raise UsageError(non_finite_stop(bad_steps, step, out))
            if lead and args.sample_every and step % args.sample_every == 0:     # rank 0's groups
                save_samples(out, step, [items[i].text for i in indices], targets, images, rewards, sources, ode,
                             args, tracker)
            # ---- CHECKPOINT ------------------------------------------------------------------
            if step % args.save_every == 0 or step == args.steps or stopping:
                path = save_step_checkpoint(out, step, trainer, args, lead)
                last_saved = step
            if stopping:
                exit_after_checkpoint(stop, out, step, path, lead)
    except KeyboardInterrupt:   # the second Ctrl+C: leave now, the last checkpoint is complete
        print(f"\ninterrupted: last checkpoint is step {last_saved} in {out / 'checkpoints'}", file=sys.stderr)
        sys.exit(130)
    finally:
        stop.restore()
        close_run(args, items, out, tracker, lock)
    if args.save_pipeline and lead:
        save_trained_pipeline(trainer.pipe, args)
    return trainer.pipe


# #############################################################################################
# PART II. Flow-GRPO: the DiT as a policy over denoising steps (--policy dit|both)
# #############################################################################################
# It reuses Part I's score_groups, grpo_loss and grpo_update: a denoising step plays the role of a token.


# =============================================================================================
# 12. The SDE step, the DiT rollout and its loss
# =============================================================================================
# GLM-Image's authors post-train both halves ("decoupled RL"): the AR for low-frequency signals
# (layout, semantics), the DiT for high-frequency ones (detail, text). To train the DiT with the
# same group_advantages and grpo_loss we need what the AR has for free: a probability for what
# was sampled. The pipeline's Euler ODE step x' = x + v * dt is deterministic, so there is no
# log-prob to put in a ratio. Flow-GRPO (Liu et al. 2025, yifan123/flow_grpo,
# `sde_step_with_logprob`, type 'sde') swaps each step for an SDE with the same marginals,
#     std_t = a * sqrt(sigma / (1 - sigma))
#     mean  = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
#     x'    = mean + std_t * sqrt(-dt) * eps,          dt = sigma' - sigma < 0
# so each step is a Gaussian policy pi_theta(x' | x_t) whose log-prob we can ratio, exactly as a
# token's. a = --dit-noise-level; a = 0 gives back the pipeline's Euler step (tested).
# A trajectory of K denoising steps is then a "sequence" of K actions: logp [N, K], mask all ones.
# Log-probs are the MEAN over latent dims (as flow_grpo): a sum over C*h*w dims (256 on the tiny
# model, 65536 at 1024^2) would make one step's log-ratio thousands of times larger than a token's.
# The mean keeps a step's ratio near 1, but small: a clip of 0.2 would never act, hence
# --dit-clip-eps 1e-4 (flow_grpo's value).
# Which steps train (--dit-train-steps T, default K - 1): the first T steps run the SDE and enter
# the loss; the rest run the plain ODE. The last step is not trained by default (as flow_grpo):
# it lands on sigma' = 0, its Gaussian is the sharpest of the trajectory (std = std_t *
# sqrt(sigma_last) ~ a * sigma_last), so small weight changes give large log-ratios and noisy
# gradients; and an SDE step that is not trained would only add reward noise nobody is credited for. Cheaper variants are not built here: a random window of SDE steps inside an ODE trajectory
# (Flow-GRPO-Fast, MixGRPO's sliding window) would need only --dit-train-steps' window to move.

@dataclass
class DitCondition:
    """What the DiT is conditioned on, built as GlmImagePipeline.__call__ builds it for one prompt at a
    time (N = P x G rows, prompt p's G samples at rows p*G .. p*G+G-1)."""
    prompt_embeds: list              # per prompt: [G, S_p, D] glyph embeddings (encode_prompt of it alone)
    negative_embeds: list            # per prompt: [G, S', D] glyph embeddings of "" (CFG's unconditional branch), or None
    prior: torch.Tensor              # [N, 4*H*W] target-grid tokens upsampled 2x (the DiT's 16-px grid)
    target_size: torch.Tensor        # [N, 2] (height, width) in pixels
    crop_coords: torch.Tensor        # [N, 2] zeros, the pipeline's default crops_coords_top_left
    guidance_scale: float
    source_latents: list = None      # i2i, per prompt: normalised VAE latent [1, C, h, w] of the source
    source_prior: list = None        # i2i, per prompt: its VQ ids upsampled 2x [4*h*w]


@dataclass
class DitRollout:
    states: torch.Tensor     # [N, K+1, C, h, w] x_0 (initial noise) ... x_K (final latent), fp32
    old_logp: torch.Tensor   # [N, T] log pi_old(x_{i+1} | x_i) of the T trained steps at sampling time
    timesteps: torch.Tensor  # [K] the pipeline's (unshifted) timesteps
    sigmas: torch.Tensor     # [K+1] the scheduler's shifted sigmas, ending in 0


def dit_schedule(pipe, height, width, num_inference_steps):
    """(timesteps [K], sigmas [K+1]) exactly as GlmImagePipeline.__call__ sets them up: timesteps
    int(linspace(1000, 1, K+1)[:-1]), sigmas = timesteps / 1000, shifted by the scheduler with the
    pipeline's calculate_shift(mu) inside retrieve_timesteps. sigma is read back from
    scheduler.sigmas, which is shifted: t / 1000 is not the sigma the DiT was run at."""
    from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps

    scheduler, device = pipe.scheduler, pipe._execution_device
    seq_len = (height // pipe.vae_scale_factor) * (width // pipe.vae_scale_factor) // pipe.transformer.config.patch_size ** 2
    train_steps = scheduler.config.num_train_timesteps
    timesteps = np.linspace(train_steps, 1.0, num_inference_steps + 1)[:-1].astype(np.int64).astype(np.float32)
    mu = calculate_shift(seq_len, scheduler.config.get("base_image_seq_len", 256),
                         scheduler.config.get("base_shift", 0.25), scheduler.config.get("max_shift", 0.75))
    timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, device, timesteps, timesteps / train_steps, mu=mu)
    return timesteps, scheduler.sigmas.to(device, torch.promote_types(pipe.transformer.dtype, torch.float32))


@torch.no_grad()
def dit_condition(pipe, prompts, group_size, target_tokens, grid_hw, guidance_scale, sources=None, source_prior=None):
    """The DiT's inputs for P prompts x G samples. target_tokens [N, H*W]; i2i: `sources` (PIL) and
    `source_prior` ((upsampled VQ ids, grid) as encode_sources makes them) per prompt. The frozen glyph
    encoder and VAE run once here; the source's KV cache depends on the DiT's weights and is written
    per pass (write_source_caches). Each prompt's glyphs are encoded alone, unpadded (see dit_velocity)."""
    from diffusers.pipelines.glm_image.pipeline_glm_image import retrieve_latents

    H, W = grid_hw
    height, width = 32 * H, 32 * W
    device, dtype = pipe._execution_device, pipe.dtype
    n = target_tokens.shape[0]
    encoded = [pipe.encode_prompt([p], guidance_scale > 1, num_images_per_prompt=group_size, device=device,
                                  dtype=dtype) for p in prompts]
    embeds, negative = [e for e, _ in encoded], [u for _, u in encoded] if guidance_scale > 1 else None
    prior = torch.cat([pipe._upsample_token_ids(t, H, W) for t in target_tokens]).to(device)
    latents = None
    if sources is not None:
        # the pipeline's i2i path: preprocess, VAE mode (argmax), normalise with latents_mean/std
        vae = pipe.vae
        mean, std = (torch.tensor(v).view(1, -1, 1, 1).to(device, dtype)
                     for v in (vae.config.latents_mean, vae.config.latents_std))
        pixels = [pipe.image_processor.preprocess(s, height=height, width=width).to(device, dtype) for s in sources]
        latents = [(retrieve_latents(vae.encode(p), sample_mode="argmax") - mean) / std for p in pixels]
    size = torch.tensor([[height, width]], dtype=dtype, device=device).repeat(n, 1)
    return DitCondition(embeds, negative, prior, size, torch.zeros_like(size), guidance_scale, latents,
                        [ids.to(device) for ids, _ in source_prior] if sources is not None else None)


def write_source_caches(dit, cond):
    """One GlmImageKVCache per prompt. i2i: a DiT pass over the prompt's source latent at timestep 0
    writes every layer's keys/values into it (as the pipeline does); the denoising passes of its G
    samples then attend to them (GlmImageLayerKVCache.get expands the entry to G rows). t2i: empty
    caches, as the pipeline passes. `dit` may be the DDP wrapper (section 21): this pass is part
    of the training graph."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    module = unwrap(dit)
    caches = [GlmImageKVCache(num_layers=module.config.num_layers) for _ in cond.prompt_embeds]
    if cond.source_latents is None:
        return caches
    for cache, latent, ids, embeds in zip(caches, cond.source_latents, cond.source_prior, cond.prompt_embeds):
        cache.set_mode("write")
        out = dit(hidden_states=latent.to(module.dtype), encoder_hidden_states=embeds[:1, :0],
                  prior_token_id=ids, prior_token_drop=torch.zeros_like(ids, dtype=torch.bool),
                  timestep=torch.zeros(1, device=latent.device), target_size=cond.target_size[:1],
                  crop_coords=cond.crop_coords[:1], kv_caches=cache, return_dict=False)[0]
        if torch.is_grad_enabled() and is_sharded(module):
            # --fsdp: FSDP2 gathers a layer's weights for backward when the gradient reaches the
            # layer's *output*; the cached keys/values are side outputs it does not watch, so their
            # backward would find the weights freed. 0 x this pass's output, added to the velocity
            # (dit_velocity), routes the gradient through the outputs too: no value changes.
            cache.anchor = at_least_fp32(out).sum() * 0
    return caches


def dit_velocity(dit, latents, t, cond, caches):
    """The guided velocity v [N, C, h, w] (fp32) at timestep t, as the pipeline's loop computes it:
    the DiT gets `timestep = t - 1`; with CFG the unconditional branch drops the prior tokens
    (prior_token_drop=True) and uses the glyph embeddings of "", v = v_u + g (v_c - v_u). With CFG
    during training the policy *is* the guided velocity: two DiT passes per step.

    One DiT call per prompt (its G rows), never one over prompts: a prompt's glyph embeddings are as
    long as its quoted text, and a batch of prompts is left-padded with zero embeddings that the DiT
    then attends to. diffusers' pipeline passes no attention mask, and the DiT's own attention_mask
    would not help: it becomes a float 0/1 tensor that SDPA adds as a bias (diffusers issue 13587).
    Measured on the tiny DiT: "a red circle ..." batched with a prompt holding 17 glyph tokens moved
    its velocity by up to 2.2e-2 (1.1 % of its norm; 1.6e-2 with the mask passed). Per prompt, a
    group's DiT input is exactly the pipeline's for that prompt alone, whatever shares its batch or
    rank, so 1 process and K compute the same samples and gradients."""
    n = latents.shape[0] // len(cond.prompt_embeds)
    timestep = t.expand(n) - 1
    i2i, dtype = cond.source_latents is not None, unwrap(dit).dtype

    def branch(rows, embeds, drop, cache, mode):
        if i2i:
            cache.set_mode(mode)     # read the source's keys/values; the unconditional branch skips them
        prior = cond.prior[rows]
        return dit(hidden_states=latents[rows].to(dtype), encoder_hidden_states=embeds, prior_token_id=prior,
                   prior_token_drop=torch.full_like(prior, drop, dtype=torch.bool), timestep=timestep,
                   target_size=cond.target_size[rows], crop_coords=cond.crop_coords[rows], return_dict=False,
                   kv_caches=cache)[0].to(torch.promote_types(dtype, torch.float32))

    velocities = []
    for p, cache in enumerate(caches):
        rows = slice(p * n, (p + 1) * n)
        v = branch(rows, cond.prompt_embeds[p], False, cache, "read")
        if cond.guidance_scale > 1:
            v_uncond = branch(rows, cond.negative_embeds[p], True, cache, "skip")
            v = v_uncond + cond.guidance_scale * (v - v_uncond)
        velocities.append(v + cache.anchor if hasattr(cache, "anchor") else v)
    return torch.cat(velocities)


def sde_step(v, x, sigmas, i, noise_level, eps=None, x_next=None):
    """One Flow-GRPO SDE step from x = x_i at sigma_i (fp32 [N, C, h, w]). Returns (x', logp [N], mean).

    x' = mean + std * eps with std = std_t * sqrt(-dt); pass `x_next` instead of `eps` to score a
    stored transition (recomputation). logp is the Gaussian log-density averaged over latent dims.
    noise_level = 0 is the plain Euler step (x' = mean = x + v dt, no log-prob). flow_grpo replaces
    sigma = 1 by sigmas[1] only inside std_t, where sigma / (1 - sigma) would divide by zero."""
    sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
    mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    if noise_level == 0:
        return mean, None, mean
    std = std_t * torch.sqrt(-dt)
    if x_next is None:
        x_next = mean + std * eps
    logp = -((x_next.detach() - mean) ** 2) / (2 * std ** 2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return x_next, logp.mean(dim=tuple(range(1, logp.ndim))), mean


def step_std(sigmas, i, noise_level):
    """The std of step i's Gaussian, std_t * sqrt(-dt) (a scalar), as in sde_step."""
    sigma = sigmas[i]
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
    return std_t * torch.sqrt(sigmas[i] - sigmas[i + 1])


def sde_generators(seed, step, prompt_indices):
    """One generator per prompt for the SDE noise, seeded from (seed, step, prompt index): a prompt's
    noise does not depend on which other prompts share its batch."""
    return [torch.Generator().manual_seed(seed * 7_919 + 2_000_003 * step + 17 * index + 1) for index in prompt_indices]


@torch.no_grad()
def sample_dit(dit, cond, noise, schedule, noise_level, train_steps, generators):
    """Denoises `noise` [N, C, h, w] (N = len(generators) x G) over the pipeline's schedule. The first
    `train_steps` steps are SDE steps (their eps drawn per prompt, [G, C, h, w] from its generator) and
    record log-probs; the rest are ODE steps. Returns a DitRollout; its states[:, -1] is the latent."""
    timesteps, sigmas = schedule
    caches = write_source_caches(dit, cond)
    x, states, logps = noise.to(sigmas.device, sigmas.dtype), [], []
    for i, t in enumerate(timesteps):
        states.append(x)
        v = dit_velocity(dit, x, t, cond, caches)
        if i < train_steps:
            group = (x.shape[0] // len(generators), *x.shape[1:])
            eps = torch.cat([torch.randn(group, generator=g) for g in generators]).to(x.device, x.dtype)
            x, logp, _ = sde_step(v, x, sigmas, i, noise_level, eps=eps)
            logps.append(logp)
        else:
            x, _, _ = sde_step(v, x, sigmas, i, 0.0)
    states.append(x)
    old_logp = torch.stack(logps, 1) if logps else x.new_zeros(x.shape[0], 0)
    return DitRollout(torch.stack(states, 1), old_logp, timesteps, sigmas)


def dit_step_logprob(dit, cond, rollout, i, noise_level):
    """Recomputes step i of every stored trajectory with gradients: (logp [N], mean [N, C, h, w]).
    The source's KV cache is rewritten inside this step's graph (the DiT's weights made it), so each
    step can be backpropagated and freed on its own."""
    caches = write_source_caches(dit, cond)
    x = rollout.states[:, i]
    v = dit_velocity(dit, x, rollout.timesteps[i], cond, caches)
    _, logp, mean = sde_step(v, x, rollout.sigmas, i, noise_level, x_next=rollout.states[:, i + 1])
    return logp, mean


def dit_policy_logprobs(dit, cond, rollout, noise_level):
    """logp [N, T] of all T trained steps (with gradients when enabled): the DiT's policy_logprobs."""
    return torch.stack([dit_step_logprob(dit, cond, rollout, i, noise_level)[0]
                        for i in range(rollout.old_logp.shape[1])], 1)


def dit_kl(mean, ref_mean, std):
    """Closed-form KL between the step Gaussians of policy and reference (same std), per sample and
    averaged over latent dims like the log-prob: ||mean - ref_mean||^2 / (2 std^2). [N, C, h, w] -> [N]."""
    return ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std ** 2)


def latents_to_images(pipe, latents):
    """The pipeline's own decode: un-normalise with the VAE's latents_mean/std, vae.decode, postprocess.
    latents [N, C, h, w] -> images [N, 3, H, W] in [0, 1] (fp32, CPU)."""
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean, std = (torch.tensor(v).view(1, -1, 1, 1).to(latents.device, latents.dtype)
                 for v in (vae.config.latents_mean, vae.config.latents_std))
    image = vae.decode(latents * std + mean, return_dict=False)[0]
    return at_least_fp32(pipe.image_processor.postprocess(image, output_type="pt")).cpu()


@torch.no_grad()
def ode_decode(pipe, cond, noise, schedule):
    """The deterministic (a = 0) decode of the current DiT: what it paints without SDE noise."""
    rollout = sample_dit(pipe.transformer, cond, noise, schedule, 0.0, 0, [])
    return latents_to_images(pipe, rollout.states[:, -1])


def dit_loss_terms(policy, reference, cond, rollout, advantages, args):
    """The DiT's loss for grpo_update, in pieces: one per trained denoising step, each grpo_loss over
    that step's column with weight 1/T, so the T per-step backward passes add up to the gradient of
    grpo_loss over all [N, T] (mask all ones) while only one step's activations are alive at once
    (flow_grpo does the same). KL (beta > 0): closed form on the step means against the reference
    DiT (adapters off with LoRA, else a frozen copy). `policy` is the DiT or its DDP wrapper (the
    training forward goes through it; under DDP the gradients are averaged on the last step's
    backward). Returns terms(epoch), as ar_loss_terms."""
    steps = rollout.old_logp.shape[1]
    ones = torch.ones_like(rollout.old_logp[:, :1])
    advantages = advantages.to(rollout.old_logp.device)

    def terms(epoch):
        for i in sync_on_last(policy, range(steps)):
            logp, mean = dit_step_logprob(policy, cond, rollout, i, args.dit_noise_level)
            loss, metrics = grpo_loss(logp[:, None], rollout.old_logp[:, i:i + 1], advantages, ones,
                                      args.dit_clip_eps)
            if args.beta > 0:
                with torch.no_grad():
                    ref_mean = dit_reference_mean(unwrap(policy), reference, cond, rollout, i, args.dit_noise_level)
                kl = dit_kl(mean, ref_mean, step_std(rollout.sigmas, i, args.dit_noise_level)).mean()
                loss = loss + args.beta * kl
                metrics["kl"] = kl.item()
            if epoch == 0:
                metrics["logp_diff_max"] = (logp.detach() - rollout.old_logp[:, i]).abs().max().item()
            yield loss, {**metrics, "loss": loss.item()}, 1 / steps
    return terms


def dit_reference_mean(dit, reference, cond, rollout, i, noise_level):
    """Step i's mean under the reference: the same DiT with its LoRA adapters off, or the frozen copy."""
    if reference is None:
        dit.disable_adapters()
        try:
            return dit_step_logprob(dit, cond, rollout, i, noise_level)[1]
        finally:
            dit.enable_adapters()
    return dit_step_logprob(reference, cond, rollout, i, noise_level)[1]


# =============================================================================================
# 13. The DiT's training step
# =============================================================================================

def prepare_dit_policy(dit, args):
    """Marks what of the DiT is trained: all its weights (the tiny model's default), or LoRA adapters
    on its attention projections through diffusers' PEFT integration (add_adapter; the KL reference
    is then the same DiT with disable_adapters()). Adapters train in fp32, as the AR's."""
    if args.dit_lora_rank:
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig

        dit.requires_grad_(False)
        dit.add_adapter(LoraConfig(r=args.dit_lora_rank, lora_alpha=args.dit_lora_rank, lora_dropout=0.0,
                                   target_modules=DIT_LORA_TARGETS))
        cast_training_params(dit, dtype=torch.promote_types(dit.dtype, torch.float32))
    else:
        dit.requires_grad_(True)
    if args.gradient_checkpointing:
        dit.enable_gradient_checkpointing()
    return [p for p in dit.parameters() if p.requires_grad]


def shared_prompt_tokens(pipe, prompts, sources, indices, slots, step, args, cache):
    """--policy dit: one token grid per prompt (its group shares it). 'per-prompt' (--dit-prior) draws
    each prompt's grid from a seed of (seed, prompt index), the same grid every step: the tiny DiT
    then sees a fixed input per prompt and can learn what to paint from it. A random AR's grids
    say little about the prompt, so with 'per-step' grids the DiT can only learn an image that
    suits every prompt on average; those are drawn from the seed of (seed, step, slot), as the AR's
    groups (so any number of processes draws the same grids). The AR is frozen, so a prompt's
    per-prompt draw is kept in `cache` rather than sampled again every step. Returns a Rollout-like
    object with target_tokens [P, H*W], grid_hw and source_prior."""
    def draw(i, seed):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(seed)                               # leaves the run's RNG stream untouched
            return sample_group(pipe, [prompts[i]], 1, args.temperature, args.height, args.width, args.loss_tokens,
                                sources and [sources[i]], record_logp=False)

    if args.dit_prior == "per-step":
        draws = [draw(i, sampling_seed(args.seed, step, slot)) for i, slot in enumerate(slots)]
    else:
        for i, index in enumerate(indices):
            if index not in cache:
                cache[index] = draw(i, args.seed * 7_919 + index)
        draws = [cache[index] for index in indices]
    return SimpleNamespace(target_tokens=torch.cat([d.target_tokens for d in draws]), grid_hw=draws[0].grid_hw,
                           source_prior=sources and [d.source_prior[0] for d in draws])


def grpo_step_dit(trainer, items, indices, step, args, slots=None):
    """One GRPO step with the DiT as (part of) the policy, --policy dit|both. Returns grpo_step's tuple
    plus the a = 0 decode of the updated DiT [P, 3, H, W] on sample-sheet steps (else None).

    dit: the AR tokens are sampled once per prompt and shared by its group, as is the initial noise,
    so the G samples differ only by their SDE noise and the advantage credits the DiT alone.
    both: tokens and SDE noise both vary; each sample gets one reward and one advantage, used by both
    halves. Credit assignment is then shared: the AR's advantage also carries the luck of the SDE
    noise and the DiT's the luck of the tokens, each half's signal is the other's noise. On the tiny
    model the DiT's noise moves the reward far more than the tokens, so the AR learns more slowly than
    under --policy ar (the README compares them)."""
    pipe, ar, dit = trainer.pipe, trainer.pipe.vision_language_encoder, trainer.pipe.transformer
    batch = [items[i] for i in indices]
    prompts = [it.text for it in batch]
    sources = [it.source for it in batch] if args.mode == "i2i" else None
    G, train_ar = args.group_size, args.policy == "both"
    slots = range(len(indices)) if slots is None else slots
    # ---- SAMPLE: tokens (AR), then trajectories (DiT SDE) -----------------------------------
    if train_ar:
        rollout = sample_tokens(trainer, prompts, sources, slots, step, args)
    else:
        rollout = shared_prompt_tokens(pipe, prompts, sources, indices, slots, step, args, trainer.prompt_tokens)
    tokens = rollout.target_tokens if train_ar else rollout.target_tokens.repeat_interleave(G, 0)   # [N, H*W]
    source_prior = rollout.source_prior and rollout.source_prior[::G if train_ar else 1]          # per prompt
    cond = dit_condition(pipe, prompts, G, tokens, rollout.grid_hw, args.guidance_scale, sources, source_prior)
    schedule = dit_schedule(pipe, args.height, args.width, args.num_inference_steps)
    noise = group_noise(pipe, indices, G, args.height, args.width, args.seed, step, args.dit_noise)
    with whole_weights(dit):
        trajectories = sample_dit(dit, cond, noise, schedule, args.dit_noise_level, args.dit_train_steps,
                                  sde_generators(args.seed, step, indices))
    # ---- DECODE ------------------------------------------------------------------------------
    with torch.no_grad():
        images = latents_to_images(pipe, trajectories.states[:, -1])                       # [N, 3, H, W]
    # ---- REWARD + ADVANTAGE: the same function for both halves --------------------------------
    targets = batch_targets(batch)                                                        # [P, 3, H, W]
    rewards, advantages, reward_metrics = score_groups(trainer.rewards, images, repeat_each(prompts, G), targets, G)
    # ---- UPDATE: one optimiser loop; each trained half contributes its loss terms ------------
    if trainer.before_update:
        trainer.before_update()
    halves = []
    if train_ar:
        ref_logp = (reference_logprobs(ar, trainer.reference, rollout, args.temperature, trainer.suppressed,
                                       args.micro_batch_size) if args.beta > 0 else None)
        ar.train()
        halves.append(("", trainer.params, ar_loss_terms(trainer.policy, rollout, advantages, ref_logp, args,
                                                         trainer.suppressed)))
    halves.append(("dit/", trainer.dit_params, dit_loss_terms(trainer.dit_policy, trainer.dit_reference, cond,
                                                              trajectories, advantages, args)))
    update = grpo_update(trainer.optimizer, halves, args)
    row = {"step": step, **reward_metrics, **update,
           "loss": update.get("loss", 0.0) + update["dit/loss"]}                         # AR + DiT
    ode = None
    if args.sample_every and step % args.sample_every == 0:
        first = slice(None, None, G)     # a = 0 decode of each prompt's first sample, shared noise
        ode_cond = dit_condition(pipe, prompts, 1, tokens[first], rollout.grid_hw, args.guidance_scale, sources,
                                 source_prior)
        with whole_weights(dit):
            ode = ode_decode(pipe, ode_cond, noise[first], schedule)
    return row, rewards, images, targets, sources, ode


# #############################################################################################
# PART III. Plumbing: skip on first read
# #############################################################################################
# Nothing below is GRPO: how the run starts, stops and logs, file formats, the tiny model's renderer,
# checkpoints, torchrun and FSDP, the memory plan, saving. Part I calls each piece in one line.


# =============================================================================================
# 14. Starting a run: flag checks (one-line errors before anything loads), --out, resume point
# =============================================================================================

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends '(default: X)' to each flag's help, except for X = None: those flags say in words
    what happens without them ('Default: mse.'), which '(default: None)' would contradict."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def attach_negative_numbers(argv):
    """['--lr', '-1e-3'] -> ['--lr=-1e-3']. argparse takes '-1e-3' for an option (its negative-number
    rule knows '-1' and '-.5', not exponents) and fails with 'expected one argument'."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.fullmatch(r"-[\d.]+(e[-+]?\d+)?", token, re.I):
            out[-1] += "=" + token
        else:
            out.append(token)
    return out


def validate_args(args):
    """Cheap checks before any model is loaded, so a typo fails at once (in the ~1.4 s torch takes to import)."""
    positive = {"--steps": args.steps, "--inner-epochs": args.inner_epochs, "--prompts-per-step": args.prompts_per_step,
                "--num-inference-steps": args.num_inference_steps, "--save-every": args.save_every}
    for flag, value in positive.items():
        if value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.group_size < 2:
        raise UsageError(f"--group-size must be at least 2 (advantages compare samples within a group), got {args.group_size}")
    for flag, value in {"--lr": args.lr, "--clip-eps": args.clip_eps, "--temperature": args.temperature}.items():
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    for flag, value in {"--height": args.height, "--width": args.width}.items():
        if value < 32 or value % 32:
            raise UsageError(f"{flag} must be a positive multiple of 32 (GLM-Image works on 32-pixel tokens), got {value}")
    world = launched_world_size()
    if args.prompts_per_step % world:
        raise UsageError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the number of processes "
                         f"({world}): each rank trains whole groups")
    if args.ar_trainable == "head" and (args.lora_rank or args.fsdp):
        raise UsageError("--ar-trainable head trains the AR's output layer alone: it takes neither --lora-rank "
                         "(adapters in the body) nor --fsdp (a layer this small is not worth sharding)")
    if args.fsdp and (args.lora_rank or args.dit_lora_rank or args.save_pipeline):
        raise UsageError("--fsdp shards full fine-tuning; LoRA adapters are small enough to replicate (drop --fsdp), "
                         "and --save-pipeline needs whole weights (resume the last checkpoint in one process)")
    if args.plan_gpus and not args.plan:
        raise UsageError("--plan-gpus sets the GPU counts of --plan's FSDP rows: add --plan, or drop it")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        raise UsageError(f"--micro-batch-size must be at least 1, got {args.micro_batch_size}")
    if min(args.beta, args.sample_every, args.lora_rank, args.weight_decay, args.lr_warmup_steps) < 0:
        raise UsageError("--beta, --sample-every, --lora-rank, --weight-decay and --lr-warmup-steps "
                         "must not be negative")
    if args.checkpoints_total_limit is not None and args.checkpoints_total_limit < 1:
        raise UsageError(f"--checkpoints-total-limit must be at least 1, got {args.checkpoints_total_limit}")
    if args.report_to != "none" and importlib.util.find_spec(args.report_to) is None:   # package = flag value
        raise UsageError(f"--report-to {args.report_to} needs the '{args.report_to}' package: "
                         f"pip install {args.report_to}")
    validate_dit_args(args)
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    check_writable("--out", args.out)
    if args.save_pipeline:
        target = Path(args.save_pipeline)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise UsageError(f"--save-pipeline {target} already exists; pick a new directory (nothing is overwritten)")
        check_writable("--save-pipeline", target)
    if args.model != TINY and not (Path(args.model) / "model_index.json").is_file():
        if not looks_like_hub_id(args.model):
            kind = "no such directory" if not Path(args.model).exists() else "not a directory with model_index.json"
            raise UsageError(f"--model {args.model}: {kind} (give 'tiny', a hub id like zai-org/GLM-Image, "
                             "or a save_pretrained directory)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for but no CUDA device is available")
    if args.offload and not (args.device != "cpu" and torch.cuda.is_available()):
        raise UsageError("--offload moves the frozen DiT, VAE and text encoder to a CUDA device when used; there is none here")


def validate_dit_args(args):
    for flag, value in {"--dit-lr": args.dit_lr, "--dit-clip-eps": args.dit_clip_eps,
                        "--dit-noise-level": args.dit_noise_level}.items():
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    steps = args.dit_train_steps
    if steps is not None and not 1 <= steps <= args.num_inference_steps:
        raise UsageError(f"--dit-train-steps must be between 1 and --num-inference-steps "
                         f"({args.num_inference_steps}), got {steps}")
    if args.dit_lora_rank < 0:
        raise UsageError("--dit-lora-rank must not be negative")
    if args.policy == "ar" and (args.dit_lora_rank or steps is not None):
        raise UsageError("--dit-lora-rank and --dit-train-steps need --policy dit or both")
    if args.policy == "dit" and args.lora_rank:
        raise UsageError("--lora-rank adapts the AR, which --policy dit does not train (use --dit-lora-rank)")


def validate_plan_args(args):
    """--plan's own checks (validate_args guards a run, and the plan loads and writes nothing)."""
    for k in args.plan_gpus or ():
        if k < 2:
            raise UsageError(f"--plan-gpus must be at least 2 (one GPU has nothing to shard with), got {k}")
        if args.prompts_per_step % k:
            raise UsageError(f"--prompts-per-step {args.prompts_per_step} must be divisible by --plan-gpus {k}: "
                             "each rank trains whole groups")


def looks_like_hub_id(name):
    """'owner/name' that is not a local path: a typo in './runs/x' or 'runs/x' (whose 'runs' is a
    local directory) must not be sent to the hub as a repo id."""
    owner = name.split("/", 1)[0]
    return (re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", name) is not None and not Path(name).exists()
            and not Path(owner).is_dir())


def check_writable(flag, path):
    """Fails now, not after loading the model or training: the nearest existing parent of `path`
    must be a directory we can create files in (probed with a temporary file, removed at once)."""
    import tempfile

    parent = Path(path).absolute()
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write in {parent} ({e.strerror})")


def resolve_runtime(args):
    """Values derived from flags, computed once and printed in the 'running with' block."""
    args.device = "cuda" if args.device == "auto" and torch.cuda.is_available() else (
        "cpu" if args.device == "auto" else args.device)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.offload is None:
        args.offload = args.device == "cuda"
    if args.lora_alpha is None:
        args.lora_alpha = float(args.lora_rank)
    if args.ar_trainable == "auto":
        args.ar_trainable = "head" if args.model == TINY and not (args.lora_rank or args.fsdp) else "all"
    if args.dit_train_steps is None and args.policy != "ar":
        args.dit_train_steps = max(args.num_inference_steps - 1, 1)
    if args.micro_batch_size is None:
        args.micro_batch_size = args.group_size
    return args


def open_run(args):
    """Everything before the first step. Validates the flags, takes the --out lock first (nothing is
    loaded for a run that may not write here), then loads prompts, rewards, the checkpoint and the
    model (start_training). If the start stops (bad input), a --out made for this run is removed
    again: bad input leaves nothing behind. Returns (items, trainer, start step, out, lead), or
    None when there is nothing to do. `lead`: rank 0, the one rank that writes and prints; `lock`: its
    --out lock (an open file; None on the other ranks)."""
    validate_args(args)
    out = prepare_out_dir(args)
    resolve_runtime(args)
    init_distributed(args)
    lead = rank() == 0
    made = [d for d in [out.absolute(), *out.absolute().parents] if not d.exists()]    # directories the lock will create
    lock = lock_out_dir(out) if lead else None     # held while the run lasts (the open file keeps it)
    started = None
    try:
        if lead:
            prepare_out_dir(args)      # again under the lock: another run may have started meanwhile
        started = start_training(args, out, lead)
    finally:
        if lead and started is None:
            lock.close()
            if made:
                (out / ".lock").unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    for directory in made:       # innermost first; stops at one that is not empty
                        directory.rmdir()
    return None if started is None else (*started, out, lead, lock)


def start_training(args, out, lead):
    """Everything between the lock and the first step: prompts, rewards, checkpoint, model, and the
    checks that need them. Returns (items, trainer, start step), or None when there is nothing to do."""
    # Targets are checked for the built-in mse before any plug-in loads (a CLIP model takes a
    # while), for plug-ins that read them once they are loaded.
    builtin = ["mse"] if any(spec.partition("=")[0] == "mse" for spec in args.reward) else []
    items = read_prompts(args.prompts, args.height, args.width, args.mode, need_targets=builtin)
    rewards = load_rewards(args.reward)
    readers = [r.name for r in rewards if r.uses_targets]
    if readers and not builtin:
        require_targets(items, readers)
    args.prompts_sha256 = file_sha256(args.prompts)
    ckpt_path = find_checkpoint(args.resume, out) if args.resume else None
    ckpt = read_checkpoint(ckpt_path) if ckpt_path else None
    if ckpt is not None:
        differences = check_resume_flags(ckpt["args"], args)
        if differences and not args.resume_force:
            raise UsageError(f"--resume {ckpt_path}: flags differ from the checkpoint's: {'; '.join(differences)} "
                             "(add --resume-force to accept)")
        if ckpt["step"] >= args.steps:
            print(f"nothing to do: {ckpt_path} is at step {ckpt['step']} and --steps is {args.steps} "
                  f"(pass --steps {ckpt['step'] + args.steps} to train {args.steps} more)")
            return None
        later = check_resume_point(ckpt_path, ckpt["step"], out, args)
    trainer, start = setup_training(args, ckpt, ckpt_path, rewards)
    check_prompt_lengths(trainer.pipe, items, args)
    if lead and ckpt is not None:
        keep_aside(later)
    return items, trainer, start


def check_prompt_lengths(pipe, items, args):
    """A prompt longer than the AR's context is a UsageError naming its line and the limit (a
    100k-character line otherwise ran for minutes at 3.6 GB with no message). The context
    (max_position_embeddings) holds the prompt, an i2i source's tokens, the generated tokens and
    the template's few grid markers (32 are set aside for them)."""
    grid = (args.height // 32) * (args.width // 32)
    others = (2 * grid + 1 if args.mode == "i2i" else generated_tokens(args.height, args.width)) + 32
    context = pipe.vision_language_encoder.config.text_config.max_position_embeddings
    lengths = [len(ids) for ids in pipe.processor.tokenizer([it.text for it in items], add_special_tokens=False)["input_ids"]]
    for item, length in zip(items, lengths):
        if length > context - others:
            raise UsageError(f"{item.where}: the prompt is {length} tokens; the model's context of {context} leaves "
                             f"{context - others} for a prompt at {args.height}x{args.width}")


def prepare_out_dir(args):
    """Refuses to write a new run over an old one: resuming is the only way to continue a run
    (also one killed before its first checkpoint: --resume latest then starts it over)."""
    out = Path(args.out)
    if args.resume is None and ((out / "metrics.jsonl").exists() or any((out / "checkpoints").glob("step_*.pt"))):
        raise UsageError(f"--out {out} already holds a run; pass --resume latest to continue it or pick another --out")
    return out


def lock_out_dir(out):
    """An exclusive fcntl.flock on <out>/.lock for the whole run, so that two runs never write
    into one --out. The OS releases it when the process ends, even on kill -9: no stale locks.
    Returns the open file; the lock lasts as long as it stays open."""
    import fcntl

    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / ".lock", "a")      # stays empty: a failed start leaves --out byte-identical
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"--out {out} is in use by another run; wait for it to finish or pick another --out")
    return handle


def check_resume_point(ckpt_path, step, out, args):
    """Resuming from step k of a run that went further (later checkpoints exist) would replace its
    history after k: refused unless --resume-force, which keeps the later checkpoints beside the
    new ones as step_*.pt.dropped (truncate_metrics keeps the later rows likewise). Returns them."""
    later = [p for p in sorted((out / "checkpoints").glob("step_*.pt")) if int(p.stem[5:]) > step]
    if later and not args.resume_force:
        raise UsageError(f"--resume {ckpt_path}: {out} has later checkpoints ({later[-1].name}); resuming from step "
                         f"{step} would drop them and the metrics after step {step} (add --resume-force to do so; "
                         "they are then kept as *.dropped)")
    return later


def keep_aside(checkpoints):
    """step_*.pt -> step_*.pt.dropped: out of --resume latest's way, not deleted."""
    for path in checkpoints:
        path.rename(path.with_name(path.name + ".dropped"))
        print(f"note: kept {path.name} of the dropped history as {path.name}.dropped")


def close_run(args, items, out, tracker, lock):
    """At the end, and on any exit: the reward curve (its moving average over one pass through the
    prompts), the tracker, the --out lock (rank 0 holds it)."""
    if lock:
        save_reward_curve(out / "reward_curve.png", read_metrics(out / "metrics.jsonl"),
                          window=min(20, math.ceil(len(items) / args.prompts_per_step)))
    if tracker:
        tracker.close()
    if lock:
        lock.close()     # (the process's end would release it too; an in-process caller may run again)


# =============================================================================================
# 15. Prompt files, images and the demo's targets
# =============================================================================================

EXIF_ORIENTATION = 0x0112


COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "white": (255, 255, 255), "black": (0, 0, 0), "orange": (245, 140, 30), "purple": (140, 60, 180)}


SHAPES = ("circle", "square", "triangle")


@dataclass
class PromptItem:
    """One prompt line. Its images are read (or drawn) each time a step asks for them, never kept:
    1,000 targets at 1024^2 held 4.6 GB per process. `target` / `source`: RGB, --width x --height,
    or None (no target given and no reward reads one; t2i has no source)."""
    text: str
    where: str                   # 'prompts.txt:3', for messages
    size: tuple                  # (height, width) images are resized to
    mode: str = "t2i"
    target_file: Path = None
    source_file: Path = None
    draw_target: bool = False    # no target file: draw the demo target from the prompt's words
    draw_source: bool = False    # i2i, no source file: draw the demo source

    @property
    def target(self):
        if self.target_file:
            return read_image(self.target_file, self.where, "target", self.size)
        if self.draw_target:
            return draw_demo(self.text, *self.size, self.where, "target" if self.mode == "i2i" else None)
        return None

    @property
    def source(self):
        if self.source_file:
            return read_image(self.source_file, self.where, "source", self.size)
        return draw_demo(self.text, *self.size, self.where, "source") if self.draw_source else None


def read_prompts(path, height, width, mode="t2i", need_targets=True):
    """Parses the prompt file. Line format: `prompt`, `prompt | target.png`, and in i2i
    `prompt | target.png | source.png` (paths relative to the prompt file). Blank lines and
    comment lines (first non-blank character '#') are skipped; a '#' later in a line is text
    ('colour #ff0000'); `\\|` is a '|' inside the prompt; tabs become spaces. Images of another
    size are resized to --width x --height; i2i sources too, which keeps them multiples of 32 px
    and lets a whole group decode in one call.
    need_targets: False (no reward reads targets: a missing target stays None, any line is a valid
    prompt), or True / the names of the rewards that read them (see require_targets).
    Every image is checked here (it opens, its header and size read) but its pixels are read only
    when a step uses it (PromptItem)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--prompts {path}: file not found")
    items, resized = [], False
    for lineno, raw in enumerate(read_utf8(path).splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        text, *paths = (part.strip() for part in re.split(r"(?<!\\)\|", line))
        text = text.replace("\\|", "|").replace("\t", " ")
        where = f"{path}:{lineno}"
        if not text:
            raise UsageError(f"{where}: empty prompt before '|'")
        if len(paths) > (2 if mode == "i2i" else 1):
            raise UsageError(f"{where}: too many '|' fields for --mode {mode} (write \\| for a '|' in the prompt)")
        paths += [""] * (2 - len(paths))
        files = [path.parent / p if p else None for p in paths]
        for file, name, kind in zip(files, paths, ("target", "source")):
            if file is None:
                continue
            w, h = check_image(file, where, kind)
            resized |= (w, h) != (width, height)
            if w * height != h * width:
                print(f"note: {where}: {kind} {name} is {w}x{h}, squashed to {width}x{height} "
                      "(another aspect ratio; crop it yourself to keep its proportions)")
        target_file, source_file = files
        draw_source = mode == "i2i" and source_file is None
        item = PromptItem(text, where, (height, width), mode, target_file, source_file,
                          draw_target=draw_source and target_file is None, draw_source=draw_source)
        if draw_source:
            demo_words_or_fail(text, where, mode)
        items.append(item)
    if not items:
        raise UsageError(f"--prompts {path}: no prompts (only blank or comment lines)")
    if resized:
        print(f"note: images resized to {width}x{height} (--width x --height)")
    if need_targets:
        require_targets(items, [] if need_targets is True else need_targets)
    return items


def require_targets(items, reward_names=()):
    """Every prompt needs a target (a reward reads them): one without a target file gets the demo
    target drawn from its words, or is a UsageError naming the line and the rewards."""
    for item in items:
        if item.target_file is None and not item.draw_target:
            demo_words_or_fail(item.text, item.where, item.mode,
                               f"the reward {', '.join(reward_names)} reads targets" if reward_names else "")
            item.draw_target = True


def read_utf8(path):
    """The prompt file as text. 'utf-8-sig' drops the BOM Windows editors put first (else it would
    glue itself to a first '# comment' line and make it a prompt)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        hint = " (it looks like UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise UsageError(f"--prompts {path}: not UTF-8 text{hint}: byte 0x{data[e.start]:02x} at offset {e.start}; "
                         "save the file as UTF-8")


def check_image(path, where, kind):
    """(width, height) of an image file as it will be shown, from its header alone (PIL decodes
    pixels only on load); a file PIL cannot identify, or whose data is broken, is a UsageError."""
    try:
        with Image.open(path) as image:
            image.verify()            # PNG: chunk CRCs (no decoding); other formats: what PIL can check
        with Image.open(path) as image:   # (verify must come first and leaves the file unusable)
            size = image.size
            turned = header_exif(image).get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)   # 90-degree turns
    except FileNotFoundError:
        raise UsageError(f"{where}: {kind} image {path} not found")
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise UsageError(f"{where}: {kind} {path} is not a readable image ({type(e).__name__})")
    return size[::-1] if turned else size


def header_exif(image):
    """EXIF tags without decoding pixels. (PNG's getexif() decodes the whole image to look for an
    eXIf chunk after the pixel data; one before it is in image.info.)"""
    if image.format != "PNG":
        return image.getexif()
    exif = Image.Exif()
    if "exif" in image.info:
        exif.load(image.info["exif"])
    return exif


def read_image(path, where, kind, size):
    """An image file as RGB, upright (its EXIF orientation applied, as viewers show a phone photo),
    resized to size = (height, width)."""
    try:
        with Image.open(path) as image:
            image = to_rgb(ImageOps.exif_transpose(image))
    except FileNotFoundError:
        raise UsageError(f"{where}: {kind} image {path} not found (it was there at start-up)", local=True)
    except (UnidentifiedImageError, OSError) as e:
        raise UsageError(f"{where}: {kind} {path} is not a readable image ({type(e).__name__})", local=True)
    return image if image.size == size[::-1] else image.resize(size[::-1], Image.BICUBIC)


def to_rgb(image):
    """RGB as the user sees the file. PIL's convert('RGB') alone gets two cases wrong:
    transparency is dropped, leaving whatever colour hides under alpha 0 (usually black), so
    transparent pixels are composited on white as viewers show them; and 16-bit greyscale
    ('I;16', 'I') is clipped to 0..255, turning almost every pixel white, so it is scaled by 255/65535."""
    if image.mode in ("I", "I;16", "I;16B", "I;16L"):
        scaled = np.asarray(image, dtype=np.float64) * (255.0 / 65535.0)
        return Image.fromarray(np.clip(scaled.round(), 0, 255).astype(np.uint8)).convert("RGB")
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba).convert("RGB")
    return image.convert("RGB")


def demo_words(prompt):
    words = re.findall(r"[a-z]+", prompt.lower())
    return [w for w in words if w in COLOURS], next((w for w in words if w in SHAPES), None)


def draw_shape(shape, colour, background, height, width):
    image = Image.new("RGB", (width, height), COLOURS[background])
    draw = ImageDraw.Draw(image)
    box = (width * 0.2, height * 0.2, width * 0.8, height * 0.8)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(width / 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLOURS[colour])
    return image


def demo_words_or_fail(prompt, where, mode, why=""):
    """(colours, shape) to draw the demo images from, or a UsageError saying what the line lacks
    (and `why` it needs them)."""
    colours, shape = demo_words(prompt)
    why = f"{why}; " if why else ""
    if mode == "t2i" and (not colours or shape is None):
        raise UsageError(f"{where}: no target image given and no colour+shape words to draw one "
                         f"({why}write 'prompt | target.png')")
    if mode == "i2i" and (len(colours) < 2 or shape is None):
        raise UsageError(f"{where}: --mode i2i needs 'prompt | target.png | source.png', or two colours and "
                         f"a shape to draw them (e.g. 'make the red circle blue'){f' ({why[:-2]})' if why else ''}")
    return colours, shape


def draw_demo(prompt, height, width, where, role=None):
    """Demo images from the prompt's words. t2i (role None): '<colour> <shape> on a <colour>
    background'. i2i, from '... <colour> <shape> ... <colour>', e.g. 'make the red circle blue':
    the source is the shape in the first colour, the target in the second, on white."""
    colours, shape = demo_words_or_fail(prompt, where, "t2i" if role is None else "i2i")
    if role is None:
        return draw_shape(shape, colours[0], colours[1] if len(colours) > 1 else "white", height, width)
    return draw_shape(shape, colours[0 if role == "source" else 1], "white", height, width)


# =============================================================================================
# 16. Reward plug-ins: --reward module:fn | file.py:fn
# =============================================================================================

def load_reward(spec):
    """'mse' | 'module:fn' | 'path/file.py:fn', each optionally followed by '=WEIGHT' -> Reward."""
    where, weight = spec, 1.0
    if "=" in spec:
        where, _, text = spec.rpartition("=")
        try:
            weight = float(text)
        except ValueError:
            raise UsageError(f"--reward {spec}: the weight after '=' must be a number, got {text!r}")
        if not math.isfinite(weight):
            raise UsageError(f"--reward {spec}: the weight after '=' must be finite, got {text!r}")
    if where == "mse":
        return Reward("mse", mse, weight, True)
    module_name, _, fn_name = where.rpartition(":")
    if not module_name or not fn_name:
        raise UsageError(f"--reward {spec}: expected 'mse', 'module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            if not Path(module_name).is_file():
                raise UsageError(f"--reward {spec}: file {module_name} not found")
            module_spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            # the current directory first, as `python -m` has it (`python grpo_glm.py` puts only
            # the script's own directory on sys.path)
            sys.path.insert(0, os.getcwd())
            try:
                module = importlib.import_module(module_name)
            finally:
                sys.path.remove(os.getcwd())
    except UsageError:
        raise
    except Exception as e:   # whatever the plug-in's own import raises
        raise UsageError(f"--reward {spec}: importing {module_name} failed: {type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]}")
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UsageError(f"--reward {spec}: {module_name} has no function {fn_name}")
    return Reward(fn_name, fn, weight, bool(getattr(fn, "uses_targets", False)))


def load_rewards(specs):
    rewards = [load_reward(spec) for spec in specs]
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        raise UsageError(f"--reward: two rewards share a name ({', '.join(names)}); rename one function")
    return rewards


# =============================================================================================
# 17. LOG: the console, metrics.jsonl, sample sheets, the reward curve, TensorBoard / W&B
# =============================================================================================

def start_logging(args, trainer, out, start):
    """Drops metrics rows a killed run wrote after its checkpoint, prints the 'running with' block
    and opens the tracker (or None)."""
    truncate_metrics(out / "metrics.jsonl", start)
    trainable = sum(p.numel() for p in trainer.trained.parameters() if p.requires_grad)
    ar_full = "head" if args.ar_trainable == "head" else "full"
    halves = {"ar": [("", args.lora_rank, ar_full)], "dit": [("DiT ", args.dit_lora_rank, "full")],
              "both": [("AR ", args.lora_rank, ar_full), ("DiT ", args.dit_lora_rank, "full")]}[args.policy]
    how = ", ".join(f"{half}{f'LoRA r={r}' if r else full}" for half, r, full in halves)
    print(f"running with: mode={args.mode} model={args.model} device={args.device} dtype={args.dtype} "
          f"offload={args.offload} batch={args.prompts_per_step}x{args.group_size} mu={args.inner_epochs} "
          + (f"lr={args.lr} " if args.policy != "dit" else "") + f"trainable={count_text(trainable)} ({how}) "
          f"image={args.height}x{args.width} loss_tokens={args.loss_tokens} dit_noise={args.dit_noise} out={out} "
          f"threads={torch.get_num_threads()} processes={world_size()} micro_batch={args.micro_batch_size}"
          + (f" policy={args.policy} dit_lr={args.dit_lr} dit_train_steps={args.dit_train_steps}/"
             f"{args.num_inference_steps} dit_noise_level={args.dit_noise_level}" if args.policy != "ar" else ""))
    print("rewards: " + " + ".join(f"{r.weight:g} x {r.name}" for r in trainer.rewards)
          + f" | lr schedule {args.lr_scheduler}, warm-up {args.lr_warmup_steps} | report to {args.report_to}")
    return open_tracker(args, out, start)


def count_text(n):
    """A parameter count readable at any size: 3.2k, 0.09M would be 90.1k, 8.91B."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}" if unit != "k" else f"{n / size:.1f}k"
    return str(n)


def finish_row(row, trainer, args, t0):
    """Adds the learning rates this step's updates used, moves the schedule on by one GRPO step,
    averages the row over ranks and times it."""
    lrs = trainer.lr_scheduler.get_last_lr()    # [AR][, DiT]
    if args.policy != "dit":
        row["lr"] = lrs[0]
    if args.policy != "ar":
        row["dit/lr"] = lrs[-1]
    with warnings.catch_warnings():
        # a step whose updates were all skipped (non-finite) never called optimizer.step();
        # the schedule still moves on by one GRPO step, as planned, and PyTorch need not warn
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        trainer.lr_scheduler.step()
    row = reduce_metrics(row)
    row["seconds"] = round(time.time() - t0, 3)
    return row


def log_step(row, step, args, trainer, out, tracker, warned):
    """metrics.jsonl, the tracker, one console line, the one-time collapse warning. Returns `warned`."""
    append_metrics(out / "metrics.jsonl", row)
    if tracker:
        tracker.log(row, step)
    dit_loss = f"dit loss {row.get('dit/loss', math.nan):+.3e}"     # ~1e-5: step log-probs are means
    losses = {"ar": f"loss {row['loss']:+.4f}", "dit": dit_loss,
              "both": f"loss {row['loss'] - row.get('dit/loss', math.nan):+.4f} | {dit_loss}"}[args.policy]
    print(f"step {step:4d}/{args.steps} | {losses} | reward {row['reward_mean']:.5f} "
          f"± {row['reward_std']:.5f} | " + "".join(
              f"{prefix}ratio {row[prefix + 'ratio_mean']:.4f} | {prefix}clip {row[prefix + 'clip_ratio']:.3f} "
              f"| {prefix}kl {row[prefix + 'kl']:.2e} | " for prefix in ("", "dit/") if prefix + "kl" in row)
          + (f"entropy {row['entropy']:.3f} | " if "entropy" in row else "")
          + f"zero_std {row['frac_reward_zero_std']:.2f} | {row['seconds']:.2f}s", flush=True)
    return warn_if_collapsed(row, warned, math.log(trainer.pipe.transformer.config.prior_vq_quantizer_codebook_size))


def append_metrics(path, row):
    """One JSON line per step. NaN and inf (a skipped update's loss, a broken reward) are written
    as null: JSON has no such numbers, and jq or JSON.parse reject Python's bare NaN."""
    row = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, allow_nan=False) + "\n")


def warn_if_collapsed(row, warned, max_entropy=None):
    """Once per run, on stderr: most groups tied, so most advantages are 0 and the step trained
    on (almost) nothing. The entropy tells why: near 0, the policy has collapsed and draws G
    identical samples; high (`max_entropy` = uniform over the codebook), the samples differ but
    the reward gives them all the same value (a 0/1 reward that no sample passes yet). Returns
    whether the warning has been given."""
    if warned or row["frac_reward_zero_std"] <= 0.5:
        return warned
    head = f"warning: step {row['step']}: {row['frac_reward_zero_std']:.0%} of groups have identical rewards"
    if "entropy" not in row:          # --policy dit: no AR entropy; the SDE noise keeps samples apart
        why = "the reward does not separate the samples"
    elif row["entropy"] < 0.5 * max_entropy:
        why = (f"entropy {row['entropy']:.3f} of {max_entropy:.2f}: the policy has collapsed; lower --lr or "
               "raise --temperature")
    else:
        why = (f"entropy {row['entropy']:.3f} of {max_entropy:.2f}: the samples differ but the reward does not "
               "separate them (a pass/fail reward that no sample passes?); make the reward graded")
    print(f"{head}: no learning signal: {why}", file=sys.stderr, flush=True)
    return True


def skip_cause(row):
    """What made a step skip all its updates: 'reward <names>', 'loss' or 'gradient'."""
    bad = [k[len("rewards/"):] for k, v in row.items() if k.startswith("rewards/") and not math.isfinite(v)]
    return f"reward {', '.join(bad)}" if bad else "loss" if row.get("skipped_nonfinite_loss") else "gradient"


def non_finite_stop(causes, step, out):
    """The message of the stop after 5 steps in a row whose updates were all skipped, naming what
    was non-finite and only checkpoints that exist (the weights are still those of the last step that
    updated, step - 5 or earlier)."""
    seen = list(dict.fromkeys(causes))
    advice = {"loss": "the policy's log-probs overflowed: try a lower --lr",
              "gradient": "try a lower --lr or --max-grad-norm"}
    what = "; ".join(f"non-finite {c} ({advice.get(c, 'fix the reward: it returned NaN or inf')})" for c in seen)
    found = sorted((out / "checkpoints").glob("step_*.pt"))
    saved = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was written yet (none reached --save-every)"
    return f"stopping: steps {step - len(causes) + 1}-{step} updated nothing: {what}; {saved}"


def truncate_metrics(path, last_step):
    """On resume, drop rows past the checkpoint's step (left by a run that died after it), so
    the log holds exactly one history. The dropped rows are kept beside it, and the run says so."""
    if not path.exists():
        return
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    kept = [line for line in lines if json.loads(line)["step"] <= last_step]
    dropped = [line for line in lines if json.loads(line)["step"] > last_step]
    if dropped:
        aside = path.with_name(f"metrics.dropped_after_step_{last_step:06d}.jsonl")
        atomic_write_bytes(aside, "".join(r + "\n" for r in dropped).encode())
        steps = [json.loads(line)["step"] for line in dropped]
        print(f"note: resuming at step {last_step} drops metrics rows of steps {steps[0]}..{steps[-1]} "
              f"(no checkpoint after step {last_step}); kept in {aside}")
    atomic_write_bytes(path, "".join(r + "\n" for r in kept).encode())


def read_metrics(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def save_samples(out, step, prompts, targets, images, rewards, sources, ode, args, tracker):
    sheet = save_sample_grid(out / "samples" / f"step_{step:06d}.png", prompts, targets, images, rewards,
                             args.group_size, sources, ode)
    if tracker:
        tracker.log_image("samples", sheet, step)


def save_sample_grid(path, prompts, targets, images, rewards, group_size, sources=None, ode=None, scale=None):
    """One row per prompt: (i2i: the source,) the target (if any), then its G samples captioned with
    their rewards, and (--policy dit|both, `ode` [P, 3, H, W]) the current DiT's deterministic a = 0
    decode. Images are how one notices collapse or reward hacking long before the numbers do.
    Returns the sheet (PIL) for the trackers."""
    scale = scale or max(1, 128 // images.shape[-1])          # cells at least 128 px wide, to be seen
    width, height = images.shape[-1] * scale, images.shape[-2] * scale
    caption = 14
    to_pil = lambda t: Image.fromarray((t.clamp(0, 1).permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    rows = []
    for row, prompt in enumerate(prompts):
        cells = [(sources[row], "source")] if sources is not None else []
        if targets is not None:
            cells.append((to_pil(targets[row]), "target"))
        cells += [(to_pil(images[i]), f"{rewards[i].item():.4f}")
                  for i in range(row * group_size, (row + 1) * group_size)]
        if ode is not None:
            cells.append((to_pil(ode[row]), "a=0 (ODE)"))
        rows.append((prompt, cells))
    sheet = Image.new("RGB", (len(rows[0][1]) * width, len(rows) * (height + 2 * caption)), "white")
    draw, font = ImageDraw.Draw(sheet), label_font()
    for r, (prompt, cells) in enumerate(rows):
        y = r * (height + 2 * caption)
        draw.text((2, y), drawable(prompt[:80], font), fill="black", font=font)
        for c, (image, label) in enumerate(cells):
            sheet.paste(image.resize((width, height), Image.NEAREST), (c * width, y + caption))
            draw.text((c * width + 2, y + caption + height), label, fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return sheet


@functools.lru_cache(maxsize=1)
def label_font():
    """Pillow's built-in font at 12 px (at its default 10 px some spaces shrink to nothing)."""
    from PIL import ImageFont

    return ImageFont.load_default(size=12)


def drawable(text, font):
    """`text` as `font` can draw it: a character it has no glyph for (the built-in font has ASCII,
    not even 'é') loses its accents ('é' -> 'e') or becomes '?' (emoji, CJK), instead of a box."""
    glyph = lambda ch: (lambda m: (m.size, bytes(m)))(font.getmask(ch))
    missing = glyph("\U0010FFFD")       # a private-use code point: the font's 'no glyph' box
    out = []
    for ch in text:
        if ch != " " and glyph(ch) == missing:
            plain = unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode()
            ch = plain if plain and all(c == " " or glyph(c) != missing for c in plain) else "?"
        out.append(ch)
    return "".join(out)


def save_reward_curve(path, rows, size=(640, 360), margin=48, window=1):
    """reward_curve.png: mean reward per step (thin line) +- the mean within-group std (band), and
    its moving average over `window` steps (thick line; the caller passes the steps one pass over
    the prompt file takes: with one prompt per step the raw curve zig-zags between prompts). Drawn
    with Pillow so that a run with no tracker still shows its curve. Written at the end and on
    Ctrl+C or SIGTERM."""
    rows = [r for r in rows if r["reward_mean"] is not None and r["reward_std"] is not None]   # null: non-finite
    if not rows:
        return
    steps = [r["step"] for r in rows]
    low = [r["reward_mean"] - r["reward_std"] for r in rows]
    high = [r["reward_mean"] + r["reward_std"] for r in rows]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(low), max(high)
    y0, y1 = (y0 - 1e-6, y1 + 1e-6) if y1 - y0 < 1e-6 else (y0, y1)
    w, h = size
    to_xy = lambda step, y: (margin + (step - x0) / (x1 - x0) * (w - 2 * margin),
                             h - margin - (y - y0) / (y1 - y0) * (h - 2 * margin))
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    band = [to_xy(s, y) for s, y in zip(steps, high)] + [to_xy(s, y) for s, y in zip(steps[::-1], low[::-1])]
    draw.polygon(band, fill=(190, 210, 240))
    means = [r["reward_mean"] for r in rows]
    draw.line([to_xy(s, m) for s, m in zip(steps, means)], fill=(110, 140, 220), width=1)
    title = "reward per step: mean +- within-group std"
    if 1 < window < len(rows):
        average = [sum(means[max(0, i - window + 1): i + 1]) / len(means[max(0, i - window + 1): i + 1])
                   for i in range(len(means))]
        draw.line([to_xy(s, m) for s, m in zip(steps, average)], fill=(20, 40, 140), width=3)
        title += f"; thick: moving average over {window} steps"
    draw.rectangle((margin, margin, w - margin, h - margin), outline="black")
    font = label_font()
    draw.text((margin, 8), title, fill="black", font=font)
    draw.text((4, margin - 14), f"{y1:.4g}", fill="black", font=font)
    draw.text((4, h - margin + 2), f"{y0:.4g}", fill="black", font=font)
    draw.text((margin, h - margin + 6), f"step {x0}", fill="black", font=font)
    draw.text((w - margin - 50, h - margin + 6), f"step {max(steps)}", fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
# Trackers (plumbing, not GRPO): the same rows as metrics.jsonl, plus the sample sheets and the
# flags. Imported only when asked for, so neither package is needed otherwise.

class TensorBoardTracker:
    """torch.utils.tensorboard's SummaryWriter, writing to <out>/logs. On resume, purge_step drops
    events a killed run wrote after its last checkpoint, as truncate_metrics does for the jsonl."""

    def __init__(self, out, args, start):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "logs"), purge_step=start + 1 if start else None)
        flags = "\n".join(f"| --{k.replace('_', '-')} | {v} |" for k, v in sorted(vars(args).items()))
        self.writer.add_text("flags", "| flag | value |\n|---|---|\n" + flags, global_step=start)

    def log(self, row, step):
        for key, value in row.items():
            if key != "step":
                self.writer.add_scalar(key, value, step)

    def log_image(self, name, image, step):
        self.writer.add_image(name, np.asarray(image), step, dataformats="HWC")

    def close(self):
        self.writer.close()


class WandbTracker:
    """Weights & Biases; WANDB_MODE=offline writes the run under <out>/wandb for a later `wandb sync`.
    Logged directly, not mirrored from TensorBoard with wandb.init(sync_tensorboard=True) as CleanRL
    does: that path syncs asynchronously, rounds values to fp32, and lost a run's events when it
    closed early (seen in this project's offline test)."""

    def __init__(self, out, args, start):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="grpo_glm", name=out.name, dir=str(out), config=vars(args))

    def log(self, row, step):
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def log_image(self, name, image, step):
        self.run.log({name: self.wandb.Image(image)}, step=step)

    def close(self):
        self.run.finish()


def open_tracker(args, out, start):
    """None for --report-to none (validate_args already checked that the package is installed)."""
    if args.report_to == "none":
        return None
    return (TensorBoardTracker if args.report_to == "tensorboard" else WandbTracker)(out, args, start)


# =============================================================================================
# 18. Interruptions: Ctrl+C and SIGTERM
# =============================================================================================

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)   # Ctrl+C; what Slurm, Kubernetes and torchrun send before SIGKILL


class AbandonStep(BaseException):
    """A stop signal came before the step's UPDATE: drop the step (a BaseException, so that no
    `except Exception` on the way, e.g. around a reward plug-in, swallows it)."""


class StopAfterStep:
    """Ctrl+C (SIGINT) and SIGTERM stop the run at a state that can be resumed, and exit 128 + signal
    number (130, 143). Before the step's UPDATE (sampling, decoding, rewards: most of a step) nothing
    has touched the weights yet, so the step is abandoned at once and the previous step is the one
    saved; a schedulers' grace period (Slurm's KillWait, Kubernetes' 30 s) is then enough. Once the
    update has begun, the step is finished and saved: a step updated by some inner epochs, not all,
    is no state to resume from. A second Ctrl+C stops at once (the last checkpoint is complete); a
    second SIGTERM changes nothing (Slurm signals every process and torchrun forwards its own, so a
    rank may get two). Under torchrun the ranks decide together (`before_update`, and the loop's
    check after each step)."""

    def __init__(self):
        self.signum = None          # the first stop signal received
        self.abandonable = False    # True from a step's start until its update begins
        self.previous = {s: signal.signal(s, self.request) for s in STOP_SIGNALS}

    @property
    def requested(self):
        return self.signum is not None

    def request(self, signum, _frame):
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        name = "Ctrl+C" if signum == signal.SIGINT else signal.Signals(signum).name
        if rank() == 0:
            print(f"\n{name}: " + ("abandoning this step (its update has not begun) and saving the last one"
                                   if self.abandonable else "finishing this step and saving a checkpoint")
                  + " (Ctrl+C to quit now)", file=sys.stderr, flush=True)
        if self.abandonable:
            self.abandonable = False
            raise AbandonStep

    def begin_step(self):
        self.abandonable, self.agreed = True, False
        if self.requested:          # came after the last step's stop check: nothing of this step to keep
            self.abandonable = False
            raise AbandonStep

    def agree(self):
        """True if any rank got a stop signal; all ranks then adopt its number (for the exit code)."""
        if is_ddp():
            seen = torch.tensor(int(self.signum or 0), device=collective_device())
            dist.all_reduce(seen, op=dist.ReduceOp.MAX)
            if seen.item() and not self.requested:
                self.signum = int(seen.item())
                if rank() == 0:
                    print(f"{signal.Signals(self.signum).name} on another rank: stopping", file=sys.stderr, flush=True)
        return self.requested

    def before_update(self):
        """Called by the step right before its UPDATE: the last moment to drop it. All ranks take
        part (a rank whose handler raised AbandonStep joins from the loop, see `agree_after_abandon`)."""
        self.abandonable, self.agreed = False, True
        if self.agree():
            raise AbandonStep

    def agree_after_abandon(self):
        """A rank that left its step early still answers the other ranks' before_update vote."""
        if not self.agreed:
            self.agreed = True
            self.agree()

    def exit_code(self):
        return 128 + self.signum

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stop_before_update(stop, trainer, args, out, step, last_saved, step_rng):
    """A stop signal arrived before this step's update: the weights are still step - 1's. Saves
    step - 1 (if not saved yet) and exits. If a rank was killed (kill -9, OOM; torchrun then
    SIGTERMs the rest), the others still hold step - 1 and rank 0 saves it alone."""
    lead = rank() == 0
    peers = True
    try:
        stop.agree_after_abandon()
    except Exception as e:
        if not (is_ddp() and collective_failed(e)):
            raise
        peers = False
    set_rng_state(step_rng)                   # what a checkpoint of step - 1 holds
    if step - 1 > last_saved and (peers or lead):
        save_step_checkpoint(out, step - 1, trainer, args, lead)
    if peers:
        all_ranks_agree(True)     # the others wait for rank 0's file before they exit
    if lead:
        print(f"interrupted in step {step} before its update: " + (
            f"step {step - 1} is saved in {out / 'checkpoints' / f'step_{step - 1:06d}.pt'}; continue with "
            f"--resume latest --out {out}" if step - 1 > 0 else "no step finished, nothing to save"), file=sys.stderr)
    sys.exit(stop.exit_code())


def exit_after_checkpoint(stop, out, step, path, lead):
    all_ranks_agree(True)     # the others wait for rank 0's file before they exit
    if lead:
        print(f"interrupted: saved step {step} to {path}; continue with --resume latest --out {out}", file=sys.stderr)
    sys.exit(stop.exit_code())


# =============================================================================================
# 19. CHECKPOINT
# =============================================================================================
# A checkpoint holds what an exact resume needs: trainable weights (all AR weights, or only the
# LoRA adapters), AdamW state, the learning-rate schedule's position, the step, every RNG state,
# and the flags. It is written to a temporary file, fsynced and renamed, so a crash or kill
# mid-write leaves the previous checkpoint intact; loading uses weights_only=True (no pickled
# code), so RNG states are stored as tensors and plain lists.

def atomic_write_bytes(path, data):
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state():
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [version, list(state), gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state):
    version, inner, gauss = state["python"]
    random.setstate((version, tuple(inner), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainable_state(model):
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def save_step_checkpoint(out, step, trainer, args, lead):
    """All ranks: the training state (gathered under --fsdp, a collective); rank 0 writes it. Weights
    and AdamW state are identical on every rank, and no rank-local randomness is left (sampling
    seeds are per group): rank 0's checkpoint is the whole state. Returns its path (rank 0)."""
    state = gather_training_state(trainer.trained, trainer.optimizer)
    if not lead:
        return None
    path = save_checkpoint(out, step, trainer.trained, trainer.optimizer, args, trainer.lr_scheduler, state)
    if args.checkpoints_total_limit:
        prune_checkpoints(out, args.checkpoints_total_limit)
    return path


def save_checkpoint(out_dir, step, model, optimizer, args, lr_scheduler, state=None):
    """Writes <out>/checkpoints/step_NNNNNN.pt atomically. A Ctrl+C or SIGTERM during the write is
    held back and re-raised once the file is complete. `state`: (weights, AdamW state) already
    gathered from the ranks under --fsdp (gather_training_state), in the same format as here."""
    path = out_dir / "checkpoints" / f"step_{step:06d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    trainable, optimizer_state = state or (trainable_state(model), optimizer.state_dict())
    payload = {"format": CHECKPOINT_FORMAT, "step": step, "trainable": trainable,
               "optimizer": optimizer_state, "lr_scheduler": lr_scheduler.state_dict(),
               "rng": rng_state(), "args": vars(args)}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    interrupted = []
    previous = {s: signal.signal(s, lambda signum, _: interrupted.append(signum)) for s in STOP_SIGNALS}
    try:
        atomic_write_bytes(path, buffer.getvalue())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for signum in interrupted:
        signal.raise_signal(signum)   # now handled as usual (see StopAfterStep)
    return path


def prune_checkpoints(out_dir, keep):
    """--checkpoints-total-limit: deletes all but the newest `keep` step checkpoints. Runs after a
    save has completed, so a complete newest checkpoint always exists."""
    for path in sorted((out_dir / "checkpoints").glob("step_*.pt"))[:-keep]:
        path.unlink()


def find_checkpoint(spec, out_dir):
    """--resume latest -> newest complete step_*.pt in <out>/checkpoints, or None when there is
    none yet (a run killed before its first checkpoint starts over, as in diffusers' scripts);
    else the given path."""
    if spec == "latest":
        found = sorted((out_dir / "checkpoints").glob("step_*.pt"))
        if not found:
            print(f"--resume latest: no checkpoint in {out_dir / 'checkpoints'} yet; starting from step 0")
            return None
        return found[-1]
    path = Path(spec)
    if not path.is_file():
        raise UsageError(f"--resume {spec}: file not found")
    return path


def read_checkpoint(path):
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a foreign or truncated file
        raise UsageError(f"--resume {path}: not a readable checkpoint ({type(e).__name__})")
    if not isinstance(ckpt, dict) or not str(ckpt.get("format", "")).startswith("grpo_glm-checkpoint-"):
        raise UsageError(f"--resume {path}: not a checkpoint of grpo_glm.py")
    if ckpt["format"] != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume {path}: written by an older grpo_glm.py ({ckpt['format']}, this one reads "
                         f"{CHECKPOINT_FORMAT}); start a new run")
    return ckpt


def check_resume_flags(saved_args, args):
    """Lists algorithm flags that differ from the checkpoint's; harmless ones (--steps, --out,
    intervals, --resume) may change freely. The prompt file counts by its contents (a hash), not
    by how its path was spelled: './prompts.txt' is 'prompts.txt', an edited file is not."""
    def describe(k):
        if k == "prompts_sha256":
            return f"--prompts {saved_args.get('prompts')} -> {args.prompts}: contents differ"
        return f"--{k.replace('_', '-')} {saved_args.get(k)} -> {getattr(args, k)}"
    return [describe(k) for k in ALGORITHM_FLAGS if saved_args.get(k) != getattr(args, k)]


def file_sha256(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def restore_checkpoint(ckpt, path, model, optimizer, lr_scheduler):
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(ckpt["trainable"]) != names:
        raise UsageError(f"--resume {path}: its weights do not fit this model (different --model or --lora-rank)")
    try:
        if not load_sharded_state(model, optimizer, ckpt["trainable"], ckpt["optimizer"]):   # --fsdp: section 21
            model.load_state_dict(ckpt["trainable"], strict=False)
            optimizer.load_state_dict(ckpt["optimizer"])
        lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    except (RuntimeError, ValueError) as e:
        raise UsageError(f"--resume {path}: its weights do not fit this model ({str(e).splitlines()[0][:120]})")
    set_rng_state(ckpt["rng"])


# =============================================================================================
# 20. The tiny model's renderer: pre-trained once on token mosaics, then cached
# =============================================================================================
# `--model tiny` is GLM-Image at toy size, built from the real classes (build_tiny_pipeline). Its
# AR stays random: learning what to paint from the prompt is GRPO's job. A random DiT + VAE would
# paint colour noise whatever the tokens say, and nothing GRPO does would show in the pictures; so
# the renderer learns a synthetic task: codebook id k means palette colour k, and a token grid's
# truth is its "mosaic", every 32-px cell filled with its token's colour. The VAE's latent carries
# the colour (channels 0-2 = the cell's colour in [-1, 1] per 8-px latent pixel): the VAE decoder
# is set to paint it (colour_vae), and the DiT learns by flow matching prior tokens -> that latent
# (train_tiny_renderer, ~15 s of CPU). The result is saved with save_pretrained to a cache
# directory and loaded with from_pretrained, the path a user's own checkpoint takes
# (tiny_pipeline_dir). Tests also use the untrained variant, renderer="random" (random DiT and VAE,
# ~1 s), where only the code path matters.

TINY_CODEBOOK = 64                       # real: 16384
TINY_VISION_VOCAB = TINY_CODEBOOK + 16   # real: 16512 (codebook + 128 special ids)
# A minimal stand-in chat template (the real processor ships its own). A source image sits between
# image start and end tokens: get_rope_index finds source images by those markers (and gives them
# 2-D positions); a bare <|image|> would be numbered like text.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
                      "<|dit_token_16384|><|image|><|dit_token_16385|>"
                      "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
TINY_RENDERER_FORMAT = "grpo_glm-tiny-renderer-v1"
TINY_RENDERER = dict(        # everything that shapes the training (all of it enters the cache key)
    dit_steps=800, dit_lr=3e-3, batch=8, dit_grids=((2, 2), (3, 3), (4, 4), (3, 2)), inference_steps=4,
)


def build_tiny_tokenizer():
    """A character-level tokenizer: the image tokens first (as in the real one, where the bos
    '<|dit_token_16384|>' is image_start_token_id), printable ASCII, GlmImageProcessor's specials."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    image_tokens = [f"<|dit_token_{i}|>" for i in range(TINY_CODEBOOK)]
    image_tokens += [f"<|dit_token_{16384 + i}|>" for i in range(TINY_VISION_VOCAB - TINY_CODEBOOK)]
    chars = [chr(c) for c in range(32, 127)]
    specials = ["<|image|>", "<sop>", "<eop>", "<pad>", "<unk>"]
    vocab = {t: i for i, t in enumerate(image_tokens + chars + specials)}
    # BPE with no merges = one token per character; the special tokens match as whole strings.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|dit_token_16384|>", eos_token="<|dit_token_16385|>",
        pad_token="<pad>", unk_token="<unk>", padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
    )


def build_tiny_pipeline(seed=0, ar_init_range=0.02, renderer="random"):
    """GLM-Image at toy size, seeded: renderer "random" or "mosaic" (the banner). `ar_init_range` >
    0.02 sharpens the AR's logits (tests: wrong M-RoPE positions then change log-probs visibly)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import (ByT5Tokenizer, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageProcessor,
                              T5Config, T5EncoderModel)
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    torch.manual_seed(seed)
    mosaic = renderer == "mosaic"
    tokenizer = build_tiny_tokenizer()
    # GLM-Image's image processor settings but min_pixels: the real 512^2 would upscale a small
    # source, while the pipeline VAE-encodes it at its own size (the DiT's source tokens would not line up).
    image_processor = GlmImageImageProcessorPil(patch_size=16, temporal_patch_size=1, merge_size=1,
                                                min_pixels=32 * 32, max_pixels=2048 * 2048,
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                  chat_template=TINY_CHAT_TEMPLATE)
    ar_config = GlmImageConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            vision_vocab_size=TINY_VISION_VOCAB, eos_token_id=TINY_CODEBOOK + 1,
            pad_token_id=tokenizer.pad_token_id,  # the default 167841 is outside a tiny vocabulary
            initializer_range=ar_init_range,
            # the mosaic AR rotates faster: at theta 1e4 with 4 rotary frequencies a grid row turns
            # the angle by 0.01 rad and a column by 0.001, and positions barely register
            rope_parameters={"rope_type": "default", "rope_theta": 4.0 if mosaic else 10000.0,
                             "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=64, patch_size=16, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=TINY_CODEBOOK, latent_channels=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"),
        image_start_token_id=TINY_CODEBOOK, image_end_token_id=TINY_CODEBOOK + 1,
    )
    ar = GlmImageForConditionalGeneration(ar_config)
    if mosaic:
        # At the default init a grid token's logits are set by the random token before it (the
        # input embedding dominates a 2-layer residual stream), and GRPO would learn one colour for
        # every cell of every prompt. Equal image-token embeddings (a cell's choice depends on the
        # prompt and its place, not on the tokens drawn before it) and q/k at 16x the init (attention
        # sharp enough to tell prompts apart) let lm_head read each (prompt, cell) off its own features.
        with torch.no_grad():
            image_embeddings = ar.model.language_model.embed_tokens.weight[:TINY_VISION_VOCAB]
            image_embeddings.copy_(image_embeddings.mean(0).expand_as(image_embeddings))
            for layer in ar.model.language_model.layers:
                layer.self_attn.q_proj.weight.mul_(16.0)
                layer.self_attn.k_proj.weight.mul_(16.0)
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    # patch_size x vae_scale_factor = 16 pixels per DiT token: the AR's 32-pixel tokens are
    # upsampled 2x before they reach the DiT (as in the real model).
    transformer = GlmImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16 if mosaic else 8,
        num_attention_heads=2, text_embed_dim=32, time_embed_dim=16, condition_dim=8,
        prior_vq_quantizer_codebook_size=TINY_CODEBOOK)
    if mosaic:
        vae = colour_vae()
    else:
        # A random DiT mostly ignores the tokens; a strong prior-token embedding restores the real
        # model's division of labour (tokens decide the content), which RL on the AR relies on.
        with torch.no_grad():
            transformer.prior_token_embedding.weight.mul_(30.0)
        vae = AutoencoderKL(
            block_out_channels=(8, 8, 8, 8), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=4,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(), processor=processor, text_encoder=text_encoder, vision_language_encoder=ar,
        vae=vae, transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler())
    # Built from configs, components start in train mode (T5's dropout would embed a prompt differently each call).
    for module in (ar, text_encoder, transformer, vae):
        module.eval()
    return pipe


def tiny_palette(codebook_size=TINY_CODEBOOK):
    """Colour [K, 3] in [0, 1] of each codebook id: id k paints the demo's colour k mod 8 (many ids
    per colour, as in a real VQ codebook; a random policy draws a cell's right colour 1 time in 8)."""
    names = ("red", "green", "blue", "yellow", "white", "black", "orange", "purple")
    colours = torch.tensor([COLOURS[n] for n in names], dtype=torch.float32) / 255
    return colours[torch.arange(codebook_size) % len(names)]


def token_mosaic(tokens, grid_hw, palette, cell=32):
    """tokens [N, H*W] -> the grid's truth [N, 3, H*cell, W*cell] in [0, 1]: each cell in its colour."""
    H, W = grid_hw
    colours = palette[tokens].view(-1, H, W, 3).permute(0, 3, 1, 2)
    return colours.repeat_interleave(cell, 2).repeat_interleave(cell, 3)


def colour_latents(tokens, grid_hw, palette, channels, cell):
    """The latent a grid decodes from [N, channels, H*cell, W*cell]: its mosaic in [-1, 1], then zeros."""
    mosaic = token_mosaic(tokens, grid_hw, palette, cell) * 2 - 1
    return torch.cat([mosaic, mosaic.new_zeros(mosaic.shape[0], channels - 3, *mosaic.shape[2:])], 1)


def random_grids(batch, grid_hw, codebook_size, generator):
    """Training grids [batch, H*W], each from a sub-palette of 1, 2, 4 or all colours (uniform
    fields and two-colour shapes as familiar to the renderer as confetti)."""
    rows = []
    for _ in range(batch):
        k = [1, 2, 4, codebook_size][int(torch.randint(4, (1,), generator=generator))]
        colours = torch.randperm(codebook_size, generator=generator)[:k]
        rows.append(colours[torch.randint(k, (grid_hw[0] * grid_hw[1],), generator=generator)])
    return torch.stack(rows)


def colour_vae(latent_channels=4, width=8, carrier=32.0):
    """A tiny AutoencoderKL whose decoder paints latent channels 0-2 upsampled 8x, set by hand (GroupNorm
    erases absolute colour, and gradient descent stalls): residual branches off, upsampler convs the
    identity, conv_in writes (c, -c) beside a constant pair (+carrier, -carrier), so the group's mean
    is 0 and its std ~ carrier / 2 whatever the colours; conv_out reads SiLU(c) - SiLU(-c) = c."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(
        block_out_channels=(width,) * 4, in_channels=3, out_channels=3, latent_channels=latent_channels,
        norm_num_groups=1, down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
    decoder, eye = vae.decoder, torch.eye(width)
    with torch.no_grad():
        for name, module in decoder.named_modules():
            if name.endswith((".conv2", ".to_out.0")):                       # residual branches: off
                module.weight.zero_(), module.bias.zero_()
            elif name.endswith("upsamplers.0.conv"):                          # nearest upsample, then identity
                module.weight.zero_(), module.bias.zero_()
                module.weight[:, :, 1, 1] = eye
        vae.post_quant_conv.weight.copy_(torch.eye(latent_channels)[:, :, None, None])
        vae.post_quant_conv.bias.zero_()
        decoder.conv_in.weight.zero_(), decoder.conv_in.bias.zero_()
        for c in range(3):
            decoder.conv_in.weight[c, c, 1, 1], decoder.conv_in.weight[3 + c, c, 1, 1] = 1.0, -1.0
        decoder.conv_in.bias[6:] = carrier * torch.tensor([1.0, -1.0]).repeat(width // 2)[: width - 6]
        decoder.conv_norm_out.weight.fill_(math.sqrt((decoder.conv_in.bias ** 2).mean().item()))
        decoder.conv_norm_out.bias.zero_()
        decoder.conv_out.weight.zero_(), decoder.conv_out.bias.zero_()
        for c in range(3):
            decoder.conv_out.weight[c, c, 1, 1], decoder.conv_out.weight[c, 3 + c, 1, 1] = 1.0, -1.0
    return vae.eval().requires_grad_(False)


def train_tiny_renderer(pipe, settings, seed):
    """Flow matching onto the colour latents, in place (fp32, CPU): x_t = scale_noise(x0, t, eps), target
    eps - x0, through the sampler's own conditioning and velocity (Part II). Returns the last loss."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    codebook = pipe.transformer.config.prior_vq_quantizer_codebook_size
    palette, cell, channels = tiny_palette(codebook), 32 // pipe.vae_scale_factor, pipe.vae.config.latent_channels
    dit = pipe.transformer.train().requires_grad_(True)
    optimizer = torch.optim.Adam(dit.parameters(), lr=settings["dit_lr"])
    loss, batch = torch.tensor(float("nan")), settings["batch"]
    # the glyph condition of "" per grid size, computed once (it does not depend on the tokens)
    conds = {hw: dit_condition(pipe, [""], batch, torch.zeros(batch, hw[0] * hw[1], dtype=torch.long), hw, 1.0)
             for hw in map(tuple, settings["dit_grids"])}    # one prompt, "", of `batch` rows: one DiT call
    for step in range(settings["dit_steps"]):
        hw = tuple(settings["dit_grids"][step % len(settings["dit_grids"])])
        timesteps, _ = dit_schedule(pipe, 32 * hw[0], 32 * hw[1], settings["inference_steps"])   # sets the scheduler
        tokens = random_grids(batch, hw, codebook, generator)                            # [B, H*W]
        x0 = colour_latents(tokens, hw, palette, channels, cell)                         # [B, C, h, w]
        t = timesteps[torch.randint(len(timesteps), (batch,), generator=generator)]
        eps = torch.randn(x0.shape, generator=generator)
        x_t = pipe.scheduler.scale_noise(x0, t, eps)
        cond = replace(conds[hw], prior=torch.cat([pipe._upsample_token_ids(row, *hw) for row in tokens]))
        v = dit_velocity(dit, x_t, t, cond, write_source_caches(dit, cond))
        loss = ((v - (eps - x0)) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    dit.eval().requires_grad_(False)
    return loss.item()


@contextlib.contextmanager
def quiet_progress_bars():
    """diffusers' and transformers' loading/saving bars, off for the duration."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    was = diffusers_logging.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    diffusers_logging.disable_progress_bar(), transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was[0]:
            diffusers_logging.enable_progress_bar()
        if was[1]:
            transformers_logging.enable_progress_bar()


def tiny_cache_key(seed, settings):
    """A hash of all that shapes the built model: seed, settings, format, library versions and the
    source of the functions that build and train it (an edit to any of them builds a new model)."""
    import inspect

    import diffusers
    import transformers

    code = [inspect.getsource(f) for f in (build_tiny_tokenizer, build_tiny_pipeline, colour_vae, tiny_palette,
                                            token_mosaic, colour_latents, random_grids, train_tiny_renderer,
                                            dit_schedule, dit_condition, dit_velocity, write_source_caches,
                                            policy_generation_config, image_token_suppression)]
    parts = {"format": TINY_RENDERER_FORMAT, "seed": seed, "settings": settings, "code": code,
             "constants": [TINY_CODEBOOK, TINY_VISION_VOCAB, TINY_CHAT_TEMPLATE],
             "versions": [torch.__version__, diffusers.__version__, transformers.__version__]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


TINY_WEIGHTED = ("vision_language_encoder", "text_encoder", "transformer", "vae")   # components with weight files
TINY_MANIFEST = "grpo_glm_tiny.json"   # written last: a directory without it (or with a wrong one) is never loaded


def tiny_cache_is_complete(path, key):
    """True only for a finished build of `key` whose files all match the manifest's sha256, with
    weights for every model."""
    try:
        manifest = json.loads((path / TINY_MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        weighted = all(any(name.startswith(f"{component}/") and name.endswith(".safetensors") for name in files)
                       for component in TINY_WEIGHTED)
        return manifest["key"] == key and weighted and all(
            hashlib.sha256((path / name).read_bytes()).hexdigest() == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def tiny_pipeline_dir(seed=0, settings=None):
    """`--model tiny`'s directory for this seed in $GRPO_GLM_CACHE (else $XDG_CACHE_HOME/grpo_glm or
    ~/.cache/grpo_glm), built on first use: in a temporary directory renamed into place after its
    manifest, under a lock a second run waits on. An entry that fails its manifest is rebuilt."""
    import shutil
    import tempfile

    from filelock import FileLock

    settings = dict(TINY_RENDERER if settings is None else settings)
    key = tiny_cache_key(seed, settings)
    root = Path(os.environ.get("GRPO_GLM_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "grpo_glm")
    final = root / f"tiny-seed{seed}-{key}"
    if tiny_cache_is_complete(final, key):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{final.name}.lock"):   # released when the block ends (or the process dies)
        if tiny_cache_is_complete(final, key):      # another run built it while we waited
            return final
        if final.exists():
            print(f"note: {final} is incomplete or corrupt; rebuilding it")
            shutil.rmtree(final)
        for stale in root.glob(f".{final.name}.tmp-*"):     # left by a killed build, never loaded
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
        try:
            start = time.time()
            print(f"building --model tiny (seed {seed}): a random AR, and a renderer (DiT) pre-trained on token "
                  f"mosaics for {settings['dit_steps']} steps, once ...", end=" ", flush=True)
            with torch.random.fork_rng(devices=[]):
                pipe = build_tiny_pipeline(seed, renderer="mosaic")
                pipe.set_progress_bar_config(disable=True)
                loss = train_tiny_renderer(pipe, settings, seed)
            ar = pipe.vision_language_encoder
            ar.generation_config = policy_generation_config(     # section 23
                ar, pipe.transformer.config.prior_vq_quantizer_codebook_size, temperature=1.0)
            with quiet_progress_bars():
                pipe.save_pretrained(tmp)
            files = {str(p.relative_to(tmp)): hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(tmp.rglob("*")) if p.is_file()}
            atomic_write_bytes(tmp / TINY_MANIFEST, json.dumps(
                {"key": key, "seed": seed, "settings": settings, "final_loss": loss, "files": files},
                indent=1).encode())
            os.rename(tmp, final)
            print(f"done in {time.time() - start:.0f} s (flow-matching loss {loss:.4f}), cached in {final}", flush=True)
        except BaseException:
            print("failed", flush=True)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


# =============================================================================================
# 21. More GPUs: torchrun data parallel (DDP) and sharding (--fsdp)
# =============================================================================================
# `torchrun --nproc_per_node K grpo_glm.py ...` starts K copies of this script (RANK, LOCAL_RANK and
# WORLD_SIZE in their environment). --prompts-per-step is the global count, cut into K contiguous
# blocks (DanceGRPO's layout): each rank samples, decodes, rewards and standardises whole groups of
# its own, so the advantages need no communication. What crosses ranks: the gradient average
# (DDP's all-reduce, FSDP's reduce-scatter) and a few scalars per step (metrics, the skip and stop
# decisions: all_reduce_scalars). Rank 0 alone writes metrics, samples and checkpoints.
# Why 1 process and K sample and train the same: a group's tokens are drawn from a seed of (seed,
# step, slot), its DiT noise from (seed, prompt), and every forward covers one micro-batch of rows
# cut the same way on any K (by default one group; the DiT one prompt's group, see dit_velocity).
# So the samples are the same, and the weights are too, up to the order of floating-point sums. In
# fp32 that order shows: AdamW divides each coordinate by its own size, and coordinates that are 0
# but for rounding (~1e-9, near its eps) then move apart by up to ~lr/10 (README, Measurements); in
# float64 (--dtype float64) 1 and K processes agree to rounding, as the tests check. A checkpoint
# written at one world size resumes exactly at another.

def float64_throughout(pipe):
    """--dtype float64 runs every weight-dependent sum in float64. Two library functions round to
    fp32 on purpose (a bf16 model needs it): the AR's RMSNorm (transformers' GlmImageRMSNorm) and
    the DiT's rotary embedding (diffusers' apply_rotary_emb, `x.float()`). In a float64 run they round
    activations to fp32, and a 1e-16 difference in sum order then flips an fp32 rounding (6e-8)
    here and there: 1 and 2 processes drifted 1e-9 apart on torch 2.14.1. Both are swapped for the
    same formula in at least fp32, which is the library's own at every other dtype."""
    import diffusers.models.embeddings as embeddings
    from transformers.models.glm_image.modeling_glm_image import GlmImageRMSNorm

    def rms_norm(self, x):
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)

    def rotary(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2, library=embeddings.apply_rotary_emb):
        if x.dtype != torch.float64 or (use_real, use_real_unbind_dim, sequence_dim) != (True, -2, 1):
            return library(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
        cos, sin = (f.to(x.device)[None, :, None, :] for f in freqs_cis)     # GLM-Image's DiT: [B, S, heads, D]
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        return x * cos + torch.cat([-x_imag, x_real], dim=-1) * sin

    for module in pipe.vision_language_encoder.modules():
        if isinstance(module, GlmImageRMSNorm):
            module.forward = rms_norm.__get__(module)
    if not getattr(embeddings.apply_rotary_emb, "float64_throughout", False):
        rotary.float64_throughout = True
        embeddings.apply_rotary_emb = rotary


def init_distributed(args):
    """Joins the process group torchrun describes (nothing to do for one process): gloo on CPU, nccl
    on CUDA. A rank that dies or hangs makes the others' next collective raise after --dist-timeout."""
    if launched_world_size() == 1:
        return
    if args.device == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        args.device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=args.dist_timeout))


def launched_world_size():
    """The process count torchrun set in the environment (readable before the group is joined)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_ddp():
    return dist.is_available() and dist.is_initialized()


def rank():
    return dist.get_rank() if is_ddp() else 0


def world_size():
    return dist.get_world_size() if is_ddp() else 1


def collective_device():
    """nccl reduces CUDA tensors only, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def rank_slots(prompts_per_step):
    """Positions (in the step's global prompt list) of this rank's groups: a contiguous block."""
    per_rank = prompts_per_step // world_size()
    return range(rank() * per_rank, (rank() + 1) * per_rank)


def wrap_for_training(model, device):
    """DistributedDataParallel around a module that trains: its backward averages the gradients, so
    every rank's AdamW takes the same step. Only the training forward goes through it (no `.generate`:
    no-grad passes use unwrap(model)). Buffers are not broadcast: none changes during training."""
    if not is_ddp() or is_sharded(model):        # FSDP2 shards in place and averages by itself
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.device(device)] if str(device).startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, forward_sync_buffers=False)


def unwrap(model):
    """The module inside a DDP wrapper, else the model."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def all_reduce_scalars(values, op):
    """Numbers reduced element-wise over ranks by `op` (dist.ReduceOp.SUM, MIN, MAX), as float64
    floats: one collective for the lot. Without torchrun, the values themselves."""
    if not is_ddp():
        return [float(v) for v in values]
    reduced = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(reduced, op=op)
    return reduced.tolist()


def all_ranks_agree(flag):
    """True only if `flag` is True on every rank. Decisions that change how many collectives a rank
    runs next (skip a non-finite update, stop after Ctrl+C) must be taken together, or one rank
    waits forever in an all-reduce the others never start."""
    return all_reduce_scalars([bool(flag)], dist.ReduceOp.MIN)[0] == 1


MAX_METRICS = ("logp_diff_max",)


def reduce_metrics(row):
    """A metrics row averaged over ranks (maxima for MAX_METRICS). Every rank holds as many samples
    of the same length, so the mean of the per-rank means is the global mean."""
    if not is_ddp():
        return row
    keys = [k for k in row if k != "step"]
    values = [float(row[k]) for k in keys]
    total, peak = all_reduce_scalars(values, dist.ReduceOp.SUM), all_reduce_scalars(values, dist.ReduceOp.MAX)
    reduced = {k: peak[i] if k in MAX_METRICS else total[i] / world_size() for i, k in enumerate(keys)}
    return {"step": row["step"], **{k: type(row[k])(v) for k, v in reduced.items()}}


def collective_failed(error):
    """True for an error raised inside torch.distributed or DDP: a peer that died or timed out (gloo
    reports one as a plain RuntimeError, hence the look at where it came from). Inside backward
    (DDP's all-reduce, FSDP's reduce-scatter) the frame is autograd's: the message names the backend."""
    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, dist.DistError) or bool(frames and (
        re.search(r"torch[/\\](distributed|nn[/\\]parallel)[/\\]", frames[-1].filename)
        or re.search(r"torch[/\\]autograd[/\\]", frames[-1].filename) and re.search(r"gloo|nccl", str(error), re.I)))
# --fsdp: FSDP2 (torch.distributed.fsdp.fully_shard). Each rank keeps 1/K of every trained weight,
# its gradient and AdamW moments (DTensors on a 1-D mesh). A unit's weights are all-gathered just
# before its forward and backward and freed after; gradients are reduce-scattered (averaged) into
# the shards after every backward. Units: each decoder layer, then the root (embeddings, norms,
# heads, the AR's frozen vision encoder and VQ). Sampling runs on whole weights (whole_weights):
# generate would otherwise all-gather every layer per generated token. Checkpoints hold whole
# weights and AdamW state, as a 1-process run writes them, so either resumes the other.

def is_sharded(model):
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


@functools.cache
def device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(collective_device().type, (world_size(),))


def shard_for_training(model, params, args, reference=None):
    """--fsdp under torchrun: shards `model` and its frozen KL `reference` in place; returns the
    trainable parameters, new DTensors that AdamW must be built on (else `params`). bf16: trained
    shards in fp32 (AdamW's updates of a bf16 weight round away), gathered as bf16, reduced in fp32."""
    if not (args.fsdp and is_ddp()):
        return params
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # The DiT returns a view (its unpatchify); FSDP2 warns in case the caller modifies it in place,
    # which would skip its pre-backward hook. Nothing here does (dit_velocity is out of place).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy()
    if args.dtype == "bfloat16":
        from diffusers.training_utils import cast_training_params

        cast_training_params(model, dtype=torch.float32)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for module in (model, reference):
        if module is None:
            continue
        for unit in sharded_layers(module):
            fully_shard(unit, mesh=device_mesh(), mp_policy=policy)
        # FSDP2 keeps a root's weights gathered after its forward (backward needs them at once), and
        # a root that never runs backward would keep them for good: the reference reshards at once.
        fully_shard(module, mesh=device_mesh(), mp_policy=policy,
                    reshard_after_forward=True if module is reference else None)
    return [p for p in model.parameters() if p.requires_grad]


def sharded_layers(module):
    """The units sharded one by one before the root: the AR's decoder layers, the DiT's blocks."""
    inner = getattr(module, "model", None)
    return inner.language_model.layers if inner is not None else module.transformer_blocks


@contextlib.contextmanager
def whole_weights(model):
    """A sharded model's whole weights, gathered for the duration (sampling and no-grad passes then
    run with no communication) and freed after. A no-op for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    model.set_reshard_after_forward(False)
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        model.set_reshard_after_forward(True)
        model.set_reshard_after_forward(False, recurse=False)   # FSDP2's default for the root
        for unit in units:
            unit.reshard()


def clip_gradients(params, max_norm):
    """torch's clip_grad_norm_ in its two halves, so that a sharded (DTensor) norm is reduced to the
    whole gradient's before it scales them (as torchtitan does). Returns the norm before clipping."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def gather_training_state(model, optimizer):
    """--fsdp: the trained weights and AdamW state gathered whole onto rank 0's CPU (a collective:
    every rank calls it), as (weights by name, optimizer.state_dict()-style AdamW state with
    parameters numbered in param-group order) -- the format a 1-process run saves. None for a
    model that is not sharded (save_checkpoint then reads model and optimizer itself)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=options)
    by_name = get_optimizer_state_dict(model, optimizer, options=options)
    if rank() != 0:
        return None
    index = {name: i for i, name in enumerate(n for group in by_name["param_groups"] for n in group["params"])}
    return weights, {"state": {index[n]: s for n, s in by_name["state"].items()},
                     "param_groups": [{**group, "params": [index[n] for n in group["params"]]}
                                      for group in by_name["param_groups"]]}


def load_sharded_state(model, optimizer, weights, optimizer_state):
    """--fsdp: loads whole weights and AdamW state (a checkpoint of any world size) into the shards
    (every rank calls it; each keeps its part). Returns False for a model that is not sharded."""
    if not is_sharded(model):
        return False
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_name = {"state": {order[i]: s for i, s in optimizer_state["state"].items()},
               "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                for group in optimizer_state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=options)
    return True


# =============================================================================================
# 22. Memory plan for the real GLM-Image (arithmetic on the real configs, meta device)
# =============================================================================================
# --plan prints the bytes one GPU holds, from the configs alone: the components are built on the
# meta device (shapes, no memory, no download). Weights in the model dtype (bf16 on CUDA: d = 2
# bytes); LoRA adapters, their gradients and AdamW moments in fp32 (a = 4); under full fine-tuning
# gradients and moments in the weights' dtype (torch's AdamW allocates its state like the
# parameter). The AR's terms were checked against the CPU allocator's live bytes for one update at
# the real width (test_slow_memory_plan_matches_a_measured_update_at_the_real_width) and, per
# layer, against autograd's saved tensors; the DiT's are estimates.

GiB = 1024 ** 3
ADAPTER_BYTES = 4        # LoRA adapters train in fp32 (prepare_policy): weights, grads, AdamW moments
FSDP_MASTER_BYTES = 4    # --fsdp's trained shards, their gradients and AdamW moments: fp32
# The real checkpoint's image-processor settings (its public config; the tiny model differs in min_pixels).
REAL_IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=1, merge_size=1, min_pixels=512 * 512,
                            max_pixels=2048 * 2048)


def saved_glm_image_on_meta(directory):
    """The components of a saved pipeline directory, from its config.json files, on meta."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import AutoConfig, GlmImageForConditionalGeneration, T5EncoderModel

    d = Path(directory)
    with torch.device("meta"):
        return {
            "ar": GlmImageForConditionalGeneration(AutoConfig.from_pretrained(d / "vision_language_encoder")),
            "dit": GlmImageTransformer2DModel.from_config(GlmImageTransformer2DModel.load_config(d / "transformer")),
            "glyph_t5": T5EncoderModel(AutoConfig.from_pretrained(d / "text_encoder")),
            "vae": AutoencoderKL.from_config(AutoencoderKL.load_config(d / "vae")),
        }


def saved_image_processor(directory):
    """The image processor a saved pipeline ships (it sets an i2i source's token count), else None."""
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    try:
        return GlmImageImageProcessorPil.from_pretrained(Path(directory) / "processor")
    except (OSError, ValueError):
        return None                                         # then the real checkpoint's settings


def numel(module):
    return sum(p.numel() for p in module.parameters())


def generated_tokens(height, width):
    """Tokens the AR writes for one t2i image: ~16x16 preview + (H/32)x(W/32) grid + 1 end slot
    (the preview as GlmImageProcessor._get_target_shape computes it)."""
    ratio = (height // 32) / (width // 32)
    preview = int(math.sqrt(ratio) * 16) * int(math.sqrt(1 / ratio) * 16)
    return preview + (height // 32) * (width // 32) + 1


def source_tokens(height, width, image_processor=None):
    """VQ tokens of one i2i source image at height x width, by the processor's own rule (1,024 at 1024^2)."""
    if image_processor is None:
        from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil
        image_processor = GlmImageImageProcessorPil(**REAL_IMAGE_PROCESSOR)
    return image_processor.get_number_of_image_patches(height, width) // image_processor.merge_size ** 2


def ar_sequence(mode, height, width, prompt_tokens=64, image_processor=None):
    """(P, L): prompt and generated tokens of one AR sample (section 4). i2i: the prompt also holds
    the source's VQ tokens between image start and end, and L is the grid + end slot (no preview)."""
    if mode == "t2i":
        return prompt_tokens, generated_tokens(height, width)
    return prompt_tokens + 2 + source_tokens(height, width, image_processor), (height // 32) * (width // 32) + 1


def head_dim(text_config):
    return getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads


# What one AR update holds, in bytes: d the model dtype's size, a = ADAPTER_BYTES, h hidden, kv the
# key/value width, i intermediate, r the LoRA rank, V the vision vocabulary, n samples x L generated
# logit rows. SDPA (flash, on CUDA and CPU) keeps no T^2 matrix, only a log-sum-exp per head.
#   per token, each layer    d (2h + 2kv + 3i)    q, k, v after RoPE, SDPA's output; gate_up's output, SiLU's
#                            + 4 heads + 4(4h + 4)  the LSE; the 4 RMSNorms' fp32 inputs and 1 / rms
#     + full fine-tuning     d (7h + i)           the norms' normalised values; inputs of q/k/v, o, gate_up, down
#     + LoRA                 a (5h + i) + 6 a r   the adapters' inputs cast to fp32 (q, k, v each cast theirs; an
#                                                 fp32 model keeps the shared ones, 3h + i), the A outputs
#     checkpointing          d h                  the layer's input; one layer is recomputed in full in backward
#   per token, outside       4h + 2 d rot         the final norm's fp32 input, M-RoPE's cos and sin (all layers)
#     + full fine-tuning     2 d h                the final norm's normalised value, lm_head's input
#   per logit row            d V                  the logits (held by ar_loss_terms till the next micro-batch)
#     forward                8 V                  token_logprobs' fp32 copy and its division by T
#     forward, 1st pass      24 V                 its log_softmax (4 V) + the entropy monitor (logits / T,
#                                                 log_softmax, exp, nan_to_num, product: 20 V)
#     backward               12 V                 the fp32 gradient chain of gather and log_softmax
#   frozen lm_head (LoRA)    n V h d              matmul broadcasts the weight over the logits_to_keep slice
#                                                 and the CPU's bmm copies it (CUDA may not: the plan is high)
#   step                     grads + one exp_avg_sq copy of all parameters (foreach AdamW, the CUDA
#                            default), or 2 x the largest tensor (per tensor, CPU)

def layer_activation_bytes(text_config, lora_rank=0, bytes_per=2):
    """Bytes one decoder layer keeps per token for its backward (the table above)."""
    h, i, heads = text_config.hidden_size, text_config.intermediate_size, text_config.num_attention_heads
    kv = text_config.num_key_value_heads * head_dim(text_config)
    d, a = bytes_per, ADAPTER_BYTES
    kept = d * (2 * h + 2 * kv + 3 * i) + 4 * heads + 4 * (4 * h + 4)
    if not lora_rank:
        return kept + d * (7 * h + i)
    return kept + a * (5 * h + i if d != a else 3 * h + i) + len(LORA_TARGETS) * a * lora_rank


def ar_update_bytes(text_config, samples, prompt_tokens, generated, lora_rank, checkpointing, trainable,
                    largest_trainable, head_trainable=0, bytes_per=2, foreach=True):
    """One micro-batch's forward/backward and AdamW step on top of the weights and moments (the table
    above): each phase's peak and their max, "peak". `head_trainable`: parameters whose gradients
    exist from the start of backward (final norm and lm_head; 0 under LoRA)."""
    d, h, V = bytes_per, text_config.hidden_size, text_config.vision_vocab_size
    tokens = samples * (prompt_tokens + generated - 1)       # teacher-forced input: prompt + generated[:-1]
    rows = samples * generated
    layer = layer_activation_bytes(text_config, lora_rank, d) * tokens
    layers = text_config.num_hidden_layers
    kept = layers * d * h * tokens if checkpointing else layers * layer
    rotary = int(head_dim(text_config) * text_config.rope_parameters.get("partial_rotary_factor", 1.0))
    outside = tokens * (4 * h + (0 if lora_rank else 2 * d * h) + 2 * rotary * d)
    state = ADAPTER_BYTES if lora_rank else d                 # gradients and moments: the parameters' dtype
    grads = state * trainable
    logits = rows * d * V
    head_copy = 0 if head_trainable else samples * V * h * d
    held = kept + outside + logits
    forward_model = held + max(head_copy, rows * 8 * V)
    forward_logits = held + rows * 24 * V
    backward_activations = max(held + rows * 12 * V, held + logits + head_copy,
                               kept + logits + layer if checkpointing else 0)
    backward = max(backward_activations + head_trainable * state, grads + logits)
    optimizer_temp = state * (trainable if foreach else 2 * largest_trainable)
    step = grads + optimizer_temp
    return {"grads": grads, "adam": 2 * state * trainable, "optimizer_temp": optimizer_temp,
            "activations": max(forward_model, forward_logits, backward_activations),
            "forward_model": forward_model, "forward_logits": forward_logits, "backward": backward, "step": step,
            "peak": max(forward_model, forward_logits, backward, step)}


def ar_weight_bytes(total_params, trainable, lora_rank, bytes_per=2):
    """The AR's weights in the model dtype, plus the fp32 LoRA adapters (not in a bare model's count)."""
    return bytes_per * total_params + (ADAPTER_BYTES * trainable if lora_rank else 0)


def trainable_tensors(ar, lora_rank):
    """Numels of the tensors prepare_policy trains: the language model and lm_head (the vision
    encoder and VQ stay frozen), or LoRA's A [r, in] and B [out, r] of each adapted Linear."""
    if not lora_rank:
        return [p.numel() for m in (ar.model.language_model, ar.lm_head) for p in m.parameters()]
    return [n for name, m in ar.model.language_model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS
            for n in (lora_rank * m.in_features, m.out_features * lora_rank)]


def memory_plan(components, height, width, samples, prompt_tokens=64, ranks=(64, 16), mode="t2i",
                image_processor=None, bytes_per=2, foreach=True, beta=0.0):
    """The AR's rows per training mode, without and with checkpointing; (rows, parameter counts,
    tokens per sample)."""
    ar = components["ar"]
    counts = {name: numel(module) for name, module in components.items()}
    frozen = {k: bytes_per * v for k, v in counts.items() if k != "ar"}
    prompt_len, generated = ar_sequence(mode, height, width, prompt_tokens, image_processor)
    head = numel(ar.model.language_model.norm) + numel(ar.lm_head)
    rows = []
    for rank in (0,) + tuple(ranks):
        tensors = trainable_tensors(ar, rank)
        trainable = sum(tensors)
        # the KL reference of full fine-tuning is a frozen copy of the AR (LoRA: adapters off)
        weights = ar_weight_bytes(counts["ar"], trainable, rank, bytes_per)
        weights += bytes_per * counts["ar"] if beta > 0 and not rank else 0
        for checkpointing in (False, True):
            u = ar_update_bytes(ar.config.text_config, samples, prompt_len, generated, rank, checkpointing,
                                trainable, max(tensors), 0 if rank else head, bytes_per, foreach)
            resident = weights + u["adam"]
            # between updates the gradients stay (zero_grad comes at the next update) while the frozen
            # parts run: offloaded, one at a time; else all of them, always
            rows.append({"mode": f"lora-{rank}" if rank else "full", "grad_ckpt": checkpointing,
                         "micro_batch": samples, "trainable_params": trainable, "ar_weights": weights,
                         "grads": u["grads"], "adam": u["adam"], "activations": u["activations"],
                         "update_peak": resident + u["peak"],
                         "peak_offload": resident + max(u["peak"], u["grads"] + max(frozen.values())),
                         "peak_no_offload": resident + max(u["peak"], u["grads"]) + sum(frozen.values())})
    return rows, counts, prompt_len + generated


def dit_lora_parameter_count(dit, rank):
    return sum(rank * (m.in_features + m.out_features) for n, m in dit.named_modules()
               if isinstance(m, torch.nn.Linear) and any(n.endswith(t) for t in DIT_LORA_TARGETS))


def dit_activation_bytes(dit, height, width, samples, cfg, checkpointing, text_tokens=64):
    """What one denoising step (Part II backpropagates one at a time) keeps for backward, bf16, x2 with
    CFG: per block and token ~30 x hidden values (attention as the AR's, a 4x GELU MLP), not measured;
    with checkpointing, each block's input and one block recomputed."""
    hidden = dit.config.num_attention_heads * dit.config.attention_head_dim
    block_inputs = ((height // 16) * (width // 16) + text_tokens) * samples * (2 if cfg else 1) * hidden * 2
    layers = dit.config.num_layers
    return layers * block_inputs + 30 * block_inputs if checkpointing else layers * 30 * block_inputs


def dit_memory_plan(components, height, width, samples, cfg, ar_row, text_tokens=64, ranks=(64,)):
    """--policy dit|both rows, as memory_plan's. Gradients accumulate over the trained steps beside one
    step's activations. 'dit': the frozen AR stays on the GPU; 'both' adds the trained AR (`ar_row`),
    whose activations are freed before the DiT's backward starts."""
    dit = components["dit"]
    counts = {name: numel(module) for name, module in components.items()}
    frozen = max(2 * v for k, v in counts.items() if k not in ("dit", "ar"))     # offloaded, one at a time
    rows = []
    for mode, trainable in [("full", counts["dit"])] + [(f"lora-{r}", dit_lora_parameter_count(dit, r)) for r in ranks]:
        lora = mode != "full"
        weights = 2 * counts["dit"] + (4 * trainable if lora else 0)
        state = ADAPTER_BYTES if lora else 2
        grads, adam = state * trainable, 2 * state * trainable
        for checkpointing in (False, True):
            act = dit_activation_bytes(dit, height, width, samples, cfg, checkpointing, text_tokens)
            dit_peak = weights + grads + adam + max(act, state * trainable) + frozen
            rows.append({"mode": mode, "grad_ckpt": checkpointing, "trainable_params": trainable, "dit_weights": weights,
                         "grads": grads, "adam": adam, "activations": act, "peak_dit": dit_peak + 2 * counts["ar"],
                         "peak_both": dit_peak + ar_row["ar_weights"] + ar_row["grads"] + ar_row["adam"]})
    return rows


# --fsdp, per GPU on K GPUs (section 21). Sharded: the trained weights as fp32 master shards, with
# fp32 gradients and two fp32 moments (16 bytes per parameter / K); the frozen ones (the AR's vision
# encoder and VQ) in bf16 / K. Gathered in bf16, whole on every GPU for a while:
#   the root unit (embeddings, heads, final norms, the AR's vision encoder and VQ), from its forward
#     to the end of its backward (FSDP2 does not reshard a root after forward);
#   two decoder layers: forward prefetches the next, backward the previous (_backward_prefetch);
#   at the end of a layer's backward, its reduce: the bf16 gradient and its fp32 copy (2 + 4 bytes
#     per parameter); the root's reduce comes last, when layers and activations are freed;
#   the whole model while it samples (whole_weights), beside its sampling working set.
# Peaks: the resident shards + the largest phase: sampling (all gradients, as zero_grad comes at the
# next update, + one half's whole weights, or a frozen part's turn), a half's backward beside its and
# the earlier halves' gradients, AdamW's step (foreach: one exp_avg_sq copy, the gradients' bytes).
# Not counted: all-gather buffers briefly doubled during a copy-out, the reference's no-grad pass
# (below the update's), the CUDA allocator's slack.

def ar_sampling_bytes(text_config, samples, micro_batch, prompt_tokens, generated, bytes_per=2):
    """The AR's working set while it samples `samples`: the larger of generate's KV cache and pi_old's
    no-grad pass over a micro-batch (the logits, their fp32 copy / T, its log_softmax: 2 + 4 + 4 bytes)."""
    kv = text_config.num_key_value_heads * head_dim(text_config)
    cache = samples * (prompt_tokens + generated) * text_config.num_hidden_layers * 2 * kv * bytes_per
    return max(cache, micro_batch * generated * text_config.vision_vocab_size * (bytes_per + 8))


def fsdp_shard_bytes(model, trainable, gpus, working, sampling=0, reference=False, bytes_per=2):
    """Per-GPU bytes of `model` sharded on `gpus` GPUs (the comment above), `working` bytes of
    activations per backward, `sampling` bytes of working set while it samples. "backward": its peak
    on top of the gradients, in a layer (gathered + activations + its reduce) or the root's reduce."""
    layers = [numel(layer) for layer in sharded_layers(model)]
    total, m, d = numel(model), FSDP_MASTER_BYTES, bytes_per
    gathered = d * (total - sum(layers) + 2 * max(layers))
    return {"weights": (m * trainable + d * (total - trainable)) / gpus,
            "grads": m * trainable / gpus, "adam": 2 * m * trainable / gpus,
            "reference": d * total / gpus if reference else 0,
            "gathered": gathered, "activations": working, "sampling": d * total + sampling,
            "backward": max(gathered + working + (d + m) * max(layers), (d + m) * (trainable - sum(layers)))}


def fsdp_peaks(halves, beside=0, offloaded=0):
    """Per-GPU peaks of the halves trained together, in grpo_update's order (the comment above), with
    `beside` bytes always on the GPU and `offloaded`, the largest frozen part, taking its turn."""
    resident = beside + sum(h["weights"] + h["adam"] + h["reference"] for h in halves)
    grads = sum(h["grads"] for h in halves)
    done, update = 0, 2 * grads
    for h in halves:
        done += h["grads"]
        update = max(update, done + h["backward"])
    sampling = grads + max(h["sampling"] for h in halves)
    return {"update_peak": resident + update, "sampling_peak": resident + sampling,
            "peak": resident + max(update, sampling, grads + offloaded)}


def fsdp_memory_plan(components, gpus, height, width, samples, batch, cfg, prompt_tokens=64, mode="t2i",
                     image_processor=None, beta=0.0):
    """--plan-gpus: --fsdp rows per GPU for each K in `gpus`, without and with checkpointing: the AR's
    micro-batch of `samples` (its working set as ar_update_bytes', no whole gradients), the DiT's
    step over batch // K samples. Frozen parts offloaded; under 'dit' the frozen AR stays whole."""
    ar, dit = components["ar"], components["dit"]
    counts = {name: numel(module) for name, module in components.items()}
    offloaded = max(2 * v for k, v in counts.items() if k not in ("ar", "dit"))
    prompt_len, generated = ar_sequence(mode, height, width, prompt_tokens, image_processor)
    head = numel(ar.model.language_model.norm) + numel(ar.lm_head)
    rows = []
    for k in gpus:
        for checkpointing in (False, True):
            working = ar_update_bytes(ar.config.text_config, samples, prompt_len, generated, 0, checkpointing,
                                      trainable=0, largest_trainable=0, head_trainable=head)["peak"]
            sampling = ar_sampling_bytes(ar.config.text_config, batch // k, samples, prompt_len, generated)
            a = fsdp_shard_bytes(ar, sum(trainable_tensors(ar, 0)), k, working, sampling, beta > 0)
            activations = dit_activation_bytes(dit, height, width, batch // k, cfg, checkpointing)
            d = fsdp_shard_bytes(dit, counts["dit"], k, activations, reference=beta > 0)
            rows.append({"gpus": k, "grad_ckpt": checkpointing, "ar": a, "dit": d,
                         **fsdp_peaks([a], offloaded=max(offloaded, 2 * counts["dit"])),
                         "peak_dit": fsdp_peaks([d], beside=2 * counts["ar"], offloaded=offloaded)["peak"],
                         "peak_both": fsdp_peaks([a, d], offloaded=offloaded)["peak"]})
    return rows


def print_table(columns, rows):
    """A markdown table: a header of `columns`, then one line of cells per row."""
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for cells in rows:
        print("| " + " | ".join(cells) + " |")


def plan_components(args):
    """(components, image processor) of --model: the tiny model, or a saved directory's or the real
    model's on meta (GlmImageConfig() is the real AR; the other sizes our reading of the checkpoint)."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import GlmImageConfig, GlmImageForConditionalGeneration, T5Config, T5EncoderModel

    if args.model == TINY:
        pipe = build_tiny_pipeline(args.seed, renderer="mosaic")
        return ({"ar": pipe.vision_language_encoder, "dit": pipe.transformer, "glyph_t5": pipe.text_encoder,
                 "vae": pipe.vae}, pipe.processor.image_processor)
    if Path(args.model).is_dir():
        return saved_glm_image_on_meta(args.model), saved_image_processor(args.model)
    with torch.device("meta"):
        return {
            "ar": GlmImageForConditionalGeneration(GlmImageConfig()),
            "dit": GlmImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=16, num_layers=30, attention_head_dim=128,
                num_attention_heads=32, text_embed_dim=1472, time_embed_dim=512, condition_dim=256,
                prior_vq_quantizer_codebook_size=16384),
            "glyph_t5": T5EncoderModel(T5Config(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12,
                                                num_heads=6, feed_forward_proj="gated-gelu")),
            "vae": AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                                 block_out_channels=(128, 512, 1024, 1024), layers_per_block=3,
                                 down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4),
        }, None


def print_memory_plan(args):
    validate_plan_args(args)
    components, image_processor = plan_components(args)
    # AR activations are held for one micro-batch (--micro-batch-size samples, default G); the DiT's
    # update runs a denoising step over the whole batch at once.
    samples, batch = args.micro_batch_size or args.group_size, args.group_size * args.prompts_per_step
    ranks = (args.lora_rank,) if args.lora_rank else (64, 16)
    rows, counts, tokens = memory_plan(components, args.height, args.width, samples, ranks=ranks, mode=args.mode,
                                       image_processor=image_processor, beta=args.beta)
    prompt_len, generated = ar_sequence(args.mode, args.height, args.width, image_processor=image_processor)
    # the tiny model's bytes would all print as 0.0 GiB: small models get MiB and thousands
    unit, unit_name = (GiB, "GiB") if max(r["peak_no_offload"] for r in rows) >= GiB else (1024 ** 2, "MiB")
    count_div, count_name = (1e6, "M") if max(counts.values()) >= 1e8 else (1e3, "k")
    size = lambda *values: [f"{v / unit:.1f}" for v in values]
    print(f"parameters of {args.model}: " + ", ".join(f"{k} {v / count_div:,.1f} {count_name}" for k, v in counts.items()))
    layout = f"{prompt_len} prompt + {generated} generated"
    if args.mode == "i2i":
        layout = layout.replace(" prompt", f" prompt incl. the source's {source_tokens(args.height, args.width, image_processor)} VQ tokens")
    print(f"--mode {args.mode}, teacher-forced pass: {samples} samples x {tokens} tokens ({layout}, "
          f"{args.height}x{args.width}); estimates in {unit_name}, bf16 weights, torch's AdamW (foreach)"
          + (", KL reference copy for full fine-tuning" if args.beta > 0 else "") + "\n")
    print_table(["mode", "grad ckpt", "micro-batch", "trainable", "AR weights", "grads", "AdamW", "activations",
                 "update peak", "peak, offload", "peak, no offload"],
                [[r["mode"], "yes" if r["grad_ckpt"] else "no", str(r["micro_batch"]),
                  f"{r['trainable_params'] / count_div:.1f} {count_name}",
                  *size(*(r[k] for k in ("ar_weights", "grads", "adam", "activations", "update_peak",
                                         "peak_offload", "peak_no_offload")))] for r in rows])
    ar_row = next(r for r in rows if r["mode"] == f"lora-{ranks[0]}" and r["grad_ckpt"])
    dit_rows = dit_memory_plan(components, args.height, args.width, batch, args.guidance_scale > 1, ar_row)
    print(f"\nDiT (Flow-GRPO, --policy dit|both): one denoising step's forward over {batch} samples, "
          f"CFG {'on' if args.guidance_scale > 1 else 'off'}; 'both' adds the AR's {ar_row['mode']} weights, grads and AdamW")
    print_table(["DiT mode", "grad ckpt", "trainable", "DiT weights", "grads", "AdamW", "activations", "peak, dit",
                 "peak, both"],
                [[r["mode"], "yes" if r["grad_ckpt"] else "no", f"{r['trainable_params'] / count_div:.1f} {count_name}",
                  *size(*(r[k] for k in ("dit_weights", "grads", "adam", "activations", "peak_dit", "peak_both")))]
                 for r in dit_rows])
    if args.plan_gpus:
        print_fsdp_plan(fsdp_memory_plan(components, args.plan_gpus, args.height, args.width, samples, batch,
                                         args.guidance_scale > 1, mode=args.mode, image_processor=image_processor,
                                         beta=args.beta), samples, batch, size)
    else:
        print("\n(--plan-gpus K adds the per-GPU rows of --fsdp, full fine-tuning sharded over K GPUs)")


def print_fsdp_plan(rows, samples, batch, size):
    """fsdp_memory_plan's rows as two tables, the AR's and the DiT's; `size` formats bytes in the plan's unit."""
    def table(half, title, peaks):
        print_table(["GPUs", "grad ckpt", title, "grads", "AdamW", "gathered", "activations", *peaks],
                    [[str(r["gpus"]), "yes" if r["grad_ckpt"] else "no",
                      *size(r[half]["weights"] + r[half]["reference"],
                            *(r[half][k] for k in ("grads", "adam", "gathered", "activations")),
                            *(r[k] for k in peaks.values()))] for r in rows])

    print(f"\n--fsdp, full fine-tuning, per GPU on K GPUs: fp32 shards of the trained weights, their gradients and "
          f"AdamW (16 bytes per parameter / K), the bf16 root + 2 layers gathered, a micro-batch of {samples}; "
          "frozen parts offloaded")
    table("ar", "AR weights", {"update peak": "update_peak", "sampling peak": "sampling_peak", "peak": "peak"})
    print(f"\nDiT under --fsdp, per GPU: one denoising step over {batch} / K samples; 'dit' keeps the frozen AR "
          "whole on every GPU, 'both' its shards, gradients and AdamW (fewer bytes from about K = 8)")
    table("dit", "DiT weights", {"peak, dit": "peak_dit", "peak, both": "peak_both"})


# =============================================================================================
# 23. Saving and using the trained model (--save-pipeline, generate_images)
# =============================================================================================

def save_trained_pipeline(pipe, args):
    """Writes a pipeline that GlmImagePipeline.from_pretrained(dir) loads as usual: LoRA merged into
    the weights (no adapter code needed to load), the AR's generation config the trained policy."""
    ar = pipe.vision_language_encoder
    if args.lora_rank and args.policy != "dit":
        merge_lora(ar)
    if args.dit_lora_rank:
        pipe.transformer.fuse_lora()        # diffusers' merge, W += B @ A * alpha / r
        pipe.transformer.unload_lora()      # each peft wrapper back to its base Linear
    ar.generation_config = policy_generation_config(
        ar, pipe.transformer.config.prior_vq_quantizer_codebook_size, args.temperature)
    pipe.save_pretrained(args.save_pipeline)
    print(f"saved the trained pipeline to {args.save_pipeline}")


def policy_generation_config(ar, codebook_size, temperature):
    """The trained policy, softmax(logits / T) with the special ids suppressed (as sample_group draws),
    as the config the pipeline's AR stage samples with. The real one's suppresses nothing: a briefly
    trained AR then writes image start/end ids mid-grid and the pipeline crashes."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
        suppress_tokens=image_token_suppression(ar, codebook_size),
        bos_token_id=ar.generation_config.bos_token_id, pad_token_id=ar.config.text_config.pad_token_id,
        eos_token_id=ar.config.text_config.eos_token_id)


def merge_lora(ar):
    """peft's LoraLayer.merge (W += B @ A * alpha / r), each wrapper then swapped for its base Linear:
    transformers' add_adapter API has no merge, and peft's merge_and_unload needs a PeftModel."""
    from peft.tuners.lora import LoraLayer

    wrappers = [(name, module) for name, module in ar.named_modules() if isinstance(module, LoraLayer)]
    for name, module in wrappers:
        module.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(ar.get_submodule(parent_name), child, module.get_base_layer())
    ar.peft_config = {}
    ar._hf_peft_config_loaded = False
    return ar


@torch.no_grad()
def generate_images(pipe, prompts, sources=None, height=64, width=64, num_inference_steps=4, guidance_scale=1.0,
                    temperature=None, seed=0):
    """Text-to-image, or edits of `sources` (one PIL image per prompt), with a pipeline trained here
    (from_pretrained(--save-pipeline dir), or main()'s return value): one PIL image per prompt. It
    runs the training's sample_group and decode_images; the library's `pipe(prompt, image=[source])`
    fails (diffusers 0.42.1 with transformers 5, see encode_sources). temperature: default the saved
    generation config's. Seeds the global torch RNG (generate takes no generator)."""
    if height % 32 or width % 32:
        raise ValueError(f"height and width must be multiples of 32, got {height}x{width}")
    if sources is not None and len(sources) != len(prompts):
        raise ValueError(f"one source per prompt: got {len(sources)} sources for {len(prompts)} prompts")
    ar = pipe.vision_language_encoder
    temperature = temperature or getattr(ar.generation_config, "temperature", None) or 1.0
    pipe.processor.tokenizer.padding_side = "left"        # as load_pipeline sets it for training
    if sources is not None:                               # upright, at the trained size
        sources = [to_rgb(ImageOps.exif_transpose(s)).resize((width, height), Image.BICUBIC) for s in sources]
    noise = group_noise(pipe, range(len(prompts)), 1, height, width, seed, 0, "per-prompt")
    images = []
    for k, prompt in enumerate(prompts):
        torch.manual_seed(seed * 1_000_003 + k)
        source = sources and sources[k: k + 1]
        rollout = sample_group(pipe, [prompt], 1, temperature, height, width, "target", sources=source,
                               record_logp=False)
        images.append(decode_images(pipe, [prompt], rollout, noise[k: k + 1], num_inference_steps, guidance_scale,
                                    source))
    pixels = torch.cat(images).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray((p * 255).round().astype(np.uint8)) for p in pixels]


# =============================================================================================
# 24. Entry point
# =============================================================================================

def main(argv=None):
    args = parse_args(argv)
    try:
        if args.plan:
            print_memory_plan(args)
            return
        return train(args)
    except UsageError as e:
        where = int(os.environ.get("RANK", "0"))      # torchrun's rank (the group may not be joined yet)
        if e.local and launched_world_size() > 1:
            print(f"error: rank {where}: {e}", file=sys.stderr)
        elif where == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if not (is_ddp() and collective_failed(e)):
            raise
        print(f"error: rank {rank()} lost contact with the other processes ({str(e).splitlines()[0][:160]}): "
              f"one died or hung past --dist-timeout; its own output says why", file=sys.stderr)
        sys.exit(1)
    finally:
        if is_ddp():
            dist.destroy_process_group()


def release_process_group_holders():
    """Under torchrun: frees the trained model while Python is fully alive. DDP's and FSDP's state
    keeps the process group referenced past destroy_process_group; left to interpreter exit, its gloo
    threads release tensors when no thread may take the GIL any more, and a finished rank dies of
    SIGABRT ("terminate called without an active exception"; pytorch PR 179291 describes it)."""
    gc.collect()


if __name__ == "__main__":
    main()
    release_process_group_holders()
