"""One markdown table from cases.sh's $OUT/*.json (real_size.py's records).

python3 .ci/gpu/summary.py OUTDIR                          the table
python3 .ci/gpu/summary.py --mark OUTDIR CASE RC WALL LIMIT  (cases.sh, after each case) its exit code into CASE.json
"""
import glob
import json
import os
import sys

SHORT = {"load_pipeline": "load", "sample_tokens": "sample", "shared_prompt_tokens": "prior",
         "decode_images": "decode", "sample_dit_trajectories": "dit-sample", "compute_rewards": "reward",
         "grpo_update": "update", "dit_update": "dit-update", "ode_images": "ode", "save_checkpoint": "save"}


def mark(outdir, case, rc, wall, limit):
    path = os.path.join(outdir, f"{case}.json")
    rec = {"case": case, "phases": {}}
    if os.path.exists(path):
        try:
            rec = json.load(open(path))
        except ValueError:
            pass
    rc = int(rc)
    rec.update(rc=rc, wall_s=int(wall), limit_s=int(limit))
    if rc == 0 and rec.get("status") == "ok":
        rec["result"] = "done"
    elif rc in (124, 137) or (rc == 143 and "status" not in rec) or "exit 143" in str(rec.get("status")):
        rec["result"] = "timeout"   # 124: SIGTERM at the limit; 137: SIGKILL 5 s later; exit 143: grpo_glm's own stop
    else:
        rec["result"] = f"failed (rc {rc})"
    with open(path, "w") as f:
        json.dump(rec, f, indent=1, default=str)


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def decode_ms(rec):
    """(median ms per decode step from the per-token hook, rows, first-call excess s) of the last sampling call with
    one; else (~ms per token overall: prefill, pass 1 and any compile included)."""
    calls = rec.get("sampling") or []
    for entry in reversed(calls):
        hooks = [v for v in entry.values() if isinstance(v, dict) and v.get("calls", 0) > 16]
        if hooks:
            h = max(hooks, key=lambda v: v["calls"])
            first = next((e for e in calls for v in e.values() if isinstance(v, dict) and v.get("calls", 0) > 16), entry)
            excess = max((v.get("excess_s", 0) for v in first.values() if isinstance(v, dict)), default=None)
            return f"{h['median_ms']:.1f} (x{entry.get('rows')}, p90 {h['p90_ms']:.1f})", excess
    for entry in sorted(reversed(calls), key=lambda e: e.get("phase") != "sample_groups"):  # the last, the sampler's
        if entry.get("ms_per_token_overall"):
            return f"~{entry['ms_per_token_overall']:.1f} overall (x{entry.get('rows')}, last call)", None
    return "-", None


def phases(rec):
    ph = rec.get("phases", {})
    parts = []
    if step := ph.get("grpo_step") or ph.get("flow_grpo_step"):  # --policy ar's step, or dit|both's
        parts.append("**step " + "/".join(fmt(s) for s in step["seconds"]) + "**")
    for name, short in SHORT.items():
        if name in ph:
            parts.append(f"{short} " + "/".join(fmt(s) for s in ph[name]["seconds"]))
    opened = rec.get("open")
    if opened and rec.get("result") != "done":
        parts.append("cut in " + " > ".join(f"{n} (from {t} s)" for n, t in opened))
    return "; ".join(parts) or "-"


def peak(rec):
    ph = rec.get("phases", {})
    alloc = max([p.get("peak_gib", 0) for p in ph.values()] + [rec.get("peak_allocated_gib") or 0])
    reserved = rec.get("peak_reserved_gib")
    return f"{fmt(alloc)} / {fmt(reserved)}" if reserved else fmt(alloc)


def compile_info(rec, excess):
    c = rec.get("compile") or {}
    secs = (c.get("seconds") or {}).get("_compile.compile_inner")
    bits = [f"{fmt(secs)} s"] if secs is not None else []
    step = rec.get("phases", {}).get("grpo_step") or rec.get("phases", {}).get("flow_grpo_step") or {}
    if step.get("compile_s_so_far"):
        bits = ["by step: " + "/".join(fmt(s) for s in step["compile_s_so_far"])]
    if excess is not None:
        bits.append(f"1st decode {excess:+.1f} s")
    if rec.get("capture_s"):   # per DecodeGraph: its warm-up step (any compile in it) + the capture
        bits.append("capture " + "/".join(fmt(s, 2) for s in rec["capture_s"]) + " s")
    stats = c.get("stats") or {}
    if stats.get("unique_graphs") is not None:
        bits.append(f"{stats['unique_graphs']} graphs")
    if c.get("recompiles"):
        bits.append(f"{c['recompiles']} recompiles")
    if c.get("graph_breaks"):
        bits.append(f"{c['graph_breaks']} breaks")
    cg = c.get("cudagraphs")
    if cg:
        bits.append(f"cudagraphs {cg['recorded']} rec, {cg['rerecords']} re-rec")
    if (c.get("inductor") or {}).get("cudagraph_skips"):
        bits.append(f"{c['inductor']['cudagraph_skips']} cudagraph skips")
    return ", ".join(bits) or "-"


def table(outdir):
    recs = []
    for path in glob.glob(os.path.join(outdir, "*.json")):
        try:
            recs.append(dict(json.load(open(path)), _mtime=os.path.getmtime(path)))
        except ValueError as e:
            print(f"{path}: unreadable ({e})")
    recs.sort(key=lambda r: r["_mtime"])   # the order they ran in
    first = next((r for r in recs if r.get("device")), {})
    print(f"\n{first.get('device', '?')}, torch {first.get('torch', '?')}, " +
          ", ".join(f"{k} {v}" for k, v in (first.get("versions") or {}).items()) + (", SMALL (toy widths)" if first.get("small") else ""))
    print("\n| case | result | wall / limit s | phases s (per call) | decode ms/token | compile | peak GiB alloc / reserved |")
    print("|---|---|---|---|---|---|---|")
    for r in recs:
        ms, excess = decode_ms(r)
        result = r.get("result") or ("done" if r.get("status") == "ok" else r.get("status", "?"))
        if r.get("status") not in (None, "ok") and result != "timeout":
            result += f": {str(r['status'])[:120]}"
        print(f"| {r.get('case')} ({r.get('decode_backend', '?')}) | {result} | {r.get('wall_s', '-')} / {r.get('limit_s', '-')} | {phases(r)} | {ms} | "
              f"{compile_info(r, excess)} | {peak(r)} |")
    for r in recs:   # the metrics' diagnostics, one line per case
        rows = r.get("metrics") or []
        if rows:
            keep = ("seconds", "ratio_mean", "dit/ratio_mean", "clip_ratio", "logp_diff_max", "dit/logp_diff_max",
                    "skipped_updates")
            shown = [{k: v for k, v in row.items() if k in keep or "gap" in k or "diff" in k} for row in rows]
            print(f"- {r['case']} metrics: {json.dumps(shown)[:400]}")
        plan = r.get("plan") or {}
        if plan.get("error"):
            print(f"- {r['case']} plan: {plan['error']}")
        elif plan.get("rows"):
            peaks = [{k: v for k, v in row.items() if "peak" in k or k in ("mode", "DiT mode", "micro-batch")}
                     for row in plan["rows"]]
            print(f"- {r['case']} plan (GiB): {json.dumps(peaks)[:400]}")
        if r.get("traceback") and r.get("result") != "done":
            print(f"- {r['case']} error: {r['traceback'].strip().splitlines()[-1][:300]}")


if __name__ == "__main__":
    if sys.argv[1] == "--mark":
        mark(*sys.argv[2:7])
    else:
        table(sys.argv[1])
