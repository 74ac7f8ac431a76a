"""The runs whose digests the house move (issue 31) must leave unchanged: the demo model and
each synthetic family on CPU, threads and processes, pipeline depth 0/1, interleaved groups and
prefill-main.  `python tests/digest_cases.py` records them for this machine's CPU kernels;
tests/test_digests_unchanged.py compares.

A digest is the md5 of fp32 bytes, so it is a property of the CPU kernels too: torch's AVX2 and
AVX512 kernels (and oneDNN's) round differently in the last bits.  So there is one record per
torch CPU capability (`torch.backends.cpu.get_cpu_capability()`): tests/data/digests_before_house.json
was written at fa4ce70, the commit before the move, on the machines of that time (not AVX2: an
AVX2 machine's digests differ from it); tests/data/digests_before_house_AVX2.json was written at
fa4ce70 too, on an AVX2 machine (AMD EPYC, session 10), with this file's cases."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
RECORD = DATA / "digests_before_house.json"  # the first record (see above)


def record_path(capability: str | None = None) -> Path:
    """The record for a torch CPU capability (this machine's by default)."""
    if capability is None:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    own = DATA / f"digests_before_house_{capability}.json"
    return own if own.exists() else RECORD
TOKENS, CHUNK, DECODE = 80, 16, 3


@dataclass(frozen=True)
class Case:
    arch: str
    devices: tuple[str, ...]
    depth: int = 1
    split: str = "auto"
    prefill_main: bool = False
    executor: str = "threads"
    quant: str = "q8_0"
    n_layers: int = 4

    @property
    def name(self) -> str:
        return (f"{self.arch}-{self.quant}-L{self.n_layers}-{len(self.devices)}dev-d{self.depth}-{self.split}"
                f"{'-main' if self.prefill_main else ''}-{self.executor}")


ARCHS = ("qwen3moe", "qwen3", "qwen2", "llama")
THREADS = [Case(a, ("cpu",) * n, d) for a in ARCHS for n in (1, 2) for d in (0, 1)] + [
    Case(a, ("cpu", "cpu"), 1, prefill_main=True) for a in ARCHS] + [
    Case("qwen3moe", ("cpu", "cpu"), 1, "interleave:2", n_layers=8),
    Case("qwen3moe", ("cpu", "cpu"), 0, "interleave:2", n_layers=8),
    Case("qwen3moe", ("cpu", "cpu"), 1, quant="q4_k_m"),
    Case("qwen3moe", ("cpu", "cpu"), 1, quant="f16"),
]
PROCESSES = [
    Case("qwen3moe", ("cpu", "cpu"), 1, executor="processes"),
    Case("qwen3moe", ("cpu", "cpu"), 0, executor="processes"),
    Case("qwen3moe", ("cpu", "cpu"), 1, prefill_main=True, executor="processes"),
    Case("llama", ("cpu", "cpu"), 1, executor="processes"),
]
CASES = THREADS + PROCESSES


def model_path(case: Case, folder: Path) -> Path:
    from engine.io import synth

    recipe = synth.recipe_from_args("demo", arch=case.arch, quant=case.quant, n_layers=case.n_layers)
    path = folder / f"{case.arch}-{case.quant}-L{case.n_layers}.gguf"
    if not path.exists():
        synth.write_model(path, recipe)
    return path


def run_case(case: Case, folder: Path) -> dict:
    from engine.config import EngineConfig
    from engine.io import gguf_model
    from engine.io.prompt import synthetic
    from engine.pipeline.session import Session

    model = gguf_model.load(model_path(case, folder))
    cfg = EngineConfig(devices=list(case.devices), chunk_tokens=CHUNK, pipeline_depth=case.depth,
                       layer_split=case.split, prefill_main=case.prefill_main, executor=case.executor)
    sess = Session(model, cfg)
    try:
        rep = sess.run(synthetic(TOKENS, model.spec.vocab, nonce=7), decode_tokens=DECODE).report
    finally:
        sess.close()
    return {"digest": rep.digest, "generated": list(rep.generated)}


def main() -> None:
    import tempfile

    logging_quiet = "--quiet" in sys.argv
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        for case in CASES:
            out[case.name] = run_case(case, Path(d))
            if not logging_quiet:
                sys.stdout.write(f"{case.name}: {out[case.name]}\n")
    record_path().write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
