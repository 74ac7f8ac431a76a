"""`strata-bench plan`: predict a run from a recorded one (engine/plan/planner.py), or rank settings.

    strata-bench plan --from-run docs/bench/overlap2-fixed-1024-64k-s3.json.gz \\
        --devices cuda:0,cuda:1 --link gen5x16,5.3 --prefill 2048
    strata-bench plan --from-run 12 --devices cuda:0,cuda:1 --link 26.7,5.3 --peer none --sweep

`--from-run` takes a trace file or the id of a run in the app's history.  Every prediction
prints its error on the source run itself (its own configuration from its own profile).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine import failure, settings_table
from engine.plan import planner

HISTORY_ENV = settings_table.row("gui_data_dir").env  # the app's data folder (engine/settings_table.py)


def history_path(given: str | None) -> Path:
    if given:
        return Path(given)
    folder = settings_table.env_value("gui_data_dir") or ""
    if not folder:
        from platformdirs import user_data_dir

        folder = user_data_dir("strata-gui", appauthor=False)
    return Path(folder) / "history.sqlite3"


def load_source(text: str, history: str | None) -> planner.MeasuredRun:
    if text.isdigit() and not Path(text).exists():
        return planner.load_history_run(history_path(history), int(text))
    return planner.load_trace_run(text)


def _list(text: str | None, n: int, what: str, conv=float) -> list[Any] | None:
    if text is None:
        return None
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if len(items) == 1:
        items = items * n
    if len(items) != n:
        raise planner.PlanError(f"--{what}: one value, or one per device ({n})")
    return [conv(t) for t in items]


def machine_from_args(ns: argparse.Namespace, src: planner.MeasuredRun, profile: planner.CostProfile) -> tuple[
        planner.Machine, list[str]]:
    names = [d.strip() for d in ns.devices.split(",")] if ns.devices else src.devices
    unique = list(dict.fromkeys(names))
    base = planner.machine_of_run(src, profile)
    links = _list(ns.link, len(unique), "link", planner.parse_link) or [0.0] * len(unique)
    pageable = _list(ns.pageable, len(unique), "pageable", planner.parse_link) or [0.0] * len(unique)
    vram = _list(ns.vram_gib, len(unique), "vram-gib") or [0.0] * len(unique)
    speed = _list(ns.speed, len(unique), "speed") or [1.0] * len(unique)
    devs = [planner.DeviceSpec(n, link_gbs=lk, pageable_gbs=p, vram_gib=v, speed=s)
            for n, lk, p, v, s in zip(unique, links, pageable, vram, speed)]
    if ns.peer is None:
        peer = base.peer_gbs
    elif ns.peer.lower() in ("none", "0", "host"):
        peer = 0.0
    else:
        peer = planner.parse_link(ns.peer)
    return planner.Machine(devs, peer_gbs=peer), names


def settings_from_args(ns: argparse.Namespace, src: planner.MeasuredRun, n_devices: int) -> planner.PlanSettings:
    s = planner.settings_of_run(src)
    if ns.devices or ns.interleave:
        s = replace(s, layer_split=None)
    if ns.prompt_tokens:
        s = replace(s, prompt_tokens=int(ns.prompt_tokens))
    if ns.chunk_tokens:
        s = replace(s, chunk_tokens=ns.chunk_tokens if ns.chunk_tokens == "auto" else int(ns.chunk_tokens))
    if ns.chunk_schedule:
        if ns.chunk_schedule not in ("fixed", "balanced"):
            raise planner.PlanError(f"--chunk-schedule {ns.chunk_schedule!r}: fixed or balanced")
        s = replace(s, schedule=ns.chunk_schedule)
    if ns.pipeline_depth is not None:
        s = replace(s, pipeline_depth=int(ns.pipeline_depth))
    if ns.prefill_main is not None:
        s = replace(s, prefill_main=ns.prefill_main not in ("0", "off", "false"))
    if ns.pin_limit_gib is not None:
        s = replace(s, pin_limit_gib=float(ns.pin_limit_gib))
    if ns.arena_gib is not None:
        s = replace(s, arena_gib=float(ns.arena_gib))
    if ns.layer_split:
        s = replace(s, layer_split=[int(x) for x in ns.layer_split.split(",")])
    if ns.interleave:
        s = replace(s, interleave=int(ns.interleave))
    if ns.decode_tokens is not None:
        s = replace(s, decode_tokens=int(ns.decode_tokens))
    return s


def hist_text(h: list[float]) -> str:
    return "/".join(f"{x * 100:.0f}" for x in h)


def render(pred: planner.Prediction, profile: planner.CostProfile, own: planner.ErrorRow) -> str:
    lines = [f"profile: {own.profile_from} ({pred.notes and '; '.join(pred.notes) or 'no caveats'})",
             f"settings: {pred.settings.describe()}; {len(pred.stages)} stage(s) on "
             f"{','.join(s.device for s in pred.stages)}; {len(pred.bounds)} chunks of up to {pred.chunk} tokens",
             f"predicted prefill: {pred.prefill_tok_s:,.0f} tok/s ({pred.prefill_s * 1e3:,.1f} ms for "
             f"{pred.prompt_tokens:,} tokens)"]
    if pred.decode_tok_s:
        lines.append(f"predicted decode: {pred.decode_tok_s:,.1f} tok/s")
    lines.append(f"busy histogram 0/1/../{len(pred.stages)} stages computing: {hist_text(pred.busy_histogram)} %")
    lines.append(f"bottleneck: {pred.bottleneck}")
    guessed = sorted({n for _, n in pred.bounds if profile.extrapolated(n)})
    if guessed:
        lines.append(f"caution: chunk size(s) {guessed} priced from other sizes (the profile measured "
                     f"{list(profile.fitted_sizes or profile.layer_s)})")
    lines.append("")
    lines.append("| stage | device | layers | wall ms | compute ms | wait ms | copy ms | stream ms |")
    lines.append("|---:|---|---|---:|---:|---:|---:|---:|")
    for st, t in zip(pred.stages, pred.per_stage):
        lines.append(f"| {st.stage} | {st.device} | {st.first_layer}-{st.end_layer - 1} | {t.wall_ns / 1e6:,.1f} | "
                     f"{t.compute_ns / 1e6:,.1f} | {t.wait_ns / 1e6:,.1f} | {t.copy_ns / 1e6:,.1f} | "
                     f"{t.stream_ns / 1e6:,.1f} |")
    lines.append("")
    lines.append(f"error on the source run (its own configuration from its own profile): predicted "
                 f"{own.predicted_tok_s:,.0f} vs measured {own.measured_tok_s:,.0f} tok/s ({own.error:+.1%}); "
                 f"busy histogram within {own.hist_points:.1f} points")
    return "\n".join(lines)


def cmd_plan(ns: argparse.Namespace) -> int:
    try:
        return _plan(ns)
    except (planner.PlanError, ValueError, OSError) as exc:
        print(f"strata-bench: error: {exc}", file=sys.stderr)
        return failure.BAD_INPUT


def _plan(ns: argparse.Namespace) -> int:
    src = load_source(ns.from_run, ns.history)
    profile = planner.profile_from_run(src)
    if ns.profile:
        entered = planner.CostProfile.from_dict(json.loads(Path(ns.profile).read_text()))
        profile = replace(entered, n_layers=entered.n_layers or profile.n_layers,
                          handoff_bytes_per_token=entered.handoff_bytes_per_token or profile.handoff_bytes_per_token)
    own_pred = planner.predict_run(profile, src)
    own = planner.ErrorRow(profile.source, src.name, planner.measured_tok_s(src), own_pred.prefill_tok_s,
                           src.busy_histogram, own_pred.busy_histogram)
    machine, names = machine_from_args(ns, src, profile)
    settings = settings_from_args(ns, src, len(names))
    if not ns.sweep:
        pred = planner.simulate(profile, machine, settings, devices=names)
        if ns.format == "json":
            print(json.dumps({"prefill_tok_s": pred.prefill_tok_s, "prefill_s": pred.prefill_s,
                              "busy_histogram": pred.busy_histogram, "bottleneck": pred.bottleneck,
                              "chunk": pred.chunk, "n_chunks": len(pred.bounds),
                              "own_error": own.error, "profile": profile.to_dict()}, indent=1))
        else:
            print(render(pred, profile, own))
        return 0
    base = planner.simulate(profile, machine, settings, devices=names)
    pins = [settings.pin_limit_gib]
    if settings.arena_gib > 0:
        pins = sorted({settings.pin_limit_gib, settings.arena_gib} - {None}) or [None]
    ranked = planner.sweep(profile, machine, settings, orders=not ns.keep_order, pin_limits=pins)
    print(f"base: {settings.describe()} on {','.join(names)}: {base.prefill_tok_s:,.0f} tok/s predicted")
    print(f"profile: {profile.source}; its own run predicted {own.error:+.1%} from it; chunk sizes swept: "
          f"{sorted(profile.layer_s)} (those it prices from a measurement)")
    print()
    print("| rank | settings | devices | predicted tok/s | gain vs base | busy 0/../N % | bottleneck |")
    print("|---:|---|---|---:|---:|---|---|")
    marked = False
    for i, c in enumerate(ranked[:ns.top], 1):
        p = c.prediction
        star = "*" if any(profile.extrapolated(n) for _, n in p.bounds) else ""
        marked = marked or bool(star)
        print(f"| {i} | {c.settings.describe()}{star} | {','.join(c.devices)} | {p.prefill_tok_s:,.0f} | "
              f"{p.prefill_tok_s / base.prefill_tok_s - 1:+.1%} | {hist_text(p.busy_histogram)} | {p.bottleneck} |")
    if marked:
        print(f"\n* chunk sizes the profile did not measure (it measured {list(profile.fitted_sizes or profile.layer_s)}):"
              " priced from neighbouring sizes; a balanced schedule also runs without CUDA graphs in the engine")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The `plan` subcommand (called from engine.cli.bench.build_parser)."""
    p = sub.add_parser("plan", help="predict a run from a recorded one's costs; --sweep ranks settings")
    p.add_argument("--from-run", required=True, help="a trace file (.json/.json.gz) or a history run id")
    p.add_argument("--history", help="the app's history file (default: the app's own)")
    p.add_argument("--profile", help="an entered cost profile (JSON of engine.plan.planner.CostProfile) instead")
    p.add_argument("--devices", help="devices of the predicted run, e.g. cuda:0,cuda:1 (default: the source's)")
    p.add_argument("--link", help="host link GB/s per device: a number or PCIe genGxW (gen4x4); one or one each")
    p.add_argument("--pageable", help="pageable host->device GB/s per device (default: half the link)")
    p.add_argument("--peer", help="GPU-to-GPU GB/s, or none (hand-offs staged through the host)")
    p.add_argument("--vram-gib", dest="vram_gib", help="VRAM per device: experts resident when they fit")
    p.add_argument("--speed", help="compute speed per device relative to the profile's device (default 1)")
    p.add_argument("--prompt-tokens", dest="prompt_tokens", type=int)
    # the engine settings a prediction can change: their rows' flags (engine/settings_table.py), typed
    # as the planner takes them
    settings_table.add_flags(p, ("chunk_tokens", "chunk_schedule", "pipeline_depth", "prefill_main", "pin_limit_gib"),
                             chunk_schedule={"help": "fixed or balanced"},
                             pipeline_depth={"type": int, "choices": (0, 1), "help": "1 overlap, 0 join"},
                             pin_limit_gib={"type": float, "help": "GiB of the expert arena to page-lock"})
    p.add_argument("--arena-gib", dest="arena_gib", type=float, help="expert arena size (the pin limit's share)")
    settings_table.add_flags(p, ("layer_split",), layer_split={"help": "layers per device, e.g. 8,8,16"})
    p.add_argument("--interleave", type=int, help="V layer groups per device (issue 21)")
    p.add_argument("--decode-tokens", dest="decode_tokens", type=int)
    p.add_argument("--sweep", action="store_true", help="rank chunk, schedule, depth, prefill-main, pin limit, order")
    p.add_argument("--keep-order", action="store_true", help="sweep without trying other device orders")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--format", choices=("md", "json"), default="md")
    p.set_defaults(func=cmd_plan)
    return p
