"""The model-family registry (issue 31 item 2): a family is one module of engine/models/; nothing
else in the engine branches on an architecture's name, and a family registered at run time is
written, loaded, planned and run through the whole pipeline, its layers' state made by it."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import models
from engine.config import EngineConfig
from engine.io import gguf_model, synth
from engine.io.prompt import synthetic
from engine.models.blocks import KVState, LayerKind, attention_parts
from engine.models.kv import LayerKV, receive_state, send_state
from engine.models.layers import Layer
from engine.pipeline.session import Session
from engine.plan.memory_plan import plan_memory

ENGINE = Path(__file__).resolve().parent.parent / "engine"


def _family_literals(node: ast.AST, names: set[str]) -> list[ast.Constant]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]


def _branches(tree: ast.AST, names: set[str]) -> list[tuple[int, int, str]]:
    """Where a family's name decides something: compared (==, in, match), listed with another
    family's name (a hand-written list of families), or a dict key."""
    found: dict[int, ast.Constant] = {}
    for node in ast.walk(tree):
        hits: list[ast.Constant] = []
        if isinstance(node, ast.Compare):
            hits = _family_literals(node, names)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            lits = [e for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
            hits = lits if len(lits) >= 2 else []
        elif isinstance(node, ast.Dict):
            hits = [k for k in node.keys if isinstance(k, ast.Constant) and k.value in names]
        elif isinstance(node, ast.match_case):
            hits = _family_literals(node.pattern, names)
        found.update((id(c), c) for c in hits)
    return sorted((c.lineno, c.col_offset, c.value) for c in found.values())


def test_nothing_outside_engine_models_branches_on_a_family_name():
    names = set(models.names())
    offenders = []
    for path in sorted(ENGINE.rglob("*.py")):
        if "models" in path.relative_to(ENGINE).parts[:1]:
            continue
        for line, _, name in _branches(ast.parse(path.read_text()), names):
            offenders.append(f"{path.relative_to(ENGINE.parent)}:{line}: {name!r}")
    assert not offenders, "branch on the architecture name outside engine/models/: " + "; ".join(offenders)


def test_the_branch_check_finds_a_branch():
    names = set(models.names())
    src = 'if spec.arch == "llama": pass\nmoe = a in ("qwen3", "qwen2")\nx = {"qwen2": 1}\n'
    assert [n for _, _, n in _branches(ast.parse(src), names)] == ["llama", "qwen3", "qwen2", "qwen2"]


def test_an_unknown_architecture_names_the_registered_ones():
    with pytest.raises(models.UnknownFamily, match=r"unsupported architecture 'mamba' \(supported: qwen3moe, "):
        models.family("mamba")
    with pytest.raises(synth.RecipeError, match="arch='mamba': allowed qwen3moe, qwen3, qwen2, llama"):
        synth.check_recipe(synth.ModelRecipe(arch="mamba"))


# ------------------------------------------------------------ a throwaway family
class TaggedKV(LayerKV):
    """Full-attention KV (the real cache) that remembers which layer it belongs to."""

    def __init__(self, layer: int, *args) -> None:
        super().__init__(*args)
        self.layer = layer
        self.adopted = 0

    def adopt(self, length: int) -> None:
        super().adopt(length)
        self.adopted += 1


@dataclass(frozen=True)
class TaggedState(KVState):
    name: str = "tagged-kv"

    def new(self, spec, capacity, device, dtype):  # the layer index is given by the family below
        raise AssertionError("the family makes its states with their layer index")


BUILT: list[int] = []  # the layers the runtime built through the family's own class


class ToyLayer(Layer):
    """Full attention's arithmetic, built through the family's layer kind (as a recurrent or
    latent-attention family names its own class)."""

    def __init__(self, spec, index, *args, **kwargs) -> None:
        super().__init__(spec, index, *args, **kwargs)
        BUILT.append(index)


@dataclass(frozen=True)
class ToyFamily(models.Family):
    """Experts with q/k norm AND q/k/v biases: a combination none of the four families has."""

    def layer_kind(self, spec, i):
        return LayerKind("attention", attention_parts, TaggedState(), layer=lambda: ToyLayer)

    def new_state(self, spec, i, capacity, device, dtype):
        return TaggedKV(i, capacity, spec.n_kv_heads, spec.head_dim, device, dtype)


TOY = "toymoe"


@pytest.fixture()
def toy_model(tmp_path):
    models.register(ToyFamily(TOY, moe=True, qk_norm=True, qkv_bias=True))
    try:
        recipe = synth.recipe_from_args("demo", arch=TOY, n_layers=4)
        yield gguf_model.load(synth.write_model(tmp_path / "toy.gguf", recipe))
    finally:
        models.unregister(TOY)


def _run(model, devices, **settings):
    cfg = EngineConfig(devices=list(devices), chunk_tokens=16, **settings)
    sess = Session(model, cfg)
    try:
        rep = sess.run(synthetic(64, model.spec.vocab, nonce=3), decode_tokens=2).report
        states = [kv for st in sess.stages for kv in st.kvs]
    finally:
        sess.close()
    return rep, states


def test_a_registered_family_is_loaded_and_run_through_the_pipeline(toy_model):
    s = toy_model.spec
    assert (s.arch, s.is_moe, s.qk_norm, s.qkv_bias) == (TOY, True, True, True)
    assert toy_model.has("blk.3.attn_q.bias") and toy_model.has("blk.3.attn_k_norm.weight")
    BUILT.clear()
    one, states = _run(toy_model, ["cpu"])
    assert [type(kv) for kv in states] == [TaggedKV] * 4 and [kv.layer for kv in states] == [0, 1, 2, 3]
    assert BUILT == [0, 1, 2, 3]  # every layer built by the class the family's kind names
    for depth in (0, 1):
        two, states = _run(toy_model, ["cpu", "cpu"], pipeline_depth=depth)
        assert (two.digest, two.generated) == (one.digest, one.generated)
    main, states = _run(toy_model, ["cpu", "cpu"], prefill_main=True)
    assert (main.digest, main.generated) == (one.digest, one.generated)
    handed = [kv for kv in states if kv.layer >= 2]  # stage 1's layers: their state came from stage 0
    assert handed and all(kv.adopted == 1 for kv in handed)


def test_the_memory_plan_counts_the_states_the_family_makes(toy_model):
    s = toy_model.spec
    plan = plan_memory(toy_model, EngineConfig(devices=["cpu", "cpu"]), 100)
    for d in plan.devices:
        made = models.new_states(s, range(d.first, d.end), 100, "cpu", torch.float32)
        assert d.kv == sum(kv.nbytes for kv in made) == models.states_bytes(s, range(d.first, d.end), 100,
                                                                               torch.float32)


def test_the_hand_off_moves_a_layers_state_and_counts_its_bytes():
    spec = synth.ModelRecipe(arch="qwen3", n_layers=1).spec()
    src, dst = (models.new_states(spec, [0], 8, "cpu", torch.float32)[0] for _ in range(2))
    k, v = torch.randn(5, spec.n_kv_heads, spec.head_dim), torch.randn(5, spec.n_kv_heads, spec.head_dim)
    src.append(k, v, 0)
    assert dst.copy_from(src) == 2 * k.numel() * 4
    assert dst.length == 5 and torch.equal(dst.k[:5], k) and torch.equal(dst.v[:5], v)
    small = LayerKV(4, spec.n_kv_heads, spec.head_dim, torch.device("cpu"), torch.float32)
    with pytest.raises(RuntimeError, match="KV copy of 5 tokens into a cache of capacity 4"):
        small.copy_from(src)


def test_the_transport_hand_off_sends_the_length_then_the_views_and_the_receiver_adopts_them():
    spec = synth.ModelRecipe(arch="llama", n_layers=1).spec()
    src, dst = (models.new_states(spec, [0], 8, "cpu", torch.float32)[0] for _ in range(2))
    src.append(torch.randn(3, spec.n_kv_heads, spec.head_dim), torch.randn(3, spec.n_kv_heads, spec.head_dim), 0)
    pipe: list = []
    sent = send_state(src, pipe.append, lambda t: pipe.append(t.clone()))
    length, tensors = pipe[0], iter(pipe[1:])
    got = receive_state(dst, length, lambda t: t.copy_(next(tensors)))
    assert sent == got == 2 * 3 * spec.n_kv_heads * spec.head_dim * 4
    assert dst.length == 3 and torch.equal(dst.k[:3], src.k[:3]) and torch.equal(dst.v[:3], src.v[:3])
