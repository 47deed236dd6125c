"""Real-size GLM-Image (random weights, the real configs) through grpo_glm on CUDA.

Usage: python real_size.py CASE OUTDIR [grpo_glm flags...]
Builds the 9B AR + 7B DiT + glyph T5 + VAE from the real configs in bf16 straight on the GPU (no
weights can be downloaded), swaps it in for grpo_glm.pipeline_from_pretrained, runs grpo_glm.main with
the flags, and writes OUTDIR/CASE.json: per-phase seconds (CUDA-synchronised) and peak allocated bytes.
SMALL=1 shrinks every width and depth (a CPU dry run of this script).
"""
import json
import os
import sys
import time

import torch

PROJ = os.environ.get("PROJ", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))   # the repo root
sys.path.insert(0, PROJ)
import grpo_glm as g  # noqa: E402

SMALL = os.environ.get("SMALL") == "1"
CUDA = torch.cuda.is_available()
REC = {"phases": {}, "events": []}


def sync():
    if CUDA:
        torch.cuda.synchronize()


def mem():
    return torch.cuda.max_memory_allocated() if CUDA else 0


def real_tokenizer():
    """A tokenizer with the real ids where they matter: image tokens 0..16511 (start 16384, end 16385),
    pad 167841, <|image|> 167855, a vocabulary of 168064; printable ASCII and <sop>/<eop> in between."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<|dit_token_{i}|>": i for i in range(16512)}
    nxt = 16512
    for c in range(32, 127):
        vocab[chr(c)] = nxt
        nxt += 1
    for name in ("<sop>", "<eop>", "<unk>"):
        vocab[name] = nxt
        nxt += 1
    special = {167841: "<pad>", 167855: "<|image|>"}
    for i in range(nxt, 168064):
        vocab[special.get(i, f"<|unused_{i}|>")] = i
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>")),
        bos_token="<|dit_token_16384|>", eos_token="<|dit_token_16385|>", pad_token="<pad>", unk_token="<unk>",
        padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"})
    assert tok.convert_tokens_to_ids("<|image|>") == 167855 and tok.pad_token_id == 167841
    return tok


def build_real_pipeline(dtype):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline, GlmImageTransformer2DModel
    from transformers import (ByT5Tokenizer, GlmImageConfig, GlmImageForConditionalGeneration, GlmImageProcessor,
                              T5Config, T5EncoderModel)
    from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

    t0 = time.time()
    tok = real_tokenizer()
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12], "partial_rotary_factor": 0.5}
    text = dict(rope_parameters=rope)
    vision, vq = {}, {}
    dit_kw = dict(attention_head_dim=128, num_attention_heads=32)
    t5 = dict(vocab_size=384, d_model=1472, d_kv=64, d_ff=3584, num_layers=12, num_heads=6,
              feed_forward_proj="gated-gelu")
    vae_kw = dict(latent_channels=16, block_out_channels=(128, 512, 1024, 1024), layers_per_block=3)
    if SMALL:   # same structure, toy widths (rotary 2 x (8 + 12 + 12) = 64 of head_dim 128 kept)
        text.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1)
        vision = dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64)
        vq = dict(embed_dim=32, latent_channels=64)
        dit_kw = dict(attention_head_dim=128, num_attention_heads=2, num_layers=2, time_embed_dim=64,
                      condition_dim=32)
        t5.update(d_model=1472, d_ff=256, num_layers=1, num_heads=2)
        vae_kw = dict(latent_channels=16, block_out_channels=(32, 32, 32, 32), layers_per_block=1, norm_num_groups=8)
    device = "cuda" if CUDA else "cpu"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            ar = GlmImageForConditionalGeneration(GlmImageConfig(text_config=text, vision_config=vision, vq_config=vq))
            text_encoder = T5EncoderModel(T5Config(**t5))
            transformer = GlmImageTransformer2DModel(**dit_kw)
            vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                                up_block_types=["UpDecoderBlock2D"] * 4, latents_mean=[0.0] * 16,
                                latents_std=[1.0] * 16, **vae_kw)
    finally:
        torch.set_default_dtype(prev)
    bad = 0
    with torch.no_grad():
        for m in (ar, text_encoder, transformer, vae):
            for p in m.parameters():
                if not torch.isfinite(p).all():
                    bad += 1
                    p.normal_(0, 0.02)
    for m in (ar, text_encoder, transformer, vae):
        m.to(dtype).eval()
    pil = GlmImageImageProcessorPil(**g.REAL_IMAGE_PROCESSOR, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = GlmImageProcessor(image_processor=pil, tokenizer=tok, chat_template=g.TINY_CHAT_TEMPLATE)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="linear",
                                            base_shift=0.25, max_shift=0.75)
    pipe = GlmImagePipeline(tokenizer=ByT5Tokenizer(), processor=processor, text_encoder=text_encoder,
                            vision_language_encoder=ar, vae=vae, transformer=transformer, scheduler=sched)
    sync()
    counts = {k: sum(p.numel() for p in m.parameters()) for k, m in
              [("ar", ar), ("dit", transformer), ("t5", text_encoder), ("vae", vae)]}
    REC["build"] = {"seconds": round(time.time() - t0, 1), "params": counts, "nonfinite_reinit": bad,
                    "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if CUDA else 0}
    print("built", REC["build"], flush=True)
    dump()
    return pipe


def dump():
    """REC so far into OUTDIR/CASE.json: a case cut by its time limit still reports its finished phases."""
    REC["elapsed_s"] = round(time.time() - T0, 1)
    tmp = os.path.join(REC["outdir"], f".{REC['case']}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(REC, f, indent=1, default=str)
    os.replace(tmp, os.path.join(REC["outdir"], f"{REC['case']}.json"))   # never a half-written file


T0 = time.time()
OPEN = []       # the phases in progress, outermost first: [name, start, peak bytes seen]
TOKENS = {}     # per-token hook name -> [timestamps (CUDA events or perf_counter)]
LAST_BEAT = [0.0]


PEAKS = {"allocated": 0, "reserved": 0}  # the whole run's, across fold_peak's resets


def fold_peak():
    """max_memory_allocated since the last reset into every open phase, then reset: nested phases' peaks stay right."""
    if CUDA:
        peak = torch.cuda.max_memory_allocated()
        for frame in OPEN:
            frame[2] = max(frame[2], peak)
        PEAKS["allocated"] = max(PEAKS["allocated"], peak)
        PEAKS["reserved"] = max(PEAKS["reserved"], torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()


def passthrough():
    """Inside a torch.compile trace or a CUDA-graph capture a hook must do nothing (no sync, no event)."""
    try:
        if torch.compiler.is_compiling():
            return True
    except AttributeError:
        pass
    return CUDA and torch.cuda.is_current_stream_capturing()


def timed(name, fn):
    def wrapper(*a, **k):
        if passthrough():
            return fn(*a, **k)
        sync()
        fold_peak()
        frame = [name, time.time(), 0]
        OPEN.append(frame)
        REC["open"] = [[f[0], round(f[1] - T0, 1)] for f in OPEN]
        if name in SAMPLING:
            for stamps in TOKENS.values():
                stamps.clear()
        dump()
        try:
            out = fn(*a, **k)
            sync()
        finally:
            fold_peak()
            OPEN.remove(frame)
            REC["open"] = [[f[0], round(f[1] - T0, 1)] for f in OPEN]
        seconds = round(time.time() - frame[1], 2)
        if CUDA:
            REC["peak_reserved_gib"] = round(PEAKS["reserved"] / 2**30, 2)
        ph = REC["phases"].setdefault(name, {"calls": 0, "seconds": [], "peak_gib": 0.0})
        ph["calls"] += 1
        ph["seconds"].append(seconds)
        ph["peak_gib"] = max(ph["peak_gib"], round(frame[2] / 2**30, 2))
        for parent in OPEN:
            parent[2] = max(parent[2], frame[2])
        extra = ""
        if name in SAMPLING:
            extra = token_stats(name, out, seconds)
        compile_stats()
        if name in STEPS:   # compile seconds so far at each step's end: step 1's vs the later steps'
            ph.setdefault("compile_s_so_far", []).append(REC["compile"].get("seconds", {}).get("_compile.compile_inner"))
        dump()
        print(f"[real_size] {name} {seconds} s, peak {frame[2] / 2**30:.1f} GiB{extra}", flush=True)
        return out
    return wrapper


def tokens_of(out):
    """(rows, generated tokens) of a sampler's output: a Rollout's old_logp / loss_mask [N, L], if it has one."""
    for attr in ("old_logp", "loss_mask", "sequences"):
        t = getattr(out, attr, None)
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            return t.shape[0], t.shape[1] - (getattr(out, "prompt_len", 0) if attr == "sequences" else 0)
    return None, None


def token_stats(name, out, seconds):
    """Per-token intervals of this sampling call from the per-token hooks (if any fired), else seconds / tokens."""
    rows, L = tokens_of(out)
    entry = {"seconds": seconds, "rows": rows, "tokens": L}
    if L:
        entry["ms_per_token_overall"] = round(1000 * seconds / L, 2)   # prefill, pass 1 and any compile included
    for hook, stamps in TOKENS.items():
        if len(stamps) < 3:
            continue
        if CUDA:
            ms = [a.elapsed_time(b) for a, b in zip(stamps, stamps[1:])]
        else:
            ms = [1000 * (b - a) for a, b in zip(stamps, stamps[1:])]
        s = sorted(ms)
        med = s[len(s) // 2]
        entry[hook] = {"calls": len(stamps), "median_ms": round(med, 3), "p10_ms": round(s[len(s) // 10], 3),
                       "p90_ms": round(s[9 * len(s) // 10], 3), "first_ms": [round(x, 1) for x in ms[:4]],
                       "excess_s": round((sum(ms) - med * len(ms)) / 1000, 2)}  # ~ compile + CUDA-graph record
        stamps.clear()
    REC.setdefault("sampling", []).append({"phase": name, **entry})
    best = [v for k, v in entry.items() if isinstance(v, dict) and v["calls"] > 16]
    if best:
        b = max(best, key=lambda v: v["calls"])
        return f", {L} tokens x {rows} rows: {b['median_ms']} ms/token (median), first-call excess {b['excess_s']} s"
    return f", {L} tokens x {rows} rows: {entry.get('ms_per_token_overall')} ms/token overall" if L else ""


def token_hook(name, fn):
    """Marks each call of a per-token function (no sync: a CUDA event, or the clock on the CPU)."""
    stamps = TOKENS.setdefault(name, [])

    def wrapper(*a, **k):
        out = fn(*a, **k)
        if not passthrough():
            if CUDA:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                stamps.append(e)
            else:
                stamps.append(time.perf_counter())
            now = time.time()
            if now - LAST_BEAT[0] > 10:    # a heartbeat into the JSON: a decode cut by the limit shows how far it got
                LAST_BEAT[0] = now
                REC["tokens_so_far"] = {h: len(s) for h, s in TOKENS.items()}
                if CUDA:
                    REC["peak_reserved_gib"] = round(max(PEAKS["reserved"], torch.cuda.max_memory_reserved()) / 2**30, 2)
                dump()
        return out
    return wrapper


def compile_stats():
    """torch.compile's own counters: dynamo/inductor seconds, graphs, recompiles, cache hits, CUDA-graph records."""
    try:
        from torch._dynamo.utils import compilation_time_metrics, counters
        keys = ("_compile.compile_inner", "OutputGraph.call_user_compiler", "compile_fx_inner")
        c = {"seconds": {k: round(sum(compilation_time_metrics.get(k, [])), 1) for k in keys},
             "frames": dict(counters.get("frames", {})), "stats": dict(counters.get("stats", {})),
             "recompiles": sum(counters.get("recompiles", {}).values()),
             "graph_breaks": sum(counters.get("graph_break", {}).values()),
             "inductor": {k: v for k, v in counters.get("inductor", {}).items()
                          if "cache" in k or "cudagraph" in k},
             "aot_autograd": dict(counters.get("aot_autograd", {}))}
        if CUDA:
            from torch._inductor import cudagraph_trees
            manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
            if manager is not None:
                c["cudagraphs"] = {"recorded": int(repr(manager.graph_counter)[6:-1]),
                                   "rerecords": sum(sum(d.values()) for d in manager.num_rerecord.values())}
        REC["compile"] = c
    except Exception as e:
        REC["compile"] = {"error": f"{type(e).__name__}: {e}"[:300]}


# Phases timed by name (a name the file no longer has is skipped, and the JSON says which were found)
PHASES = ("load_pipeline", "place_pipeline", "setup_training", "grpo_step", "flow_grpo_step", "sample_tokens",
          "shared_prompt_tokens", "sample_groups", "old_logprobs", "decode_images", "sample_dit_trajectories",
          "sample_dit", "latents_to_images", "compute_rewards", "grpo_update", "dit_update", "save_checkpoint",
          "ode_images")
SAMPLING = ("sample_groups", "sample_tokens", "shared_prompt_tokens")
STEPS = ("grpo_step", "flow_grpo_step")  # --policy ar's step; dit|both's
# Called once per decoded token, outside any compiled region (TOKEN_HOOKS overrides): its calls' spacing is ms/token
TOKEN_CANDIDATES = os.environ.get("TOKEN_HOOKS", "decode_step").split(",")


def decode_backend(kind):
    """FastDecoder's decode step for this case: '' (grpo_glm's: eager kernels captured as one CUDA graph), 'none'
    (eager, no graph) or 'inductor' (the step compiled by inductor, default mode, then captured); 'dit-compiled':
    grpo_glm's decode, and the frozen DiT's repeated blocks compiled (diffusers' compile_repeated_blocks; --policy
    ar only). Times each capture and marks each replay (a token) for token_stats."""
    REC["decode_backend"] = kind or "cuda graph of eager kernels"
    if kind == "none":
        fast = g.FastDecoder
        g.FastDecoder = lambda device, capture=None: fast(device, capture=lambda step: (step(), step))
    if kind == "dit-compiled":
        load = g.load_pipeline

        def compiled_dit(args):
            pipe = load(args)
            pipe.transformer.compile_repeated_blocks(fullgraph=True, dynamic=True)  # text lengths vary per prompt
            return pipe
        g.load_pipeline = compiled_dit
    if kind == "inductor":   # decode steps only (one row of ids); the prefill stays eager
        eager, compiled = g.decode_step, torch.compile(g.decode_step, fullgraph=True)
        g.decode_step = lambda ar, ids, *rest: (compiled if ids.shape[1] == 1 else eager)(ar, ids, *rest)
    capture = g.cuda_graph

    def timed_capture(step):
        sync()
        t0 = time.time()
        first, replay = capture(step)
        sync()
        REC.setdefault("capture_s", []).append(round(time.time() - t0, 2))   # warm-up step (+ compile) + capture
        dump()
        return first, token_hook("replay", replay)
    g.cuda_graph = timed_capture


def plan_of(flags):
    """--plan's rows for this run (GiB), to set the measured peak against; an error if the plan's API moved."""
    try:
        args = g.parse_args(flags)
        rows, _, _ = g.plan_of_run(args)
        table, key, rank = ("ar", "mode", args.lora_rank) if args.policy == "ar" else ("dit", "DiT mode",
                                                                                      args.dit_lora_rank)
        gib = lambda r: {k: (round(v / 2**30, 1) if isinstance(v, (int, float)) and v > 2**20 else v)
                         for k, v in r.items() if k != "half"}
        mine = [r for r in rows[table] if r.get("grad ckpt") == args.gradient_checkpointing]
        mode = [r for r in mine if r.get(key) in (f"lora-{rank}" if rank else "full", f"lora-{rank}, both")]
        return {"table": table, "rows": [gib(r) for r in mode or mine]}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def main():
    case, outdir, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    os.makedirs(outdir, exist_ok=True)
    REC.update(case=case, outdir=outdir, flags=flags, torch=torch.__version__,
               device=torch.cuda.get_device_name() if CUDA else "cpu", small=SMALL)
    limit = float(os.environ.get("CASE_LIMIT", 0))
    if limit > 8:   # every thread's stack just before the time limit: where a cut case was
        import faulthandler
        faulthandler.dump_traceback_later(limit - 6, exit=False)
    import diffusers
    import transformers
    REC["versions"] = {"transformers": transformers.__version__, "diffusers": diffusers.__version__}
    try:
        import peft
        REC["versions"]["peft"] = peft.__version__
    except ImportError:
        pass
    REC["plan"] = plan_of(flags)
    decode_backend(os.environ.get("DECODE_BACKEND", ""))
    if not hasattr(g, "pipeline_from_pretrained"):   # the one hook the run cannot do without
        print("[real_size] grpo_glm has no pipeline_from_pretrained: the random-weight model cannot be swapped in",
              flush=True)
    orig = getattr(g, "pipeline_from_pretrained", None)
    g.pipeline_from_pretrained = lambda args, dtype: build_real_pipeline(dtype)
    REC["hooks"] = {"phases": [n for n in PHASES if callable(getattr(g, n, None))],
                    "missing": [n for n in PHASES if not callable(getattr(g, n, None))],
                    "per_token": [n for n in TOKEN_CANDIDATES if callable(getattr(g, n, None))]}
    for name in REC["hooks"]["phases"]:
        setattr(g, name, timed(name, getattr(g, name)))
    for name in REC["hooks"]["per_token"]:
        setattr(g, name, token_hook(name, getattr(g, name)))
    print("[real_size] hooks", json.dumps(REC["hooks"]), flush=True)
    t0 = time.time()
    status = "ok"
    pipe = None
    try:
        pipe = g.main(flags)
    except SystemExit as e:
        status = f"exit {e.code}"
    except Exception as e:
        import traceback
        status = f"{type(e).__name__}: {str(e)[:600]}"
        REC["traceback"] = traceback.format_exc()[-4000:]
    REC["status"] = status
    REC["train_seconds"] = round(time.time() - t0, 1)
    fold_peak()
    REC["peak_allocated_gib"] = round(PEAKS["allocated"] / 2**30, 2)
    REC["peak_reserved_gib"] = round(PEAKS["reserved"] / 2**30, 2)
    compile_stats()
    metrics = os.path.join(flags[flags.index("--out") + 1], "metrics.jsonl") if "--out" in flags else None
    if metrics and os.path.exists(metrics):
        REC["metrics"] = [json.loads(line) for line in open(metrics)]
    # The pipeline's own inference of the same images (the floor of a step), if asked and the run succeeded
    if pipe is not None and os.environ.get("INFER") == "1":
        args = g.parse_args(flags)
        try:
            sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            t1 = time.time()
            with torch.no_grad():
                pipe(prompt=["a red circle on a white background"], height=args.height, width=args.width,
                     num_inference_steps=args.num_inference_steps, guidance_scale=args.guidance_scale,
                     num_images_per_prompt=args.group_size, output_type="pt")
            sync()
            REC["pipeline_inference"] = {"seconds": round(time.time() - t1, 2), "peak_gib": round(mem() / 2**30, 2),
                                         "images": args.group_size}
        except Exception as e:
            REC["pipeline_inference"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    g.pipeline_from_pretrained = orig
    dump()
    print(case, status, json.dumps({k: REC[k] for k in ("phases", "train_seconds", "peak_reserved_gib") if k in REC},
                                   default=str), flush=True)
    if status != "ok" and "traceback" in REC:
        print(REC["traceback"], flush=True)
    return status


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result == "ok" else int(result[5:]) if result.startswith("exit ") and result[5:].isdigit() else 1)
