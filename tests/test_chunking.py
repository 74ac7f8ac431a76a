"""The auto chunk model: prompt length AND stage count decide, from measured costs."""
import pytest

from engine.plan import chunking
from engine.plan.chunking import (
    GRAIN,
    ChunkCost,
    balanced_bounds,
    bounds_makespan,
    choose,
    chunk_bounds,
    schedule,
)

CANDS = (1024, 2048, 4096, 8192, 16384)
# per-layer seconds at each size: small chunks use the GPU less well (not a straight line)
LAYER_S = {1024: 0.0012, 2048: 0.0020, 4096: 0.0037, 8192: 0.0072, 16384: 0.0143}


def choose_chunk(n_tokens, n_stages, c, cands):
    """(chunk, why) of the fixed schedule's best candidate."""
    got = choose(n_tokens, n_stages, c, cands, ("fixed",))
    return got.chunk, got.reason


def makespan(n_tokens, chunk, n_stages, c):
    return bounds_makespan(chunk_bounds(n_tokens, chunk), n_stages, c)


def cost(host=0.0, attn=0.0, layers=16):
    return ChunkCost(LAYER_S, attn_s_per_token_key=attn, host_s_per_layer=host, layers_per_stage=layers)


def test_bounds_cover_the_prompt():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert sum(n for _, n in chunk_bounds(65536, 6144)) == 65536


def test_one_stage_takes_big_chunks_more_stages_take_smaller():
    one, _ = choose_chunk(65536, 1, cost(), CANDS)
    four, why = choose_chunk(65536, 4, cost(), CANDS)
    assert one == 16384 and four < one and "4 stage(s)" in why


def test_short_prompts_are_not_split_needlessly():
    assert choose_chunk(3000, 1, cost(), CANDS)[0] == 3000


def test_the_shared_host_bound_pushes_back_to_bigger_chunks():
    free, _ = choose_chunk(65536, 4, cost(host=0.0), CANDS)
    launch_bound, _ = choose_chunk(65536, 4, cost(host=0.002), CANDS)
    assert launch_bound > free


def test_interpolation_and_attention_term():
    c = cost(attn=1e-9, layers=1)
    assert c.t0(3072) == (LAYER_S[2048] + LAYER_S[4096]) / 2
    assert c.stage_time(1024, 8192) == LAYER_S[1024] + 1e-9 * 1024 * 8192
    assert makespan(4096, 4096, 2, c) == 2 * LAYER_S[4096]


# attention's extra cost per (token x cached key) per layer, about what H200 showed (3.1 ms per 16 layers
# for 2048 more keys at chunk 2048)
ATTN = 5e-11


def test_balanced_chunks_cover_the_prompt_and_cost_the_same():
    c = cost(attn=ATTN)
    for n, k in ((32768, 16), (65536, 32), (10000, 7)):
        b = balanced_bounds(n, k, c)
        assert [p for p, _ in b] == [sum(m for _, m in b[:i]) for i in range(len(b))]  # contiguous
        assert sum(m for _, m in b) == n and len(b) <= k
        assert all(m % GRAIN == 0 for _, m in b[:-1])
        sizes = [m for _, m in b]
        assert sizes == sorted(sizes, reverse=True)  # deeper chunks attend to more: they get smaller
        times = [c.layer_time(m, p) for p, m in b[:-1]]
        assert max(times) / min(times) < 1.1, times


def test_balanced_schedule_shrinks_the_pipeline_bubble():
    """Equal chunks make each stage wait for its predecessor's costlier chunk; balanced ones don't."""
    c = cost(attn=ATTN)
    for n in (32768, 65536):
        fixed = makespan(n, 2048, 2, c)
        balanced = bounds_makespan(balanced_bounds(n, n // 2048, c), 2, c)
        ideal = bounds_makespan(chunk_bounds(n, 2048), 1, c)  # the work itself, no bubble
        assert balanced < fixed
        assert (balanced - ideal) < 0.75 * (fixed - ideal)


def test_schedule_choice_follows_the_setting():
    c = cost(attn=ATTN)
    assert schedule(4096, 1024, "fixed", c) == chunk_bounds(4096, 1024)
    assert len(schedule(65536, 2048, "balanced", c)) == 32
    got = choose(65536, 2, c, CANDS)
    assert got.kind in ("fixed", "balanced") and str(got.chunk) in got.reason
    assert got.bounds == tuple(schedule(65536, got.chunk, got.kind, c, floor=chunking.efficient_floor(c)))
    assert choose(65536, 2, c, CANDS, ("fixed",)).kind == "fixed"
    assert choose(65536, 1, c, CANDS).kind == "fixed"  # one stage: no bubble to balance
    assert choose(65536, 1, c, CANDS, ("balanced",)).kind == "balanced"  # unless asked
    assert choose(100, 2, c, CANDS).chunk == 100


def _flow_shop(times: list[float], n_dev: int, v: int) -> float:
    """Independent reference: chunks in order through D x V layer groups (group k on device
    k mod D, a group's step T_i / V); a device runs one step at a time, a group takes chunks in
    order, a chunk takes groups in order; the earliest-ready step goes first."""
    k_groups = n_dev * v
    done: dict[tuple[int, int], float] = {}
    free = [0.0] * n_dev
    pending = [(i, 0) for i in range(len(times))]
    while pending:
        def ready(t):
            i, k = t
            return max(done.get((i, k - 1), 0.0) if k else 0.0, done.get((i - 1, k), 0.0) if i else 0.0)
        cands = [t for t in pending
                 if (t[1] == 0 or (t[0], t[1] - 1) in done) and (t[0] == 0 or (t[0] - 1, t[1]) in done)]
        i, k = min(cands, key=lambda t: (max(ready(t), free[t[1] % n_dev]), t[0]))
        start = max(ready((i, k)), free[k % n_dev])
        done[(i, k)] = free[k % n_dev] = start + times[i] / v
        pending.remove((i, k))
        if k + 1 < k_groups:
            pending.append((i, k + 1))
    return max(done.values())


@pytest.mark.parametrize("n_dev,v", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_makespan_model_matches_a_flow_shop_when_chunks_do_not_fill_the_devices(n_dev, v):
    """With interleaved groups and fewer chunks than devices a chunk's chain is serial (a
    single chunk over 2 devices takes 2 x T, not T + T / V): the model must say so."""
    cost = ChunkCost({64: 1.0}, 0.0, 0.0, layers_per_stage=1)
    for m in range(1, n_dev + 1):
        bounds = chunk_bounds(64 * m, 64)
        times = [cost.stage_time(n, p) for p, n in bounds]
        assert chunking.bounds_makespan(bounds, n_dev, cost, v) == pytest.approx(_flow_shop(times, n_dev, v)), m
