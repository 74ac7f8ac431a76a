"""Every setting, one row: its type, environment variable (and the seeds' aliases), CLI flag,
choices, allowed text, form label, tooltip and doc line.

`engine/config.py` parses and checks settings by these rows, `engine/cli/bench.py` and
`engine/cli/plan_cli.py` make their flags from them, the app's form (`strata_gui/run/settings_model.py`,
`strata_gui/views/settings_view.py`) takes its fields, labels and tooltips from them, and the
README's settings tables are `readme_tables()` (`python -m engine.settings_table` prints them;
tests/test_settings_table.py fails when the README differs).

Two groups: "engine" rows are the fields of `EngineConfig` (one run's settings: CLI > environment >
default); "diagnostics" rows are environment-only switches read where they act (kernel A/Bs, the
stage timeout, the rendezvous key, the log and data folders), through `env_text`.

No torch, no Qt: `strata-bench --help` and the app's form import this at once.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_PREFILL = 1 << 20  # the largest chunk size in tokens

# how a row's text is read (engine/config.py holds one parser and one check per kind)
KINDS = ("devices", "layer_split", "chunk", "depth", "bool", "gib", "choice", "address", "text")


@dataclass(frozen=True)
class Setting:
    """One setting.  `choices`: the words a "choice" takes, or the words a "gib" number may be
    instead ("auto", "all").  `flag_value`: what the README shows after the flag.  `label` empty:
    not a field of the app's form."""

    name: str
    kind: str
    default: Any
    doc: str  # the README row's first cell: what it is, in a line
    default_text: str  # the README's default cell
    allowed: str = ""  # what a refusal says is allowed
    env: str = ""
    env_aliases: tuple[str, ...] = ()  # the seeds' variables, read when `env` is unset
    name_aliases: tuple[str, ...] = ()  # the seeds' setting names (arms, records, keys)
    flag: str = ""
    flag_aliases: tuple[str, ...] = ()  # the seeds' flags, hidden from --help
    flag_value: str = ""
    help: str = ""  # the CLI's --help line
    choices: tuple[str, ...] = ()
    label: str = ""
    tooltip: str = ""
    placeholder: str = ""  # the form's hint in an empty text field, or a check box's text
    form_items: tuple[tuple[str, Any], ...] = ()  # a form combo's (text, value) items (default: choices)
    group: str = "engine"

    def items(self) -> tuple[tuple[str, Any], ...]:
        """The form combo's items: `form_items`, else each choice as itself."""
        return self.form_items or tuple((c, c) for c in self.choices)


BOOL_ALLOWED = "1/0, true/false, on/off"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "devices", "devices", ("cpu",), "stage devices, one stage per entry in order", "cpu",
        allowed="cpu, cuda or cuda:N", flag="--devices", flag_value="cuda:0,cuda:1/cpu,cpu",
        help="comma-separated stage devices, e.g. cuda:0,cuda:1 or cpu,cpu (default: cpu)", label="Device list",
        tooltip="The devices of the layer split, one stage per entry in order (cpu,cpu splits the model into two "
                "CPU stages); more stages only pay off when the prompt has enough chunks to keep them all busy."),
    Setting(
        "gpu_order", "choice", "pcie", "GPU ordering", "pcie", allowed="pcie or configured",
        env="STRATA_GPU_ORDER", flag="--gpu-order", flag_value="pcie/configured",
        help="pcie (widest link first, default) or configured", choices=("pcie", "configured"),
        label="GPU ordering",
        tooltip="pcie puts the GPU with the widest PCIe link first as the main device, which carries the "
                "stream-bound prompt path (1384 vs 890 tok/s in the seed); configured keeps your order, "
                "which you can then drag below."),
    Setting(
        "layer_split", "layer_split", "auto",
        "layer split (auto: contiguous or interleave:V, whichever models faster for the prompt; counts; or "
        "interleave:V layer groups per device)", "auto",
        allowed="auto, comma-separated layer counts such as 12,12,24, or interleave:V (V layer groups per device)",
        flag="--layer-split", flag_value="auto/8,8,16/interleave:2",
        help="auto (balanced), counts per device such as 12,12,24, or interleave:V (V groups per device)",
        label="Layer split", placeholder="e.g. 2,2",
        tooltip="How many layers each stage owns: auto balances them, manual counts such as 12,12,24 "
                "(one per device, summing to the model's layers) let a faster or emptier card carry more. "
                "interleave V gives each device V groups of layers (2 GPUs, V=2: layers 0-7 on the first, "
                "8-15 on the second, 16-23 on the first again…): a chunk visits every device V times, "
                "so the pipeline's fill and drain shrink about V-fold while chunks stay big."),
    Setting(
        "chunk_tokens", "chunk", "auto", "chunk size in tokens", "auto",
        allowed=f"auto or a chunk size in tokens (1..{MAX_PREFILL})", env="STRATA_CHUNK_TOKENS",
        env_aliases=("STRATA_PREFILL",), name_aliases=("prefill",), flag="--chunk-tokens",
        flag_aliases=("--prefill",), flag_value="auto/N", help="chunk size in tokens: auto or N",
        label="Chunk size",
        tooltip="Tokens per prefill chunk: auto (the engine's default) weighs prompt length and stage count; on "
                "4 GPUs a fixed 3072 or 4096 beat auto by up to 27% at 6-12K-token prompts, while 1024 was too "
                "small everywhere.", placeholder="tokens, e.g. 256"),
    Setting(
        "chunk_schedule", "choice", "fixed",
        "chunk schedule (fixed; balanced: same count, equal modelled cost; auto: the cheaper by the model)",
        "fixed", allowed="fixed or balanced or auto", env="STRATA_CHUNK_SCHEDULE", flag="--chunk-schedule",
        flag_value="fixed/balanced/auto",
        help="fixed (default), balanced (as many chunks, each of equal modelled cost) or auto (the cheaper "
             "by the model)",
        choices=("fixed", "balanced", "auto"), label="Chunk schedule",
        tooltip="fixed: every chunk the chosen size. balanced: as many chunks, sized so each costs the "
                "same (bigger early, smaller late, since a late chunk attends to the whole prompt before "
                "it) — the next stage then never waits for a costlier chunk; each new size plans its "
                "kernels once, so it pays off on repeated prompt lengths; auto: whichever of the two the "
                "measured costs model faster."),
    Setting(
        "pipeline_depth", "depth", 1, "pipeline depth (1 overlap, 0 join)", "1",
        allowed="0 (join) or 1 (overlap)", env="STRATA_PIPELINE_DEPTH", env_aliases=("STRATA_PF_DEPTH",),
        name_aliases=("pf_depth",), flag="--pipeline-depth", flag_aliases=("--pf-depth",), flag_value="0/1",
        help="1 overlap (default), 0 join", label="Pipeline depth", form_items=(("1 · overlap", 1), ("0 · join", 0)),
        tooltip="1 (overlap) lets a stage take the next chunk while the stages below still work (2.04x on a "
                "4-GPU split); 0 (join) restores the old wait for the whole chain below, for an A/B one setting "
                "apart."),
    Setting(
        "prefill_main", "bool", False, "prefill on main GPU", "off", allowed=BOOL_ALLOWED,
        env="STRATA_PREFILL_MAIN", flag="--prefill-main", flag_value="[0/1]",
        help="prefill the whole prompt on the main device, then hand the KV to the stages", label="Prefill-main",
        placeholder="prefill the whole prompt on the main device",
        tooltip="Prefill the whole prompt on the main (first) device, then copy the later layers' KV to "
                "their stages; helps when prefill is bound by streaming expert misses over a slow second "
                "link (+54% in the seed), decode stays split."),
    Setting(
        "cuda_graphs", "bool", True, "CUDA graphs per layer (decode 12 → 159 tok/s on H200)", "on",
        allowed=BOOL_ALLOWED, env="STRATA_CUDA_GRAPHS", flag="--cuda-graphs", flag_value="[0/1]",
        help="replay layers as CUDA graphs (default 1; 0 runs every op eagerly)", label="CUDA graphs",
        placeholder="replay layers as CUDA graphs",
        tooltip="Replay each layer's kernels as CUDA graphs (one launch instead of ~50): decode went from "
                "12 to 159 tok/s on an H200; costs some VRAM per chunk size. Off runs every op eagerly."),
    Setting(
        "executor", "choice", "threads", "executor (stages as threads, or as processes on torch.distributed)",
        "threads", allowed="threads or processes", env="STRATA_EXECUTOR", flag="--executor",
        flag_value="threads/processes",
        help="threads (default: stages as threads of one process) or processes (a process per stage on "
             "torch.distributed)",
        choices=("threads", "processes"), label="Executor",
        form_items=(("threads · one process", "threads"), ("processes · one per stage", "processes")),
        tooltip="threads: every stage a thread of this process (the default); processes: every stage a "
                "process of its own on torch.distributed (NCCL between GPUs, gloo on CPU) owning its device, "
                "layers and KV, so stages stop sharing one interpreter (the GIL) — starting them costs "
                "seconds, then they stay up between runs of the same settings."),
    Setting(
        "rendezvous", "address", "",
        "where attached stages connect (processes; see [docs/executor.md](docs/executor.md))", "spawn here",
        allowed="empty (stage processes on this machine) or HOST:PORT (stages started with "
                "`strata-bench stage --rendezvous HOST:PORT` attach to this controller), port 1..65534 "
                "(the controller's store listens on PORT+1)",
        env="STRATA_RENDEZVOUS", flag="--rendezvous", flag_value="HOST:PORT",
        help="executor processes: HOST:PORT where stages started with `strata-bench stage --rendezvous "
             "HOST:PORT` attach (default: spawn them here)",
        label="Rendezvous", placeholder="empty: stages start here; or HOST:PORT",
        tooltip="With executor processes: empty starts the stage processes on this machine; HOST:PORT makes "
                "this app the controller that stages started elsewhere with `strata-bench stage --rendezvous "
                "HOST:PORT` attach to (a taken port or a stage that never attaches fails the Run with a message)."),
    Setting(
        "pin_limit_gib", "gib", "auto", "pinned limit (GiB)", "auto", allowed="auto or a number of GiB >= 0",
        env="STRATA_PIN_LIMIT_GIB", flag="--pin-limit-gib", flag_value="auto/N",
        help="GiB of the expert arena to page-lock: auto or N", choices=("auto",), label="Pin limit (GiB)",
        placeholder="auto or GiB",
        tooltip="GiB of the host expert arena to page-lock for fast DMA (auto: what the machine allows); "
                "20 GiB lifted a 2-GPU Windows split whose registration was capped at 8 GiB, and more than "
                "can be pinned is refused."),
    Setting(
        "expert_cache", "gib", "auto", "expert cache per stage (GiB)", "auto (all experts if they fit)",
        allowed="auto, all or a number of GiB >= 0", flag="--expert-cache", flag_value="auto/all/N",
        help="GiB of VRAM per stage for experts: auto, all, or N (fewer: streamed from host RAM)",
        choices=("auto", "all"), label="Expert cache (GiB)", placeholder="auto, all or GiB",
        tooltip="VRAM per stage for cached experts in GiB (auto: from free VRAM, all: every expert); "
                "misses stream from host RAM, so a larger cache means less streaming during prefill."),
    Setting(
        "handoff", "choice", "auto", "hand-off", "auto", allowed="auto or peer or host", flag="--handoff",
        flag_value="auto/peer/host", help="auto, peer or host", choices=("auto", "peer", "host")),
    Setting(
        "dtype", "choice", "auto", "compute dtype (auto: bf16 on CUDA, fp32 on CPU)", "auto",
        allowed="auto or float32 or bfloat16 or float16", flag="--dtype",
        flag_value="auto/bfloat16/float16/float32",
        help="compute dtype: auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16 or float32",
        choices=("auto", "float32", "bfloat16", "float16")),
    Setting(
        "timing", "bool", False, "timing report", "off", allowed=BOOL_ALLOWED, env="STRATA_PREFILL_TIMING",
        flag="--timing", flag_value="[0/1]", help="per-stage wall/compute/wait (stderr)"),
    Setting(
        "check_nan", "bool", False, "non-finite check", "off", allowed=BOOL_ALLOWED, env="STRATA_DBG_NAN",
        flag="--check-nan", flag_value="[0/1]",
        help="check every layer's output for NaN/inf as it runs (names the first stage, chunk and layer; "
             "off: one check of the logits)"),
)

DIAGNOSTICS: tuple[Setting, ...] = (
    Setting(
        "attention", "text", "", "attention kernel on CUDA: `sdpa` keeps the masked SDPA call instead of the "
        "cuDNN prefix+diagonal split (an A/B, and a way out)", "the split", env="STRATA_ATTENTION",
        group="diagnostics"),
    Setting(
        "qk_kernel", "text", "", "`torch` turns the Triton q/k norm + RoPE kernel off", "Triton where it runs",
        env="STRATA_QK_KERNEL", group="diagnostics"),
    Setting(
        "moe_kernels", "text", "", "`torch` turns the Triton SwiGLU and slot-sum kernels off",
        "Triton where it runs", env="STRATA_MOE_KERNELS", group="diagnostics"),
    Setting(
        "decode_attention", "text", "", "`torch` turns the Triton split-K decode attention off",
        "Triton where it runs", env="STRATA_DECODE_ATTENTION", group="diagnostics"),
    Setting(
        "gdn_kernel", "text", "", "`torch` keeps the torch chunked gated delta rule (Qwen3-Next/Qwen3.5 GDN "
        "layers) instead of flash-linear-attention's Triton kernels", "fla where it runs (the `gdn` extra, CUDA, "
        "bf16/fp16)", env="STRATA_GDN_KERNEL", group="diagnostics"),
    Setting(
        "dequant", "text", "", "`torch` keeps the torch GGUF dequantiser instead of the Triton one",
        "Triton where it runs", env="STRATA_DEQUANT", group="diagnostics"),
    Setting(
        "stage_timeout_s", "text", "", "executor processes: seconds a stage may make no progress before the run "
        "ends with a message naming it", "60", env="STRATA_STAGE_TIMEOUT_S", group="diagnostics"),
    Setting(
        "rendezvous_key", "text", "", "the key attached stages prove (20+ characters; unset: the controller "
        "makes one and prints the stage command; a stage also takes `stage --key-file FILE`)",
        "a random one per controller", env="STRATA_RENDEZVOUS_KEY", group="diagnostics"),
    Setting(
        "log_dir", "text", "", "the folder of the error logs an internal error names", "the platform's per-user "
        "log folder (e.g. `~/.local/state/strata-gui/log`)", env="STRATA_LOG_DIR", group="diagnostics"),
    Setting(
        "gui_data_dir", "text", "", "the app's data folder (its run history; `strata-bench plan --from-run ID` "
        "reads it)", "the platform's per-user data folder", env="STRATA_GUI_DATA_DIR", group="diagnostics"),
    Setting(
        "nvtx", "text", "", "`0` drops the NVTX ranges (stage compute, hand-offs, decode steps) that CUDA runs "
        "mark for Nsight Systems", "on (CUDA only)", env="STRATA_NVTX", group="diagnostics"),
)

ROWS: dict[str, Setting] = {s.name: s for s in (*SETTINGS, *DIAGNOSTICS)}
ENGINE_ROWS: dict[str, Setting] = {s.name: s for s in SETTINGS}


def row(name: str) -> Setting:
    """The row of a setting or diagnostic by its name (KeyError for no such row)."""
    return ROWS[name]


def rows_of_kind(*kinds: str) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.kind in kinds)


def form_rows() -> tuple[Setting, ...]:
    """The engine settings the app's form shows as fields of their own, in table order."""
    return tuple(s for s in SETTINGS if s.label)


def env_value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A diagnostic's variable as set (read now, not stripped: a key is its exact bytes), None when
    unset: with `env_text`, the one way the side-channel variables are read."""
    env = os.environ if env is None else env
    return env.get(ROWS[name].env)


def env_text(name: str, env: Mapping[str, str] | None = None) -> str:
    """A diagnostic's value, stripped; "" when unset."""
    return (env_value(name, env) or "").strip()


# --------------------------------------------------------------------------------- CLI flags
def add_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None, *,
              with_help: bool = True, **overrides: dict[str, Any]) -> None:
    """The flags of `names` (every engine setting when None), each with its hidden seeds' aliases.
    A bool takes an optional 0|1 (a bare flag means on).  `overrides[name]` replaces argparse
    keywords of one flag (plan_cli's typed flags)."""
    for s in (ENGINE_ROWS[n] for n in names) if names is not None else SETTINGS:
        kw: dict[str, Any] = {"dest": s.name}
        if with_help:
            kw["help"] = s.help
        if s.kind == "bool":
            kw.update(nargs="?", const="1", metavar="0|1")
        kw.update(overrides.get(s.name, {}))
        parser.add_argument(s.flag, **kw)
        for alias in s.flag_aliases:
            parser.add_argument(alias, **{**kw, "help": argparse.SUPPRESS})


def flag_values(ns: argparse.Namespace) -> dict[str, Any]:
    """The engine settings a parsed command line gives (flags left out are not there)."""
    return {s.name: getattr(ns, s.name) for s in SETTINGS if getattr(ns, s.name, None) is not None}


# ------------------------------------------------------------------------------ README tables
README_BEGIN = "<!-- settings tables: made by `python -m engine.settings_table` from engine/settings_table.py -->"
README_END = "<!-- end of the settings tables -->"


def _cli_cell(s: Setting) -> str:
    flags = " ".join(x for x in (s.flag, s.flag_value) if x)
    return f"`{flags}`" if flags else ""


def readme_tables() -> str:
    """The README's settings section between its markers: the engine settings, then the diagnostics."""
    lines = [README_BEGIN, "", "| setting | env | CLI | default |", "|---|---|---|---|"]
    for s in SETTINGS:
        env = " ".join([s.env, *(f"({a})" for a in s.env_aliases)]) if s.env else ""
        lines.append(f"| {s.doc} | {env} | {_cli_cell(s)} | {s.default_text} |")
    lines += ["", "Diagnostics and other environment-only variables (read where they act):", "",
              "| variable | what | default |", "|---|---|---|"]
    lines += [f"| {s.env} | {s.doc} | {s.default_text} |" for s in DIAGNOSTICS]
    lines += ["", README_END]
    return "\n".join(lines)


def readme_section(text: str) -> str:
    """The part of `text` (the README) between the markers, markers included ("" when absent)."""
    start = text.find(README_BEGIN)
    end = text.find(README_END)
    if start < 0 or end < start:
        return ""
    return text[start:end + len(README_END)]


if __name__ == "__main__":
    print(readme_tables())
