"""GRPO for GLM-Image, in one file.

  pip install -r requirements.txt
  python grpo_glm.py --steps 40 --out runs/demo   # the tiny GLM-Image (section 21), ~2 min on a CPU
  python grpo_glm.py --reward my_rewards.py:score --report-to tensorboard --out runs/mine
  python grpo_glm.py --model zai-org/GLM-Image --lora-rank 64 --height 512 --width 512 --out runs/ar
  python grpo_glm.py --plan --model zai-org/GLM-Image     # memory plan at 1024x1024, no GPU
  torchrun --nproc_per_node 8 grpo_glm.py --prompts-per-step 8 --out runs/glm8  # section 22

GLM-Image is a hybrid: an autoregressive (AR) transformer writes a grid of discrete image tokens,
and a diffusion transformer (DiT) + VAE paint the pixels they describe. The AR is the policy:

    prompt --AR samples tokens y ~ pi_theta(.|prompt)--> y --DiT+VAE--> image --reward--> r

GRPO (Shao et al. 2024, DeepSeekMath) needs no value network: it samples a group of G images per
prompt, standardises each reward within its group, A_i = (r_i - mean(r)) / (std(r) + eps), and
pushes the policy up on better-than-average samples with PPO's clipped surrogate (Schulman et al.
2017), optionally with a KL penalty towards the initial model.

Reading map: Part I (sections 1-11) is GRPO on the AR in a step's order; Part II (12-13) Flow-GRPO's
step (--policy dit|both); Part III (14-25) plumbing, GLM-Image's machinery first. Copy out (tested):
mse_reward, group_advantages, grpo_loss, sde_step, dit_kl need only torch; token_logprobs also
kept_logits, dropped_by_warpers and a SamplingParams (any object with its 4 fields).
Symbols: N = P x G samples (P prompts, G group size), S prompt tokens (padded), L generated tokens,
H x W target grid in tokens (32H x 32W px), V vocabulary, K denoising steps, T of them trained.
"""

import argparse
import contextlib
import copy
import datetime
import fcntl
import functools
import gc
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import random
import re
import runpy
import shutil
import signal
import sys
import tempfile
import time
import unicodedata
import warnings
from dataclasses import dataclass, make_dataclass, replace
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":     # Ctrl+C outside section 19's handler: one line
    sys.excepthook = lambda kind, *rest: sys.__excepthook__(kind, *rest) if kind is not KeyboardInterrupt else print(
        "\ninterrupted: every checkpoint written is complete", file=sys.stderr)

import numpy as np
import torch
import torch.distributed as dist
from filelock import FileLock
from PIL import Image, ImageDraw, ImageFont, ImageOps, UnidentifiedImageError

CHECKPOINT_FORMAT = "grpo_glm-checkpoint-v3"   # v3: AdamW state keyed by parameter name, at every world size
TINY = "tiny"


class UsageError(Exception):
    """Bad input: one line on stderr, exit code 2, no traceback. Under torchrun rank 0 prints it, or
    with `local=True` (a reward failing on its images) the rank it failed on."""

    def __init__(self, message, local=False):
        super().__init__(message)
        self.local = local


# PART I. GRPO on the autoregressive half, from the flags to the training loop
# A whole run, in a step's order. GLM-Image's machinery sits behind the calls named
# here (section 14); read their names and comments, not their code.


# ==== 1. Settings
# All flags: flag_parser (section 15); the loss's and update's (default):
#     --group-size G (32)          samples per prompt (sections 4, 7)
#     --prompts-per-step P (2)     a step's batch is N = P x G samples
#     --temperature, --top-k/-p    the policy pi (section 4)
#     --reward (mse)               what an image scores; repeated: a sum (6)
#     --loss-tokens (target)       the tokens the loss covers (sections 4, 9)
#     --clip-eps (0.2), --beta (0) PPO's clip range, the KL's weight (9)
#     --inner-epochs mu (4), --lr  AdamW passes over a batch (10)
#     --max-grad-norm (1.0)        the gradient norm's clip (10)
#     --micro-batch-size (G)       samples a forward (8, 10)
#     --policy (ar)                what trains: the AR; dit|both: Part II
# A pretrained --model has its model card's defaults (--model X --help shows them).
# A new flag: add it to its group in flag_parser, read it where it is used.
# --resume refuses a changed flag of a group titled "(a resume must match)".
# A checkpoint older than a flag compares it at its parser default, so a new
# flag's value must stay what the parser gave (None: resolve it where it is read).


# ==== 2. Model
# GLM-Image is one diffusers GlmImagePipeline: the AR (transformers'
# GlmImageForConditionalGeneration), the policy, and a frozen renderer
# (glyph encoder, DiT, VAE). load_pipeline loads it; prepare_policy picks what
# trains: LoRA adapters (--lora-rank) or the AR's own weights (both section 14).
# `--model tiny` (section 21): the real classes at toy size, the real code path.


# ==== 3. A step's prompts
# Run.steps (section 19) picks the step's P prompt lines (under torchrun, this
# rank's share). step_prompts reads their texts, target images, i2i sources.
# seeded(seed, purpose, step, index) gives every random stream its own generator.


# ==== 4. SAMPLE: G token grids per prompt, with the log-prob of every sampled token
# The prompt names the target grid: H x W image tokens, each 32 x 32 px. The AR writes
#     h*w preview tokens | H*W target-grid tokens | 1 end slot
# (a ~16 x 16 preview at any size, first; i2i: none). At 128 px: 256 + 16 + 1 = 273
# tokens, the target grid generated[:, 256:272]. Only the target grid reaches the DiT.
# Token positions are M-RoPE's (time, row, column); grid cell (i, j) sits at
# (s, s + i, s + j). The loss must use them too: old_logprobs says why.

@dataclass
class Rollout:
    sequences: torch.Tensor       # [N, S+L] prompt (left-padded) + generated tokens
    attention_mask: torch.Tensor  # [N, S+L-1] of the forward's input, sequences[:, :-1]
    position_ids: torch.Tensor    # [3, N, S+L-1] its M-RoPE positions, the sampler's
    sampler_logp: torch.Tensor    # [N, L] log pi(token), as the sampler drew it
    loss_mask: torch.Tensor       # [N, L] 1 on the tokens the loss covers
    target_tokens: torch.Tensor   # [N, H*W] the target grid, row-major
    grid_hw: tuple                # (H, W) of the target grid in tokens
    prompt_len: int               # S
    source_prior: list = None     # i2i, per sample: the source's VQ ids for the DiT
    old_logp: torch.Tensor = None  # [N, L] log pi_old(token): old_logprobs' pass

    @property
    def generated(self):  # [N, L]
        return self.sequences[:, self.prompt_len:]


@dataclass(frozen=True)
class SamplingParams:
    """The AR policy (vLLM's name): pi = softmax(logits / temperature) over the kept ids
    (kept_logits, section 8). The sampler and the loss both read it."""
    temperature: float = 1.0
    top_k: int = 0          # keep the k likeliest ids (0: all)
    top_p: float = 1.0      # of those, the fewest whose mass adds up to p (1: all)
    codebook: int = 0       # ids >= it (image start, end) crash the DiT: never drawn


def gumbel_max(logits, uniform, sampling):
    """A draw from softmax(z) over the finite z: argmax_v (z_v - log(-log u_v)), u ~ U(0, 1).
    logits, u [N, V] -> (ids [N], log pi(ids) [N] fp64)."""
    kept = torch.isfinite(kept_logits(logits, sampling))  # pi's kept set
    z = logits.double() / sampling.temperature
    z = z.masked_fill(~kept, float("-inf"))
    token = (z - torch.log(-torch.log(uniform))).argmax(-1)  # u = 0: -inf, never drawn
    return token, z.log_softmax(-1).gather(-1, token[:, None])[:, 0]


@torch.no_grad()
def sample_groups(pipe, prompts, group_size, sampling, height, width, loss_tokens,
                  sources=None, generators=None, prompt_len=None, decoder=None):
    """G samples per prompt (i2i: edits of `sources`) -> Rollout, without old_logp.
    The sampler (decode_loop, section 14, or a run's FastDecoder) runs a forward a
    token on a KV cache and draws each by gumbel_max: their log pi is sampler_logp.
    Group k draws from generators[k] alone (None: seeded off the global RNG)."""
    ar = pipe.vision_language_encoder  # the AR
    batch, source_prior, grids = generation_inputs(
        pipe, prompts, sources, group_size, height, width, prompt_len)  # left-padded
    L = sum(h * w for h, w in grids) + 1  # t2i: preview, target; i2i: target; end
    positions = rollout_positions(ar, batch, grids)  # [3, N, S + L - 1]
    mask = batch["attention_mask"]
    mask = torch.nn.functional.pad(mask, (0, L - 1), value=1)  # [N, S + L - 1]
    uniforms = group_uniforms(ar, generators or len(prompts), group_size)
    decoder = decoder or functools.partial(decode_loop, cache=static_cache(ar, mask.shape))
    prompt = batch["input_ids"]  # [N, S]
    tokens, logp = decoder(ar, prompt, positions, mask, L, uniforms, sampling)
    H, W = grids[-1]
    target = slice(L - 1 - H * W, L - 1)  # the target grid, then the end slot
    covered = target if loss_tokens == "target" else slice(0, target.stop)
    loss_mask = torch.zeros_like(tokens, dtype=torch.float32)
    loss_mask[:, covered] = 1.0
    return Rollout(torch.cat([prompt, tokens], 1), mask, positions, logp, loss_mask,
                   tokens[:, target], (H, W), prompt.shape[1], source_prior)


def sample_tokens(trainer, prompts, sources, slots, step, args):
    """SAMPLE this rank's groups -> Rollout with pi_old (old_logprobs). Group `slot`
    draws from seeded(step, slot), padded to the run's prompt length: its tokens are
    alike on any number of processes."""
    ar, sampling = trainer.ar.model, trainer.sampling
    generators = [seeded(args.seed, "tokens", step, s, ar.device) for s in slots]
    ar.eval()
    with whole_weights(ar) as sharded:  # --fsdp: gathered, sampled eagerly
        decoder = None if sharded else trainer.decoder
        rollout = sample_groups(trainer.pipe, prompts, args.group_size, sampling,
                                args.height, args.width, args.loss_tokens, sources,
                                generators, trainer.prompt_len, decoder)
        ar.model.train()  # the body (.model), as in the loss
        old_logp = old_logprobs(ar, rollout, sampling, args.micro_batch_size)
    return replace(rollout, old_logp=old_logp)


def sampler_gap(rollout):
    """|old_logp - sampler_logp| on the loss tokens, logged: rounding (old_logprobs)
    unless the loss's forward scores another policy than the sampler's."""
    gap = (rollout.old_logp - rollout.sampler_logp).abs()[rollout.loss_mask.bool()]
    return {"sampler_gap_max": gap.max().item(), "sampler_gap_mean": gap.mean().item()}


# ==== 5. DECODE: target-grid tokens -> DiT -> VAE -> pixels
# decode_images runs the frozen renderer as GlmImagePipeline would, on noise that
# group_noise draws once a prompt: a group's G images differ by their tokens alone.


# ==== 6. REWARD
# A reward is fn(images, prompts, targets) -> [N] floats, higher = better:
#     images   [N, 3, 32H, 32W] in [0, 1], on the CPU, fp32 (or --dtype float64)
#     prompts  N str; a prompt's G samples are consecutive rows
#     targets  [N, 3, 32H, 32W], or None if a prompt in the step has none
# For example, in my_rewards.py, run with --reward my_rewards.py:brightness:
#     def brightness(images, prompts, targets):
#         return images.mean(dim=(1, 2, 3))
# --reward module:fn=WEIGHT also works; repeated, the rewards add up (section 17
# loads them; a NaN leaves its group out, a raise stops the run). The default,
# --reward mse, wraps mse_reward below.

def mse_reward(images, targets):
    """r = -mean((image - target)^2) over channels and pixels, the demo's reward.
    images, targets: float [N, 3, 32H, 32W] in [0, 1] -> [N] in [-1, 0]; 0: perfect."""
    wide = images.to(torch.promote_types(images.dtype, torch.float32))  # a caller's bf16
    return -((wide - targets) ** 2).mean(dim=(1, 2, 3))


def compute_rewards(rewards, images, prompts, targets, group_size):
    """(total [N] = sum_k w_k r_k, {name: r_k [N]}) over the --reward plug-ins (Reward:
    .name, .fn, .weight); prompts (P) and targets [P, ...] repeat G times each.
    Summed, then standardised (TRL's order): a reward's pull is weight x its spread."""
    prompts = repeat_each(prompts, group_size)
    if targets is not None:
        targets = targets.repeat_interleave(group_size, 0)
    values = [call_reward(reward, images, prompts, targets) for reward in rewards]
    total = sum(reward.weight * value for reward, value in zip(rewards, values))
    return total, {reward.name: value for reward, value in zip(rewards, values)}


# ==== 7. ADVANTAGE

def group_advantages(rewards, group_size, eps=1e-4):
    """A_i = (r_i - mean_group(r)) / (std_group(r) + eps), rewards [N] in groups of G.
    Unbiased std, as TRL. A tied group gets exactly 0 (an fp32 mean is an ulp off), as
    does one with a NaN or inf (left out: the others train). eps is not tiny: MSE
    rewards 1e-4 apart are not blown up to +-1."""
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {list(rewards.shape)}: not [N], N a multiple of {group_size}")
    groups = rewards.view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    advantages = centred / (groups.std(dim=1, keepdim=True) + eps)
    tied = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    left_out = tied | ~groups.isfinite().all(1, True)
    return torch.where(left_out, 0.0, advantages).view(-1)


# ==== 8. Log-probs: the loss's, and pi_old's by the same pass

def kept_logits(logits, sampling, keep=None):
    """z [..., V] with pi = softmax(z): logits / temperature in at least fp32 (a bf16
    log-softmax loses ~1e-2); -inf past the codebook and off the top-k / top-p kept set.
    keep [...]: ids kept whatever (after an update a sampled id may drop out of the
    set, and log 0 has no gradient)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / sampling.temperature
    if sampling.codebook:
        z[..., sampling.codebook:].fill_(float("-inf"))  # fill_: no host tensor
    if sampling.top_k or sampling.top_p < 1:  # the set transformers' warpers keep
        z = z.masked_fill(dropped_by_warpers(z, sampling, keep), float("-inf"))
    return z


def token_logprobs(logits, tokens, sampling):
    """log pi(token): logits [N, L, V], tokens [N, L] -> [N, L]."""
    z = kept_logits(logits, sampling, keep=tokens)
    return torch.log_softmax(z, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits, sampling):
    """Entropy of pi, [N, L, V] -> [N, L] nats; at most log(#kept ids)."""
    z = kept_logits(logits, sampling)
    return torch.distributions.Categorical(logits=z).entropy()


def policy_logits(ar, rollout):
    """A teacher-forced forward at the rollout's M-RoPE positions -> logits [N, L, V]
    of the L generated tokens (input sequences[:, :-1]: position t predicts t + 1)."""
    num_generated = rollout.generated.shape[1]
    return ar(input_ids=rollout.sequences[:, :-1], attention_mask=rollout.attention_mask,
              position_ids=rollout.position_ids, logits_to_keep=num_generated,
              use_cache=False).logits


def micro_batches(rollout, size):
    """[(rows, part)]: rows, a slice of the batch, `size` at a time; part, the rollout's
    rows less the padding columns none of them needs (slice_rollout, section 14)."""
    N = rollout.sequences.shape[0]
    return [(rows, slice_rollout(rollout, rows)) for rows in row_slices(N, size)]


def policy_logprobs(ar, rollout, sampling):
    """log pi(generated token) [N, L], teacher-forced."""
    return token_logprobs(policy_logits(ar, rollout), rollout.generated, sampling)


@torch.no_grad()
def old_logprobs(ar, rollout, sampling, size):
    """log pi_old [N, L]: the loss's own forward, once, before any update. Passes
    2..mu of grpo_update need pi_old frozen: hence this pass. On pass 1 the loss
    computes this very tensor, bit for bit (ratio 1, logp_diff_max 0), as nothing
    differs: the weights (no optimizer.step() yet), the code (policy_logits, its DDP
    wrapper alike, and token_logprobs), the body's train mode, the micro-batches
    (each drops the padding its rows share: other rows, other sums). Measured on
    the CPU and an H200; --fsdp: to rounding.
    Why not the sampler's own log-probs (sampler_logp)? Its kernels differ (a KV
    cache, a token a step) and round otherwise: ~1e-6 in fp32, ~1e-2 in bf16.
    The pitfall: a forward without the sampler's position_ids numbers the grid
    like text. The ratio would still be 1, but pi_old and the loss would score a
    policy other than the one that sampled, nats a token apart (sampler_gap)."""
    parts = micro_batches(rollout, size)
    return torch.cat([policy_logprobs(ar, part, sampling) for _, part in parts])


# ==== 9. Loss
# --loss-tokens: the reward depends only on the H*W target-grid tokens, which the preview
# tokens condition. Training those too ('all') is the unbiased gradient, plus h*w ~ 256
# tokens of near-pure noise; 'target' (the default) accepts that bias for less noise.

def grpo_loss(logp, old_logp, advantages, mask, clip_eps, beta=0.0, ref_logp=None):
    """PPO-clipped GRPO objective, averaged over the loss tokens -> (loss, metrics).

        ratio    = exp(logp - old_logp)                   rho_t in the papers
        pg_loss1 = -A * ratio
        pg_loss2 = -A * clip(ratio, 1 - eps, 1 + eps)
        pg_loss  = max(pg_loss1, pg_loss2)                = -min(rho A, clip(rho) A)
        kl       = exp(ref - logp) - (ref - logp) - 1     k3 estimator of KL(pi || pi_ref)
        loss     = masked_mean(pg_loss + beta * kl)

    logp, old_logp, ref_logp (when beta > 0), mask: [N, L]; advantages: [N].
    k3 is unbiased on tokens drawn from pi (the first pass); beta 0: kl logs 0.
    Pass 1 has ratio 1, so nothing clips: the gradient is -A grad log pi (REINFORCE,
    A standardised in its group) + beta grad k3. The mean is over this micro-batch's
    n tokens; grpo_update weights it by its share of the batch's tokens, so the
    batch's loss is its token mean: TRL's loss_type 'dapo'."""
    if beta > 0 and ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp, the reference's log-probs [N, L]")
    adv = advantages.unsqueeze(1)  # [N, 1]
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
    masked_mean = lambda x: (x * mask).sum() / n
    low, high = ratio < 1 - clip_eps, ratio > 1 + clip_eps
    clipped = (low & (adv < 0)) | (high & (adv > 0))
    return masked_mean(per_token), {"ratio_mean": masked_mean(ratio).item(),
                                    "clip_ratio": masked_mean(clipped.float()).item(),
                                    "kl": masked_mean(kl).item()}


# ==== 10. UPDATE: mu passes of clipped-surrogate ascent over the same batch
# The learning-rate schedule steps once a GRPO step (Run.record, section 19).

def grpo_update(trainer, rollout, advantages, args, learns=True):
    """mu = --inner-epochs passes over one batch -> the step's metrics. A pass sums
    its micro-batches' gradients, then takes one AdamW step, unless a loss or the
    norm is not finite, or no rank `learns` (has a group of finite rewards).
    trainer.ar (section 14): .forward, the AR or its DDP wrapper; .params."""
    policy, sampling, optimizer = trainer.ar, trainer.sampling, trainer.optimizer
    # The body is in train mode, as for pi_old's pass (sample_tokens sets it).
    # pi_ref: a frozen copy, or under LoRA the base (adapters off for it)
    ref_logp = reference_logprobs(trainer, rollout, args) if args.beta > 0 else None
    advantages = advantages.to(rollout.old_logp.device)  # [N]
    tokens = rollout.loss_mask.sum()
    # UpdateLog (section 14) logs each key of `terms`. A pass: the share-weighted sum
    # of its micro-batches' values (logp_diff_max: their max). The row: the mean of
    # the passes that stepped; entropy and logp_diff_max are pass 1's.
    log = UpdateLog()
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        micro = []  # (share, metrics) of each micro-batch
        batches = micro_batches(rollout, args.micro_batch_size)
        for rows, part in sync_on_last(policy.forward, batches):  # DDP: sync the last
            logits = policy_logits(policy.forward, part)  # [n, L, V]
            logp = token_logprobs(logits, part.generated, sampling)  # [n, L]
            ref = None if ref_logp is None else ref_logp[rows]
            loss, terms = grpo_loss(logp, part.old_logp, advantages[rows],
                                    part.loss_mask, args.clip_eps, args.beta, ref)
            if epoch == 0:  # at pi_old: the ratio check, and entropy collapse
                terms |= first_pass_checks(logits, logp, part, sampling)
            share = (part.loss_mask.sum() / tokens).item()
            (loss * share).backward()  # one micro-batch's graph alive at a time
            micro.append((share, {**terms, "loss": loss.item()}))
        norm = torch.nn.utils.clip_grad_norm_(policy.params, args.max_grad_norm).item()
        losses = [m["loss"] for _, m in micro]
        stepped = update_allowed(all(map(math.isfinite, [*losses, norm])), learns)
        if stepped:
            optimizer.step()
            check_weights_finite(optimizer)
        log.add_pass(micro, norm, stepped)
    return log.row()


def first_pass_checks(logits, logp, part, sampling):
    """|logp - old_logp|, 0 where old_logprobs says, and the entropy: near 0 a group's samples
    are alike, rewards tie, advantages are 0 and learning stops for good."""
    mask = part.loss_mask
    with torch.no_grad():
        entropy = (token_entropy(logits, sampling) * mask).sum() / mask.sum()
    diff = ((logp - part.old_logp).abs() * mask).max()
    return {"logp_diff_max": diff.item(), "entropy": entropy.item()}


# ==== 11. One GRPO step, and the training loop

@dataclass
class StepRecord:
    """What a step hands the log (Run.record, section 19)."""
    row: dict               # the step's metrics
    prompts: list           # P str
    images: torch.Tensor    # [N, 3, 32H, 32W], a prompt's G consecutive
    rewards: torch.Tensor   # [N] (Part II with --dit-reward: [N, 2])
    targets: torch.Tensor   # [P, 3, 32H, 32W] | None
    sources: list           # i2i: P PIL images | None
    ode: torch.Tensor = None  # Part II: the updated DiT's noise-free decodes


def grpo_step(trainer, items, indices, step, args, slots=None, before_update=lambda: None):
    """One GRPO step on items[indices], this rank's `slots` of the step's prompts
    (default: all) -> StepRecord. before_update: the run's stop check (section 19)."""
    prompts, targets, sources = step_prompts(items, indices, args.mode)
    slots = range(len(indices)) if slots is None else slots
    G, pipe = args.group_size, trainer.pipe
    # ---- SAMPLE: G token grids per prompt, and pi_old ----
    rollout = sample_tokens(trainer, prompts, sources, slots, step, args)
    # ---- DECODE: images [N, 3, 32H, 32W] by the frozen renderer ----
    noise = group_noise(pipe, indices, G, args.height, args.width, args.seed, step,
                        args.dit_noise)
    images = decode_images(pipe, prompts, sources, rollout, noise,
                           args.num_inference_steps, args.guidance_scale)
    # ---- REWARD: r [N], one per image ----
    rewards, per_reward = compute_rewards(trainer.rewards, images, prompts, targets, G)
    row = {"step": step, **reward_metrics(rewards, per_reward, G)}  # LOG (section 18)
    row |= sampler_gap(rollout)
    # ---- ADVANTAGE: A [N], each reward standardised within its group ----
    advantages = group_advantages(rewards, G)
    # ---- UPDATE: mu passes over the batch ----
    before_update()  # a stop signal before this point drops the step (section 19)
    learns = bool(rewards.view(-1, G).isfinite().all(1).any())  # a finite group
    row |= grpo_update(trainer, rollout, advantages, args, learns)
    return StepRecord(row, prompts, images, rewards, targets, sources)


def train(args):
    """The training loop. Run (section 19) is its plumbing: it opens the run (flags,
    --out, prompts, rewards, the model, --resume), records each step (LOG, sample
    sheet, CHECKPOINT) and stops on Ctrl+C / SIGTERM."""
    step_fn = grpo_step if args.policy == "ar" else flow_grpo_step  # Part II
    with Run(args) as run:
        for step, indices, slots in run.steps():  # this rank's prompts
            result = step_fn(run.trainer, run.items, indices, step, args, slots,
                             run.vote)
            run.record(step, result)
    return run.trainer and run.trainer.pipe  # None: nothing to do


# PART II. Flow-GRPO: the DiT as a policy over denoising steps (--policy dit|both)
# flow_grpo_step (section 13) reads as grpo_step, reusing sample_tokens, group_advantages, grpo_loss
# and grpo_update's loop: a denoising step plays a token's role.


# ==== 12. The SDE step, the DiT rollout and its loss
# GLM-Image's authors post-train both halves ("decoupled RL"): AR for layout and semantics, DiT for detail and
# text. grpo_loss needs the sampled step's probability; Euler's x' = x + v dt has none. Flow-GRPO (Liu et al.
# 2025, yifan123/flow_grpo's `sde_step_with_logprob`) swaps it for an SDE of the same marginals, a Gaussian policy
# pi_theta(x' | x) of noise level a = --dit-noise-level:
#     std_t = a * sqrt(sigma / (1 - sigma))
#     mean  = x * (1 + std_t^2 / (2 sigma) * dt) + v * (1 + std_t^2 (1 - sigma) / (2 sigma)) * dt
#     x'    = mean + std_t * sqrt(-dt) * eps,      dt = sigma' - sigma < 0;   a = 0: Euler's step
# T trained steps are T actions: logp [N, T], mask all ones. A step's log-prob is the MEAN over latent dims
# (as flow_grpo; a sum over 65536 would dwarf a token's), so an update moves a step's ratio by ~1e-3
# (dit/ratio): PPO's 0.2 would never clip; flow_grpo's 1e-4 (--dit-clip-eps) clips a good share (dit/clip).
# The first --dit-train-steps T steps run the SDE, the rest the ODE (untrained SDE noise: reward noise no one is
# credited for); the last, onto sigma' = 0, never trains (as flow_grpo): its Gaussian is the sharpest.


@dataclass
class DitRollout:
    states: torch.Tensor     # [N, K+1, C, h, w] x_0 (initial noise) ... x_K (final latent), fp32
    old_logp: torch.Tensor   # [N, T] log pi_old(x_{i+1} | x_i), the sampler's: the loss's forward
    timesteps: torch.Tensor  # [K] the pipeline's (unshifted) timesteps
    sigmas: torch.Tensor     # [K+1] the scheduler's shifted sigmas, ending in 0


@dataclass
class DitCondition:
    """The DiT's inputs as GlmImagePipeline.__call__ builds them, per prompt (its G samples at rows p*G..)."""
    prompt_embeds: list          # per prompt: [G, S_p, D] glyph embeddings (encode_prompt of it alone)
    negative_embeds: list        # per prompt: [G, S', D] glyph embeddings of "" (CFG's other branch), or None
    prior: torch.Tensor          # [N, 4*H*W] target-grid tokens upsampled 2x (the DiT's 16-px grid)
    target_size: torch.Tensor    # [N, 2] (height, width) in pixels
    crop_coords: torch.Tensor    # [N, 2] zeros, the pipeline's default crops_coords_top_left
    guidance_scale: float
    source_latents: list = None  # i2i, per prompt: normalised VAE latent [1, C, h, w] of the source
    source_prior: list = None    # i2i, per prompt: its VQ ids upsampled 2x [4*h*w]


def dit_schedule(pipe, height, width, num_inference_steps):
    """(timesteps [K], sigmas [K+1]) as GlmImagePipeline.__call__ sets them; sigmas from the scheduler: shifted."""
    from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps
    scheduler, device = pipe.scheduler, pipe._execution_device
    seq_len = height * width // (pipe.vae_scale_factor * pipe.transformer.config.patch_size) ** 2  # latent patches
    train_steps = scheduler.config.num_train_timesteps
    timesteps = np.linspace(train_steps, 1.0, num_inference_steps + 1)[:-1].astype(np.int64).astype(np.float32)
    mu = calculate_shift(seq_len, scheduler.config.get("base_image_seq_len", 256),
                         scheduler.config.get("base_shift", 0.25), scheduler.config.get("max_shift", 0.75))
    timesteps, _ = retrieve_timesteps(scheduler, num_inference_steps, device, timesteps, timesteps / train_steps, mu=mu)
    return timesteps, scheduler.sigmas.to(device, torch.promote_types(pipe.transformer.dtype, torch.float32))


@torch.no_grad()
def dit_condition(pipe, prompts, group_size, target_tokens, grid_hw, guidance_scale, sources=None, source_prior=None):
    """The DiT's inputs for P prompts x G samples, target_tokens [N, H*W]; i2i: per prompt its source (PIL) and
    (upsampled VQ ids, grid). The frozen glyph encoder and VAE run here, once per step."""
    from diffusers.pipelines.glm_image.pipeline_glm_image import retrieve_latents
    H, W = grid_hw
    height, width = 32 * H, 32 * W
    device, dtype = pipe._execution_device, pipe.dtype
    encoded = [pipe.encode_prompt([p], guidance_scale > 1, num_images_per_prompt=group_size, device=device,
                                  dtype=dtype) for p in prompts]
    embeds, negative = [e for e, _ in encoded], [u for _, u in encoded] if guidance_scale > 1 else None
    prior = torch.cat([pipe._upsample_token_ids(t, H, W) for t in target_tokens]).to(device)
    latents = None
    if sources is not None:      # the pipeline's i2i path: preprocess, VAE mode (argmax), normalise
        mean, std = latent_stats(pipe.vae, device, dtype)
        pixels = [pipe.image_processor.preprocess(s, height=height, width=width).to(device, dtype) for s in sources]
        latents = [(retrieve_latents(pipe.vae.encode(p), sample_mode="argmax") - mean) / std for p in pixels]
    size = torch.tensor([[height, width]], dtype=dtype, device=device).repeat(target_tokens.shape[0], 1)
    return DitCondition(embeds, negative, prior, size, torch.zeros_like(size), guidance_scale, latents,
                        [ids.to(device) for ids, _ in source_prior] if sources is not None else None)


def latent_stats(vae, device, dtype):
    stats = (vae.config.latents_mean, vae.config.latents_std)  # DiT latent = (VAE latent - mean) / std
    return (torch.tensor(v).view(1, -1, 1, 1).to(device, dtype) for v in stats)


def latents_to_images(pipe, latents):
    """The pipeline's decode (un-normalise, vae.decode, postprocess) -> [N, 3, H, W] in [0, 1], fp32, CPU."""
    latents = latents.to(pipe.vae.dtype)
    mean, std = latent_stats(pipe.vae, latents.device, latents.dtype)
    image = pipe.vae.decode(latents * std + mean, return_dict=False)[0]
    return at_least_fp32(pipe.image_processor.postprocess(image, output_type="pt")).cpu()


def dit_velocity(dit, latents, t, cond, caches):
    """The pipeline's guided velocity [N, C, h, w] (fp32) at t (the DiT gets t - 1). CFG: v_u + w (v_c - v_u), v_u
    without prior tokens and source; both branches run the trained DiT with gradients, as flow_grpo's training
    forward (one batch of both there): the policy is the guided velocity. A call per prompt: a batch pads glyph
    embeddings with zeros the DiT attends to (diffusers issue 13587)."""
    dtype = getattr(dit, "module", dit).dtype  # under DDP the model is .module

    def branch(rows, embeds, drop, cache):
        prior = cond.prior[rows]
        return dit(hidden_states=latents[rows].to(dtype), encoder_hidden_states=embeds, prior_token_id=prior,
                   prior_token_drop=torch.full_like(prior, drop, dtype=torch.bool), timestep=t.expand(len(prior)) - 1,
                   target_size=cond.target_size[rows], crop_coords=cond.crop_coords[rows], return_dict=False,
                   kv_caches=cache)[0].to(torch.promote_types(dtype, torch.float32))

    velocities, start = [], 0
    for p, cache in enumerate(caches):
        rows = slice(start, start + len(cond.prompt_embeds[p]))
        start = rows.stop
        v = branch(rows, cond.prompt_embeds[p], False, cache)
        if cond.guidance_scale > 1:     # the unconditional branch skips the source too (the pipeline's "skip")
            v_uncond = branch(rows, cond.negative_embeds[p], True, None)
            v = v_uncond + cond.guidance_scale * (v - v_uncond)
        velocities.append(v + cache.anchor if hasattr(cache, "anchor") else v)  # --fsdp: write_source_caches
    return torch.cat(velocities)


def sde_step(v, x, sigmas, i, noise_level, eps=None, x_next=None):
    """The step above from x = x_i [N, C, h, w] (fp32) -> (x', logp [N], mean, std = std_t sqrt(-dt)); `x_next`:
    scores that stored step. logp: Normal.log_prob as flow_grpo (unvalidated: a NaN reaches grpo_update's skip),
    mean over latent dims; None at noise_level 0. flow_grpo puts sigmas[1] for sigma = 1 (1 - sigma = 0)."""
    sigma, dt = sigmas[i], sigmas[i + 1] - sigmas[i]
    std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigmas[1], sigma)))
    std = std_t * torch.sqrt(-dt)
    mean = x * (1 + std_t ** 2 / (2 * sigma) * dt) + v * (1 + std_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    if noise_level == 0:
        return mean, None, mean, std
    if x_next is None:
        x_next = mean + std * eps
    logp = torch.distributions.Normal(mean, std, validate_args=False).log_prob(x_next.detach())
    return x_next, logp.mean(dim=tuple(range(1, logp.ndim))), mean, std


@torch.no_grad()
def sample_dit(dit, cond, noise, schedule, noise_level=0.0, train_steps=0, generators=()):
    """Denoises `noise` [N, C, h, w] -> DitRollout: `train_steps` SDE steps (eps: a generator per prompt), then ODE."""
    timesteps, sigmas = schedule
    x, states, logps = noise.to(sigmas.device, sigmas.dtype), [], []
    with whole_weights(dit):
        caches = write_source_caches(dit, cond)
        for i, t in enumerate(progress(timesteps, "denoising")):
            states.append(x)
            v = dit_velocity(dit, x, t, cond, caches)
            if i < train_steps:
                group = (x.shape[0] // len(generators), *x.shape[1:])
                eps = torch.cat([torch.randn(group, generator=g) for g in generators]).to(x.device, x.dtype)
                x, logp, _, _ = sde_step(v, x, sigmas, i, noise_level, eps=eps)
                logps.append(logp)
            else:
                x = sde_step(v, x, sigmas, i, 0.0)[0]
    states.append(x)
    old_logp = torch.stack(logps, 1) if logps else x.new_zeros(x.shape[0], 0)
    return DitRollout(torch.stack(states, 1), old_logp, timesteps, sigmas)


def dit_step_logprob(dit, cond, rollout, i, noise_level):
    """Step i of the stored trajectories, with gradients: (logp [N], mean [N, C, h, w], std). The source's KV
    cache is rewritten in the step's graph: each step backpropagates on its own."""
    x = rollout.states[:, i]
    v = dit_velocity(dit, x, rollout.timesteps[i], cond, write_source_caches(dit, cond))
    return sde_step(v, x, rollout.sigmas, i, noise_level, x_next=rollout.states[:, i + 1])[1:]


def dit_kl(mean, ref_mean, std):
    """KL of the policy's and the reference's step Gaussians (same std, std_t sqrt(-dt)): |mean - ref|^2 / (2 std^2),
    [N, C, h, w] -> [N], mean over dims as logp. flow_grpo divides by std_t^2 (no |dt|): 1 / |dt| times weaker."""
    return ((mean - ref_mean) ** 2).mean(dim=tuple(range(1, mean.ndim))) / (2 * std ** 2)


def condition_rows(cond, rows):
    """The DitCondition of samples `rows` (a slice): the prompts they touch, embeddings cut to their share."""
    G = len(cond.prompt_embeds[0])
    shares = [(p, n) for p, n in enumerate(np.bincount(np.arange(rows.start, rows.stop) // G)) if n]

    def pick(per_prompt, cut=False):  # None stays None
        return per_prompt and [per_prompt[p][:n] if cut else per_prompt[p] for p, n in shares]
    return replace(cond, prompt_embeds=pick(cond.prompt_embeds, True), negative_embeds=pick(cond.negative_embeds, True),
                   prior=cond.prior[rows], target_size=cond.target_size[rows], crop_coords=cond.crop_coords[rows],
                   source_latents=pick(cond.source_latents), source_prior=pick(cond.source_prior))


def dit_update(trainer, run, advantages, args, learns=True):
    """grpo_update for the DiT: mu passes of grpo_loss (+ beta x dit_kl) per trained step and micro-batch (a step at
    a time, as flow_grpo), weighted rows / (N T): a pass's loss is grpo_loss over [N, T]."""
    dit, optimizer, rollout = trainer.dit, trainer.optimizer, run.trajectories
    N, T = rollout.old_logp.shape
    advantages = advantages.to(rollout.old_logp.device)
    parts = [(rows, condition_rows(run.cond, rows), replace(rollout, states=rollout.states[rows],
                                                            old_logp=rollout.old_logp[rows]))
             for rows in row_slices(N, args.micro_batch_size)]
    log = UpdateLog("dit/")
    for epoch in range(args.inner_epochs):
        optimizer.zero_grad(set_to_none=True)
        micro = []
        for i, (rows, condition, part) in sync_on_last(dit.forward, [(i, p) for i in range(T) for p in parts]):
            logp, mean, std = dit_step_logprob(dit.forward, condition, part, i, args.dit_noise_level)
            old_logp = part.old_logp[:, i:i + 1]
            loss, terms = grpo_loss(logp[:, None], old_logp, advantages[rows], torch.ones_like(old_logp),
                                    args.dit_clip_eps)
            if args.beta > 0:
                with torch.no_grad(), reference_weights(dit.model, dit.reference) as ref:
                    ref_mean = dit_step_logprob(ref, condition, part, i, args.dit_noise_level)[1]
                kl = dit_kl(mean, ref_mean, std).mean()
                loss = loss + args.beta * kl
                terms["kl"] = kl.item()
            if epoch == 0:
                terms["logp_diff_max"] = (logp.detach() - old_logp[:, 0]).abs().max().item()
            share = len(old_logp) / (N * T)
            (loss * share).backward()
            micro.append((share, {**terms, "loss": loss.item()}))
        norm = torch.nn.utils.clip_grad_norm_(dit.params, args.max_grad_norm).item()
        stepped = update_allowed(all(map(math.isfinite, [*(m["loss"] for _, m in micro), norm])), learns)
        if stepped:
            optimizer.step()
            check_weights_finite(optimizer)
        log.add_pass(micro, norm, stepped)
    return log.row()


# ==== 13. The Flow-GRPO step
# --policy dit: a prompt's G samples share AR tokens and initial noise, differ by SDE noise alone: the advantage
# credits the DiT alone. --policy both: each sample's one advantage (or each half's, --dit-reward) trains both
# halves. They touch disjoint weights with independent losses, so each updates on its own, the AR first.

def prepare_dit_policy(dit, args):
    """Marks what of the DiT trains, and returns it: LoRA on its attention, or all its weights."""
    if args.dit_lora_rank:
        add_lora(dit, args.dit_lora_rank, args.dit_lora_rank, DIT_LORA_TARGETS)
    else:
        dit.requires_grad_(True)
    if args.gradient_checkpointing:
        dit.enable_gradient_checkpointing()
    return [p for p in dit.parameters() if p.requires_grad]


def flow_grpo_step(trainer, items, indices, step, args, slots=None, before_update=lambda: None):
    """grpo_step for --policy dit|both -> StepRecord, with the updated DiT's a = 0 decodes for the sheet."""
    prompts, targets, sources = step_prompts(items, indices, args.mode)
    slots = range(len(indices)) if slots is None else slots
    G, pipe = args.group_size, trainer.pipe
    # ---- SAMPLE tokens: both: G per prompt (Part I); dit: one per prompt, shared by its group ----
    if trainer.ar:
        rollout = sample_tokens(trainer, prompts, sources, slots, step, args)
    else:
        rollout = shared_prompt_tokens(trainer, prompts, sources, indices, args)
    # ---- SAMPLE the DiT (and DECODE): G SDE trajectories per prompt from its initial noise ----
    noise = group_noise(pipe, indices, G, args.height, args.width, args.seed, step, args.dit_noise)
    run = sample_dit_trajectories(pipe, prompts, sources, rollout, noise, indices, step, args)
    # ---- REWARD: the AR's from --reward; the DiT's from --dit-reward, else the same ----
    rewards, per_reward = compute_rewards(trainer.rewards, run.images, prompts, targets, G)
    row, dit_rewards = {"step": step, **reward_metrics(rewards, per_reward, G)}, rewards
    if trainer.dit_rewards:  # decoupled RL (section 12)
        dit_rewards, dit_per_reward = compute_rewards(trainer.dit_rewards, run.images, prompts, targets, G)
        row |= {"dit/" + k: v for k, v in reward_metrics(dit_rewards, dit_per_reward, G).items()}
    # ---- ADVANTAGE and UPDATE: each half its own mu passes ----
    before_update()  # a stop signal before this point drops the step (section 19)
    if trainer.ar:
        row |= sampler_gap(rollout)
        learns = row["frac_reward_nonfinite"] < 1
        row |= grpo_update(trainer, rollout, group_advantages(rewards, G), args, learns)
    learns = row.get("dit/frac_reward_nonfinite", row["frac_reward_nonfinite"]) < 1
    row |= dit_update(trainer, run, group_advantages(dit_rewards, G), args, learns)
    ode = None  # the sheet's: the updated DiT's a = 0 decode of each prompt's first sample
    if args.sample_every and (step % args.sample_every == 0 or step == args.steps):
        firsts = SimpleNamespace(target_tokens=rollout.target_tokens[::G], grid_hw=rollout.grid_hw,
                                 source_prior=rollout.source_prior and rollout.source_prior[::G])
        ode = decode_images(pipe, prompts, sources, firsts, noise[::G], args.num_inference_steps, args.guidance_scale)
    if trainer.dit_rewards:  # the sheet's captions: AR / DiT
        rewards = torch.stack([rewards, dit_rewards], 1)
    return StepRecord(row, prompts, run.images, rewards, targets, sources, ode)


def shared_prompt_tokens(trainer, prompts, sources, indices, args):
    """--policy dit: a token grid per prompt, drawn once (trainer.prompt_tokens) and shared by its G samples: a fixed
    input the DiT learns to paint -> target_tokens [N, H*W]."""
    pipe, cache, G = trainer.pipe, trainer.prompt_tokens, args.group_size
    for i, index in enumerate(indices):
        if index not in cache:
            generator = seeded(args.seed, "dit prior", 0, index, pipe.vision_language_encoder.device)
            cache[index] = sample_groups(pipe, [prompts[i]], 1, trainer.sampling, args.height, args.width,
                                         args.loss_tokens, sources and [sources[i]], [generator])
    draws = [cache[index] for index in indices]
    source_prior = sources and repeat_each([d.source_prior[0] for d in draws], G)  # per sample
    return SimpleNamespace(target_tokens=torch.cat([d.target_tokens.expand(G, -1) for d in draws]),
                           grid_hw=draws[0].grid_hw, source_prior=source_prior)


def sample_dit_trajectories(pipe, prompts, sources, rollout, noise, indices, step, args):
    """SAMPLE and DECODE for --policy dit|both -> namespace: cond, trajectories (a DitRollout), images [N, 3, H, W]."""
    G = args.group_size
    cond = dit_condition(pipe, prompts, G, rollout.target_tokens, rollout.grid_hw, args.guidance_scale, sources,
                         rollout.source_prior and rollout.source_prior[::G])  # i2i: per prompt
    schedule = dit_schedule(pipe, args.height, args.width, args.num_inference_steps)
    trajectories = sample_dit(pipe.transformer, cond, noise, schedule, args.dit_noise_level, args.dit_train_steps,
                              [seeded(args.seed, "sde noise", step, index) for index in indices])
    images = latents_to_images(pipe, trajectories.states[:, -1])  # VAE frozen: no graph
    return SimpleNamespace(cond=cond, trajectories=trajectories, images=images)


# PART III. Plumbing: skip on first read
# How a run starts, stops, logs, saves, and more GPUs; Part I calls each in a line.


# ==== 14. The GRPO step's plumbing: model, prompts, renderer, sampler, update

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
DIT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the DiT's attention


def load_pipeline(args):
    """The GlmImagePipeline on args.device, its renderer frozen: text_encoder (the glyph encoder), transformer
    (the DiT), vae."""
    pipe = pipeline_from_pretrained(args, getattr(torch, args.dtype))
    for name in ("text_encoder", "transformer", "vae"):
        getattr(pipe, name).requires_grad_(False)
    pipe.processor.tokenizer.padding_side = "left"  # every prompt ends at one column
    pipe.set_progress_bar_config(disable=True)      # the run prints a line a step
    pipe.vae.enable_slicing()  # one image at a time: at 1024^2 each holds ~3 GiB
    place_pipeline(pipe, args)  # on the device; --offload: frozen parts take turns
    return pipe


def prepare_policy(ar, args):
    """What of the AR trains (--lora-rank, --ar-trainable) -> the trained parameters."""
    if args.lora_rank:
        add_lora(ar, args.lora_rank, args.lora_alpha, LORA_TARGETS, exclude_modules=r".*visual.*|.*vqmodel.*")
    else:
        ar.requires_grad_(True)
        ar.model.visual.requires_grad_(False)  # the vision encoder and VQ read sources
        ar.model.vqmodel.requires_grad_(False)
        if args.ar_trainable == "head":
            # lm_head reads each (prompt, cell) off the body's fixed features. The tiny AR's body is random:
            # trained along, it paints every cell alike (README).
            ar.model.requires_grad_(False)
    if args.gradient_checkpointing:
        ar.activation_checkpointing_enable({"use_reentrant": False})
        ar.disable_input_require_grads()  # a hook only reentrant checkpointing needs
    # The loss runs the body in train mode (gradient checkpointing needs it), and so does pi_old's pass.
    # Dropout would make each its own policy.
    if dropout := active_dropout(ar.model.language_model):
        raise UsageError(f"--model {args.model}: dropout in {dropout}: set it to 0")
    return [p for p in ar.parameters() if p.requires_grad]


def step_prompts(items, indices, mode):
    """-> prompts (P str), targets [P, 3, 32H, 32W] in [0, 1] | None, i2i sources (PIL)."""
    batch = [items[i] for i in indices]
    targets = [it.image("target") for it in batch]
    if any(t is None for t in targets):
        targets = None
    else:  # PIL -> [P, 3, 32H, 32W]
        targets = torch.from_numpy(np.stack(targets)).permute(0, 3, 1, 2) / 255
    sources = [it.image("source") for it in batch] if mode == "i2i" else None
    return [it.text for it in batch], targets, sources


def repeat_each(items, group_size):
    return [x for x in items for _ in range(group_size)]  # [a, b] -> [a x G, b x G]


def seeded(seed, purpose, step=0, index=0, device="cpu"):
    """Every random stream (prompt order, tokens, DiT noise): a generator of its own, seeded by (--seed, purpose,
    step, index), alike on any rank. Hashed: sums collide."""
    digest = hashlib.sha256(f"{seed}/{purpose}/{step}/{index}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little"))


def group_noise(pipe, prompt_indices, group_size, height, width, seed, step, mode):
    """Initial DiT latents [N, C, 4H, 4W]: one draw per prompt, shared by its G samples, so that only the tokens
    differ. --dit-noise per-prompt: the same every step."""
    shape = (pipe.transformer.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    step = 0 if mode == "per-prompt" else step
    draws = [torch.randn(shape, generator=seeded(seed, "dit noise", step, i)) for i in prompt_indices]
    return torch.stack(draws).repeat_interleave(group_size, 0)


@torch.no_grad()
def decode_images(pipe, prompts, sources, rollout, noise, num_inference_steps, guidance_scale):
    """DECODE: images [N, 3, 32H, 32W] from the target grids, with the pipeline's schedule, conditioning and Euler
    steps (Part II's loop, no noise). Not `pipe(...)`: it pads prompts' glyph embeddings together (the DiT attends
    to the zeros), and re-hooks CPU offload at its end (moving the trained AR off the GPU)."""
    G = rollout.target_tokens.shape[0] // len(prompts)
    priors = rollout.source_prior and rollout.source_prior[::G]  # i2i: per prompt
    cond = dit_condition(pipe, prompts, G, rollout.target_tokens, rollout.grid_hw, guidance_scale, sources, priors)
    H, W = rollout.grid_hw
    schedule = dit_schedule(pipe, 32 * H, 32 * W, num_inference_steps)
    latents = sample_dit(pipe.transformer, cond, noise, schedule).states[:, -1]
    return latents_to_images(pipe, latents)


def update_allowed(finite, learns):
    """The guard before optimizer.step(), voted by every rank: every rank's loss and gradient norm are finite (a
    NaN would reach every weight), and some rank `learns`."""
    votes = from_every_rank((finite, learns))
    return all(f for f, _ in votes) and any(l for _, l in votes)


def pipeline_from_pretrained(args, dtype):
    """--model's GlmImagePipeline ('tiny': built and cached on first use, section 21)."""
    from diffusers import GlmImagePipeline
    from diffusers.utils import logging as diffusers_logging
    if args.model == TINY and rank() == 0:  # save_pretrained writes on rank 0 only
        tiny_pipeline_dir(args.seed)
    all_ranks_agree(True)
    path = tiny_pipeline_dir(args.seed) if args.model == TINY else args.model
    if dtype == torch.float64:
        float64_throughout()
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # offline it warns "Couldn't connect to the Hub" first
    try:
        return GlmImagePipeline.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        why = f"could not be loaded: {e}".partition("\n")[0] if Path(path).is_dir() else "not in the local Hugging " \
            f"Face cache nor downloadable here; `hf download {args.model}` where the hub is reachable, or a directory"
        raise UsageError(f"--model {args.model}: {why}")
    finally:
        diffusers_logging.set_verbosity(verbosity)


def place_pipeline(pipe, args):
    """--offload: diffusers moves model_cpu_offload_seq's models to the GPU in turn; trained ones stay."""
    if not args.offload:
        return pipe.to(args.device)
    trains_dit = args.policy != "ar"
    pipe.model_cpu_offload_seq = "text_encoder->vae" if trains_dit else "text_encoder->transformer->vae"
    pipe._exclude_from_cpu_offload = ["vision_language_encoder"] + ["transformer"] * trains_dit
    pipe.enable_model_cpu_offload(device=args.device)


def offload_by_plan(args):
    """--offload's default -> (on?, note): on if --plan's peak without it exceeds free GPU memory."""
    if not (args.device == "cuda" and torch.cuda.is_available()):
        return False, False
    peak, free = plan_options(args, *plan_of_run(args)[:2])[0][-1], torch.cuda.mem_get_info(args.device)[0]
    return peak > free, f"{peak > free} (auto: plan {peak / 2**30:.1f} GiB, free {free / 2**30:.1f} GiB)"


def add_lora(model, r, alpha, targets, **config):
    """PEFT LoRA on `targets`, base frozen; adapters in fp32 (cast_training_params): bf16 rounds off AdamW steps."""
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig, inject_adapter_in_model
    model.requires_grad_(False)
    # peft's injection: transformers 5.24's add_adapter refuses every peft released
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, **config), model)
    cast_training_params(model, dtype=torch.promote_types(model.dtype, torch.float32))


def lora_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer
    return [module for module in model.modules() if isinstance(module, BaseTunerLayer)]


def policy_generation_config(ar, sampling):
    """The policy as the AR's generation config, so that a saved pipeline samples the policy trained."""
    from transformers import GenerationConfig
    # Only these fields: generate() fills every unset one from the checkpoint's (penalties, n-gram bans)
    return GenerationConfig(
        do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        suppress_tokens=list(range(sampling.codebook, ar.config.text_config.vision_vocab_size)),
        bos_token_id=ar.generation_config.bos_token_id, pad_token_id=ar.config.text_config.pad_token_id,
        eos_token_id=ar.config.text_config.eos_token_id)


def sampling_of(ar):
    """policy_generation_config's inverse: a saved pipeline's policy."""
    return SamplingParams((c := ar.generation_config).temperature, c.top_k, c.top_p, min(c.suppress_tokens or [0]))


def processor_inputs(pipe, prompts, sources, height, width, device):
    """Prompts (and i2i source images) tokenised as GlmImagePipeline.generate_prior_tokens does."""
    images = [[] if s is None else [{"type": "image", "image": s}] for s in sources or [None] * len(prompts)]
    messages = [[{"role": "user", "content": im + [{"type": "text", "text": p}]}] for p, im in zip(prompts, images)]
    return pipe.processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": True, "target_h": height, "target_w": width}).to(device)


def generation_inputs(pipe, prompts, sources, group_size, height, width, prompt_len=None):
    """-> (the AR's inputs, P x G rows left-padded to `prompt_len`; i2i's per-sample DiT condition; the grids
    (h, w) to generate: t2i preview, target). t2i: `text<sop>H W<eop><sop>h w<eop><bos>`; i2i: `<start><source's VQ
    tokens><end>text<sop>H W<eop><bos>`. The end slot: generate()'s end-of-image step, never trained or painted."""
    ar = pipe.vision_language_encoder
    inputs = processor_inputs(pipe, prompts, sources, height, width, ar.device)
    ids, per_sample, source_prior = inputs["input_ids"], inputs["images_per_sample"], None
    if sources is not None:
        # i2i: vision encoder + VQ once a prompt, ids into the image placeholders
        source_grids = ar.model.get_image_grids_for_generation(per_sample, inputs["image_grid_thw"])
        features = list(ar.get_image_features(inputs["pixel_values"], source_grids).pooler_output)
        tokens = torch.split(ar.get_image_tokens(features), source_grids.prod(-1).tolist())
        prior = [(pipe._upsample_token_ids(t, h, w).squeeze(0), torch.tensor([[1, 2 * h, 2 * w]]))
                 for t, (_, h, w) in zip(tokens, source_grids.tolist())]
        ids = ids.masked_scatter(ids == ar.config.image_token_id, torch.cat(tokens))
        source_prior = repeat_each(prior, group_size)
    extra = (prompt_len or ids.shape[1]) - ids.shape[1]
    ids = torch.nn.functional.pad(ids, (extra, 0), value=ar.config.text_config.pad_token_id)
    mask = torch.nn.functional.pad(inputs["attention_mask"], (extra, 0), value=0)
    grids = torch.split(inputs["image_grid_thw"], per_sample.tolist())  # a block of rows a prompt
    batch = {"input_ids": ids.repeat_interleave(group_size, 0),
             "attention_mask": mask.repeat_interleave(group_size, 0),
             "image_grid_thw": torch.cat(repeat_each(grids, group_size)),
             "images_per_sample": per_sample.repeat_interleave(group_size)}
    generated = grids[0][-1:] if sources is not None else grids[0].flip(0)  # t2i prompts list (target, preview)
    return batch, source_prior, [(h, w) for _, h, w in generated.tolist()]


def rollout_positions(ar, batch, grids):
    """M-RoPE positions [3, N, S + L - 1] of prompt + generated[:-1] as get_rope_index lays them out: the prompt
    by it (2-D mask: padding is not text; text moves all three), each grid (h, w) at (s, s + i, s + j), s = last
    + 1, += max(h, w)."""
    prompt, _ = ar.model.get_rope_index(**batch)
    offsets = [ar.model.get_vision_position_ids(sum(max(*hw) for hw in grids[:k]), torch.tensor([1, h, w]))
               for k, (h, w) in enumerate(grids)]  # [3, h*w] each; the end slot's is never read
    return torch.cat([prompt, prompt[:, :, -1:] + 1 + torch.cat(offsets, 1)[:, None].to(prompt.device)], -1)


def run_prompt_len(pipe, items, args):
    """The longest prompt's length + 1, every step: one shape (one captured graph), never unpadded (SDPA's causal
    kernel sums in another order). Each must leave the images and 32 markers room in the context."""
    grid = (args.height // 32) * (args.width // 32)
    others = (2 * grid + 1 if args.mode == "i2i" else ar_sequence("t2i", args.height, args.width)[1]) + 32
    context = pipe.vision_language_encoder.config.text_config.max_position_embeddings
    texts = [it.text for it in items]
    lengths = pipe.processor.tokenizer(texts, add_special_tokens=False, return_length=True)["length"]
    item = items[lengths.index(longest := max(lengths))]
    if longest > context - others:
        raise UsageError(f"--height {args.height} --width {args.width}: {others} tokens, over the model's context "
                         f"of {context}" if others >= context else f"{item.where}: the prompt is {longest} tokens; the "
                         f"model's context of {context} leaves {context - others} at {args.height}x{args.width}")
    source = [item.image("source")] if args.mode == "i2i" else None
    return processor_inputs(pipe, [item.text], source, args.height, args.width, "cpu")["input_ids"].shape[1] + 1


def group_uniforms(ar, generators, group_size):
    """() -> a token's uniforms [N, V] fp64, group k's rows from generators[k]; an int: seeded off the global RNG."""
    if isinstance(generators, int):
        generators = [torch.Generator(ar.device).manual_seed(int(torch.randint(2**62, ()))) for _ in range(generators)]
    V = ar.config.text_config.vision_vocab_size
    return lambda: torch.cat([torch.rand(group_size, V, generator=gen, device=gen.device, dtype=torch.float64)
                              for gen in generators])


def static_cache(ar, shape):
    from transformers import StaticCache
    return StaticCache(ar.config, max_cache_len=shape[1])


def decode_step(ar, ids, positions, mask, cache, uniform, sampling):
    """ids [N, q] at their M-RoPE positions -> the next token [N] by gumbel_max, and its
    log pi; the cache's length picks the positions on the device (no host sync)."""
    at = cache.get_seq_length() + torch.arange(ids.shape[1], device=ids.device)
    out = ar(ids, mask, positions.index_select(2, at), cache, logits_to_keep=1)
    return gumbel_max(out.logits[:, -1], uniform, sampling)


def decode_loop(ar, ids, positions, mask, num_tokens, uniforms, sampling, cache,
                step=decode_step):
    """The sampler: forward -> Gumbel-max -> append, a token per row a step. ids [N, S] ->
    (tokens [N, L], log pi [N, L]). step: the later steps' (FastDecoder: a CUDA graph)."""
    tokens, logps = [], []
    for t in range(num_tokens):
        draw = step if t else decode_step  # the prefill: its own shape, eager
        token, logp = draw(ar, ids, positions, mask, cache, uniforms(), sampling)
        tokens.append(token)
        logps.append(logp)
        ids = token[:, None]
    return torch.stack(tokens, 1), torch.stack(logps, 1)


class FastDecoder:
    """decode_loop for a run: a DecodeGraph per shape and policy (same tokens), eager once one failed. Ranks
    make graphs at the same calls: a decoder per caller (eval splits unevenly)."""

    def __init__(self, device, capture=None):
        self.capture = capture or (cuda_graph if device.type == "cuda" else lambda step: (step(), step))
        self.graphs = {}

    def __call__(self, ar, ids, positions, mask, num_tokens, uniforms, sampling):
        if not (graph := self.graphs is not None and self.graph(ar, ids, positions, mask, sampling)):
            return decode_loop(ar, ids, positions, mask, num_tokens, uniforms, sampling, static_cache(ar, mask.shape))
        graph.cache.reset()  # in place: its addresses stay
        graph.positions.copy_(positions)
        graph.mask.copy_(mask)
        ticks = iter(progress(range(num_tokens), "sampling tokens"))
        ticking = lambda: [next(ticks, None), uniforms()][1]
        return decode_loop(ar, ids, graph.positions, graph.mask, num_tokens, ticking, sampling, graph.cache, graph)

    def graph(self, ar, ids, positions, mask, sampling):
        if (key := (mask.shape, sampling)) not in self.graphs:
            try:
                self.graphs[key] = DecodeGraph(ar, ids, positions, mask, sampling, self.capture)
            except Exception as error:
                print(f"warning: decode CUDA graph failed ({type(error).__name__}: {error}".partition("\n")[0]
                      + "): eager steps from now on; --disable-cuda-graph skips it", file=sys.stderr)
            self.graphs = self.graphs if all_ranks_agree(key in self.graphs) else None  # a rank's failure: all eager
        return self.graphs and self.graphs[key]


class DecodeGraph:
    """A decode step (forward + Gumbel-max: ~1,000 kernels) as a CUDA graph on fixed buffers; a trial replay first."""

    def __init__(self, ar, ids, positions, mask, sampling, capture):
        self.cache, self.positions, self.mask = static_cache(ar, mask.shape), positions.clone(), mask.clone()
        self.uniform = ids.new_full((len(ids), ar.config.text_config.vision_vocab_size), 0.5, dtype=torch.float64)
        step = lambda ids: decode_step(ar, ids, self.positions, self.mask, self.cache, self.uniform, sampling)
        self.ids = step(ids)[0][:, None]  # the prefill
        _, self.replay = capture(lambda: step(self.ids))
        self.replay()

    def __call__(self, ar, ids, positions, mask, cache, uniform, sampling):  # t >= 1; positions...cache: ours
        self.ids.copy_(ids)
        self.uniform.copy_(uniform)
        return [out.clone() for out in self.replay()]  # the graph's own: its next replay overwrites them


def cuda_graph(step):
    """-> (step(), replay): the warm-up torch.cuda.graph's docs ask for, on the capture's stream; a rerun."""
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # restores the stream if capture fails
        first = step()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)
    return first, lambda: graph.replay() or out


def progress(steps, what):  # a bar on rank 0's terminal: real-model phases are slow
    if not (sys.stderr.isatty() and rank() == 0):
        return steps
    from tqdm.auto import tqdm
    return tqdm(steps, desc=what, leave=False)


@torch.no_grad()
def dropped_by_warpers(z, sampling, keep=None):
    """[..., V] True where transformers' top-k / top-p warpers drop an id of z (ties as theirs), but `keep`'s. 1,024
    rows at a time: sorting all [N, L, V] holds ~23 bytes a logit."""
    k, p, parts = sampling.top_k, sampling.top_p, []
    for rows in z.detach().reshape(-1, z.shape[-1]).split(1024):
        dropped = torch.zeros_like(rows, dtype=torch.bool)
        if k:  # keep z >= the k-th largest
            dropped |= rows < torch.topk(rows, min(k, rows.shape[-1]), dim=-1).values[..., -1:]
        if p < 1:  # ascending (the warper's tie order): drop while the mass so far is <= 1 - p
            ascending, order = torch.sort(rows.masked_fill(dropped, float("-inf")), dim=-1)
            tail = ascending.softmax(-1).cumsum(-1) <= 1 - p
            tail[..., -1].fill_(False)  # never the largest
            dropped |= tail.scatter(-1, order, tail)
        parts.append(dropped)
    dropped = torch.cat(parts).view_as(z)
    if keep is not None:
        dropped.scatter_(-1, keep.unsqueeze(-1), False)
    return dropped


def at_least_fp32(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 -> fp32; fp64 stays


def active_dropout(model):
    """The first module with dropout in train mode (nn.Dropout's p, attention_dropout), or None."""
    return next((name for name, m in model.named_modules()
                 if getattr(m, "p" if isinstance(m, torch.nn.Dropout) else "attention_dropout", 0) > 0), None)


def row_slices(num_samples, size):
    return [slice(start, min(start + size, num_samples)) for start in range(0, num_samples, size)]


def slice_rollout(rollout, rows):
    """The Rollout's `rows` less padding columns none needs: a group's forward sees them alike in any batch."""
    mask = rollout.attention_mask[rows]
    first = int(mask.any(dim=0).nonzero()[0])  # only prompt columns can be all padding
    per_row = {name: None if (value := getattr(rollout, name)) is None else value[rows]
               for name in ("sampler_logp", "old_logp", "loss_mask", "target_tokens", "source_prior")}
    return replace(rollout, sequences=rollout.sequences[rows, first:], attention_mask=mask[:, first:],
                   position_ids=rollout.position_ids[:, rows, first:], prompt_len=rollout.prompt_len - first, **per_row)


def sync_on_last(forward, batches):
    """DDP: no gradient all-reduce but on the last batch. Every rank runs as many, or they hang."""
    for k, batch in enumerate(batches):
        with forward.no_sync() if hasattr(forward, "no_sync") and k < len(batches) - 1 else contextlib.nullcontext():
            yield batch


@contextlib.contextmanager
def reference_weights(model, reference):
    """The KL's pi_ref: `reference` (full fine-tuning's frozen copy), or with LoRA (None) `model`, adapters off."""
    from diffusers.utils.peft_utils import set_adapter_layers  # each PEFT layer's enable_adapters
    set_adapter_layers(model, enabled=reference is not None)
    try:
        yield model if reference is None else reference
    finally:
        set_adapter_layers(model)


def reference_logprobs(trainer, rollout, args):  # pi_ref [N, L]: pi_old's pass, the reference's weights
    with reference_weights(trainer.ar.model, trainer.ar.reference) as reference:
        return old_logprobs(reference, rollout, trainer.sampling, args.micro_batch_size)


class UpdateLog:
    """grpo_update's and dit_update's bookkeeping, as section 10 says; plus the skip counts."""
    FIRST_PASS = ("logp_diff_max", "entropy")

    def __init__(self, prefix=""):
        self.prefix, self.passes = prefix, []

    def add_pass(self, micro_batches, grad_norm, stepped):
        metrics = {}
        for share, terms in micro_batches:
            for key, value in terms.items():
                summed = metrics.get(key, 0.0) + value * share
                metrics[key] = max(metrics.get(key, value), value) if key == "logp_diff_max" else summed
        self.passes.append(({**metrics, "grad_norm": grad_norm}, stepped))

    def row(self):
        done, first = [m for m, stepped in self.passes if stepped], self.passes[0][0]
        row = {k: sum(m[k] for m in done) / len(done) if done else math.nan
               for k in first if k not in self.FIRST_PASS}
        row |= {k: first[k] for k in self.FIRST_PASS if k in first}
        row |= {"skipped_updates": len(self.passes) - len(done),
                "skipped_nonfinite_loss": sum(not (s or math.isfinite(m["loss"])) for m, s in self.passes)}
        return {self.prefix + k: v for k, v in row.items()}


def check_weights_finite(optimizer):  # a sum per tensor: no big temporary
    from torch.distributed.tensor import DTensor
    sums = [(p.to_local() if isinstance(p, DTensor) else p).detach().sum().float()
            for group in optimizer.param_groups for p in group["params"]]
    if not all_ranks_agree(bool(torch.isfinite(torch.stack(sums)).all())):
        raise UsageError("the update made the weights non-finite (--lr too large?); checkpoints are intact")


@dataclass
class Half:
    """The AR or the DiT, trained: `forward` (itself or its DDP wrapper), KL `reference` (reference_weights)."""
    model: torch.nn.Module
    forward: object
    params: list
    reference: object = None


@dataclass
class Trainer:
    pipe: object  # GlmImagePipeline
    sampling: SamplingParams
    optimizer: torch.optim.Optimizer = None
    lr_scheduler: object = None
    trained: torch.nn.Module = None  # what checkpoints hold: AR, or {AR, DiT}
    ar: Half = None  # None: --policy dit
    dit: Half = None  # None: --policy ar
    rewards: list = None  # --reward's plug-ins (section 6)
    dit_rewards: list = None  # --dit-reward's (none: the DiT's are `rewards`)
    prompt_len: int = None  # run_prompt_len
    decoder: FastDecoder = None
    prompt_tokens: dict = None  # --policy dit: prompt index -> token grid (shared_prompt_tokens)


def setup_training(args, rewards, dit_rewards=()):
    """Loads the model, marks what trains, one AdamW (a param group per half) and its learning-rate schedule."""
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import set_seed
    pipe = load_pipeline(args)
    set_seed(args.seed)  # after loading: one sampling stream however the model was made
    ar, dit = pipe.vision_language_encoder, pipe.transformer
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, dit.config.prior_vq_quantizer_codebook_size)
    trainer = Trainer(pipe, sampling, rewards=rewards, dit_rewards=dit_rewards, prompt_tokens={}, decoder=None if
                      args.disable_cuda_graph or args.fsdp or args.policy == "dit" else FastDecoder(ar.device))
    ar.generation_config = policy_generation_config(ar, sampling)
    trained = {}
    for half, name, prepare, lora in (("ar", "vision_language_encoder", prepare_policy, args.lora_rank),
                                      ("dit", "transformer", prepare_dit_policy, args.dit_lora_rank)):
        if args.policy in (half, "both"):
            model = trained[name] = getattr(pipe, name)
            reference = copy.deepcopy(model).requires_grad_(False) if args.beta > 0 and not lora else None
            setattr(trainer, half, Half(model, *distribute(model, prepare(model, args), args, reference), reference))
    trainer.trained = ar if args.policy == "ar" else torch.nn.ModuleDict(trained)
    groups = [{"params": h.params, "lr": lr} for h, lr in ((trainer.ar, args.lr), (trainer.dit, args.dit_lr)) if h]
    trainer.optimizer = torch.optim.AdamW(groups, weight_decay=args.weight_decay)
    # diffusers' 'constant' ignores warm-up
    warmup = args.lr_scheduler == "constant" and args.lr_warmup_steps
    trainer.lr_scheduler = get_scheduler("constant_with_warmup" if warmup else args.lr_scheduler, trainer.optimizer,
                                         num_warmup_steps=args.lr_warmup_steps, num_training_steps=args.steps)
    return trainer


def non_finite_streak(bad_steps, row, out, args, start):
    """Rows of the last steps in a row that updated nothing: 5 (or a shorter run's all) stop it."""
    stuck = [h for h in ("", "dit/") if row.get(h + "skipped_updates") == args.inner_epochs]  # a half updated nothing
    bad_steps = bad_steps + [row] if stuck else []
    if len(bad_steps) < min(5, args.steps - start):
        return bad_steps
    causes = {}
    for r in bad_steps:
        bad = [k.removeprefix("rewards/") for k, v in r.items() if k.startswith("rewards/") and not math.isfinite(v)]
        loss = r.get("skipped_nonfinite_loss") or r.get("dit/skipped_nonfinite_loss")
        causes[f"reward {', '.join(bad)} (fix the reward)" if bad else "loss (the policy's log-probs overflowed: try "
               "a lower --lr)" if loss else "gradient (try a lower --lr or --max-grad-norm)"] = 1
    found = saved_checkpoints(out)
    saved = f"the last checkpoint is {found[-1]}" if found else "no checkpoint was written yet"
    raise UsageError(f"stopping: no update since step {bad_steps[0]['step']}: non-finite "
                     f"{'; non-finite '.join(causes)}; {saved}")


def write_source_caches(dit, cond):
    """Per prompt, the KV cache its DiT passes read (t2i: None): the pipeline's t=0 pass on the source, in-graph."""
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
    module = getattr(dit, "module", dit)  # under DDP the model is .module
    if cond.source_latents is None:
        return [None] * len(cond.prompt_embeds)
    caches = []
    for latent, ids, embeds in zip(cond.source_latents, cond.source_prior, cond.prompt_embeds):
        written, read = (GlmImageKVCache(num_layers=module.config.num_layers) for _ in range(2))
        written.set_mode("write")
        out = dit(hidden_states=latent.to(module.dtype), encoder_hidden_states=embeds[:1, :0],
                  prior_token_id=ids, prior_token_drop=torch.zeros_like(ids, dtype=torch.bool),
                  timestep=torch.zeros(1, device=latent.device), target_size=cond.target_size[:1],
                  crop_coords=cond.crop_coords[:1], kv_caches=written, return_dict=False)[0]
        read.set_mode("read")  # copied lists: gradient checkpointing's rerun of the write pass appends to its own
        for mine, theirs in zip(read.caches, written.caches):
            mine.k_caches, mine.v_caches = list(theirs.k_caches), list(theirs.v_caches)
        if torch.is_grad_enabled() and fsdp_units(module):
            # --fsdp regathers a layer for backward when the gradient reaches its output, not its cached K, V:
            # 0 x the output, added to the velocity, routes it there
            read.anchor = at_least_fp32(out).sum() * 0
        caches.append(read)
    return caches


# ==== 15. Starting a run: flags, their one-line checks, --out

SAME_ON_RESUME = "a resume must match"  # in a group's title: its flags change the algorithm
# requirements.txt's lower bounds (tested equal): older ones fail deep in a run.
LEAST_VERSIONS = {"transformers": "5.23", "diffusers": "0.42.1", "peft": "0.20", "accelerate": "1.10"}


def parse_args(argv=None):
    p, argv = flag_parser(), sys.argv[1:] if argv is None else argv
    flags = [a for a in argv if a not in ("-h", "--help")]  # --help then shows --model's defaults
    if (known := p.parse_known_args(flags)[0]).model != TINY:
        p.set_defaults(**pretrained_defaults(known))  # those above are the tiny demo's
    args = p.parse_args(argv)
    if not args.eval_prompts and (args.eval_every or args.eval_num_inference_steps):
        raise UsageError("--eval-every and --eval-num-inference-steps need --eval-prompts")
    args.reward, args.eval_every = args.reward or ["mse"], args.eval_every or args.save_every
    args.eval_num_inference_steps = args.eval_num_inference_steps or p.get_default("num_inference_steps")
    return args


def flag_parser():
    p = Parser(description="GRPO for GLM-Image on image rewards.", formatter_class=HelpFormatter, allow_abbrev=False)
    p._negative_number_matcher = re.compile(r"-[\d.]+(e[-+]?\d+)?$", re.I)  # '--lr -1e-3': a value, as in Python 3.14
    count, non_negative_int = number(int, least=1), number(int, least=0)
    positive, non_negative, clip = number(float, above=0), number(float, least=0), number(float, above=0, below=1)
    pixels, draws = number(int, least=32, multiple=32), ["per-prompt", "per-step"]
    a = p.add_argument_group(f"GRPO ({SAME_ON_RESUME})").add_argument
    a("--group-size", type=number(int, least=2), default=32, help="G: samples per prompt.")
    a("--prompts-per-step", type=count, default=2, help="Prompts per step.")
    a("--temperature", type=positive, default=1.0, help="Sampling temperature; the loss scores logits / T.")
    a("--top-k", type=non_negative_int, default=0, help="Sample the k likeliest tokens (0 = all).")
    a("--top-p", type=number(float, above=0, most=1), default=1.0, help="Sample the top tokens of mass p (1 = all).")
    a("--loss-tokens", choices=["target", "all"], default="target", help="Target grid's, or also the preview's.")
    a("--clip-eps", type=clip, default=0.2, help="PPO clip: ratio in [1-eps, 1+eps].")
    a("--beta", type=non_negative, default=0.0, help="KL weight, to the initial model (0 = none).")
    a("--inner-epochs", type=count, default=4, help="mu: passes over each batch.")
    a("--lr", type=positive, default=2e-2, help="AdamW learning rate.")
    a("--policy", choices=["ar", "dit", "both"], default="ar", help="What trains: AR, DiT or both.")
    a("--reward", action="append", metavar="SPEC", help="mse|module:fn|file.py:fn[=WEIGHT]; repeats sum. Default: mse.")
    a("--seed", type=number(int, least=0, most=2**32 - 1), default=0, help="Seed of all randomness.")
    a("--lr-scheduler", choices=["constant", "cosine", "linear"], default="constant", help="Schedule over --steps.")
    a("--lr-warmup-steps", type=non_negative_int, default=0, help="Linear warm-up steps from lr 0.")
    a("--weight-decay", type=non_negative, default=0.0, help="AdamW weight decay.")
    a("--max-grad-norm", type=positive, default=1.0, help="Gradient norm clip.")
    a = p.add_argument_group(f"model and data ({SAME_ON_RESUME})").add_argument
    a("--model", default=TINY, help="'tiny' (a toy GLM-Image), a hub id or a save_pretrained dir.")
    a("--mode", choices=["t2i", "i2i"], default="t2i", help="t2i: text to image; i2i: edit a source image.")
    a("--prompts", default="prompts.txt", help="Lines 'prompt[ | target.png[ | source.png (i2i)]]'.")
    a("--height", type=pixels, default=128, help="Image height (32 px per token).")
    a("--width", type=pixels, default=128, help="Image width (32 px per token).")
    a("--num-inference-steps", type=count, default=4, help="DiT steps per image (Flow-GRPO: 10 train, 40 eval).")
    a("--guidance-scale", type=number(float, least=1), default=1.0, help="DiT classifier-free guidance (1 = off).")
    a("--dit-noise", choices=draws, default="per-prompt", help="A group's initial DiT noise: once or each step.")
    a("--lora-rank", type=non_negative_int, default=0, help="AR LoRA rank (0 = full fine-tuning).")
    a("--lora-alpha", type=positive, help="LoRA alpha (default: --lora-rank).")
    a("--ar-trainable", choices=["auto", "all", "head"], default="auto", help="auto: head (output layer) for tiny.")
    a("--dtype", choices=["auto", "float32", "bfloat16", "float64"], default="auto", help="auto=bf16 if CUDA, not tiny")
    a = p.add_argument_group(f"the DiT: --policy dit|both, Flow-GRPO ({SAME_ON_RESUME})").add_argument
    a("--dit-lr", type=positive, default=3e-3, help="The DiT's AdamW learning rate.")
    a("--dit-clip-eps", type=clip, default=1e-4, help="--clip-eps of the DiT's per-step ratio.")
    a("--dit-noise-level", type=positive, default=0.7, help="a in the SDE's std_t = a sqrt(sigma / (1 - sigma)).")
    a("--dit-train-steps", type=count, help="Trained SDE steps, then ODE (default: all but the last).")
    a("--dit-reward", action="append", metavar="SPEC", help="--policy both: the DiT's own reward (as --reward).")
    a("--dit-lora-rank", type=non_negative_int, default=0, help="DiT LoRA rank (0 = full fine-tuning).")
    a = p.add_argument_group("logging and checkpoints").add_argument
    a("--steps", type=count, default=10, help="Steps in all, resumed ones included.")
    a("--out", default="runs/grpo_glm", help="For metrics.jsonl, samples/ and checkpoints/.")
    a("--save-every", type=count, default=10, help="Checkpoint every N steps and at the end.")
    a("--checkpoints-total-limit", type=count, help="Keep the newest K (default: all).")
    a("--sample-every", type=non_negative_int, default=5, help="A sample sheet every N steps (0 = never).")
    a("--report-to", choices=["none", "tensorboard", "wandb"], default="none", help="Also log to TensorBoard/W&B.")
    a("--resume", help="A checkpoint, or 'latest' in --out.")
    a("--resume-force", action="store_true", help="Resume despite changed algorithm flags.")
    a("--save-pipeline", help="Write the trained pipeline here (LoRA merged), or a finished --resume's.")
    a("--eval-prompts", help="Held-out --prompts, sampled at step 0, every --eval-every, the end.")
    a("--eval-every", type=count, help="Steps between evals (default: --save-every).")
    a("--eval-num-inference-steps", type=count, help="Eval DiT steps (default: the model's own).")
    a = p.add_argument_group("hardware and memory").add_argument
    a("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda if available, else cpu.")
    a("--micro-batch-size", type=count, help="Samples per forward/backward (default: G).")
    a("--gradient-checkpointing", action="store_true", help="Recompute activations (AR's, DiT's) in backward.")
    a("--offload", action=argparse.BooleanOptionalAction, help="Frozen parts on CPU between uses (default: by --plan).")
    a("--disable-cuda-graph", action="store_true", help="Eager decode steps, no CUDA graph.")
    a("--fsdp", action="store_true", help="torchrun: shard trained weights and AdamW state (FSDP2).")
    a("--dist-timeout", type=count, default=600, help="Seconds a rank waits for the others.")
    a("--plan", action="store_true", help="Print --model's memory plan at --height x --width; exit.")
    a("--plan-gpus", type=number(int, least=2), nargs="+", metavar="K", help="--plan: --fsdp's bytes/GPU on K GPUs.")
    a("--plan-gpu-memory", type=positive, metavar="GiB", help="--plan: GiB to fit in (default: free GPU memory).")
    return p


class Parser(argparse.ArgumentParser):
    def error(self, message):  # a bad flag: a UsageError, no usage
        raise UsageError(re.sub(r"^argument (\S+): ", r"\1 ", message))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no '(default: None)': the help says what happens
        return action.help if action.default is None else super()._get_help_string(action)


def number(kind, least=-math.inf, above=-math.inf, most=math.inf, below=math.inf, multiple=None):
    def parse(text):
        value = kind(text)
        rules = {"finite": math.isfinite(value), f"at least {least}": value >= least, f"> {above}": value > above,
                 f"at most {most}": value <= most, f"< {below}": value < below,
                 f"a multiple of {multiple}": not multiple or value % multiple == 0}
        if broken := [rule for rule, holds in rules.items() if not holds]:
            raise argparse.ArgumentTypeError(f"must be {broken[0]}, got {value}")
        return value
    parse.__name__ = kind.__name__  # for argparse's "invalid float value: 'abc'"
    return parse


def validate_args(args):
    """Checks beyond the flags' types, before any model loads."""
    from importlib.metadata import version
    from packaging.version import Version
    outdated = ", ".join(f"{name} {version(name)} (needs >= {least})" for name, least in LEAST_VERSIONS.items()
                         if Version(version(name)) < Version(least))
    model, save = Path(args.model), Path(args.save_pipeline or ".")
    full = (args.policy != "dit" and not args.lora_rank) or (args.policy != "ar" and not args.dit_lora_rank)
    hub_id = re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", args.model) and not model.parent.is_dir()  # 'runs/x' typo: no hub
    empty = [f"--{k.replace('_', '-')}" for k, v in vars(args).items() if v == ""]
    k = next((k for k in (args.plan_gpus or () if args.plan else [world_size()]) if args.prompts_per_step % k), 0)
    refusals = [
        (empty, f"{' and '.join(empty)} is empty (an unset variable?)"),
        (outdated, f"too old: {outdated}; pip install -r requirements.txt"),
        (k, f"--prompts-per-step {args.prompts_per_step} must be divisible by "
            f"{f'--plan-gpus {k}' if args.plan else f'the number of processes ({k})'}: each rank trains whole groups"),
        (args.ar_trainable == "head" and (args.lora_rank or args.fsdp),
         "--ar-trainable head takes neither --lora-rank nor --fsdp (it trains one layer)"),
        (args.fsdp and (args.lora_rank or args.dit_lora_rank or args.save_pipeline),
         "--fsdp shards full fine-tuning, no LoRA; for --save-pipeline resume in one process"),
        (args.fsdp and not (args.plan_gpus if args.plan else world_size() > 1),
         "--fsdp needs torchrun: one process has nothing to shard (--plan: --plan-gpus K)"),
        ((args.plan_gpus or args.plan_gpu_memory) and not args.plan, "--plan-gpus and --plan-gpu-memory: add --plan"),
        ((args.dit_train_steps or 0) > args.num_inference_steps,
         f"--dit-train-steps {args.dit_train_steps} exceeds --num-inference-steps {args.num_inference_steps}"),
        (args.policy == "ar" and (args.dit_lora_rank or args.dit_train_steps is not None),
         "--dit-lora-rank and --dit-train-steps need --policy dit or both"),
        (args.dit_reward and args.policy != "both", "--dit-reward needs --policy both (--policy dit: use --reward)"),
        (args.policy == "dit" and args.lora_rank, "--policy dit trains no AR: drop --lora-rank"),
        (args.dtype == "bfloat16" and not args.fsdp and full,
         "--dtype bfloat16 full fine-tuning rounds AdamW's updates away: use LoRA, --fsdp or --dtype float32"),
        (args.report_to != "none" and importlib.util.find_spec(args.report_to) is None,
         f"--report-to {args.report_to} needs the '{args.report_to}' package: pip install {args.report_to}"),
        (args.save_pipeline and save.exists() and (not save.is_dir() or any(save.iterdir())),
         f"--save-pipeline {save} already exists"),
        (args.model != TINY and not (model / "model_index.json").is_file() and not hub_id,
         f"--model {args.model}: {'not a directory with model_index.json' if model.exists() else 'no such directory'}"
         " (give 'tiny', a hub id like zai-org/GLM-Image, or a save_pretrained directory)"),
        (args.device == "cuda" and not torch.cuda.is_available(), "--device cuda: no CUDA device"),
        (args.offload and args.device == "cpu", "--offload needs a CUDA device"),
    ]
    if why := next((why for refused, why in refusals if refused), None):
        raise UsageError(why)
    torchrun = " ".join(f"{k}={os.environ[k]}" for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK") if k in os.environ)
    if not re.fullmatch(r"(\w+=\d+ ?)*", torchrun) or world_size() > 1 and not os.getenv("MASTER_ADDR"):
        raise UsageError(f"{torchrun}: set, but not by torchrun", local=True)
    paths = {"--out": Path(args.out, "checkpoints"), "--save-pipeline": args.save_pipeline,
             "the tiny model's cache (GRPO_GLM_CACHE)": args.model == TINY and tiny_cache()}
    for flag, path in ((flag, Path(path).absolute()) for flag, path in paths.items() if path and not args.plan):
        parent = next(p for p in [path, *path.parents] if p.exists())
        if not parent.is_dir():
            raise UsageError(f"{flag}: {parent} is a file, not a directory")
        try:
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as e:
            raise UsageError(f"{flag}: cannot write in {parent} ({e.strerror})")


def pretrained_defaults(args):
    """Not tiny: the model card's sampler and decode (a saved pipeline: its own); DanceGRPO's or flow_grpo's lr."""
    saved = Path(getattr(args, "model", TINY), "vision_language_encoder/generation_config.json")
    return dict(lr=1e-5, dit_lr=3e-4 if args.dit_lora_rank else 1e-5, temperature=0.9, top_p=0.75,
                num_inference_steps=30, guidance_scale=1.5, height=1024, width=1024) | (
        json.loads(saved.read_text()).get("trained_decode", {}) if saved.is_file() else {})


def resolve_runtime(args):  # the flags' derived values
    args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" and args.model != TINY else "float32"
    if args.ar_trainable == "auto":
        args.ar_trainable = "head" if args.model == TINY and not (args.lora_rank or args.fsdp) else "all"
    if args.dit_train_steps is None and args.policy != "ar":
        args.dit_train_steps = max(args.num_inference_steps - 1, 1)
    args.offload, args.offload_note = offload_by_plan(args) if args.offload is None else (args.offload, args.offload)
    args.lora_alpha = args.lora_alpha or float(args.lora_rank)
    args.micro_batch_size = args.micro_batch_size or args.group_size
    return args


def check_source_size(processor, height, width):
    """i2i: the AR's source size (smart_resize) must be the DiT's --height x --width (zai-org/GLM-Image issue 14)."""
    from transformers.models.glm_image.image_processing_pil_glm_image import smart_resize
    size, patch = processor.size, processor.patch_size * processor.merge_size
    try:
        h, w = (2 * side for side in smart_resize(height, width, patch, size["shortest_edge"], size["longest_edge"]))
    except ValueError as e:
        raise UsageError(f"--mode i2i at {height}x{width}: the image processor refuses it ({e})")
    if (h, w) != (height, width):
        raise UsageError(f"--mode i2i: the image processor resizes a source to {h}x{w}; use --height {h} --width {w}")


def lock_out_dir(out, closing):
    """Locks <out>/.lock (flock: freed even on kill -9) until `closing`; removes what it made if nothing was logged."""
    made = [p for p in [out / ".lock", out.absolute(), *out.absolute().parents] if not p.exists()]

    def unmake():
        with contextlib.suppress(OSError):
            for path in [] if read_metrics(out / "metrics.jsonl") else made:  # up to a directory not empty
                (path.unlink if path.is_file() else path.rmdir)()
    closing.callback(unmake)  # first: an interrupt from here on leaves --out as found
    out.mkdir(parents=True, exist_ok=True)
    try:
        fcntl.flock(closing.enter_context(open(out / ".lock", "a")), fcntl.LOCK_EX | fcntl.LOCK_NB)  # stays empty
    except BlockingIOError:
        raise UsageError(f"--out {out} is in use by another run")


# ==== 16. Prompt files, images and the demo's targets

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (240, 210, 40),
           "white": (255, 255, 255), "black": (0, 0, 0), "orange": (245, 140, 30), "purple": (140, 60, 180)}
SHAPES = ("circle", "square", "triangle")


@dataclass
class PromptItem:
    """One prompt line; its images are read or drawn when asked, never kept."""
    text: str
    where: str  # 'prompts.txt:3', for messages
    size: tuple  # (height, width) images are resized to
    image_from: dict  # 'target' / 'source' -> a Path, or draw_shape's arguments

    def image(self, kind):  # RGB at `size`, or None
        if isinstance(origin := self.image_from.get(kind), Path):
            return read_image(origin, self.where, kind, self.size)
        return origin and draw_shape(*origin, *self.size)


def read_prompts(path, height, width, mode="t2i", need_targets=("mse",), flag="--prompts"):
    """Lines `prompt[ | target.png[ | source.png (i2i)]]`, paths relative to the file; `\\|` is a '|'."""
    path, items, resized = Path(path), [], False
    if not path.is_file():
        raise UsageError(f"{flag} {path}: " + ("not a regular file" if path.exists() else "file not found"))
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # -sig: drops a BOM (Windows editors)
    except UnicodeDecodeError as e:  # e.object: the bytes after a BOM
        hint = " (it looks like UTF-16)" if e.object[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise UsageError(f"{flag} {path}: not UTF-8 text{hint}: byte 0x{e.object[e.start]:02x} at offset {e.start}")
    for where, line in ((f"{path}:{n}", raw.strip()) for n, raw in enumerate(lines, 1)):
        if not line or line.startswith("#"):
            continue
        text, *paths = (part.strip() for part in re.split(r"(?<!\\)\|", line))
        text = text.replace("\\|", "|").replace("\t", " ")
        if not text:
            raise UsageError(f"{where}: empty prompt before '|'")
        if len(paths) > (2 if mode == "i2i" else 1):
            raise UsageError(f"{where}: too many '|' fields for --mode {mode} (write \\| for a '|' in the prompt)")
        image_from = {kind: path.parent / p for kind, p in zip(("target", "source"), paths) if p}
        for kind, file in image_from.items():
            w, h = read_image(file, where, kind)
            resized |= (w, h) != (width, height)
            seen = f"{where}: {kind} {file.name} is {w}x{h}"
            if max(width / w, height / h, aspect := w * height / (h * width), 1 / aspect) > 4:  # an icon, a strip
                print(f"warning: {seen}, stretched to {width}x{height}: the right file?", file=sys.stderr)
            elif aspect != 1:
                print(f"note: {seen}, squashed to {width}x{height} (crop to keep proportions)")
        if mode == "i2i" and "source" not in image_from:  # drawn from the edit's words (a missing target too)
            image_from["source"] = demo_scene(text, where, mode, "source")
            image_from.setdefault("target", demo_scene(text, where, mode))
        items.append(PromptItem(text, where, (height, width), image_from))
    if not items:
        raise UsageError(f"{flag} {path}: no prompts (only blank or comment lines)")
    if resized:
        print(f"note: images resized to {width}x{height} (--width x --height)")
    require_targets(items, need_targets, mode)
    return items


def require_targets(items, reward_names, mode):
    for item in [it for it in items if reward_names and "target" not in it.image_from]:
        why = f"the reward {', '.join(reward_names)} reads targets"
        item.image_from["target"] = demo_scene(item.text, item.where, mode, why=why)


def read_image(path, where, kind, size=None):
    """Upright (EXIF): RGB at size = (height, width); no size (start-up): its (width, height), undecoded."""
    try:
        with Image.open(path) as image:
            if size:
                return to_rgb(ImageOps.exif_transpose(image)).resize(size[::-1], Image.BICUBIC)
            # PNG's getexif() decodes the pixels; an eXIf chunk ahead of them is in info
            exif = image.getexif() if image.format != "PNG" or "exif" in image.info else Image.Exif()
            turned = exif.get(Image.ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)  # by 90 degrees
            image.verify()  # reads the whole file, decodes nothing, leaves it unusable: last
            return image.size[::-1] if turned else image.size
    except FileNotFoundError:
        raise UsageError(f"{where}: {kind} image {path} {'is gone' if size else 'not found'}", local=bool(size))
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise UsageError(f"{where}: {kind} {path} is not a readable image ({type(e).__name__})", local=bool(size))


def to_rgb(image):
    """RGB as seen, where convert('RGB') errs: 16-bit or [0, 1] float grey scaled, transparency on white."""
    if image.mode == "F" and image.getextrema()[1] <= 1:  # float TIFFs: most tools write [0, 1]
        return image.point(lambda v: v * 255 + 0.5).convert("RGB")
    if image.mode.startswith("I"):
        return image.convert("I").point(lambda v: v / 257 + 0.5).convert("RGB")  # 65535 -> 255, rounded
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        return Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def draw_shape(shape, colour, background, height, width):
    draw = ImageDraw.Draw(image := Image.new("RGB", (width, height), COLOURS[background]))
    box = (width * 0.2, height * 0.2, width * 0.8, height * 0.8)
    if shape == "triangle":
        draw.polygon([(width / 2, box[1]), box[2:], (box[0], box[3])], fill=COLOURS[colour])
    else:
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    return image


def demo_scene(prompt, where, mode, role="target", why=""):
    """draw_shape's arguments for 'red circle on white background' or 'make the red circle blue'."""
    words = re.findall(r"[a-z]+", prompt.lower())
    if mode == "t2i":
        colours, shape = [w for w in words if w in COLOURS], next((w for w in words if w in SHAPES), None)
        if not (colours and shape):
            raise UsageError(f"{where}: no target image given and no colour+shape words to draw one "
                             f"({why and why + '; '}write 'prompt | target.png')")
        return shape, colours[0], (colours + ["white"])[1]
    colour = "|".join(COLOURS)
    edit = re.search(rf"\b({colour}) ({'|'.join(SHAPES)})\b.*\b({colour})\b(?! background)", " ".join(words))
    if not edit:  # e.g. a t2i line: 'a red circle on a white background'
        raise UsageError(f"{where}: '{prompt}' is no edit{why and f' ({why})'}: --mode i2i needs 'prompt | target.png"
                         " | source.png' or '<colour> <shape> ... <new colour>' (e.g. 'make the red circle blue')")
    return edit[2], edit[1] if role == "source" else edit[3], "white"


# ==== 17. Reward plug-ins: --reward module:fn | file.py:fn

# Each rank scores its own groups; call_reward makes the return a CPU float tensor: a NaN
# or inf leaves its group out of the step, with a warning. `fn.uses_targets = True`: at
# start, a line with no target gets one drawn from its words (section 16) or is refused.
Reward = make_dataclass("Reward", ["name", "fn", "weight"])  # name: logged as rewards/<name>


def mse(images, prompts, targets):
    return mse_reward(images, targets)
mse.uses_targets = True


def load_reward(spec, flag="--reward"):
    where, _, text = spec.rpartition("=") if "=" in spec else (spec, "", "1")
    try:
        weight = number(float)(text)  # the flags' check: a finite float
    except (ValueError, argparse.ArgumentTypeError):
        raise UsageError(f"{flag} {spec}: weight after '=' must be a finite number, got {text!r}")
    if weight == 0:
        raise UsageError(f"{flag} {spec}: a weight of 0 adds nothing")
    if where == "mse":
        return Reward("mse", mse, weight)
    module, _, name = where.rpartition(":")
    if not (module and name):
        raise UsageError(f"{flag} {spec}: expected 'mse', 'module:function' or 'file.py:function'")
    sys.path.insert(0, os.getcwd())  # cwd first, as `python -m` does
    try:
        namespace = runpy.run_path(module) if module.endswith(".py") else vars(importlib.import_module(module))
    except (Exception, SystemExit) as e:  # sys.exit() in the plug-in too
        raise UsageError(f"{flag} {spec}: importing {module} failed: {type(e).__name__}: {e}".partition("\n")[0])
    finally:
        sys.path.remove(os.getcwd())
    if not callable(fn := namespace.get(name)):
        raise UsageError(f"{flag} {spec}: {module} has no function {name}")
    return Reward(name, fn, weight)


def load_rewards(specs, flag="--reward"):
    rewards = [load_reward(spec, flag) for spec in specs]
    if len({r.name for r in rewards}) < len(rewards):
        raise UsageError(f"{flag}: two rewards share a name ({', '.join(r.name for r in rewards)}); rename one")
    return rewards


def call_reward(reward, images, prompts, targets):
    """One --reward on a copy of the batch (see compute_rewards) -> [N] in the images' dtype."""
    n, name = len(prompts), reward.name
    try:
        value = reward.fn(images.clone(), list(prompts), None if targets is None else targets.clone())
    except (Exception, SystemExit) as e:  # sys.exit(0) too: not a silent exit 0
        raise UsageError(f"reward {name} raised {type(e).__name__}: {e}".partition("\n")[0], local=True)
    try:
        value = torch.as_tensor(value, dtype=images.dtype).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(f"reward {name} returned {type(value).__name__}, not a tensor or list of floats", local=True)
    if value.shape != (n,):
        raise UsageError(f"reward {name} returned shape {list(value.shape)}, expected [{n}]", local=True)
    if bad := (~torch.isfinite(value)).sum().item():
        print(f"warning: reward {name} returned {bad} non-finite values of {n}; their groups are left out of "
              "this step", file=sys.stderr)
    return value


# ==== 18. LOG: console, metrics.jsonl, sample sheets, TensorBoard / W&B
CONSOLE_FIELDS = ("loss {loss:+.4f}|dit loss {dit/loss:+.3e}|reward {reward_mean:.5f} ± {reward_std:.5f}|dit reward "
                  "{dit/reward_mean:.5f} ± {dit/reward_std:.5f}|ratio {ratio_mean:.4f}|clip {clip_ratio:.3f}|"
                  "kl {kl:.2e}|dit/ratio {dit/ratio_mean:.4f}|dit/clip {dit/clip_ratio:.3f}|dit/kl {dit/kl:.2e}|"
                  "entropy {entropy:.3f}|zero_std {frac_reward_zero_std:.2f}|{seconds:.2f}s").split("|")


def reward_metrics(rewards, per_reward, group_size):
    groups = rewards.view(-1, group_size)  # [P, G]
    kept = groups.isfinite().all(dim=1)  # [P]
    return {"reward_mean": groups[kept].mean().item(),
            "reward_std": groups.std(dim=1)[kept].mean().item(),  # the advantages' divisor (TRL's: the batch's)
            "frac_reward_zero_std": (groups.amax(dim=1) == groups.amin(dim=1)).float().mean().item(),  # tied
            "frac_reward_nonfinite": 1 - kept.float().mean().item(),  # left out
            **{f"rewards/{k}": v.mean().item() for k, v in per_reward.items()}}


def start_logging(args, trainer, out, start):
    trainable = sum(p.numel() for p in trainer.trained.parameters() if p.requires_grad)
    ar = f"LoRA r={args.lora_rank}" if args.lora_rank else "head" if args.ar_trainable == "head" else "full"
    dit = f"LoRA r={args.dit_lora_rank}" if args.dit_lora_rank else "full"
    how = {"ar": ar, "dit": f"DiT {dit}", "both": f"AR {ar}, DiT {dit}"}[args.policy]
    print(f"running with: mode={args.mode} model={args.model} device={args.device} dtype={args.dtype} "
          f"offload={args.offload_note} batch={args.prompts_per_step}x{args.group_size} mu={args.inner_epochs} "
          + f"lr={args.lr} " * (args.policy != "dit") + f"trainable={trainable:,} ({how}) "
          f"image={args.height}x{args.width} sampler=T {args.temperature}, top-k {args.top_k}, top-p {args.top_p} "
          f"decode={args.num_inference_steps} steps, guidance {args.guidance_scale} loss_tokens={args.loss_tokens} "
          f"dit_noise={args.dit_noise} out={out} threads={torch.get_num_threads()} processes={world_size()} "
          f"micro_batch={args.micro_batch_size}"
          + f" policy={args.policy} dit_lr={args.dit_lr} dit_train_steps={args.dit_train_steps}/"
          f"{args.num_inference_steps} dit_noise_level={args.dit_noise_level}" * (args.policy != "ar"))
    ar_rewards, dit_rewards = (" + ".join(f"{r.weight:g} x {r.name}" for r in rs) for rs in
                               (trainer.rewards, trainer.dit_rewards))
    print(f"rewards: {ar_rewards}" + (f" | the DiT's: {dit_rewards}" if dit_rewards else "")
          + f" | lr schedule {args.lr_scheduler}, warm-up {args.lr_warmup_steps} | report to {args.report_to}")
    if args.report_to == "none":
        return
    from accelerate.tracking import TensorBoardTracker, WandBTracker
    tracker = WandBTracker("grpo_glm", name=out.name, dir=str(out), config=vars(args)) if args.report_to == "wandb" \
        else TensorBoardTracker("logs", out, purge_step=start + 1 if start else None)  # a resume drops later events
    tracker.start()  # W&B: WANDB_MODE=offline writes <out>/wandb, for `wandb sync`
    if args.report_to == "tensorboard":
        flags = "\n".join(f"| --{k.replace('_', '-')} | {v} |" for k, v in sorted(vars(args).items()))
        tracker.writer.add_text("flags", "| flag | value |\n|---|---|\n" + flags, global_step=start)
    return tracker


def warn_if_collapsed(row, warned, max_entropy=None):
    """Once a run: most groups tied (advantages 0), and why; not on a non-finite step (call_reward warned)."""
    if warned or row["frac_reward_zero_std"] <= 0.5 or row["frac_reward_nonfinite"]:
        return warned
    why = "the reward does not separate the samples"  # --policy dit: the SDE keeps them apart
    if "entropy" in row:
        why = f"entropy {row['entropy']:.3f} of {max_entropy:.2f}: " + (
            "the policy has collapsed; lower --lr or raise --temperature" if row["entropy"] < 0.5 * max_entropy
            else "the samples differ but the reward does not separate them (pass/fail, none passing?); grade it")
    print(f"warning: step {row['step']}: {row['frac_reward_zero_std']:.0%} of groups tie: "
          f"no learning signal: {why}", file=sys.stderr, flush=True)
    return True


def read_metrics(path):  # a last row cut short by a kill: its text
    rows = [row for row in path.read_text(encoding="utf-8").splitlines() if row.strip()] if path.exists() else []
    if torn := [n for n, row in enumerate(rows[:-1], 1) if not row.endswith("}")]:
        raise UsageError(f"{path}: row {torn[0]} is cut short")
    return [json.loads(row) if row.endswith("}") else row for row in rows]


def save_sample_grid(path, prompts, targets, images, rewards, group_size, sources=None, ode=None, tracker=None,
                     step=None, name="samples"):
    """Per prompt (sorted: it stays put) 8 cells a row: [source,] target, [a=0 decode,] its G samples."""
    scale = max(1, 128 // images.shape[-1])  # cells at least 128 px wide
    height, width = (n * scale for n in images.shape[-2:])
    line, gap = 18, 6  # a line of text, white between cells
    to_pil = lambda x: x if isinstance(x, Image.Image) else Image.fromarray(  # sources: PIL already
        (x.clamp(0, 1).permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    references = [(n, x) for n, x in [("source", sources), ("target", targets), ("a=0 (ODE)", ode)] if x is not None]
    columns = min(8, cells := len(references) + group_size)
    block = 2 * line + math.ceil(cells / columns) * (height + line)  # heading, rows of cells, space
    draw = ImageDraw.Draw(sheet := Image.new("RGB", (columns * (width + gap), len(prompts) * block), "white"))
    for b, row in enumerate(sorted(range(len(prompts)), key=lambda r: prompts[r])):
        draw.text((0, b * block), drawable(prompts[row], sheet.width // 9), fill="black", font_size=16)
        samples = [(images[i], " / ".join(f"{r:.4f}" for r in rewards[i].view(-1).tolist()))  # [N] or [N, k]
                   for i in range(row * group_size, (row + 1) * group_size)]
        for i, (image, label) in enumerate([(x[row], name) for name, x in references] + samples):
            x, y = i % columns * (width + gap), b * block + line + 4 + i // columns * (height + line)
            sheet.paste(to_pil(image).resize((width, height), Image.NEAREST), (x, y))
            draw.text((x + 2, y + height + 2), label, fill="black", font_size=12)  # at 10 px some spaces vanish
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    if tracker:  # one HWC image (W&B takes no dataformats)
        formats = {"dataformats": "NHWC"} if tracker.name == "tensorboard" else {}
        tracker.log_images({name: np.asarray(sheet)[None]}, step, **formats)


def drawable(text, chars=math.inf):
    """Cut at a space to `chars`; as the built-in font draws: 'é' -> 'e', emoji, CJK -> '?', not a no-glyph box."""
    text = text if len(text) <= chars else text[:chars - 1].rsplit(" ", 1)[0] + "…"
    font = ImageFont.load_default(size=12)
    glyph = lambda ch: ((mask := font.getmask(ch)).size, bytes(mask))
    box = glyph("\U0010FFFD")  # a private-use code point has no glyph
    drawn = lambda s: bool(s) and all(c == " " or glyph(c) != box for c in s)
    plain = [unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode() for ch in text]
    return "".join(ch if drawn(ch) else p if drawn(p) else "?" for ch, p in zip(text, plain))


# ==== 19. The run: train()'s plumbing, Ctrl+C and SIGTERM

class AbandonStep(BaseException):
    """A stop signal before a step's update drops it. BaseException: no plug-in's `except Exception` catches it."""


class Run:
    def __init__(self, args):
        self.args, self.out, self.lead = args, Path(args.out), rank() == 0
        self.trainer = self.tracker = self.signum = None  # signum: the first stop signal; voted: the update began
        self.voted, self.bad_steps, self.warned, self.closing = True, [], False, contextlib.ExitStack()

    def __enter__(self):
        with self.closing:  # a failed open closes what it opened
            self.open(self.args, self.out)
            self.closing = self.closing.pop_all()
        return self

    def open(self, args, out):
        resolve_runtime(args)
        validate_args(args)
        if world_size() > 1:  # a dead or hung rank makes the others raise at --dist-timeout
            if args.device == "cuda":
                args.device = f"cuda:{os.environ['LOCAL_RANK']}"
                torch.cuda.set_device(args.device)
            dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                                    timeout=datetime.timedelta(seconds=args.dist_timeout))
        if self.lead:
            lock_out_dir(out, self.closing)
        # mse's targets: checked before slow plug-ins (CLIP) load
        builtin = ["mse"] if "mse" in [s.partition("=")[0] for s in args.reward + (args.dit_reward or [])] else []
        read = lambda path, flag="--prompts": read_prompts(path, args.height, args.width, args.mode, builtin, flag)
        items = self.items = read(args.prompts)
        self.eval_items = args.eval_prompts and read(args.eval_prompts, "--eval-prompts") or []
        if 0 < len(self.eval_items) < world_size():  # a block of at least one a rank
            raise UsageError(f"--eval-prompts {args.eval_prompts}: {len(self.eval_items)} for {world_size()} processes")
        rewards, dit_rewards = load_rewards(args.reward), load_rewards(args.dit_reward or [], "--dit-reward")
        readers = [r.name for r in rewards + dit_rewards if getattr(r.fn, "uses_targets", False)]
        require_targets(items + self.eval_items, readers, args.mode)
        args.prompts_sha256 = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()
        resume = Resume(args, out)  # refuses under the lock, before any model loads
        self.start = resume.step
        if resume.export and not args.save_pipeline:
            return
        trainer = self.trainer = setup_training(args, rewards, dit_rewards)
        trainer.prompt_len = run_prompt_len(trainer.pipe, items, args)
        self.eval_decoder = None if args.disable_cuda_graph else FastDecoder(torch.device(args.device))
        self.eval_prompt_len = self.eval_items and run_prompt_len(trainer.pipe, self.eval_items, args)
        if args.mode == "i2i":
            check_source_size(trainer.pipe.processor.image_processor, args.height, args.width)
        resume.restore(trainer, out)
        if resume.export:  # --save-pipeline only (in __exit__)
            return
        if self.lead:
            self.tracker = start_logging(args, trainer, out, self.start)
            self.closing.callback(self.tracker.finish if self.tracker else lambda: None)
        for s in (signal.SIGINT, signal.SIGTERM):
            self.closing.callback(signal.signal, s, signal.signal(s, self.request))
        # a step whose updates all skipped never called optimizer.step()
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        if self.eval_items and self.start % args.eval_every == 0 and max(from_every_rank(self.lead and not any(
                "eval/seconds" in r and r["step"] == self.start for r in read_metrics(out / "metrics.jsonl")))):
            self.evaluate(self.start)  # unless a run before the resume did

    def steps(self):
        """Yields (step, indices, slots): this rank's block of the step's prompts, seeded order per pass."""
        args, count = self.args, len(self.items)
        slots = np.array_split(range(args.prompts_per_step), world_size())[rank()].tolist()
        for step in range(self.start + 1, args.steps + 1):
            self.step, self.t0, self.step_rng, self.voted = step, time.time(), rng_state(), False
            if self.signum is not None:  # came after the last step's vote
                raise AbandonStep
            places = [divmod((step - 1) * args.prompts_per_step + slot, count) for slot in slots]
            yield step, [int(torch.randperm(count, generator=seeded(args.seed, "prompt order", epoch))[offset])
                         for epoch, offset in places], slots

    def record(self, step, result):
        args, out, trainer, row = self.args, self.out, self.trainer, result.row
        names = ["lr"] * (args.policy != "dit") + ["dit/lr"] * (args.policy != "ar")  # a param group per half
        row.update(zip(names, trainer.lr_scheduler.get_last_lr()))
        trainer.lr_scheduler.step()
        rows = from_every_rank(row)  # ranks hold equal samples: means average (*_max: maxed)
        row = {k: type(v)((max if k.endswith("_max") else np.mean)([float(r[k]) for r in rows]))
               for k, v in row.items()} | {"seconds": round(time.time() - self.t0, 3)}
        stopping = self.agree()
        if self.lead:
            self.log(row, step)
            # entropy's yardstick: log(kept ids), or under top-p step 1's entropy (if > 0)
            scale = math.log(min(args.top_k or math.inf, trainer.sampling.codebook))
            if args.top_p < 1:
                scale = next(r.get("entropy") for r in read_metrics(out / "metrics.jsonl") if "seconds" in r) or scale
            self.warned = warn_if_collapsed(row, self.warned, scale)
        self.bad_steps = non_finite_streak(self.bad_steps, row, out, args, self.start)
        if self.lead and args.sample_every and (step % args.sample_every == 0 or step == args.steps):
            save_sample_grid(out / "samples" / f"step_{step:06d}.png", result.prompts, result.targets, result.images,
                             result.rewards, args.group_size, result.sources, result.ode, self.tracker, step)
        if self.eval_items and not stopping and (step % args.eval_every == 0 or step == args.steps):
            self.evaluate(step)  # before the save: a checkpoint's step has its row (stopping: the resume's)
        if step % args.save_every == 0 or step == args.steps:
            save_checkpoint(out, step, trainer, args)
        if stopping:
            self.stop(step)

    def log(self, row, step):
        finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:  # NaN, inf -> null: JSON has no NaN
            f.write(json.dumps(finite, allow_nan=False) + "\n")
        if self.tracker:
            self.tracker.log({k: v for k, v in row.items() if k != "step"}, step)
        shown = {k.removeprefix("eval/"): v for k, v in row.items()}
        fields = [f.format_map(shown) for f in CONSOLE_FIELDS if all(k in shown for k in re.findall(r"{([^:]+):", f))]
        kind = "eval" if "eval/seconds" in row else "step"
        print(f"{kind} {step:4d}/{self.args.steps} | " + " | ".join(fields), flush=True)

    def evaluate(self, step):
        """EVAL: G samples per --eval-prompts line; seeds no step draws (step -1), alike every eval and world size."""
        args, pipe, items, t0, G = self.args, self.trainer.pipe, self.eval_items, time.time(), self.args.group_size
        sheet = self.out / "samples" / f"eval_step_{step:06d}.png"
        if self.lead:
            print(f"eval at step {step}: {len(items)} held-out prompts x {G} samples -> {sheet} ...", flush=True)
        texts, targets, sources = step_prompts(items, range(len(items)), args.mode)  # targets [n, 3, 32H, 32W] | None
        ar, mine = pipe.vision_language_encoder, np.array_split(range(len(items)), world_size())[rank()].tolist()
        prompts, own = [texts[i] for i in mine], sources and [sources[i] for i in mine]
        ar.eval()
        with whole_weights(ar) as sharded:
            rollout = sample_groups(pipe, prompts, G, self.trainer.sampling, args.height, args.width, "target", own,
                                    [seeded(args.seed, "tokens", -1, i, ar.device) for i in mine],
                                    self.eval_prompt_len, None if sharded else self.eval_decoder)
        noise = group_noise(pipe, mine, G, args.height, args.width, args.seed, -1, "per-step")  # [n, C, h, w]
        images = decode_images(pipe, prompts, own, rollout, noise, args.eval_num_inference_steps, args.guidance_scale)
        scored = (prompts, None if targets is None else targets[mine], G)
        parts = from_every_rank((images, *compute_rewards(self.trainer.rewards, images, *scored)))
        if self.lead:  # the ranks' blocks, in prompt order
            images, rewards = (torch.cat([p[i] for p in parts]) for i in (0, 1))
            per_reward = {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
            row = {"eval/" + k: v for k, v in reward_metrics(rewards, per_reward, G).items()}
            self.log({"step": step, **row, "eval/seconds": round(time.time() - t0, 3)}, step)
            save_sample_grid(sheet, texts, targets, images, rewards, G, sources, tracker=self.tracker, step=step,
                             name="eval/samples")

    def request(self, signum, _frame):
        if self.signum is not None:  # a second Ctrl+C quits now, a second SIGTERM is ignored
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signum = signum
        name = "Ctrl+C" if signum == signal.SIGINT else signal.Signals(signum).name
        if self.lead:
            what = "finishing this step" if self.voted else "abandoning this step (before its update)"
            print(f"\n{name}: {what} and saving (Ctrl+C to quit now)", file=sys.stderr, flush=True)
        if not self.voted:
            raise AbandonStep

    def agree(self):
        """True if any rank got a stop signal; all adopt its number (the exit code's)."""
        self.voted = True
        if (seen := max(from_every_rank(self.signum or 0))) and self.signum is None:
            self.signum = seen
            if self.lead:
                print(f"{signal.Signals(seen).name} on another rank: stopping", file=sys.stderr, flush=True)
        return self.signum is not None

    def vote(self):  # grpo_step's before_update
        if self.agree():
            raise AbandonStep

    def __exit__(self, kind, *_):
        try:
            if kind is AbandonStep:  # the weights are step - 1's
                self.stop(self.step - 1)
        finally:
            self.closing.close()
        if kind is None and self.trainer and self.lead:
            if pipeline := self.args.save_pipeline:
                save_trained_pipeline(self.trainer.pipe, self.args)
            said = [f"{self.out} holds " + ", ".join(p.name + "/" * p.is_dir() for p in sorted(self.out.glob("[!.]*")))]
            print("done:", "; ".join(said * self.out.is_dir() + [f"the trained pipeline: {pipeline}"] * bool(pipeline)))

    def stop(self, done):
        """Exits 128 + signal with step `done` saved (step_rng: the RNG states it left)."""
        try:
            if not self.voted and getattr(self.trainer.decoder, "graphs", 0) == {}:
                all_ranks_agree(True)  # the others vote on the decoder's first graph
            peers = self.voted or self.agree()  # a rank that left its step early still votes
        except Exception as e:
            if not collective_failed(e):
                raise
            peers = False  # a rank was killed (kill -9, OOM): rank 0 saves alone
        saved = done % self.args.save_every == 0 or done in (self.start, self.args.steps)  # by record() or a resume
        if not saved and (peers or self.lead):
            save_checkpoint(self.out, done, self.trainer, self.args, self.step_rng if done < self.step else None)
        if peers:
            all_ranks_agree(True)  # the others wait for rank 0's file
        when = f"in step {self.step} before its update" if done < self.step else f"after step {done}"
        where = (f"step {done} is saved in {self.out / 'checkpoints' / f'step_{done:06d}.pt'}; continue with "
                 f"--resume latest --out {self.out}" if done else "no step finished, nothing to save")
        if self.lead:
            print(f"interrupted {when}: {where}", file=sys.stderr)
        sys.exit(128 + self.signum)


# ==== 20. CHECKPOINT and --resume

def atomic_write(path, write):
    """write(f) to path.tmp, synced, renamed over path: readers see the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state():
    name, keys, *rest = np.random.get_state()  # numpy's uint32 keys as an int64 tensor: weights_only loads it
    return {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), *rest],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all()}  # no GPU: []


def save_checkpoint(out, step, trainer, args, rng=None):
    """All ranks gather (--fsdp: a collective); rank 0 writes."""
    weights, optimizer_state = training_state(trainer.trained, trainer.optimizer)
    if rank() != 0:
        return
    (path := out / "checkpoints" / f"step_{step:06d}.pt").parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": CHECKPOINT_FORMAT, "step": step, "trainable": weights, "optimizer": optimizer_state,
               "lr_scheduler": trainer.lr_scheduler.state_dict(), "rng": rng or rng_state(), "args": vars(args)}
    atomic_write(path, functools.partial(torch.save, payload))
    for old in saved_checkpoints(out)[:-args.checkpoints_total_limit] if args.checkpoints_total_limit else []:
        old.unlink()  # after the save: a complete newest one always exists
    return path


def saved_checkpoints(out):
    return sorted((out / "checkpoints").glob("step_*.pt"))  # oldest first: six-digit steps sort by name


def read_checkpoint(spec, out=None):
    if (path := max(saved_checkpoints(out), default=None) if spec == "latest" else Path(spec)) is None:
        print(f"--resume latest: no checkpoint in {out / 'checkpoints'} yet; starting from step 0")
        return None
    try:
        with warnings.catch_warnings(action="ignore"):  # junk can look like another pickle protocol's
            ckpt = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code
    except Exception:  # many types for a missing, foreign or truncated file
        raise UsageError(f"--resume {path}: {'not a readable checkpoint file' if path.exists() else 'no such file'}")
    if not isinstance(ckpt, dict) or not str(ckpt.get("format", "")).startswith("grpo_glm-checkpoint-"):
        raise UsageError(f"--resume {path}: not a checkpoint of grpo_glm.py")
    if ckpt["format"] != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume {path}: {ckpt['format']} is an older grpo_glm.py's format; start a new run")
    return {**ckpt, "path": path}


class Resume:
    """Resumed rows equal an unstopped run's bit for bit; restore() loads `step` (0: new), sets later files aside."""

    def __init__(self, args, out):
        if args.resume is None and ((out / "metrics.jsonl").exists() or saved_checkpoints(out)):
            raise UsageError(f"--out {out} has a run: pass --resume latest to continue it, or another --out")
        self.rows = read_metrics(out / "metrics.jsonl")
        ckpt = self.ckpt = read_checkpoint(args.resume, out) if args.resume else None
        step = self.step = ckpt["step"] if ckpt else 0
        self.export = step >= args.steps  # --save-pipeline of the checkpoint, or nothing to do
        saved = ckpt["args"] if ckpt else vars(args)
        # SAME_ON_RESUME's flags must match (else a log splices two runs); a newer flag: its default
        same = {a.dest: a.default for group in flag_parser()._action_groups if SAME_ON_RESUME in (group.title or "")
                for a in group._group_actions if a.dest != "prompts"} | {"prompts_sha256": None}
        changed = self.changed = [
            f"--prompts {saved.get('prompts')} -> {args.prompts}: contents differ" if k == "prompts_sha256"
            else f"--{k.replace('_', '-')} {saved.get(k, default)} -> {getattr(args, k)}"
            for k, default in same.items() if saved.get(k, default) != getattr(args, k)]
        if changed and not args.resume_force:
            raise UsageError(f"--resume {ckpt['path']}: flags differ (--resume-force accepts): {'; '.join(changed)}")
        if self.export:
            print(f"{ckpt['path']} is at step {step}, --steps {args.steps}: " + (
                f"exporting it to {args.save_pipeline}" if args.save_pipeline else
                f"nothing to do (--steps {step + args.steps} trains {args.steps} more)"))
            return
        self.later = [p for p in saved_checkpoints(out) if int(p.stem[5:]) > step]
        if self.later and not args.resume_force:
            raise UsageError(f"--resume {ckpt['path']}: {out} has later checkpoints ({self.later[-1].name}); "
                             "--resume-force sets them and later metrics aside (*.dropped)")

    def restore(self, trainer, out):
        if ckpt := self.ckpt:
            weight_flags = "--policy --model --lora-rank --dit-lora-rank --ar-trainable".split()
            try:
                if set(ckpt["trainable"]) != {n for n, p in trainer.trained.named_parameters() if p.requires_grad}:
                    raise ValueError(f"other parameter names ({', '.join(weight_flags)})")
                training_state(trainer.trained, trainer.optimizer, (ckpt["trainable"], ckpt["optimizer"]))
                trainer.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
            except (RuntimeError, ValueError, KeyError) as e:
                changed = [d for d in self.changed if d.split()[0] in weight_flags]
                raise UsageError(f"--resume {ckpt['path']}: weights do not fit this model: "
                                 + ("; ".join(changed) or str(e).splitlines()[0][:120]))
            if self.export:
                return  # the weights alone
            name, keys, *rest = ckpt["rng"]["numpy"]  # rng_state's, in reverse
            np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
            random.setstate(ckpt["rng"]["python"])
            torch.set_rng_state(ckpt["rng"]["torch"])
            torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])  # no CUDA: queued, never run
        if rank() != 0:
            return
        if ckpt:
            print(f"Resuming from step {self.step} ({ckpt['path']})")
        for path in self.later:
            path.rename(path.with_name(path.name + ".dropped"))
            print(f"note: renamed {path.name} to {path.name}.dropped")
        if dropped := [row for row in self.rows if isinstance(row, str) or row["step"] > self.step]:  # a torn row too
            aside = out / f"metrics.dropped_after_step_{self.step:06d}.jsonl"
            for file, kept in ((aside, dropped), (out / "metrics.jsonl", [r for r in self.rows if r not in dropped])):
                atomic_write(file, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))
            print(f"note: resuming sets the {len(dropped)} metrics rows past step {self.step} aside in {aside}")


# ==== 21. The tiny model's renderer: pre-trained once on token mosaics, then cached
# Its AR is random (what to paint is GRPO's to learn); its renderer (~15 s CPU) paints id k in colour k mod 8.

TINY_CODEBOOK = 64  # real: 16384; 8 ids a colour
TINY_VISION_VOCAB = TINY_CODEBOOK + 16  # real: 16512 (codebook + 128 special ids)
TINY_PALETTE = (torch.tensor(list(COLOURS.values()), dtype=torch.float32) / 255)[torch.arange(TINY_CODEBOOK) % 8]
# get_rope_index places a source image in 2-D by its start and end tokens (a bare <|image|>: as text)
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{% for c in m['content'] %}{{ '<|dit_token_16384|><|image|>"
                      "<|dit_token_16385|>' if c['type'] == 'image' else c['text'] }}{% endfor %}{% endfor %}")
TINY_RENDERER = dict(dit_steps=800, dit_lr=3e-3, batch=8, dit_grids=((2, 2), (3, 3), (4, 4), (3, 2)), inference_steps=4)


def build_tiny_pipeline(seed=0, ar_init_range=0.02, mosaic_ar=False):
    """Toy GLM-Image (seeded, eval, DiT untrained); mosaic_ar: --model tiny's AR; ar_init_range > 0.02: sharp logits."""
    from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from tokenizers import Tokenizer, models
    from transformers import (ByT5Tokenizer, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageProcessor,
                              GlmImageImageProcessorPil, PreTrainedTokenizerFast, T5Config, T5EncoderModel)
    torch.manual_seed(seed)
    # character-level BPE; bos '<|dit_token_16384|>' is image_start_token_id too, as the real one's
    ids = [*range(TINY_CODEBOOK), *range(16384, 16384 + TINY_VISION_VOCAB - TINY_CODEBOOK)]
    specials = {"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"}
    names = [*(f"<|dit_token_{i}|>" for i in ids), *map(chr, range(32, 127)), *specials.values(), "<pad>", "<unk>"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE({t: i for i, t in enumerate(names)}, merges=[], unk_token="<unk>")),
        bos_token=names[TINY_CODEBOOK], eos_token=names[TINY_CODEBOOK + 1], pad_token="<pad>", padding_side="left",
        extra_special_tokens=specials)
    # the real min_pixels 512^2 would upscale a small source (VAE-encoded at its size)
    image_processor = GlmImageImageProcessorPil(**dict(REAL_IMAGE_PROCESSOR, min_pixels=32 * 32),
                                                image_mean=[0.5] * 3, image_std=[0.5] * 3)
    ar = GlmImageForConditionalGeneration(GlmImageConfig(
        text_config=dict(  # pad_token_id: the default 167841 is out of vocabulary
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=2048, initializer_range=ar_init_range,
            vision_vocab_size=TINY_VISION_VOCAB, eos_token_id=TINY_CODEBOOK + 1, pad_token_id=tokenizer.pad_token_id,
            # mosaic AR: at theta 1e4 (4 frequencies) a grid row turns 0.01 rad, a column 0.001
            rope_parameters={"rope_type": "default", "rope_theta": 4.0 if mosaic_ar else 10000.0,
                             "mrope_section": [2, 1, 1], "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=64, intermediate_size=32),
        vq_config=dict(embed_dim=32, num_embeddings=TINY_CODEBOOK, latent_channels=32),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"), image_start_token_id=TINY_CODEBOOK,
        image_end_token_id=TINY_CODEBOOK + 1)).eval()
    if mosaic_ar:
        # a cell's logits must not follow the random token before it (GRPO learns one colour)
        with torch.no_grad():
            image_embeddings = ar.model.language_model.embed_tokens.weight[:TINY_VISION_VOCAB]
            image_embeddings[:] = image_embeddings.mean(0)
            for layer in ar.model.language_model.layers:
                layer.self_attn.q_proj.weight.mul_(16.0)
                layer.self_attn.k_proj.weight.mul_(16.0)
    # a T5 from a config is in train mode: dropout varies a prompt's embedding
    text_encoder = T5EncoderModel(T5Config(vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    # patch 2 x VAE 8 = 16 px a DiT token: the AR's 32-px tokens upsampled 2x, as the real model's
    transformer = GlmImageTransformer2DModel(in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16,
                                             num_attention_heads=2, text_embed_dim=32, time_embed_dim=16,
                                             condition_dim=8, prior_vq_quantizer_codebook_size=TINY_CODEBOOK)
    ar.generation_config = policy_generation_config(ar, SamplingParams(codebook=TINY_CODEBOOK))  # as training's
    return GlmImagePipeline(
        processor=GlmImageProcessor(image_processor, tokenizer, chat_template=TINY_CHAT_TEMPLATE), vae=colour_vae(),
        tokenizer=ByT5Tokenizer(), text_encoder=text_encoder.eval(), vision_language_encoder=ar,
        transformer=transformer.eval(), scheduler=FlowMatchEulerDiscreteScheduler())


def random_mosaics(batch, grid_hw, generator, cell=32):
    """(grids [batch, H*W], mosaics [batch, 3, H*cell, W*cell] in [0, 1]: cells in their token's colour)."""
    H, W = grid_hw
    def grid():  # 1, 2, 4 or all ids, a cell one of them: uniform fields, two-colour shapes, confetti
        k = [1, 2, 4, TINY_CODEBOOK][int(torch.randint(4, (1,), generator=generator))]
        return torch.randperm(TINY_CODEBOOK, generator=generator)[:k][torch.randint(k, (H * W,), generator=generator)]
    tokens = torch.stack([grid() for _ in range(batch)])
    mosaics = TINY_PALETTE[tokens.view(-1, H, W)].movedim(-1, 1)
    return tokens, mosaics.repeat_interleave(cell, 2).repeat_interleave(cell, 3)


def colour_vae(carrier=32.0):
    """A VAE painting latent channels 0-2 upsampled 8x, by hand: GroupNorm erases absolute colour, training stalls."""
    from diffusers import AutoencoderKL
    vae = AutoencoderKL(block_out_channels=(8,) * 4, down_block_types=["DownEncoderBlock2D"] * 4,
                        up_block_types=["UpDecoderBlock2D"] * 4, norm_num_groups=1, use_post_quant_conv=False,
                        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    decoder, pair = vae.decoder, torch.cat([torch.eye(3), -torch.eye(3)])  # [6, 3]: channel c -> (c, -c)
    with torch.no_grad():
        for weight in decoder.parameters():
            weight.zero_()  # residuals off
        for block in decoder.up_blocks[:-1]:  # nearest upsample, then the identity
            torch.nn.init.dirac_(block.upsamplers[0].conv.weight)
        decoder.conv_in.weight[:6, :3, 1, 1] = pair
        decoder.conv_in.bias[6:] = torch.tensor([carrier, -carrier])  # the pair keeps the mean 0
        decoder.conv_norm_out.weight.fill_(carrier / 2)  # the group's std ~ carrier / 2
        decoder.conv_out.weight[:, :6, 1, 1] = pair.T  # SiLU(c) - SiLU(-c) = c
    return vae.eval()


def train_tiny_renderer(seed, settings):
    """(pipe, last loss): flow matching (fp32, CPU), x_t = scale_noise(x0, t, eps), target eps - x0."""
    with torch.random.fork_rng(devices=[]):
        pipe = build_tiny_pipeline(seed, mosaic_ar=True)
        generator, dit, batch = torch.Generator().manual_seed(seed), pipe.transformer.train(), settings["batch"]
        optimizer = torch.optim.Adam(dit.parameters(), lr=settings["dit_lr"])
        for step in range(settings["dit_steps"]):
            hw = settings["dit_grids"][step % len(settings["dit_grids"])]
            timesteps, _ = dit_schedule(pipe, 32 * hw[0], 32 * hw[1], settings["inference_steps"])  # sets scheduler
            tokens, mosaics = random_mosaics(batch, hw, generator, 32 // pipe.vae_scale_factor)  # latent-sized
            x0 = torch.nn.functional.pad(mosaics * 2 - 1, (0, 0, 0, 0, 0, 1))  # [B, 4, h, w]: RGB in [-1, 1], zeros
            t = timesteps[torch.randint(len(timesteps), (batch,), generator=generator)]
            eps = torch.randn(x0.shape, generator=generator)
            cond = dit_condition(pipe, [""], batch, tokens, hw, 1.0)  # the glyphs of "", the grids
            v = dit_velocity(dit, pipe.scheduler.scale_noise(x0, t, eps), t, cond, write_source_caches(dit, cond))
            loss = ((v - (eps - x0)) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return pipe, loss.item()


def tiny_cache():
    return Path(os.getenv("GRPO_GLM_CACHE") or Path(os.getenv("XDG_CACHE_HOME") or Path.home() / ".cache", "grpo_glm"))


def tiny_pipeline_dir(seed=0, settings=TINY_RENDERER):
    key = [seed, settings, [*map(inspect.getsource, (build_tiny_pipeline, colour_vae, random_mosaics, dit_schedule,
           train_tiny_renderer, dit_condition, dit_velocity, write_source_caches, policy_generation_config,
           SamplingParams))], TINY_VISION_VOCAB, TINY_PALETTE.tolist(), TINY_CHAT_TEMPLATE, REAL_IMAGE_PROCESSOR,
           *(importlib.import_module(m).__version__ for m in ("torch", "diffusers", "transformers"))]
    root = tiny_cache()
    final = root / f"tiny-seed{seed}-{hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]}"
    for library in ("diffusers", "transformers"):  # a toy loads at once: no bars
        importlib.import_module(f"{library}.utils.logging").disable_progress_bar()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f".{final.name}.lock"):  # a second run waits (freed if the process dies)
        if not final.is_dir():  # built neither before nor by the run waited for
            start = time.time()
            print(f"building --model tiny (seed {seed}): {settings['dit_steps']} DiT steps ...", end=" ", flush=True)
            pipe, loss = train_tiny_renderer(seed, settings)
            partial = root / f".{final.name}.tmp"  # a killed save's is replaced, never loaded
            shutil.rmtree(partial, ignore_errors=True)
            pipe.save_pretrained(partial)
            os.rename(partial, final)  # atomic: only a finished build is final
            print(f"done in {time.time() - start:.0f} s (flow-matching loss {loss:.4f}), cached in {final}", flush=True)
    return final


# ==== 22. More GPUs: torchrun data parallel (DDP) and sharding (--fsdp)
# torchrun --nproc_per_node K: a rank samples, rewards, standardises whole groups (DanceGRPO); gradients
# and a few scalars cross ranks; rank 0 writes. 1 and K processes train alike up to sums' order.

@functools.cache  # swapped once a process
def float64_throughout():
    """--dtype float64: GlmImageRMSNorm and diffusers' apply_rotary_emb round to fp32 (1 vs 2 processes 1e-9 apart)."""
    from diffusers.models import embeddings
    from transformers.models.glm_image.modeling_glm_image import GlmImageRMSNorm
    def rms_norm(self, x):
        wide = at_least_fp32(x)
        return self.weight * torch.nn.functional.rms_norm(wide, wide.shape[-1:], eps=self.variance_epsilon).to(x.dtype)

    def rotary(x, freqs_cis, *args, library=embeddings.apply_rotary_emb, **kwargs):
        if x.dtype != torch.float64:
            return library(x, freqs_cis, *args, **kwargs)
        cos, sin = (f.to(x.device)[None, :, None, :] for f in freqs_cis)  # the DiT's x: [B, S, heads, D]
        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)  # its use_real_unbind_dim=-2: halves
        return x * cos + torch.cat([-x_imag, x_real], dim=-1) * sin
    embeddings.apply_rotary_emb, GlmImageRMSNorm.forward = rotary, rms_norm


def rank():  # torchrun's, readable before joining the group
    return int(n) if (n := os.getenv("RANK", "0")).isdecimal() and world_size() > 1 else 0


def world_size():
    return int(n) if (n := os.getenv("WORLD_SIZE", "1")).isdecimal() else 1


def from_every_rank(value):  # any picklable, in rank order
    values = [value] * world_size()
    if dist.is_initialized():
        dist.all_gather_object(values, value)
    return values


def all_ranks_agree(flag):
    """`flag` on every rank? Ranks choose collectives (skip an update, stop) together, or one hangs."""
    return all(from_every_rank(bool(flag)))


def collective_failed(error):
    """A peer died or timed out: a DistError, or (gloo, in backward too) a RuntimeError naming gloo or nccl."""
    return dist.is_initialized() and bool(isinstance(error, dist.DistError) or re.search("gloo|nccl", str(error), re.I))


def distribute(model, params, args, reference=None):
    """-> (training forward, AdamW's params). --fsdp (FSDP2): a rank keeps 1/K of each weight, gradient and moment."""
    if not dist.is_initialized():
        return model, params
    if not args.fsdp:
        return torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False), params
    from diffusers.training_utils import cast_training_params
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")  # DiT's, unedited
    compute = getattr(torch, args.dtype)
    master = torch.promote_types(compute, torch.float32)  # fp32 shards: bf16 rounds AdamW's steps away
    cast_training_params(model, dtype=master)
    mesh = init_device_mesh(torch.device(args.device).type, (world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=master)  # gathered in bf16, reduced in fp32
    for module in [m for m in (model, reference) if m is not None]:
        for unit in [*sharded_layers(module), module]:  # the policy's root stays gathered
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=True if unit is reference else None)
    return model, [p for p in model.parameters() if p.requires_grad]


def sharded_layers(module):  # fully_shard's units below the root
    return module.model.language_model.layers if hasattr(module, "model") else module.transformer_blocks


def fsdp_units(model):  # [] if not sharded
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def whole_weights(model):
    """Whole weights to sample and in no-grad passes (else each decode step gathers) -> sharded?"""
    units = fsdp_units(model)
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield bool(units)
    finally:
        for unit in units:
            unit.set_reshard_after_forward(unit is not model, recurse=False)  # FSDP2's defaults (root: False)
            unit.reshard()


def training_state(model, optimizer, loaded=None):
    """All ranks: (trained weights, AdamW state) whole on rank 0's CPU (others: {}), or loads one (any world size)."""
    from torch.distributed.checkpoint import state_dict as dsd
    whole = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True, strict=False)
    if loaded is None:
        return dsd.get_state_dict(model, optimizer, options=whole)
    dsd.set_state_dict(model, optimizer, model_state_dict=loaded[0], optim_state_dict=loaded[1], options=whole)


# ==== 23. Memory plan for the real GLM-Image (arithmetic on its configs, meta device)
# --plan: a GPU's bytes, no download; the DiT's are estimates (README, Measurements).
WEIGHT_BYTES, FP32_BYTES = 2, 4
REAL_IMAGE_PROCESSOR = dict(patch_size=16, temporal_patch_size=1, merge_size=1, min_pixels=512**2, max_pixels=2048**2)


def plan_components(model, seed=0):
    """(components, image processor) of --model: the tiny model, or on meta a saved pipeline or GLM-Image."""
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import (AutoConfig, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageImageProcessorPil,
                              T5Config, T5EncoderModel)
    if model == TINY:
        pipe = build_tiny_pipeline(seed, mosaic_ar=True)
        return ({"ar": pipe.vision_language_encoder, "dit": pipe.transformer, "glyph_t5": pipe.text_encoder,
                 "vae": pipe.vae}, pipe.processor.image_processor)
    saved, processor = Path(model), GlmImageImageProcessorPil(**REAL_IMAGE_PROCESSOR)
    if saved.is_dir():
        ar, glyph_t5 = (AutoConfig.from_pretrained(saved / p) for p in ("vision_language_encoder", "text_encoder"))
        dit = GlmImageTransformer2DModel.load_config(saved / "transformer")
        vae = AutoencoderKL.load_config(saved / "vae")
        with contextlib.suppress(OSError, ValueError):
            processor = GlmImageImageProcessorPil.from_pretrained(saved / "processor")
    else:
        ar, dit = GlmImageConfig(), dict(attention_head_dim=128, num_attention_heads=32)  # else the defaults
        glyph_t5 = T5Config(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
                            feed_forward_proj="gated-gelu")
        vae = dict(latent_channels=16, block_out_channels=(128, 512, 1024, 1024), layers_per_block=3,
                   down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4)
    with torch.device("meta"):
        return {"ar": GlmImageForConditionalGeneration(ar), "dit": GlmImageTransformer2DModel.from_config(dit),
                "glyph_t5": T5EncoderModel(glyph_t5), "vae": AutoencoderKL.from_config(vae)}, processor


def numel(module):
    return sum(p.numel() for p in module.parameters())


def ar_sequence(mode, height, width, prompt_tokens=64, image_processor=None):
    """(prompt, L) tokens: the (H/32) x (W/32) grid + an end slot; t2i + a ~16x16 preview
    (GlmImageProcessor._get_target_shape), i2i's prompt + the source's VQ tokens, image start and end."""
    from transformers import GlmImageImageProcessorPil
    grid = (height // 32) * (width // 32) + 1
    if mode == "t2i":
        ratio = (height // 32) / (width // 32)
        return prompt_tokens, int(math.sqrt(ratio) * 16) * int(math.sqrt(1 / ratio) * 16) + grid
    processor = image_processor or GlmImageImageProcessorPil(**REAL_IMAGE_PROCESSOR)
    return prompt_tokens + 2 + processor.get_number_of_image_patches(height, width) // processor.merge_size ** 2, grid


def trainable_tensors(model, lora_rank, targets=LORA_TARGETS):
    """Trained numels: add_lora's A [r, in], B [out, r] per Linear *.target; rank 0: all but the AR's visual and VQ."""
    if not lora_rank:
        return [p.numel() for name, p in model.named_parameters() if not name.startswith(("model.visual.", "model.vq"))]
    return [n for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name.endswith(tuple("." + t for t in targets))
            for n in (lora_rank * m.in_features, m.out_features * lora_rank)]


def state_bytes(trained, total, state, shard=1, adapters=False, reference=False):
    """A GPU of `shard`'s bytes between updates: weights, grads and AdamW's 2 moments (`state` bytes), KL reference."""
    weights = WEIGHT_BYTES * (total if adapters else total - trained) + state * trained
    return {"weights": weights / shard, "grads": state * trained / shard, "adam": 2 * state * trained / shard,
            "reference": WEIGHT_BYTES * total / shard if reference else 0}


def layer_activation_bytes(text, lora_rank, bytes_per):
    """Bytes a decoder layer keeps per token for backward (SDPA, flash on CUDA and CPU: no length^2 matrix)."""
    h, i, heads = text.hidden_size, text.intermediate_size, text.num_attention_heads
    kv, d, a = text.num_key_value_heads * h // heads, bytes_per, FP32_BYTES
    kept = (d * (2 * h + 2 * kv + 3 * i)  # q, k, v after RoPE, SDPA's output; gate_up's output, SiLU's
            + 4 * heads + 4 * (4 * h + 4))  # SDPA's log-sum-exp; the 4 RMSNorms' fp32 inputs and 1 / rms
    if not lora_rank:  # the norms' normalised values; inputs of q/k/v, o, gate_up, down
        return kept + d * (7 * h + i)
    # adapters' inputs cast to fp32 (q, k, v each theirs; an fp32 model keeps the shared ones), A's outputs
    return kept + a * (5 * h + i if d != a else 3 * h + i) + len(LORA_TARGETS) * a * lora_rank


def ar_update_bytes(text, samples, prompt_tokens, generated, lora_rank, checkpointing, tensors, head_trainable,
                    total_params=0, foreach=True):
    """The AR's state_bytes and each phase of a micro-batch's update, their max "peak"; `tensors`: trained numels."""
    d, h, V, rows = WEIGHT_BYTES, text.hidden_size, text.vision_vocab_size, samples * generated
    state = FP32_BYTES if lora_rank else d  # gradients and moments: the parameters' dtype
    tokens = samples * (prompt_tokens + generated - 1)  # teacher-forced input: prompt + generated[:-1]
    layer = layer_activation_bytes(text, lora_rank, d) * tokens
    kept = text.num_hidden_layers * (d * h * tokens if checkpointing else layer)  # ckpt: layer inputs
    rotary = int(h // text.num_attention_heads * text.rope_parameters.get("partial_rotary_factor", 1))
    # a token: the final norm's fp32 input, M-RoPE's cos, sin; full: its output, lm_head's input. Logits stay till
    # the next micro-batch; a frozen lm_head (LoRA): the CPU's bmm copies it a sample
    outside, logits = tokens * (4 * h + (0 if lora_rank else 2 * d * h) + 2 * rotary * d), rows * d * V
    head_copy, held = 0 if head_trainable else samples * V * h * d, kept + outside + logits
    s = state_bytes(sum(tensors), total_params, state, adapters=lora_rank > 0)
    forward = {"forward_model": held + max(head_copy, rows * 8 * V),  # token_logprobs' fp32 copy / temperature
               "forward_logits": held + rows * 24 * V}  # log_softmax (4 V) + the entropy monitor (5 x 4 V)
    backward = max(held + rows * 12 * V,  # the fp32 gradient chain of gather and log_softmax
                   held + logits + head_copy, kept + logits + layer if checkpointing else 0)  # ckpt: 1 recomputed
    # AdamW's step: exp_avg_sq copies of all (foreach, CUDA's default) or the 2 largest parameters (CPU)
    phases = {**forward, "backward": max(backward + head_trainable * state, s["grads"] + logits),
              "step": s["grads"] + state * (sum(tensors) if foreach else 2 * max(tensors))}
    return {**s, **phases, "activations": max(*forward.values(), backward), "peak": max(phases.values())}


def vae_decode_bytes(vae, height, width, images, bytes_per=WEIGHT_BYTES):
    """No-grad vae.decode's peak: an up block's first resnet keeps its input, norm1's and SiLU's outputs (3 x input)."""
    channels, last = vae.config.block_out_channels, len(vae.config.block_out_channels) - 1
    return 3 * bytes_per * images * max(channels[min(i + 1, last)] * height * width // 4 ** i for i in range(last + 1))


def memory_plan(components, height, width, samples, batch=None, prompts=1, cfg=False, gpus=(), ranks=(64, 16),
                mode="t2i", prompt_tokens=64, image_processor=None, beta=0.0, dit_rank=64, ar_rank=0):
    """{"ar", "dit": --plan's rows (+ "half": its bytes)}, parameter counts, terms; a GPU of K samples `batch` / K."""
    ar, config, d, batch = components["ar"], components["dit"].config, WEIGHT_BYTES, batch or samples
    text, counts = ar.config.text_config, {name: numel(m) for name, m in components.items()}
    frozen = {name: d * counts[name] for name in ("dit", "glyph_t5", "vae")}
    prompt_len, generated = ar_sequence(mode, height, width, prompt_tokens, image_processor)
    hidden, patches = config.num_attention_heads * config.attention_head_dim, (height // 16) * (width // 16)
    # i2i: write_source_caches' K, V per layer and prompt, alive through sampling and backward
    source_kv = prompts * config.num_layers * 2 * patches * hidden * d * (mode == "i2i")
    kv_cache = (prompt_len + generated) * text.num_hidden_layers * 2 * text.num_key_value_heads * text.hidden_size \
        // text.num_attention_heads * d
    decode = vae_decode_bytes(components["vae"], height, width, 1)
    turn = max(frozen["glyph_t5"], frozen["vae"] + decode)  # offloaded parts take turns, the VAE with its decode

    def half(name, mode, k, ckpt):
        """A trained half's bytes on a GPU of k; unseen: copy-outs, the reference's pass, slack."""
        micro, fsdp, rank, gathered = min(samples, batch // k), mode == "fsdp", int(mode[5:] or 0), 0
        trained = trainable_tensors(components[name], rank, LORA_TARGETS if name == "ar" else DIT_LORA_TARGETS)
        state = state_bytes(sum(trained), counts[name], d if mode == "full" else FP32_BYTES, k if fsdp else 1,
                            rank > 0, beta > 0 and not rank)
        if name == "ar":  # sampling: generate's KV cache of the GPU's samples, or pi_old's pass on a micro-batch
            sampling = max(batch // k * kv_cache, micro * generated * text.vision_vocab_size * 10)  # (10 B a logit)
            head = 0 if rank else numel(ar.model.language_model.norm) + numel(ar.lm_head)  # trained in full
            u = ar_update_bytes(text, micro, prompt_len, generated, rank, ckpt, () if fsdp else trained, head)
            activations, backward = u["peak" if fsdp else "activations"], u["peak"] - u["grads"]  # fsdp: below
        else:  # a denoising step's micro-batch: ~30 x hidden a block and token (x2 CFG, 64 text tokens), guessed,
            sampling = source_kv // k  # + the GPU's source caches; backward: the largest frozen part in turn
            blocks = config.num_layers + 30 if ckpt else config.num_layers * 30
            activations = blocks * (patches + 64) * micro * (1 + cfg) * hidden * d + sampling
            backward = max(frozen["glyph_t5"], frozen["vae"]) + max(activations, state["grads"])
        if fsdp:
            layers, reduce = [numel(layer) for layer in sharded_layers(components[name])], d + FP32_BYTES
            gathered, sampling = d * (counts[name] - sum(layers) + 2 * max(layers)), d * counts[name] + sampling
            backward = max(gathered + activations + reduce * max(layers), reduce * (sum(trained) - sum(layers)))
        return {"trainable": sum(trained), **state, "gathered": gathered, "activations": activations,
                "sampling": sampling, "backward": backward}

    def peaks(halves, beside, offloaded):
        """(update, sampling, overall) peaks of `halves` trained in turn; AdamW's step: 2 x grads."""
        resident = beside + sum(h["weights"] + h["adam"] + h["reference"] for h in halves)
        grads = [h["grads"] for h in halves]
        update = max(2 * sum(grads), *(sum(grads[:i + 1]) + h["backward"] for i, h in enumerate(halves)))
        sampling = sum(grads) + max(h["sampling"] for h in halves)
        return resident + update, resident + sampling, resident + max(update, sampling, sum(grads) + offloaded)

    def row(name, mode, k, ckpt):
        h, dit = half(name, mode, k, ckpt), name == "dit"
        r = {f"{'DiT ' * dit}mode": mode, "grad ckpt": ckpt, "GPUs": k, "micro-batch": min(samples, batch // k),
             "trainable": h["trainable"], "half": h, f"{'DiT' if dit else 'AR'} weights": h["weights"] + h["reference"],
             "grads": h["grads"], "AdamW": h["adam"], "activations": h["activations"]}
        if not dit:  # offloaded, the DiT takes its turn with the GPU's source caches
            update, sampling, peak = peaks([h], 0, max(frozen["dit"] + source_kv // k, turn))
            return {**r, "update peak": update, "sampling peak": sampling, "peak, offload": peak,
                    "peak, no offload": peaks([h], sum(frozen.values()), max(decode, source_kv // k))[2]}
        a = half("ar", mode if mode == "fsdp" else f"lora-{ar_rank}" if ar_rank else "full", k, ckpt)
        return {**r, "peak, dit": peaks([h], d * counts["ar"], turn)[2],  # beside the frozen AR
                "peak, both": peaks([a, h], 0, turn)[2]}  # the AR trains too: sharded, or at ar_rank (0: full)

    loras = {"ar": [f"lora-{r}" for r in ([ar_rank] if ar_rank else ranks)], "dit": [f"lora-{dit_rank}"]}
    return {name: [row(name, mode, k, c) for k in (1, *gpus) for mode in ["full", *loras[name]] + ["fsdp"] * (k > 1)
                   for c in (False, True)] for name in loras}, counts, \
        {"tokens": (prompt_len, generated), "decode": decode, "source_kv": source_kv}


def plan_of_run(args):
    components, processor = plan_components(args.model, args.seed)
    if args.mode == "i2i":
        check_source_size(processor, args.height, args.width)
    return memory_plan(components, args.height, args.width, args.micro_batch_size or args.group_size,
                       args.group_size * args.prompts_per_step, args.prompts_per_step, args.guidance_scale > 1,
                       args.plan_gpus or (), mode=args.mode, image_processor=processor, beta=args.beta,
                       dit_rank=args.dit_lora_rank or 64, ar_rank=args.lora_rank)


def plan_options(args, rows, counts):
    """[(flags changed, row, peak)] of the run's table, fewest changes then smallest first: the run's own first."""
    ar, fsdp, no = args.policy == "ar", args.fsdp and bool(args.plan_gpus), lambda on: "no " * (not on)
    rank, flag = (args.lora_rank, "--lora-rank") if ar else (args.dit_lora_rank, "--dit-lora-rank")
    flags = lambda mode, ckpt, k: ("--fsdp" if mode == "fsdp" else f"{flag} {mode[5:] or 0}",
                                   f"{no(ckpt)}--gradient-checkpointing", f"{k} GPUs")
    mine = flags("fsdp" if fsdp else f"lora-{rank}", args.gradient_checkpointing, fsdp and args.plan_gpus[0] or 1)
    frozen = (not ar) * WEIGHT_BYTES * (counts["glyph_t5"] + counts["vae"])  # on the GPU without --offload
    options = []
    for r in rows["ar" if ar else "dit"]:
        changes = [c for c, m in zip(flags(r["mode" if ar else "DiT mode"], r["grad ckpt"], r["GPUs"]), mine) if c != m]
        for offload in [False, True] if args.offload is None else [args.offload]:
            peak = r[f"peak, {no(offload)}offload" if ar else f"peak, {args.policy}"] + frozen * (not offload)
            options.append((changes + ["--offload"] * (offload and args.offload is None), r, peak))
    return sorted(options, key=lambda option: (len(option[0]), option[2]))


def print_memory_plan(args):
    validate_args(args)
    kind = (path := Path(args.model, "model_index.json")).is_file() and json.loads(path.read_text()).get("_class_name")
    if args.model not in (TINY, "zai-org/GLM-Image") and kind != "GlmImagePipeline":
        raise UsageError(f"--plan --model {args.model}: {f'a {kind}' if kind else 'a hub id'}, not GLM-Image's; --plan "
                         "knows 'tiny', zai-org/GLM-Image or a saved copy")
    (rows, counts, terms), i2i, G = plan_of_run(args), args.mode == "i2i", args.group_size
    (prompt_len, generated), prompts = terms["tokens"], args.prompts_per_step
    unit, unit_name = (2 ** 20, "MiB") if max(r["peak, no offload"] for r in rows["ar"]) < 2 ** 30 else (2 ** 30, "GiB")
    count, count_name = (1e6, "M") if max(counts.values()) >= 1e8 else (1e3, "k")  # the tiny model: MiB, thousands
    size = lambda n: f"{n / unit:.1f} {unit_name}"
    print(f"parameters of {args.model}: " + ", ".join(f"{k} {v / count:,.1f} {count_name}" for k, v in counts.items()))
    source = f" incl. the source's {prompt_len - 66} VQ tokens" * i2i  # 64 text, image start and end
    kl = ", KL reference copy for full fine-tuning" * (args.beta > 0)
    print(f"--mode {args.mode}: {prompts} x {G} samples (prompts x G) of {prompt_len + generated} tokens ({prompt_len} "
          f"prompt{source} + {generated} generated, {args.height}x{args.width}), micro-batches of "
          f"{args.micro_batch_size or G}; estimates in {unit_name} per GPU of K ({prompts} / K groups each){kl}; "
          f"counted: the VAE's decode, one image at a time ({size(terms['decode'])})"
          + f", the DiT's {prompts} source KV caches, one per prompt ({size(terms['source_kv'])})" * i2i)
    titles = ["AR (--policy ar); " + ("fsdp: --fsdp, 16 bytes per trained parameter / K, the bf16 root + 2 layers "
              "gathered" if args.plan_gpus else "--plan-gpus K adds the rows on K GPUs, and --fsdp's"),
              f"\nDiT (Flow-GRPO, --policy dit|both), CFG {'on' if args.guidance_scale > 1 else 'off'}; 'both' trains "
              "the AR too (full, or --lora-rank's; fsdp: sharded)" + "; activations incl. the source KV caches" * i2i]
    options = plan_options(args, rows, counts)
    for title, table in zip(titles, rows.values()):
        columns = [key for key in table[0] if key != "half"]
        print(title + "\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
        for r in table:
            print("| " + " | ".join(map(str, [r[columns[0]] + " (this run)" * (r is options[0][1]),
                  ("no", "yes")[r["grad ckpt"]], r["GPUs"], r["micro-batch"],
                  f"{r['trainable'] / count:.1f} {count_name}", *(f"{r[c] / unit:.1f}" for c in columns[5:])])) + " |")
    free = (args.plan_gpu_memory or 0) * 2 ** 30 or torch.cuda.is_available() and torch.cuda.mem_get_info()[0]
    beside = (peak := options[0][-1]) - options[0][1].get(f"peak, {args.policy}", peak)
    fit = [f"{' '.join(changes)} ({size(peak)})" for changes, _, peak in options if peak <= free][:3]
    verdict = "fits" if peak <= free else f"does not fit; it fits with {'; '.join(fit)}" if fit else \
        "does not fit in any row: lower --micro-batch-size or the image size, or plan GPUs for --fsdp"
    print(f"verdict: --policy {args.policy}, this run's row {'with' if args.offload else 'without'} --offload: "
          f"{size(peak)}{f' (the row + {size(beside)} glyph encoder, VAE)' * (beside > 0)} of {size(free)} free: "
          f"{verdict}" if free else "verdict: no CUDA GPU here: add --plan-gpu-memory GiB")


# ==== 24. Saving and using the trained model (--save-pipeline, generate_images)

def save_trained_pipeline(pipe, args):
    """Atomic; LoRAs merged, unwrapped (as diffusers' unload_lora); the AR's generation config: the trained decode."""
    from diffusers.utils import recurse_remove_peft_layers
    for model in (pipe.vision_language_encoder, pipe.transformer):
        for layer in lora_layers(model):
            layer.merge()
        recurse_remove_peft_layers(model)
    pipe.vision_language_encoder.generation_config.trained_decode = {  # also --model DIR's defaults
        k: getattr(args, k) for k in "height width num_inference_steps guidance_scale temperature top_k top_p".split()}
    partial = (final := Path(args.save_pipeline)).with_name(f".{final.name}.partial")
    print(f"writing the trained pipeline to {final} ...", flush=True)
    try:
        pipe.save_pretrained(partial)
        os.replace(partial, final)  # onto nothing or the empty directory validate_args allows
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@torch.no_grad()
def generate_images(pipe, prompts, sources=None, height=None, width=None, num_inference_steps=None,
                    guidance_scale=None, temperature=None, seed=0):
    """A PIL image per prompt (an edit of sources[k]), seeded by (seed, k); unset: as trained (else 64, 64, 4, 1)."""
    ar = pipe.vision_language_encoder
    trained = getattr(ar.generation_config, "trained_decode", {})  # save_trained_pipeline's
    height, width = height or trained.get("height", 64), width or trained.get("width", 64)
    num_inference_steps = num_inference_steps or trained.get("num_inference_steps", 4)
    guidance_scale = guidance_scale or trained.get("guidance_scale", 1.0)
    if height % 32 or width % 32:
        raise ValueError(f"height and width must be multiples of 32, got {height}x{width}")
    if sources is not None and len(sources) != len(prompts):
        raise ValueError(f"one source per prompt: got {len(sources)} sources for {len(prompts)} prompts")
    sampling = replace(sampling_of(ar), temperature=temperature or ar.generation_config.temperature)
    if sources is not None:  # upright, at the trained size
        sources = [to_rgb(ImageOps.exif_transpose(s)).resize((width, height), Image.BICUBIC) for s in sources]
    noise = group_noise(pipe, range(len(prompts)), 1, height, width, seed, 0, "per-prompt")
    images = []
    for k, (prompt, latents) in enumerate(zip(prompts, noise.split(1))):
        source = sources and sources[k: k + 1]
        # not pipe(prompt, image=[source]): it fails (diffusers 0.42.1, transformers 5)
        rollout = sample_groups(pipe, [prompt], 1, sampling, height, width, "target", source,
                               [seeded(seed, "generate", 0, k, ar.device)])
        images.append(decode_images(pipe, [prompt], source, rollout, latents, num_inference_steps, guidance_scale))
    return pipe.image_processor.numpy_to_pil(torch.cat(images).clamp(0, 1).permute(0, 2, 3, 1).numpy())


# ==== 25. Entry point

def main(argv=None):
    try:
        args = parse_args(argv)
        return print_memory_plan(args) if args.plan else train(args)
    except UsageError as e:
        if rank() == 0 or e.local:
            print(f"error: {f'rank {rank()}: ' if e.local and world_size() > 1 else ''}{e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        # the CPU allocator raises a plain RuntimeError
        if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e):
            print(f"error: out of memory with {args.prompts_per_step} prompts x {args.group_size} samples per step "
                  f"(micro-batch {args.micro_batch_size}): lower --micro-batch-size, --group-size or --prompts-per-step"
                  f", or add --gradient-checkpointing; " + (f"{args.out}'s checkpoints are intact" if
                  saved_checkpoints(Path(args.out)) else "no checkpoint was written"), file=sys.stderr)
        elif collective_failed(e):
            print(f"error: rank {rank()} lost contact with the other processes ({str(e).splitlines()[0][:160]}): "
                  "one died or hung past --dist-timeout; its own output says why", file=sys.stderr)
        else:
            raise
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # DDP/FSDP state outlives destroy_process_group; at exit gloo threads lack the GIL: SIGABRT, PR 179291
